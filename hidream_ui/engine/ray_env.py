"""Ray, optional and imported late: how this package finds it, connects, and says what a device is there.

Ray is an extra (`pip install hidream_ui[ray]` or `-r requirements-ray.txt`), imported only when
`--ray` is given; without it `--ray` says how to install it (`RayUnavailable`).

Addresses (`--ray ADDRESS`, env `HIDREAM_RAY_ADDRESS`):
* `auto`: the cluster already running on this machine (`ray start --head`);
* `local`: a cluster of this process's own, bound to 127.0.0.1 only (tests, a laptop);
* `HOST:PORT` or `ray://HOST:PORT`: the operator's cluster, used as given.

Binding: Ray resolves a loopback address to the machine's "reachable" one, so `_node_ip_address=
"127.0.0.1"` alone still listens on the LAN address. With `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` in
the environment before `ray` is first imported (Ray reads it at import) it binds to 127.0.0.1 only;
that variable also turns multi-node clusters off for the process, so it is set only for `local`
(and for loopback addresses), never for an operator's cluster. Usage statistics are off
(`RAY_USAGE_STATS_ENABLED=0`) and the dashboard is not started.

Token authentication (Ray 2.60): `ray start --head` turns it on when a token exists (`~/.ray/
auth_token`, `RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`; any earlier `ray.init()` on the machine writes
the file), and a process that connects to an explicit address must then run in token mode itself
(`RAY_AUTH_MODE=token`) with that token; Ray never switches a HOST:PORT client to token mode on its
own. So before `ray.init`, `check_cluster` asks the head's GCS once, by one gRPC call (no Ray
connection, a fraction of a second), whether it wants a token and whether ours is the right one;
it sets `RAY_AUTH_MODE=token` when the cluster wants one and ours works, and otherwise refuses with
one line (`refusal`): nothing listening, something else listening, no token, wrong token. Ray itself
would wait 20 s and then say "Failed to connect", or, with nothing listening, wait for minutes. A
version mismatch surfaces from `ray.init` and is put in one line too (`connect_error`). The token
comes from `--ray-token-file PATH` (env HIDREAM_RAY_TOKEN_FILE; passed to Ray as
`RAY_AUTH_TOKEN_PATH`, so the token itself never enters the environment) or Ray's own places, in
Ray's order: `RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`, `~/.ray/auth_token`. It is read only to be
sent; messages name where it came from, never what it is. Serve replicas and Ray Data actors are
started by the cluster's raylets, which have the cluster's token already.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, MutableMapping

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.config import AppConfig

RAY_VERSION = "2.60.0"  # requirements-ray.txt pins it; the tests run on it
INSTALL_HINT = (
    f"Ray is not installed in this Python ({sys.executable}): `pip install 'hidream_ui[ray]'` "
    f"or `pip install -r requirements-ray.txt` (ray[serve,data]=={RAY_VERSION}), then run again"
)
ADDRESS_ENV = "HIDREAM_RAY_ADDRESS"
LOCAL = "local"
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
NPU_RESOURCE = "NPU"  # Ray's resource name for Ascend NPUs (it sets ASCEND_RT_VISIBLE_DEVICES per actor)
# Ray's token authentication: the variables its token loader reads, in its order, and its default file.
AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = "~/.ray/auth_token"
TOKEN_FLAG = "--ray-token-file"  # env HIDREAM_RAY_TOKEN_FILE (config_table.py)
PROBE_TIMEOUT = 5.0  # seconds for the one gRPC call that asks the head whether it wants a token
# The GCS call a Ray client makes first (an empty request; the reply is the cluster's id).
_PROBE_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"


class RayUnavailable(RuntimeError):
    """Ray is not installed (the message says how to install it) or the cluster cannot be reached."""


def is_loopback(address: str) -> bool:
    """`local`, or an address whose host is this machine's loopback."""
    if address == LOCAL:
        return True
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in LOOPBACK_HOSTS


def prepare_environment(
    address: str, environ: MutableMapping[str, str] | None = None, token_file: Path | str | None = None
) -> None:
    """The variables Ray reads at import: statistics off always; loopback-only binding for a local
    cluster. A user's own setting wins (setdefault). Call before `ray` is first imported. With
    `token_file` (`--ray-token-file`) for a cluster not of our own, Ray reads the token from that file
    (`use_token_file`)."""
    environ = os.environ if environ is None else environ
    environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if is_loopback(address):
        environ.setdefault(LOOPBACK_ENV, "0")
    if token_file is not None and address != LOCAL:
        use_token_file(token_file, environ)


