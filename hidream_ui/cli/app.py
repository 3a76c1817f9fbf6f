"""`python app.py` / `python -m hidream_ui app`: parse flags, build the engine and the UI, serve.

Nothing loads at start: the engine is created empty and the model loads on the first edit (or
the "Load model" button), with progress in the browser. That keeps the cold start to gradio's
import plus the server start. A bad flag prints one `error: ...` line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import logging
import os
import sys
from typing import TYPE_CHECKING

from hidream_ui.cli.quiet import add_verbose_argument, quiet_libraries
from hidream_ui.config import (
    AppConfig,
    ConfigError,
    add_cluster_arguments,
    add_model_arguments,
    add_rewriter_arguments,
    add_server_arguments,
    check_operator_name,
    from_namespace,
    read_auth_file,
)
from hidream_ui.engine.errors import EngineError
from hidream_ui.server.lanes import ALL_LANES, DEVICE_GROUP, LATE_INPUTS, REWRITER_GROUP

if TYPE_CHECKING:  # pragma: no cover
    import gradio as gr

    from hidream_ui.engine.pool import EnginePool


logger = logging.getLogger(__name__)

EXIT_CONFIG = 2
# One upload request may carry this many files of --max-upload-mb (a batch upload sends several).
UPLOAD_REQUEST_FILES = 8
JANITOR_INTERVAL = 5.0  # seconds between two prunings of gradio's cache (files.ClientStorage.plan)
SESSION_CHECK_INTERVAL = 60.0  # seconds between two looks for idle sessions
MCP_HINT = '--mcp needs the mcp package 2.3 or a later 2.x: pip install "hidream_ui[mcp]" (or start without --mcp)'


def build_parser(prog: str = "python app.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Browser demo for HiDream-E1.1 / HiDream-E1-Full image editing. Without model flags it "
        "runs an offline tiny model trained on a world of coloured shapes (it knows 'make the <shape> <colour>', "
        "'remove the <shape>' and 'make the background <colour>'; --tiny-profile tiny: random weights, noise) "
        "so that everything can be tried; --model-dir points it at the real weights.",
    )
    add_model_arguments(parser)
    add_server_arguments(parser)
    add_rewriter_arguments(parser)
    add_cluster_arguments(parser)
    add_verbose_argument(parser)
    return parser


def ray_engine(config: AppConfig, *, verbose: bool = False):
    """The RayEngine for `config.ray` (`--ray` / HIDREAM_RAY_ADDRESS), or None (the local pool), with
    `config.replicas`; both were read and checked by the config table. ConfigError when Ray is missing
    (saying how to install it) or when the head at HOST:PORT refuses us (one gRPC call asks it: the
    one-line reason). The replicas start with the first job or the Load button, as a local model loads."""
    if config.ray is None:
        return None
    from hidream_ui.engine.ray_env import RayUnavailable, check_cluster, require_ray
    from hidream_ui.engine.ray_serve import RayEngine
    from hidream_ui.ui.services import is_public

    try:
        require_ray(config.ray)
        check_cluster(config.ray, config.ray_token_file)  # a head that refuses: one line, before serving
        return RayEngine(config, hide_paths=is_public(config), verbose=verbose)
    except (RayUnavailable, EngineError) as exc:
        raise ConfigError(str(exc)) from None


def mcp_available() -> bool:
    """The MCP tools (server/mcp_tools.py) need the `mcp` package 2.3 or a later 2.x (the `hidream_ui[mcp]`
    extra); gradio[mcp]'s mcp 1.x has another server API."""
    from importlib import metadata

    if importlib.util.find_spec("mcp") is None:
        return False
    try:
        major, minor = (int(part) for part in metadata.version("mcp").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    return major == 2 and minor >= 3


def _auth(config: AppConfig):
    """Gradio's `auth=`: the --auth / --auth-file users, plus the operator when there is a login at
    all (gradio's login is all-or-nothing: without --auth the operator signs in at /operator, see
    server/operator.py, and visitors need no login)."""
    if config.auth is not None:
        users = [config.auth]
    elif config.auth_file is not None:
        users = read_auth_file(config.auth_file)
    else:
        return None
    check_operator_name(config.operator, users)
    return users + ([config.operator] if config.operator is not None else [])


def launch(
    config: AppConfig,
    *,
    engine: "EnginePool | None" = None,
    prevent_thread_lock: bool = False,
    quiet: bool = False,
) -> tuple["gr.Blocks", str]:
    """Builds the demo for `config` (or the given engine) and starts serving it.

    Returns (demo, local URL). With `prevent_thread_lock` the call returns once the server is up
    (tests; close with `demo.close()`), otherwise it blocks until the server stops.
    Raises ConfigError for an unreadable auth file or a missing MCP extra.
    """
    # Gradio's usage analytics would phone home at launch; an offline NPU box must not wait on that.
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    auth = _auth(config)
    if api_keys(config) is not None:  # a key file that cannot be used is refused before anything starts
        check_key_logins(config, auth)
    if config.mcp and not mcp_available():
        raise ConfigError(MCP_HINT)

    # Lazy (here and below): the engine, the UI and the server modules pull torch, gradio and
    # asyncio/anyio; `app --help` and a refused config must not pay for them.
    from hidream_ui.engine.pool import EnginePool
    from hidream_ui.server import gradio_internals
    from hidream_ui.ui.layout import build_demo, launch_options, new_blocks
    from hidream_ui.ui.services import AppServices, is_public

    if engine is None:  # one engine per --devices entry, or a pool of one (engine/pool.py)
        try:
            engine = EnginePool.for_config(config, hide_paths=is_public(config))
        except EngineError as exc:
            raise ConfigError(str(exc)) from None
    if is_public(config) and not engine.hide_paths:  # a caller's engine: strangers must not see paths
        raise ConfigError(
            "an app without login (--auth) needs an engine built with hide_paths=True "
            "(EnginePool.for_config(config, hide_paths=True))"
        )
    # Before any Blocks exist: gradio reads GRADIO_TEMP_DIR when it builds components.
    cache_folder = gradio_internals.private_cache_folder()
    blocks = new_blocks(config)
    services = AppServices.for_config(
        config, engine=engine, demo=blocks, cache_folder=cache_folder, janitor=_janitor(blocks, cache_folder, config)
    )
    demo = build_demo(engine, services=services)
    # No max_size: gradio would count /status and /cancel too; `admission` limits the device lane.
    # api_open=False: the queue is the only way in. Gradio then refuses a direct POST
    # /gradio_api/run/<name> (and /api/<name>) of every queued event with 404, so admission, the
    # per-client limit, queue position and cancel hold for every caller; events declared
    # queue=False (/status, /cancel, the panel's timer) still answer there at once.
    demo.queue(max_size=None, api_open=False)
    if not admission(demo, config):
        # Never serve strangers without the queue limits: that would be an unbounded queue.
        raise ConfigError(
            "this gradio version's queue cannot be limited (see hidream_ui/server/gradio_internals.py); "
            "install the gradio version in requirements.txt"
        )
    if config.uses_tiny_model and not quiet:
        what = (
            "the offline tiny model trained on a world of coloured shapes: it edits only those scenes"
            if config.uses_trained_tiny_model
            else f"the offline tiny model with random weights (--tiny-profile {config.tiny_profile}): results are noise"
        )
        print(
            f"Running {what}. Use --model-dir /path/to/models (or HIDREAM_MODEL_DIR) for the real HiDream weights.",
            file=sys.stderr,
        )
    if not quiet:
        print(service_lines(config), file=sys.stderr)
        from hidream_ui.server.operator import startup_line  # the operator's way in (--kiosk)

        if (operator_line := startup_line(config)) is not None:
            print(operator_line, file=sys.stderr)
    trust_proxies(config)
    _, local_url, _ = demo.launch(
        server_name=config.host,
        server_port=config.port,
        share=config.share,
        auth=auth,
        mcp_server=False,  # --mcp serves our own MCP tools (server/mcp_tools.py), not gradio's
        prevent_thread_lock=prevent_thread_lock,
        quiet=quiet,
        # The bundled examples and, one by one, the result PNGs the app wrote: never the whole
        # results folder (other files there are not for strangers). The list grows in place.
        allowed_paths=services.results.allowed,
        max_file_size=config.max_upload_mb * 1024 * 1024,  # refused by gradio's upload route: 413
        # Gradio's own default is on (or GRADIO_RUN_HISTORY): its runs page and /gradio_api/run-history/*
        # routes, which can act with this machine's saved Hugging Face token for a loopback caller.
        run_history=config.run_history,
        app_kwargs=_app_kwargs(demo, services, config, engine=engine),
        **launch_options(),
    )
    return demo, local_url


def trust_proxies(config: AppConfig, environ=None) -> None:
    """--forwarded-allow-ips, for the uvicorn server gradio starts. Gradio 6.31 (http_server.start_server)
    makes its uvicorn.Config with no proxy arguments, so uvicorn (0.55) reads FORWARDED_ALLOW_IPS from the
    environment when the server is made, else trusts X-Forwarded-For from 127.0.0.1 and ::1: every client
    behind a local proxy could then name its own address, the key of every per-address limit. Always set
    from the config ("" trusts nobody), so that a FORWARDED_ALLOW_IPS the environment carries (some
    container images set "*") decides nothing. Gradio reads no X-Forwarded-For of its own: request.client,
    its login and run-history checks see what uvicorn leaves in the request."""
    environ = os.environ if environ is None else environ
    environ["FORWARDED_ALLOW_IPS"] = ",".join(config.forwarded_allow_ips)


def admission(demo, config: AppConfig) -> bool:
    """--max-queue and --max-jobs-per-client on the device lane and on the small lanes beside it
    (a remote rewriter's requests, the settings-from-PNG reader, the Speed setting: they do not
    wait behind edits, but are bounded the same way) (see `gradio_internals.admit_jobs`)."""
    from hidream_ui.server import gradio_internals  # asyncio: not for --help

    return gradio_internals.admit_jobs(
        demo,
        ALL_LANES,
        max_waiting=config.max_queue,
        per_session=config.max_jobs_per_client,
        per_session_message=lambda held: per_client_message(config, held),
        late_inputs=LATE_INPUTS,
    )


def service_lines(config: AppConfig) -> str:
    """What the start-up log says about the routes beside the page (docs/api.md): where they are and
    who may call them."""
    from hidream_ui.ui.services import is_public

    base = f"http://{config.host}:{config.port}"
    if config.api_keys_file is not None:
        who = f"with a key of {config.api_keys_file} (Authorization: Bearer)"
    elif is_public(config):
        who = "open to anyone who can open the page (no login; --api-keys FILE asks for keys)"
    else:
        who = "refused: the app has a login (start with --api-keys FILE to let programs in)"
    lines = [f"OpenAI-compatible images API: {base}/v1/images/edits, {who}"]
    if config.mcp:
        lines.append(f"MCP server (streamable HTTP): {base}/mcp, {who.split(' (')[0]}")
    return "\n".join(lines)


def api_keys(config: AppConfig):
    """The --api-keys of `config` (None without the flag); ConfigError for a file that cannot be used."""
    from hidream_ui.server.api_keys import ApiKeyFileError, ApiKeys

    if config.api_keys_file is None:
        return None
    try:
        return ApiKeys.load(config.api_keys_file)
    except ApiKeyFileError as exc:
        raise ConfigError(str(exc)) from None


def check_key_logins(config: AppConfig, auth) -> None:
    """ConfigError when a login of the app (an --auth / --auth-file user, the --operator) is named like
    an API key's login (`api-key<N>`): that person and the key's programs would be one login."""
    from hidream_ui.server.api_keys import ApiKeyFileError, check_login_names

    names = [user for user, _ in auth or []] + ([config.operator[0]] if config.operator is not None else [])
    try:
        check_login_names(names)
    except ApiKeyFileError as exc:
        raise ConfigError(str(exc)) from None


def per_client_message(config: AppConfig, held: int) -> str:
    """What a client with `held` jobs queued or running is told when it asks for one more (the browser,
    gradio_client, the OpenAI-compatible route and MCP alike)."""
    return (
        f"You already have {held} job(s) queued or running (at most {config.max_jobs_per_client} per "
        "client): wait for one to finish, or stop it."
    )


def _services(demo, services, config: AppConfig, engine=None) -> list:
    """The app's own routes beside gradio's (server/service_routes.py): the OpenAI-compatible images
    API always (it answers only where the app has no login, or with --api-keys), MCP with --mcp. Their
    calls reach the editor through `Loopback`: the app's own routes, as their caller."""
    from hidream_ui.server import gradio_internals, openai_api
    from hidream_ui.server.api_keys import ApiGate
    from hidream_ui.server.guard import LoginThrottle
    from hidream_ui.server.loopback import Loopback

    def fn_index(api_name: str) -> int | None:
        return next((index for index, fn in demo.fns.items() if fn.api_name == api_name), None)

    loopback = Loopback(
        lambda: demo.app,
        slots=config.max_jobs_per_client,
        fn_index=fn_index,
        per_client_message=lambda held: per_client_message(config, held),
        sign_in=gradio_internals.sign_in,
    )
    gate = ApiGate(api_keys(config), public=services.public, throttle=LoginThrottle(config.max_login_failures))
    sizes = engine.working_resolution_choices if engine is not None else None  # what `size` may name
    routes = [openai_api.service(config, services, loopback, gate, sizes=sizes)]
    if config.mcp:
        from hidream_ui.server import mcp_tools

        for name in ("mcp.server.streamable_http_manager", "mcp.server.streamable_http"):
            logging.getLogger(name).setLevel(logging.WARNING)  # they log every session id at INFO

        routes.append(mcp_tools.service(config, services, loopback, gate))
    from hidream_ui.server import share_links, share_routes  # "Send to my phone" and --wall

    routes.append(share_routes.service(config, services, loopback, share_links.of(demo)))
    return routes


def _janitor(demo, folder, config: AppConfig):
    """The cache janitor of `demo`'s gradio cache `folder` with its per-client accounting (the guard
    charges uploads, calls charge outputs); started by the app's lifespan."""
    from hidream_ui.server import gradio_internals  # asyncio, anyio, PIL: not for --help
    from hidream_ui.server.files import CacheJanitor, ClientStorage, StorageLimits

    limits = StorageLimits.for_config(config)
    # An upload that finds the cache full prunes at once (`prune_now`), then looks again.
    storage = ClientStorage(limits, prune_now=lambda: janitor.run_once())
    janitor = CacheJanitor(
        lambda: gradio_internals.prune_cache(
            demo, folder, limits.cache_files, limits.max_age, max_bytes=limits.cache_bytes, storage=storage
        ),
        interval=JANITOR_INTERVAL,
        storage=storage,
    )
    return janitor


def _app_kwargs(demo, services, config: AppConfig, engine=None) -> dict:
    """FastAPI arguments: the guard middleware and a lifespan that makes gradio's sessions lean,
    runs the cache janitor and the idle-session expiry and, at shutdown, every clean-up of the app
    (batch zips, cached files)."""
    import asyncio
    import contextlib

    from starlette.middleware import Middleware

    from hidream_ui.server import gradio_internals  # asyncio, anyio, PIL: not for --help
    from hidream_ui.server.guard import BoothGuard, LoginThrottle, NewSessions
    from hidream_ui.server.operator import OperatorLogin
    from hidream_ui.server.service_routes import ServiceRoutes, lifespans

    # The operator's login (/operator/login) is throttled like gradio's, with or without --auth.
    throttle = None if services.public and config.operator is None else LoginThrottle(config.max_login_failures)
    janitor = services.janitor
    storage = janitor.storage

    def charge_call(session, address, user, fn, event_id, inputs, outputs) -> None:
        storage.record_call(session, storage.client_key(address, user), fn, event_id, inputs, outputs)

    # Only a job makes a session worth keeping when gradio's session table is full (page loads and
    # History refreshes do not): the device lane's edits, batches and comparisons, and the rewriter's.
    gradio_internals.watch_calls(demo, charge_call, job_lanes=(DEVICE_GROUP, REWRITER_GROUP))

    async def expire_sessions():
        while True:
            await asyncio.sleep(min(SESSION_CHECK_INTERVAL, config.session_idle_expiry / 2))
            try:
                gradio_internals.expire_sessions(demo, config.session_idle_expiry)
            except Exception:  # noqa: BLE001 - housekeeping must never take the app down
                logger.exception("expiring idle sessions failed")

    routes = _services(demo, services, config, engine)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        gradio_internals.register_demo(demo)
        if not gradio_internals.lean_sessions(demo):
            logger.warning("gradio's sessions could not be made lean: each new session costs ~250 KB")
        expiry = asyncio.get_running_loop().create_task(expire_sessions())
        janitor.start()
        try:
            async with lifespans(routes):
                yield
        finally:
            expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await expiry
            gradio_internals.register_demo(demo, live=False)
            janitor.stop()
            services.close()
            # Nothing of this app stays in the cache (other apps of the process keep theirs).
            gradio_internals.prune_cache(demo, services.cache_folder, 0, 0)

    guard = Middleware(
        BoothGuard,
        jobs=services.jobs,
        throttle=throttle,
        require_login=not services.public,
        max_upload_bytes=UPLOAD_REQUEST_FILES * config.max_upload_mb * 1024 * 1024,
        max_body_bytes=config.max_body_kb * 1024,
        storage=storage,
        new_sessions=NewSessions(config.max_new_sessions),
        service_bodies={route.prefix: (route.max_body_bytes, route.refusal_body) for route in routes},
    )
    middleware = [guard]  # first = outermost: the guard throttles /operator/login before it is answered
    if config.operator is not None:
        middleware.append(Middleware(OperatorLogin, operator=config.operator))
    middleware.append(Middleware(ServiceRoutes, services=routes))  # inside the guard: its caps apply
    return {"middleware": middleware, "lifespan": lifespan}


def serve_error(config: AppConfig, exc: OSError) -> str:
    """What to tell a user whose server could not start: a taken port names our flag and variable
    (gradio's own message suggests GRADIO_SERVER_PORT and `server_port`, which are not ours)."""
    if "empty port" in str(exc) or getattr(exc, "errno", None) == errno.EADDRINUSE:
        return (
            f"port {config.port} on {config.host} is already in use: start with another one, e.g. "
            f"--port {config.port + 1} (or HIDREAM_PORT={config.port + 1}), or stop what uses it"
        )
    return f"cannot serve on {config.host}:{config.port}: {exc}"


def stop_on_signals() -> None:
    """SIGINT and SIGTERM both end the server the way Ctrl-C does (gradio closes it, the lifespan
    clean-up runs). SIGTERM would otherwise kill the process with no clean-up, and a shell starts
    background jobs with SIGINT ignored."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, interrupt)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if prog is None:  # `python -m hidream_ui app` runs hidream_ui/__main__.py
        prog = "python -m hidream_ui app" if os.path.basename(sys.argv[0]) == "__main__.py" else "python app.py"
    parser = build_parser(prog)
    ns = parser.parse_args(argv)  # argparse itself exits 2 with one usage line for unknown flags
    try:
        config = from_namespace(ns)
        _auth(config)  # an unreadable --auth-file or an operator name taken by a user: fail now, before gradio
        if config.mcp and not mcp_available():
            raise ConfigError(MCP_HINT)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    quiet_libraries(getattr(ns, "verbose", False))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop_on_signals()
    engine = None
    try:
        engine = ray_engine(config, verbose=bool(getattr(ns, "verbose", False)))
        launch(config, engine=engine)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as exc:
        print(f"error: {serve_error(config, exc)}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 0
    finally:
        if engine is not None:  # the replicas this app deployed (and its own local cluster)
            engine.shutdown()
    return 0


__all__ = [
    "build_parser",
    "launch",
    "main",
    "mcp_available",
    "ray_engine",
    "serve_error",
    "stop_on_signals",
    "trust_proxies",
]
