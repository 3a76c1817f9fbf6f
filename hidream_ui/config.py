"""Frozen application configuration from command-line flags and environment variables.

Precedence: an explicit flag wins over an environment variable, which wins over the default.
Every bad value raises `ConfigError` naming the flag/variable, the value and what is allowed.
Nothing here touches torch or the filesystem beyond `Path` arithmetic: building a config is
free, so `--help` and the app's cold start stay fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping
from urllib.parse import urlsplit

from hidream_ui.device.backends import DTYPE_SPECS, DeviceError
from hidream_ui.device.detect import parse_device_spec
from hidream_ui.device.pool_spec import PoolSpecError, check_devices, check_placement, split_devices, split_placement
from hidream_ui.model.plans import (
    MEMORY_CHOICES,
    PLAN_SPECS,
    WEIGHT_CHOICES,
    MemoryOptionError,
    validate_memory_options,
)
from hidream_ui.model.tiny.profiles import FULL_PROFILE_NAME, PROFILES
from hidream_ui.pipeline.attention.registry import strategy_names
from hidream_ui.pipeline.speed.settings import (
    COMPILE_CHOICES,
    MOE_CHOICES,
    SPEED_PRESETS,
    SpeedSettingError,
    check_speed,
)

VARIANTS = ("e1.1", "e1-full")
TEXT_ENCODER_MODES = ("device", "cpu", "offload")
REFINERS = ("e1", "i1")
# The offline model's profiles: those model/tiny/profiles.py builds, and `full` (the release's
# dimensions, random weights made in memory). Read from there: a second list once refused `deep`.
TINY_PROFILES = (*PROFILES, FULL_PROFILE_NAME)
# The offline model the app and the CLI open with no weights and no --tiny-profile: the one trained on the
# shapes world (it edits as asked). AppConfig's own default stays the random `tiny`, the fast one that code
# building configs directly (tests, benchmarks) gets.
OFFLINE_DEFAULT_PROFILE = "trained"
# Instruction rewriting (README "Instruction rewriting"). "auto": openai when a URL is given, else off.
REWRITERS = ("auto", "off", "local", "openai")
REWRITER_TIMEOUT_RANGE = (0.5, 600.0)
# A live preview every 4 steps: 7 pictures in a 28-step edit; each costs a few per cent of one step.
PREVIEW_EVERY_DEFAULT = 4
# At most this many previews per edit (a long edit spaces them out): each one the browser gets is a file
# in Gradio's cache, counted against --cache-max-files and the client's quota like any result copy.
PREVIEWS_MAX = 8


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which one and what is allowed."""


