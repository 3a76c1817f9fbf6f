"""Frozen application configuration from command-line flags and environment variables.

Precedence: an explicit flag wins over an environment variable, which wins over the default.
Every bad value raises `ConfigError` naming the flag/variable, the value and what is allowed.
The table of flags and variables is hidream_ui/config_table.py (its names are re-exported here);
a renamed variable's old name is read through hidream_ui/env_names.py. Nothing here touches torch
or the filesystem beyond `Path` arithmetic: building a config is free, so `--help` and the app's
cold start stay fast.
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

from hidream_ui.config_table import (  # noqa: F401  re-exported: the table's names were this module's
    _CLUSTER_OPTIONS,
    _MODEL_OPTIONS,
    _REWRITER_OPTIONS,
    _SERVER_OPTIONS,
    _SWITCHES,
    COMPILE_CHOICES,
    MEMORY_CHOICES,
    MOE_CHOICES,
    OFFLINE_DEFAULT_PROFILE,
    PREVIEW_EVERY_DEFAULT,
    PREVIEWS_MAX,
    REFINERS,
    REWRITER_TIMEOUT_RANGE,
    REWRITERS,
    SPEED_PRESETS,
    TEXT_ENCODER_MODES,
    TINY_PROFILES,
    VALUE_OPTIONS,
    WEIGHT_CHOICES,
    add_cluster_arguments,
    add_model_arguments,
    add_rewriter_arguments,
    add_server_arguments,
)
from hidream_ui.device.backends import DTYPE_SPECS, DeviceError
from hidream_ui.device.detect import parse_device_spec
from hidream_ui.device.pool_spec import PoolSpecError, check_devices, check_placement, split_devices, split_placement
from hidream_ui.env_names import RenamedVariableError, read_variable
from hidream_ui.model.plans import PLAN_SPECS, MemoryOptionError, validate_memory_options
from hidream_ui.model.tiny.profiles import PROFILES
from hidream_ui.pipeline.attention.registry import strategy_names
from hidream_ui.pipeline.speed.settings import SpeedSettingError, check_speed
from hidream_ui.variants import DEFAULT_VARIANT, VARIANTS


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which one and what is allowed."""


@dataclass(frozen=True)
class AppConfig:
    # Where the weights come from. With none of these set the app runs the offline tiny model.
    model_dir: Path | None = None
    llama: str | None = None
    i1: str | None = None
    e1: str | None = None
    variant: str = DEFAULT_VARIANT
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
    api_keys_file: Path | None = None  # --api-keys (server/api_keys.py): the keys stay in the file
    max_queue: int = 16
    mcp: bool = False
    wall: bool = False  # --wall (server/share_routes.py): /wall cycles the results visitors opted in
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
    # Ray (docs/cluster.md): the cluster's address (`auto`, `local`, HOST:PORT); None: the local pool.
    ray: str | None = None
    # --ray-token-file: the file holding the cluster's Ray token (engine/ray_env.py); the path only, never the token.
    ray_token_file: Path | None = None
    # Replicas with --ray: "N" or "MIN-MAX" (autoscaling), as `replica_bounds` reads it; None: one per device.
    replicas: str | None = None

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

    @property
    def replica_bounds(self) -> tuple[int, int | None]:
        """`replicas` as (fixed count or minimum, maximum or None); (0, None): not set."""
        return parse_replicas("replicas", self.replicas)

    def replace(self, **changes) -> "AppConfig":
        return validate(dataclasses.replace(self, **changes))