def use_token_file(token_file: Path | str, environ: MutableMapping[str, str] | None = None) -> Path:
    """Points Ray's token loader at `token_file` (`RAY_AUTH_TOKEN_PATH`); the flag is the user's explicit
    choice, so it wins over a `RAY_AUTH_TOKEN` in the environment (dropped here: Ray would read that
    first). RayUnavailable naming the file (never its content) when it cannot be read or is empty."""
    environ = os.environ if environ is None else environ
    path = Path(token_file).expanduser().resolve()
    try:
        empty = not path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise RayUnavailable(f"{TOKEN_FLAG} {path}: cannot read the token file ({_reason(exc)})") from None
    if empty:
        raise RayUnavailable(f"{TOKEN_FLAG} {path}: the token file is empty")
    environ[AUTH_TOKEN_PATH_ENV] = str(path)
    environ.pop(AUTH_TOKEN_ENV, None)
    return path


def require_ray(address: str = LOCAL, token_file: Path | str | None = None):
    """The `ray` module, with the environment prepared for `address`; RayUnavailable with the
    install line when it is missing."""
    if "ray" not in sys.modules:
        prepare_environment(address, token_file=token_file)
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable(INSTALL_HINT) from exc
    return ray


# ---------------------------------------------------------------------------------------------- tokens


@dataclass(frozen=True)
class Token:
    """The token this process would send, and where it came from (what messages name; the value never
    appears in a message, a log line or a repr)."""

    value: str = field(repr=False)
    source: str = ""  # RAY_AUTH_TOKEN, or the file's path


def find_token(environ: Mapping[str, str] | None = None) -> Token | None:
    """The token as Ray's loader finds it (RAY_AUTH_TOKEN, then the file RAY_AUTH_TOKEN_PATH names,
    then ~/.ray/auth_token), or None. A file that cannot be read counts as no token (Ray's loader
    treats it so too)."""
    environ = os.environ if environ is None else environ
    if environ.get(AUTH_TOKEN_ENV, "").strip():
        return Token(environ[AUTH_TOKEN_ENV].strip(), AUTH_TOKEN_ENV)
    named = environ.get(AUTH_TOKEN_PATH_ENV, "").strip()
    path = Path(named).expanduser() if named else Path(DEFAULT_TOKEN_FILE).expanduser()
    try:
        value = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return Token(value, str(path)) if value else None


# ---------------------------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class Refusal:
    """Why a cluster cannot be used: `kind` (one of REFUSALS) and the one line the user reads."""

    kind: str
    message: str


REFUSALS = ("nothing-listening", "no-answer", "not-ray", "no-token", "wrong-token", "version-mismatch", "other")