@dataclass(frozen=True)
class AppConfig:
    # Where the weights come from. With none of these set the app runs the offline tiny model.
    model_dir: Path | None = None
    llama: str | None = None
    i1: str | None = None
    e1: str | None = None
    variant: str = "e1.1"
    tiny_profile: str = "tiny"
    tiny_seed: int = 0
    # Compute placement.
    device: str = "auto"
    dtype: str = "auto"
    attention: str = "auto"
    text_encoders: str = "device"
    refiner: str = "e1"
    # Memory plan and transformer storage (README "Memory plans"); auto = chosen from free memory at load.
    memory: str = "auto"
    weights: str = "auto"
    transformer_file: Path | None = None
    prompt_cache_size: int = 32
    # Several devices (README "Several devices"): one engine per device, e.g. ("npu:0", "npu:1") or
    # ("all",); () = one engine on `device`. `placement`: (part, device) pairs splitting one model.
    devices: tuple[str, ...] = ()
    placement: tuple[tuple[str, str], ...] = ()
    # Outputs.
    output_dir: Path = Path("outputs")
    retention: int = 500
    # Live preview: a cheap latent -> RGB picture every K denoising steps of an edit (0: none). The one
    # home of the default (README "Live preview"; pipeline/previews.py measures its cost).
    preview_every: int = PREVIEW_EVERY_DEFAULT
    # Batch / compare limits, checked before any work starts.
    max_batch_items: int = 64
    max_grid_cells: int = 36
    # Server.
    host: str = "127.0.0.1"
    port: int = 7860
    share: bool = False
    auth: tuple[str, str] | None = None
    auth_file: Path | None = None
    max_queue: int = 16
    mcp: bool = False
    # Operator mode (README "Security"): --kiosk hides the engine-wide controls (attention, speed,
    # load model) from visitors and refuses their APIs unless the caller is logged in as `operator`.
    kiosk: bool = False
    operator: tuple[str, str] | None = field(default=None, repr=False)  # (user, password)
    # Limits on what a stranger can send and leave behind (README "Security").
    max_upload_mb: int = 50
    max_pixels: int = 25_000_000
    max_jobs_per_client: int = 2
    max_login_failures: int = 5
    cache_max_files: int = 1000
    cache_max_mb: int = 4000
    cache_max_age: int = 3600
    # What one client (its address, and its login with --auth) may keep in that cache: uploads and result copies.
    client_quota_mb: int = 500
    client_quota_files: int = 200
    # Decompressed bytes all the zips of one batch request may cost, kept or rejected (archive.ZipLimits).
    max_zip_mb: int = 512
    # A request body other than a file upload (queue joins, API calls, cancels, logins have their own 64 KB).
    max_body_kb: int = 1024
    # A session that names no request for this long (and has nothing queued or running) loses its state.
    session_idle_expiry: int = 3600
    # New sessions (page loads, API clients) one address may open per minute: a flood of fresh sessions
    # is refused (429) long before it could push a visitor's session out of gradio's table.
    max_new_sessions: int = 120
    # Proxies whose X-Forwarded-For names the client (addresses or networks; ("*",): any). Empty: nobody's,
    # so every per-address limit keys on the connection's own address (uvicorn alone trusts 127.0.0.1).
    forwarded_allow_ips: tuple[str, ...] = ()
    # Gradio's run history (its /gradio_api/runs page, /gradio_api/run-history/* routes, runs kept in the
    # browser): off unless the operator turns it on (gradio's own default is on).
    run_history: bool = False
    # Instruction rewriting: a VLM behind an OpenAI-compatible URL, or the local Llama (text only).
    # The API key is read from the environment when the client is made, never stored here.
    rewriter: str = "auto"
    rewriter_url: str | None = None
    rewriter_model: str | None = None
    rewriter_timeout: float = 20.0
    # Speed modes: exact (diffusers' MoE, eager, no step cache) unless asked.
    moe: str = "auto"
    compile: str = "none"
    cache: str = "none"

    @property
    def uses_tiny_model(self) -> bool:
        return self.model_dir is None and self.i1 is None and self.e1 is None and self.llama is None

    @property
    def uses_trained_tiny_model(self) -> bool:
        """The offline model is one with trained weights (it edits its world), not random ones."""
        spec = PROFILES.get(self.tiny_profile)
        return self.uses_tiny_model and spec is not None and spec.weights_asset is not None

    @property
    def rewriter_backend(self) -> str:
        """ "off", "local" or "openai" ("auto" resolved: openai when a URL is configured)."""
        if self.rewriter == "auto":
            return "openai" if self.rewriter_url else "off"
        return self.rewriter

    def replace(self, **changes) -> "AppConfig":
        return validate(dataclasses.replace(self, **changes))