# Whole-number settings and the least each may be (the port has a most too: 65535); with why, where 0 is allowed.
_AT_LEAST: Mapping[str, int] = {
    "port": 1,
    "max_queue": 1,
    "retention": 0,
    "preview_every": 0,
    "max_batch_items": 1,
    "max_grid_cells": 1,
    "prompt_cache_size": 1,
    "max_upload_mb": 1,
    "max_pixels": 1,
    "max_jobs_per_client": 1,
    "max_login_failures": 1,
    "cache_max_files": 1,
    "cache_max_age": 1,
    "cache_max_mb": 1,
    "client_quota_mb": 1,
    "client_quota_files": 1,
    "max_zip_mb": 1,
    "max_body_kb": 1,
    "session_idle_expiry": 1,
    "max_new_sessions": 1,
}
_ZERO_MEANS = {"retention": "0 (keep everything) or more", "preview_every": "0 (no live preview) or a number of steps"}
_PATH_FIELDS = ("model_dir", "output_dir", "auth_file", "api_keys_file", "transformer_file", "ray_token_file")
_WORD_FIELDS = (
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
)


def from_namespace(ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> AppConfig:
    """Builds the config from parsed flags, falling back to environment variables (a renamed one's
    deprecated old name too: hidream_ui/env_names.py)."""
    environ = os.environ if environ is None else environ
    raw: dict[str, tuple[str, object]] = {}  # dest -> (source name for errors, value)
    for flag, envs, dest, _ in VALUE_OPTIONS:
        value = getattr(ns, dest, None)
        if value is not None:
            raw[dest] = (flag, value)
            continue
        found = _variable(envs, environ)
        if found is not None:
            raw[dest] = found
    raw.setdefault("tiny_profile", ("the default", OFFLINE_DEFAULT_PROFILE))
    for flag, envs, dest, _ in _SWITCHES:
        if getattr(ns, dest, None):
            raw[dest] = (flag, True)
            continue
        found = _variable(envs, environ)
        if found is not None:
            raw[dest] = (found[0], _to_bool(*found))
    return validate(_coerce(raw))


def _variable(envs: tuple[str, ...], environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(name, value) of the first of `envs` that is set (or whose deprecated old name is)."""
    for env in envs:
        try:
            found = read_variable(env, environ)
        except RenamedVariableError as exc:
            raise ConfigError(str(exc)) from None
        if found is not None:
            return found
    return None


def from_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> AppConfig:
    parser = argparse.ArgumentParser(add_help=False)
    add_model_arguments(parser)
    add_server_arguments(parser)
    add_rewriter_arguments(parser)
    add_cluster_arguments(parser)
    ns, _ = parser.parse_known_args(argv or [])
    return from_namespace(ns, environ)


def _coerce(raw: dict[str, tuple[str, object]]) -> AppConfig:
    fields: dict[str, object] = {}
    for dest, (source, value) in raw.items():
        if dest in _PATH_FIELDS:
            fields[dest] = Path(str(value)).expanduser()
        elif dest in _AT_LEAST:
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
        elif dest in ("rewriter_url", "rewriter_model", "ray"):
            fields[dest] = str(value).strip() or None
        elif dest == "replicas":
            parse_replicas(source, value)  # the flag or variable is named when it is malformed
            fields[dest] = str(value).strip()
        elif dest in _WORD_FIELDS:
            fields[dest] = str(value).strip().lower()
        else:
            fields[dest] = value
    try:
        return AppConfig(**fields)
    except TypeError as exc:  # an unknown field would be a bug in the option tables
        raise ConfigError(str(exc)) from exc


def parse_replicas(source: str, value: object) -> tuple[int, int | None]:
    """`N` (a fixed count) or `MIN-MAX` (Serve autoscaling) -> (count or minimum, maximum or None);
    None -> (0, None). ConfigError naming `source` otherwise."""
    if value is None:
        return 0, None
    text = str(value).strip()
    try:
        if "-" in text:
            low, high = (int(part) for part in text.split("-", 1))
            if 1 <= low <= high:
                return low, high
        elif int(text) >= 1:
            return int(text), None
    except ValueError:
        pass
    raise ConfigError(
        f"{source}={value!r}: expected a count of 1 or more, such as 2, or autoscaling bounds such as 1-4"
    )


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
    for name, least in _AT_LEAST.items():
        if getattr(config, name) < least:
            allowed = _ZERO_MEANS.get(name, f"at least {least}")
            raise ConfigError(f"{name}={getattr(config, name)} must be {allowed}")
    parse_replicas("replicas", config.replicas)
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
