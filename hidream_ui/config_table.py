"""The table of every setting: each flag with its environment variables, where it goes in `AppConfig`
and its help, and the choice lists the help names (each read from its home). One table, so flags,
variables, `--help` and the docs' tables cannot drift apart; hidream_ui.config builds and checks the
frozen config from it (and re-exports every name here).

Nothing here touches torch: `--help` stays instant.
"""

from __future__ import annotations

import argparse

from hidream_ui.env_names import OLD_NAMES
from hidream_ui.model.plans import MEMORY_CHOICES, WEIGHT_CHOICES
from hidream_ui.model.tiny.profiles import FULL_PROFILE_NAME, PROFILES
from hidream_ui.pipeline.speed.settings import COMPILE_CHOICES, MOE_CHOICES, SPEED_PRESETS
from hidream_ui.variants import VARIANTS

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
        ("HIDREAM_STEP_CACHE",),
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
        "--api-keys",
        ("HIDREAM_API_KEYS_FILE",),
        "api_keys_file",
        "file with one API key per line: programs call /v1/images/edits and MCP with 'Authorization: Bearer KEY' "
        "(without it those routes answer only where the app has no login)",
    ),
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
        ("HIDREAM_UPLOAD_CACHE_MAX_FILES",),
        "cache_max_files",
        "files in Gradio's upload/result cache for this app; when full, the heaviest client's least recently used "
        "files go (default 1000)",
    ),
    (
        "--cache-max-mb",
        ("HIDREAM_UPLOAD_CACHE_MAX_MB",),
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
        ("HIDREAM_UPLOAD_CACHE_MAX_AGE",),
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


# Ray (docs/cluster.md): the app's engines as Ray Serve replicas on a cluster instead of the local pool.
_CLUSTER_OPTIONS = [
    (
        "--ray",
        ("HIDREAM_RAY_ADDRESS",),
        "ray",
        "run the engines as Ray Serve replicas on this cluster (`auto`: the running local cluster; `local`: one "
        "of this process's own on 127.0.0.1; or HOST:PORT); needs `pip install hidream_ui[ray]`",
    ),
    (
        "--ray-token-file",
        ("HIDREAM_RAY_TOKEN_FILE",),
        "ray_token_file",
        "with --ray: a file holding the cluster's Ray authentication token (default: Ray's own places: "
        "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token); the token is never printed or logged",
    ),
    (
        "--replicas",
        ("HIDREAM_RAY_REPLICAS",),
        "replicas",
        "with --ray: engine replicas, one per device (default: the --devices count, else every GPU/NPU of the "
        "cluster, 1 on CPUs); MIN-MAX autoscales",
    ),
]

# On/off flags: a flag turns it on, a variable (1/0, true/false, yes/no, on/off) where one exists.
_SWITCHES = [
    ("--share", (), "share", "create a public Gradio share link"),
    ("--mcp", (), "mcp", 'also serve MCP tools (edit, status, recipe) at /mcp (pip install "hidream_ui[mcp]")'),
    (
        "--wall",
        ("HIDREAM_WALL",),
        "wall",
        "serve /wall, an attract-mode page for the booth's big screen cycling the results visitors ticked "
        '"Show on the wall" for (the last 30, kept in memory only)',
    ),
    (
        "--kiosk",
        ("HIDREAM_KIOSK",),
        "kiosk",
        "visitors edit, batch and compare; the engine-wide controls (attention, speed, load model) are the "
        "operator's (--operator)",
    ),
    (
        "--run-history",
        ("HIDREAM_RUN_HISTORY",),
        "run_history",
        "turn on Gradio's run history (the /gradio_api/runs page and its routes; off by default)",
    ),
]
# Every valued option (the switches apart), in the order `from_namespace` reads them.
VALUE_OPTIONS = _MODEL_OPTIONS + _SERVER_OPTIONS + _REWRITER_OPTIONS + _CLUSTER_OPTIONS


def _env_note(envs: tuple[str, ...], switch: bool = False) -> str:
    """The help's "[env ...]" note; a renamed variable's deprecated old name is named too."""
    names = [f"{env}=1" if switch else env for env in envs]
    old = [OLD_NAMES[env] for env in envs if env in OLD_NAMES]
    if old:
        names.append("deprecated " + ", ".join(old))
    return f" [env {', '.join(names)}]" if names else ""


def _add_options(group, options) -> None:
    for flag, envs, dest, help_text in options:
        group.add_argument(flag, dest=dest, default=None, help=help_text + _env_note(envs))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    _add_options(parser.add_argument_group("model and device"), _MODEL_OPTIONS)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    _add_options(group, _SERVER_OPTIONS)
    for flag, envs, dest, help_text in _SWITCHES:
        group.add_argument(flag, dest=dest, action="store_true", default=None, help=help_text + _env_note(envs, True))


def add_rewriter_arguments(parser: argparse.ArgumentParser) -> None:
    _add_options(parser.add_argument_group("instruction rewriting"), _REWRITER_OPTIONS)


_CLUSTER_METAVARS = {"ray": "ADDRESS", "ray_token_file": "PATH", "replicas": "N|MIN-MAX"}


def add_cluster_arguments(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """The cluster options (`only`: those dests alone, e.g. `batch` and `bench cluster`, which have
    their own --ray, take `ray_token_file` from here)."""
    group = parser.add_argument_group("cluster (Ray; docs/cluster.md)") if only is None else parser
    for flag, envs, dest, help_text in _CLUSTER_OPTIONS:
        if only is None or dest in only:
            metavar = _CLUSTER_METAVARS[dest]
            group.add_argument(flag, dest=dest, metavar=metavar, default=None, help=help_text + _env_note(envs))


def add_ray_token_argument(parser: argparse.ArgumentParser) -> None:
    """`--ray-token-file` alone, from the table (`batch` and `bench cluster` have their own --ray)."""
    add_cluster_arguments(parser, only=("ray_token_file",))