# (flag, env vars, dest, help). One table so flags and variables cannot drift apart.
_MODEL_OPTIONS = [
    (
        "--model-dir",
        ("HIDREAM_MODEL_DIR",),
        "model_dir",
        "folder holding Llama-3.1-8B-Instruct/, HiDream-I1-Full/, HiDream-E1-1/ and/or HiDream-E1-Full/",
    ),
    ("--llama", ("HIDREAM_LLAMA",), "llama", "Llama-3.1-8B-Instruct: local folder or hub id"),
    ("--i1", ("HIDREAM_I1",), "i1", "HiDream-I1-Full: local folder or hub id"),
    ("--e1", ("HIDREAM_E1",), "e1", "HiDream-E1-1 (or HiDream-E1-Full for --variant e1-full): folder or hub id"),
    ("--variant", ("HIDREAM_VARIANT",), "variant", f"model variant: {' | '.join(VARIANTS)} (default e1.1)"),
    (
        "--tiny-profile",
        ("HIDREAM_TINY_PROFILE",),
        "tiny_profile",
        "offline model used when no weights are configured: "
        + " | ".join(TINY_PROFILES)
        + f" (default {OFFLINE_DEFAULT_PROFILE}: trained on the shapes world; the others have random weights; "
        f"{FULL_PROFILE_NAME}: release size, in memory)",
    ),
    ("--device", ("HIDREAM_DEVICE", "PREFERRED_DEVICE"), "device", "auto | npu | npu:N | cuda | cuda:N | cpu"),
    ("--dtype", ("HIDREAM_DTYPE",), "dtype", "auto | bf16 | fp16 | fp32 (auto probes the device)"),
    ("--attention", ("HIDREAM_ATTENTION",), "attention", "attention strategy at start-up (default auto)"),
    (
        "--text-encoders",
        ("HIDREAM_TEXT_ENCODERS",),
        "text_encoders",
        " | ".join(TEXT_ENCODER_MODES) + " (device: keep on the device, cpu: run on the host, offload: move to the "
        "device only to encode)",
    ),
    (
        "--devices",
        ("HIDREAM_DEVICES",),
        "devices",
        "one engine per device: a list such as npu:0,npu:1 or cuda:0,cuda:1 or cpu,cpu (splits the cores), or all "
        "(every visible accelerator); not with --device",
    ),
    (
        "--placement",
        ("HIDREAM_PLACEMENT",),
        "placement",
        "parts of one model on different devices: transformer=DEV,encoders=DEV[,vae=DEV]",
    ),
    (
        "--memory",
        ("HIDREAM_MEMORY",),
        "memory",
        "memory plan: " + " | ".join(MEMORY_CHOICES) + " (auto: the fastest that fits)",
    ),
    (
        "--weights",
        ("HIDREAM_WEIGHTS",),
        "weights",
        "transformer storage: " + " | ".join(WEIGHT_CHOICES) + " (auto: bf16 unless only fp8 fits without streaming)",
    ),
    (
        "--transformer-file",
        ("HIDREAM_TRANSFORMER_FILE",),
        "transformer_file",
        "single-file transformer checkpoint (.safetensors, diffusers or ComfyUI keys) used in place of the folder",
    ),
    (
        "--refiner",
        ("HIDREAM_REFINER",),
        "refiner",
        "weights of the refine stage: " + " | ".join(REFINERS) + " (e1: what upstream computes, zero copies; i1: "
        "HiDream-I1-Full, swapped)",
    ),
    (
        "--moe",
        ("HIDREAM_MOE",),
        "moe",
        "MoE forward: " + " | ".join(MOE_CHOICES) + " (auto: sync-free with --compile blocks, else diffusers; "
        "diffusers: exact; sync-free: no host sync, fixed shapes, 2x routed FLOPs)",
    ),
    (
        "--compile",
        ("HIDREAM_COMPILE",),
        "compile",
        " | ".join(COMPILE_CHOICES) + " (blocks: torch.compile / torchair on the repeated transformer blocks; eager "
        "if it fails)",
    ),
    (
        "--cache",
        ("HIDREAM_CACHE",),
        "cache",
        "default step cache of edits: none | interval:K | first-block:T | fbcache:T | taylorseer:N | magcache:T | "
        "dbcache:T, each with @S for at most S steps (or " + " | ".join(SPEED_PRESETS) + "; docs/speed.md)",
    ),
    ("--output-dir", ("HIDREAM_OUTPUT_DIR",), "output_dir", "where results and their metadata are saved"),
    ("--retention", ("HIDREAM_RETENTION",), "retention", "keep at most this many results in --output-dir"),
    (
        "--preview-every",
        ("HIDREAM_PREVIEW_EVERY",),
        "preview_every",
        f"live preview of an edit every K denoising steps; 0 = off (default {PREVIEW_EVERY_DEFAULT})",
    ),
]