def gcs_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of a plain HOST:PORT address (the head's GCS), else None (`local`, `auto`, a
    `ray://` client address, or no port: Ray resolves those itself)."""
    if address in (LOCAL, "auto") or "://" in address:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def probe(host: str, port: int, token: Token | None, timeout: float = PROBE_TIMEOUT) -> tuple[str, str]:
    """One gRPC call to the GCS at host:port, with the token when given: ("ok", ""),
    ("unauthenticated", ""), ("refused", detail), ("timeout", detail) or ("not-ray", detail)."""
    import grpc

    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    channel = grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)])
    try:
        call = channel.unary_unary(_PROBE_METHOD)
        metadata = [("authorization", f"Bearer {token.value}")] if token is not None else None
        try:
            call(b"", timeout=timeout, metadata=metadata)
            return "ok", ""
        except grpc.RpcError as exc:
            code, detail = exc.code(), " ".join(str(exc.details() or "").split())
    finally:
        channel.close()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return "unauthenticated", ""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout", detail
    if code == grpc.StatusCode.UNAVAILABLE and re.search(r"refused|No route|unreachable|resolve", detail, re.I):
        return "refused", detail
    return "not-ray", f"{code.name}: {detail}" if detail else code.name


def refusal(address: str, kind: str, detail: str = "", token: Token | None = None) -> Refusal:
    """The one line for each way a cluster refuses (docs/cluster.md lists them)."""
    where = gcs_endpoint(address)
    host_port = f"{where[0]}:{where[1]}" if where else address
    port = where[1] if where else 6379
    head = f"--ray {address}: "
    messages = {
        "nothing-listening": f"nothing is listening at {host_port} (connection refused): start the head there "
        f"(`ray start --head --port={port}`) or give its address",
        "no-answer": f"no answer from {host_port} within {PROBE_TIMEOUT:.0f} s: check the address and that the "
        "head's port is open to this machine",
        "not-ray": f"{host_port} answers, but not as a Ray head ({detail}): give the port of the head's "
        "`ray start --head --port` (default 6379)",
        "no-token": "the cluster requires Ray token authentication and this process has no token: pass "
        f"{TOKEN_FLAG} PATH (env HIDREAM_RAY_TOKEN_FILE) or set {AUTH_TOKEN_ENV}; `ray start` on the head "
        f"reads it from {DEFAULT_TOKEN_FILE} there",
        "wrong-token": f"the cluster refused the token in {token.source if token else 'use'}: it is not this "
        f"cluster's token; use the head's ({DEFAULT_TOKEN_FILE} on the head, or `ray get-auth-token` there) with "
        f"{TOKEN_FLAG} PATH or {AUTH_TOKEN_ENV}",
        "version-mismatch": f"version mismatch: {detail}: run the app with the cluster's Ray and Python "
        f"(requirements-ray.txt pins ray=={RAY_VERSION})",
    }
    return Refusal(kind, head + messages.get(kind, f"cannot connect to the Ray cluster: {detail}"))


def check_cluster(
    address: str, token_file: Path | str | None = None, environ: MutableMapping[str, str] | None = None
) -> str | None:
    """Before `ray.init(address=HOST:PORT)`: asks the head whether it wants a token and whether ours
    is right; sets `RAY_AUTH_MODE=token` when it wants one (and refreshes Ray's view of the mode when
    `ray` is imported already). Returns "open", "token" or None (an address Ray resolves itself: not
    checked); RayUnavailable with the one line of `refusal` otherwise."""
    environ = os.environ if environ is None else environ
    if token_file is not None and address != LOCAL:
        use_token_file(token_file, environ)
    where = gcs_endpoint(address)
    if where is None:
        return None
    kind, detail = probe(*where, token=None)
    if kind == "ok":
        _check_versions(address, where, None)
        return "open"
    if kind != "unauthenticated":
        mapped = {"refused": "nothing-listening", "timeout": "no-answer"}.get(kind, "not-ray")
        raise RayUnavailable(refusal(address, mapped, detail).message)
    token = find_token(environ)
    if token is None:
        raise RayUnavailable(refusal(address, "no-token").message)
    kind, detail = probe(*where, token=token)
    if kind == "unauthenticated":
        raise RayUnavailable(refusal(address, "wrong-token", token=token).message)
    if kind != "ok":
        raise RayUnavailable(refusal(address, "other", detail).message)
    if environ.get(AUTH_MODE_ENV) != "token":
        environ[AUTH_MODE_ENV] = "token"
        _refresh_ray_auth(environ)
    _check_versions(address, where, token)
    return "token"


def _check_versions(address: str, where: tuple[str, int], token: Token | None) -> None:
    """The head's Ray and Python versions (the record `ray start` keeps in its GCS) against this
    process's, with Ray's own rule (`check_version_info`): a mismatch refuses now, in one line, rather
    than at the first edit's `ray.init`. Skipped when `ray` is not imported yet (its protobufs would
    import it before `prepare_environment`) or the record cannot be read (then `ray.init` checks)."""
    if "ray" not in sys.modules:
        return
    import json

    import grpc
    from ray._private.utils import check_version_info
    from ray.core.generated import gcs_service_pb2

    host, port = where
    channel = grpc.insecure_channel(f"{host}:{port}", options=[("grpc.enable_http_proxy", 0)])
    try:
        call = channel.unary_unary(
            "/ray.rpc.InternalKVGcsService/InternalKVGet",
            request_serializer=gcs_service_pb2.InternalKVGetRequest.SerializeToString,
            response_deserializer=gcs_service_pb2.InternalKVGetReply.FromString,
        )
        metadata = [("authorization", f"Bearer {token.value}")] if token is not None else None
        request = gcs_service_pb2.InternalKVGetRequest(key=b"CLUSTER_METADATA", namespace=b"cluster")
        record = json.loads(call(request, timeout=PROBE_TIMEOUT, metadata=metadata).value or b"{}")
    except (grpc.RpcError, ValueError):
        return
    finally:
        channel.close()
    if "ray_version" not in record or "python_version" not in record:
        return
    try:
        check_version_info(record, "this machine")
    except RuntimeError as exc:
        raise RayUnavailable(connect_error(address, exc)) from None


def _refresh_ray_auth(environ: Mapping[str, str]) -> None:
    """Ray caches the mode and the token when it is imported: re-read both (as Ray's own
    `_enable_token_auth` does) when the variables changed in this process's environment."""
    if environ is not os.environ or "ray" not in sys.modules:
        return
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


_VERSIONS = re.compile(
    r"Ray: (?P<cluster_ray>\S+)\s+Python: (?P<cluster_py>\S+).*?Ray: (?P<ours_ray>\S+)\s+Python: (?P<ours_py>\S+)", re.S
)


