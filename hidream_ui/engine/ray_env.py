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
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, MutableMapping

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


class RayUnavailable(RuntimeError):
    """Ray is not installed (the message says how to install it) or the cluster cannot be reached."""


def is_loopback(address: str) -> bool:
    """`local`, or an address whose host is this machine's loopback."""
    if address == LOCAL:
        return True
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in LOOPBACK_HOSTS


def prepare_environment(address: str, environ: MutableMapping[str, str] | None = None) -> None:
    """The variables Ray reads at import: statistics off always; loopback-only binding for a local
    cluster. A user's own setting wins (setdefault). Call before `ray` is first imported."""
    environ = os.environ if environ is None else environ
    environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if is_loopback(address):
        environ.setdefault(LOOPBACK_ENV, "0")


def require_ray(address: str = LOCAL):
    """The `ray` module, with the environment prepared for `address`; RayUnavailable with the
    install line when it is missing."""
    if "ray" not in sys.modules:
        prepare_environment(address)
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable(INSTALL_HINT) from exc
    return ray


def connect(address: str, *, verbose: bool = False) -> bool:
    """Connects this process to the cluster at `address` unless it is connected already (a test's
    cluster, the app's). Returns whether this call connected it (its caller then disconnects with
    `ray.shutdown()` when done)."""
    ray = require_ray(address)
    if ray.is_initialized():
        return False
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": verbose, "configure_logging": verbose}
    try:
        if address == LOCAL:
            ray.init(_node_ip_address="127.0.0.1", **options)
        else:
            ray.init(address=address, **options)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RayUnavailable(f"--ray {address}: cannot connect to the Ray cluster: {exc}") from exc
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
    "INSTALL_HINT",
    "LOCAL",
    "NPU_RESOURCE",
    "Placement",
    "RAY_VERSION",
    "RayUnavailable",
    "connect",
    "default_replicas",
    "disconnect",
    "device_kind",
    "is_loopback",
    "placement",
    "prepare_environment",
    "require_ray",
]