_SERVER_OPTIONS = [
    ("--host", ("HIDREAM_HOST",), "host", "address to listen on (default 127.0.0.1)"),
    ("--port", ("HIDREAM_PORT",), "port", "port to listen on (default 7860)"),
    ("--auth", ("HIDREAM_AUTH",), "auth", "user:password required to open the app"),
    ("--auth-file", ("HIDREAM_AUTH_FILE",), "auth_file", "file with one user:password per line"),
    (
        "--operator",
        ("HIDREAM_OPERATOR",),
        "operator",
        "user:password of the operator, the one login that may change attention, speed and load the model "
        "with --kiosk (logs in at /operator, or on the login page with --auth)",
    ),
    ("--max-queue", ("HIDREAM_MAX_QUEUE",), "max_queue", "maximum queued requests (default 16)"),
    ("--max-batch-items", ("HIDREAM_MAX_BATCH_ITEMS",), "max_batch_items", "maximum items per batch"),
    ("--max-grid-cells", ("HIDREAM_MAX_GRID_CELLS",), "max_grid_cells", "maximum cells per compare grid"),
    (
        "--max-upload-mb",
        ("HIDREAM_MAX_UPLOAD_MB",),
        "max_upload_mb",
        "largest upload in MB, refused before it is stored (default 50)",
    ),
    (
        "--max-pixels",
        ("HIDREAM_MAX_PIXELS",),
        "max_pixels",
        "largest image in pixels, read from the header before decoding (default 25000000)",
    ),
    (
        "--max-jobs-per-client",
        ("HIDREAM_MAX_JOBS_PER_CLIENT",),
        "max_jobs_per_client",
        "jobs one client (browser tab or API client) may have queued or running (default 2)",
    ),
    (
        "--max-login-failures",
        ("HIDREAM_MAX_LOGIN_FAILURES",),
        "max_login_failures",
        "failed logins per address or user name per minute before they pause for a minute (default 5)",
    ),
    (
        "--cache-max-files",
        ("HIDREAM_CACHE_MAX_FILES",),
        "cache_max_files",
        "files in Gradio's upload/result cache for this app; when full, the heaviest client's least recently used "
        "files go (default 1000)",
    ),
    (
        "--cache-max-mb",
        ("HIDREAM_CACHE_MAX_MB",),
        "cache_max_mb",
        "MB in Gradio's upload/result cache for this app; when full, the heaviest client's least recently used "
        "files go (default 4000)",
    ),
    (
        "--client-quota-mb",
        ("HIDREAM_CLIENT_QUOTA_MB",),
        "client_quota_mb",
        "MB of uploads, result copies and previews one client (address, and login with --auth) keeps there; past "
        "it, its own least recently used files go (default 500)",
    ),
    (
        "--client-quota-files",
        ("HIDREAM_CLIENT_QUOTA_FILES",),
        "client_quota_files",
        "files of uploads, result copies and previews one client keeps in that cache; past it, its own least "
        "recently used files go (default 200)",
    ),
    (
        "--cache-max-age",
        ("HIDREAM_CACHE_MAX_AGE",),
        "cache_max_age",
        "seconds a cached upload or result copy is kept (default 3600)",
    ),
    (
        "--max-zip-mb",
        ("HIDREAM_MAX_ZIP_MB",),
        "max_zip_mb",
        "MB decompressed from all the zips of one batch request, kept or rejected (default 512)",
    ),
    (
        "--max-body-kb",
        ("HIDREAM_MAX_BODY_KB",),
        "max_body_kb",
        "largest request body other than a file upload, in KB (default 1024)",
    ),
    (
        "--session-idle-expiry",
        ("HIDREAM_SESSION_IDLE_EXPIRY",),
        "session_idle_expiry",
        "seconds after which an idle session's state is dropped (default 3600)",
    ),
    (
        "--max-new-sessions",
        ("HIDREAM_MAX_NEW_SESSIONS",),
        "max_new_sessions",
        "new sessions (page loads, API clients) one address may open per minute; more are refused (default 120)",
    ),
    (
        "--forwarded-allow-ips",
        ("HIDREAM_FORWARDED_ALLOW_IPS",),
        "forwarded_allow_ips",
        "comma-separated addresses or networks of the reverse proxies whose X-Forwarded-For names the client, "
        "or * for any (default: none; every client is the address it connects from)",
    ),
]


_REWRITER_OPTIONS = [
    (
        "--rewriter",
        ("HIDREAM_REWRITER",),
        "rewriter",
        "instruction rewriting: " + " | ".join(REWRITERS) + " (auto: openai when --rewriter-url is set, else off; "
        "local: the Llama text encoder + its LM head, text only, ~1 GB more in bf16)",
    ),
    (
        "--rewriter-url",
        ("HIDREAM_REWRITER_URL",),
        "rewriter_url",
        "base URL of an OpenAI-compatible chat-completions server with image input, e.g. http://127.0.0.1:8000/v1 "
        "(key from HIDREAM_REWRITER_API_KEY, else OPENAI_API_KEY)",
    ),
    (
        "--rewriter-model",
        ("HIDREAM_REWRITER_MODEL",),
        "rewriter_model",
        "model name the rewriter server serves (e.g. Qwen/Qwen2.5-VL-7B-Instruct)",
    ),
    (
        "--rewriter-timeout",
        ("HIDREAM_REWRITER_TIMEOUT",),
        "rewriter_timeout",
        "seconds to wait for the rewriter's answer (default 20)",
    ),
]