def connect_error(address: str, exc: BaseException) -> str:
    """The one line for what `ray.init(address=...)` raised: a version mismatch, a missing token (the
    cluster's mode came from RAY_AUTH_MODE), or any other failure's first line."""
    text = str(exc)
    if type(exc).__name__ == "AuthenticationError":
        return refusal(address, "no-token").message
    if text.startswith("Version mismatch"):
        found = _VERSIONS.search(text)
        detail = (
            f"the cluster runs Ray {found['cluster_ray']} on Python {found['cluster_py']}, this process Ray "
            f"{found['ours_ray']} on Python {found['ours_py']}"
            if found
            else " ".join(text.split())
        )
        return refusal(address, "version-mismatch", detail).message
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    return refusal(address, "other", first).message


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or type(exc).__name__


def connect(address: str, *, verbose: bool = False, token_file: Path | str | None = None) -> bool:
    """Connects this process to the cluster at `address` unless it is connected already (a test's
    cluster, the app's). Returns whether this call connected it (its caller then disconnects with
    `ray.shutdown()` when done). A HOST:PORT head is asked first (`check_cluster`): a refusal is
    one line, never a traceback or a minutes-long wait."""
    ray = require_ray(address, token_file)
    if ray.is_initialized():
        return False
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": verbose, "configure_logging": verbose}
    if address != LOCAL:
        check_cluster(address, token_file)
    try:
        if address == LOCAL:
            ray.init(_node_ip_address="127.0.0.1", **options)
        else:
            ray.init(address=address, **options)
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as exc:
        raise RayUnavailable(connect_error(address, exc)) from None
    return True


def disconnect(*, serve_too: bool = False) -> None:
    """Stops what this process started (`serve.shutdown()` first when asked, then `ray.shutdown()`).

    A garbage collection runs first: an ObjectRef or actor handle caught in a reference cycle (an
    exception's traceback holding a frame that held one) would otherwise be freed later, by whatever
    thread the collector happens to run in, and Ray ends the process when a reference is released
    after its core worker shut down ("The core worker has already been shutdown ... The process will
    exit")."""
    import gc

    import ray

    gc.collect()
    if serve_too:
        from ray import serve

        serve.shutdown()
        gc.collect()
    ray.shutdown()


@dataclass(frozen=True)
class Placement:
    """What one engine asks Ray for, and the device its config then names inside the actor."""

    kind: str  # "cuda" | "npu" | "cpu"
    options: dict[str, Any]  # ray_actor_options / map_batches resources
    device: str  # the engine's --device inside the actor (Ray makes its one card visible as index 0)


def device_kind(config: "AppConfig", resources: dict[str, float]) -> str:
    """ "cuda", "npu" or "cpu": what the configuration names (`--device`, `--devices`), or for `auto`
    what the cluster has (GPUs first, then NPUs, else CPUs)."""
    named = [name.split(":")[0].split("#")[0] for name in (config.devices or (config.device,))]
    for kind in ("cuda", "npu", "cpu"):
        if kind in named:
            return kind
    if resources.get("GPU", 0) >= 1:
        return "cuda"
    if resources.get(NPU_RESOURCE, 0) >= 1:
        return "npu"
    return "cpu"


def placement(config: "AppConfig", resources: dict[str, float], cpus_per_engine: float = 1) -> Placement:
    """One engine per device: `num_gpus=1` on CUDA, the `NPU` resource on Ascend, CPUs on CPU."""
    kind = device_kind(config, resources)
    if kind == "cuda":
        return Placement(kind, {"num_gpus": 1}, "cuda")
    if kind == "npu":
        return Placement(kind, {"resources": {NPU_RESOURCE: 1}}, "npu")
    return Placement(kind, {"num_cpus": cpus_per_engine}, "cpu")


def default_replicas(kind: str, resources: dict[str, float]) -> int:
    """One engine per device of the cluster; one on CPUs (a CPU engine uses every core it is given)."""
    count = {"cuda": resources.get("GPU", 0), "npu": resources.get(NPU_RESOURCE, 0)}.get(kind, 1)
    return max(1, int(count))


__all__ = [
    "ADDRESS_ENV",
    "AUTH_MODE_ENV",
    "AUTH_TOKEN_ENV",
    "AUTH_TOKEN_PATH_ENV",
    "REFUSALS",
    "INSTALL_HINT",
    "LOCAL",
    "NPU_RESOURCE",
    "Placement",
    "RAY_VERSION",
    "RayUnavailable",
    "Refusal",
    "Token",
    "check_cluster",
    "connect",
    "connect_error",
    "default_replicas",
    "disconnect",
    "device_kind",
    "find_token",
    "gcs_endpoint",
    "is_loopback",
    "placement",
    "prepare_environment",
    "probe",
    "refusal",
    "require_ray",
    "use_token_file",
]