_INT_FIELDS = (
    "port",
    "max_queue",
    "retention",
    "preview_every",
    "max_batch_items",
    "max_grid_cells",
    "max_upload_mb",
    "max_pixels",
    "max_jobs_per_client",
    "max_login_failures",
    "cache_max_files",
    "cache_max_age",
    "cache_max_mb",
    "client_quota_mb",
    "client_quota_files",
    "max_zip_mb",
    "max_body_kb",
    "session_idle_expiry",
    "max_new_sessions",
)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and device")
    for flag, envs, dest, help_text in _MODEL_OPTIONS:
        group.add_argument(flag, dest=dest, default=None, help=f"{help_text} [env {', '.join(envs)}]")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    for flag, envs, dest, help_text in _SERVER_OPTIONS:
        group.add_argument(flag, dest=dest, default=None, help=f"{help_text} [env {', '.join(envs)}]")
    group.add_argument("--share", action="store_true", default=None, help="create a public Gradio share link")
    group.add_argument("--mcp", action="store_true", default=None, help="also serve Gradio's MCP server")
    group.add_argument(
        "--kiosk",
        action="store_true",
        default=None,
        help="visitors edit, batch and compare; the engine-wide controls (attention, speed, load "
        "model) are the operator's (--operator) [env HIDREAM_KIOSK=1]",
    )
    group.add_argument(
        "--run-history",
        action="store_true",
        default=None,
        help="turn on Gradio's run history (the /gradio_api/runs page and its routes; off by "
        "default) [env HIDREAM_RUN_HISTORY=1]",
    )


def add_rewriter_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("instruction rewriting")
    for flag, envs, dest, help_text in _REWRITER_OPTIONS:
        group.add_argument(flag, dest=dest, default=None, help=f"{help_text} [env {', '.join(envs)}]")


def from_namespace(ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> AppConfig:
    """Builds the config from parsed flags, falling back to environment variables."""
    environ = os.environ if environ is None else environ
    raw: dict[str, tuple[str, object]] = {}  # dest -> (source name for errors, value)
    for flag, envs, dest, _ in _MODEL_OPTIONS + _SERVER_OPTIONS + _REWRITER_OPTIONS:
        value = getattr(ns, dest, None)
        if value is not None:
            raw[dest] = (flag, value)
            continue
        for env in envs:
            if environ.get(env, "").strip():
                raw[dest] = (env, environ[env].strip())
                break
    for dest in ("share", "mcp"):
        if getattr(ns, dest, None):
            raw[dest] = ("--" + dest, True)
    raw.setdefault("tiny_profile", ("the default", OFFLINE_DEFAULT_PROFILE))
    for dest, env in (("kiosk", "HIDREAM_KIOSK"), ("run_history", "HIDREAM_RUN_HISTORY")):
        if getattr(ns, dest, None):
            raw[dest] = ("--" + dest.replace("_", "-"), True)
        elif environ.get(env, "").strip():
            raw[dest] = (env, _to_bool(env, environ[env]))
    return validate(_coerce(raw))


def from_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> AppConfig:
    parser = argparse.ArgumentParser(add_help=False)
    add_model_arguments(parser)
    add_server_arguments(parser)
    add_rewriter_arguments(parser)
    ns, _ = parser.parse_known_args(argv or [])
    return from_namespace(ns, environ)


def _coerce(raw: dict[str, tuple[str, object]]) -> AppConfig:
    fields: dict[str, object] = {}
    for dest, (source, value) in raw.items():
        if dest in ("model_dir", "output_dir", "auth_file", "transformer_file"):
            fields[dest] = Path(str(value)).expanduser()
        elif dest in _INT_FIELDS:
            fields[dest] = _to_int(source, value)
        elif dest in ("auth", "operator"):
            fields[dest] = _parse_auth(source, str(value))
        elif dest == "devices":
            fields[dest] = parse_devices(source, str(value))
        elif dest == "placement":
            fields[dest] = parse_placement(source, str(value))
        elif dest == "forwarded_allow_ips":
            fields[dest] = parse_forwarded_allow_ips(source, str(value))
        elif dest == "rewriter_timeout":
            fields[dest] = _to_float(source, value)
        elif dest in ("rewriter_url", "rewriter_model"):
            fields[dest] = str(value).strip() or None
        elif dest in (
            "device",
            "dtype",
            "variant",
            "attention",
            "text_encoders",
            "refiner",
            "tiny_profile",
            "rewriter",
            "memory",
            "weights",
            "moe",
            "compile",
        ):
            fields[dest] = str(value).strip().lower()
        else:
            fields[dest] = value
    try:
        return AppConfig(**fields)
    except TypeError as exc:  # an unknown field would be a bug in the option tables
        raise ConfigError(str(exc)) from exc


def _to_int(source: str, value: object) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise ConfigError(f"{source}={value!r} is not a whole number") from None


def _to_float(source: str, value: object) -> float:
    try:
        return float(str(value).strip())
    except ValueError:
        raise ConfigError(f"{source}={value!r} is not a number") from None


def _to_bool(source: str, value: object) -> bool:
    word = str(value).strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{source}={value!r} is not one of: 1, true, yes, on, 0, false, no, off")


def _parse_auth(source: str, value: str) -> tuple[str, str]:
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise ConfigError(f"{source} must look like user:password (got {value!r})")
    return user, password


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of: {', '.join(allowed)}")


def validate(config: AppConfig) -> AppConfig:
    """Checks every field; returns the config unchanged or raises ConfigError."""
    _choice("variant", config.variant, VARIANTS)
    _choice("dtype", config.dtype, DTYPE_SPECS)
    _choice("text_encoders", config.text_encoders, TEXT_ENCODER_MODES)
    _choice("refiner", config.refiner, REFINERS)
    _choice("tiny_profile", config.tiny_profile, TINY_PROFILES)
    try:
        parse_device_spec(config.device)  # the one device grammar (cheap: no torch)
    except DeviceError as exc:
        detail = str(exc).split("is not valid: ", 1)[-1]
        raise ConfigError(f"device={config.device!r} is not valid: {detail}") from None
    if config.attention not in strategy_names():
        raise ConfigError(f"attention={config.attention!r} is not one of: {', '.join(strategy_names())}")
    if not 1 <= config.port <= 65535:
        raise ConfigError(f"port={config.port} must be between 1 and 65535")
    for name in (
        "max_queue",
        "max_batch_items",
        "max_grid_cells",
        "prompt_cache_size",
        "max_upload_mb",
        "max_pixels",
        "max_jobs_per_client",
        "max_login_failures",
        "cache_max_files",
        "cache_max_age",
        "cache_max_mb",
        "client_quota_mb",
        "client_quota_files",
        "max_zip_mb",
        "max_body_kb",
        "session_idle_expiry",
        "max_new_sessions",
    ):
        if getattr(config, name) < 1:
            raise ConfigError(f"{name}={getattr(config, name)} must be at least 1")
    if config.retention < 0:
        raise ConfigError(f"retention={config.retention} must be 0 (keep everything) or more")
    if config.preview_every < 0:
        raise ConfigError(f"preview_every={config.preview_every} must be 0 (no live preview) or a number of steps")
    if config.auth is not None and config.auth_file is not None:
        raise ConfigError("use either --auth or --auth-file, not both")
    check_forwarded_allow_ips("forwarded_allow_ips", config.forwarded_allow_ips)
    _validate_operator(config)
    _validate_rewriter(config)
    _validate_devices(config)
    try:
        config = validate_memory_options(config)
        check_speed(
            config.moe,
            config.compile,
            config.cache,
            transformer_offloaded=config.memory in PLAN_SPECS and PLAN_SPECS[config.memory].transformer != "resident",
        )
    except (MemoryOptionError, SpeedSettingError) as exc:
        raise ConfigError(str(exc)) from None
    return config


def _validate_operator(config: AppConfig) -> None:
    if config.operator is None:
        return
    if not config.kiosk:
        raise ConfigError(
            "--operator needs --kiosk: without it every visitor may change the engine settings "
            "(add --kiosk, or drop --operator)"
        )
    check_operator_name(config.operator, [config.auth] if config.auth is not None else [])


def check_operator_name(operator: tuple[str, str] | None, users: list[tuple[str, str]]) -> None:
    """The operator's name must be its own: gradio keeps one password per user name, so a shared
    name would either lock the operator out or make an --auth user the operator."""
    if operator is not None and any(user == operator[0] for user, _ in users):
        raise ConfigError(
            f"--operator user {operator[0]!r} is also an --auth/--auth-file user: give the operator a name of its own"
        )


def _validate_devices(config: AppConfig) -> None:
    """--devices and --placement (parsed by `hidream_ui.device.pool_spec`, the one grammar)."""
    try:
        check_devices(config.devices, config.device)
        check_placement(config.placement, config.device, config.devices, config.text_encoders)
    except PoolSpecError as exc:
        raise ConfigError(str(exc)) from None


def parse_devices(source: str, value: str) -> tuple[str, ...]:
    try:
        return split_devices(value)
    except PoolSpecError as exc:
        raise ConfigError(f"{source}={value!r}: {exc}") from None


def parse_placement(source: str, value: str) -> tuple[tuple[str, str], ...]:
    try:
        return split_placement(value)
    except PoolSpecError as exc:
        raise ConfigError(f"{source}={value!r}: {exc}") from None


def parse_forwarded_allow_ips(source: str, value: str) -> tuple[str, ...]:
    """--forwarded-allow-ips: comma-separated proxies ("" = none, "*" = any), checked as `validate` does."""
    proxies = tuple(item.strip() for item in value.split(",") if item.strip())
    check_forwarded_allow_ips(source, proxies, value)
    return proxies


def check_forwarded_allow_ips(source: str, proxies: tuple[str, ...], value: object = None) -> None:
    """Each proxy must be an IP address or network, or the one entry "*". Checked here because uvicorn
    takes anything else for a name that never matches (10.0.0.1/8, with host bits, trusts nobody): a typo
    would pass without a word."""
    shown = repr(value if value is not None else proxies)
    if not isinstance(proxies, tuple) or not all(isinstance(item, str) for item in proxies):
        raise ConfigError(f"{source}={shown} must be a tuple of addresses or networks (or ('*',))")
    if "*" in proxies:
        if len(proxies) > 1:
            raise ConfigError(f"{source}={shown}: * (any proxy) stands alone, not in a list")
        return
    for item in proxies:
        try:
            ipaddress.ip_network(item) if "/" in item else ipaddress.ip_address(item)
        except ValueError as exc:
            raise ConfigError(
                f"{source}={shown}: {item!r} is not an IP address or network ({exc}); give addresses "
                "or networks such as 127.0.0.1, 10.0.0.0/8 or ::1, or * for any proxy"
            ) from None


def _validate_rewriter(config: AppConfig) -> None:
    _choice("rewriter", config.rewriter, REWRITERS)
    lo, hi = REWRITER_TIMEOUT_RANGE
    timeout = config.rewriter_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not lo <= timeout <= hi:
        raise ConfigError(f"rewriter_timeout={timeout!r} must be a number of seconds from {lo:g} to {hi:g}")
    url = config.rewriter_url
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(
                f"rewriter_url={url!r} is not an http(s) URL; give the server's API base, e.g. http://127.0.0.1:8000/v1"
            )
    if config.rewriter_backend == "openai":
        if not url:
            raise ConfigError(
                "rewriter='openai' needs --rewriter-url (or HIDREAM_REWRITER_URL): the base URL of an "
                "OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1"
            )
        if not config.rewriter_model:
            raise ConfigError(
                "--rewriter-url needs --rewriter-model (or HIDREAM_REWRITER_MODEL): the model name "
                "the server serves, e.g. Qwen/Qwen2.5-VL-7B-Instruct"
            )


def read_auth_file(path: Path) -> list[tuple[str, str]]:
    """Reads `user:password` lines (blank lines and # comments ignored) for gradio's `auth=`."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--auth-file {path}: cannot read it ({exc.strerror})") from None
    pairs = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        pairs.append(_parse_auth(f"--auth-file {path} line {number}", line))
    if not pairs:
        raise ConfigError(f"--auth-file {path} holds no user:password line")
    return pairs
