"""The replica side of `--ray`: `EngineReplica` (one worker in a Ray Serve replica) and `ReplicaBoard`
(the actor the replicas report their status rows to). The app side, `RayEngine`, is in ray_serve.py.

* Each replica owns one EditEngine on one device and loads its model in its constructor, so Serve
  reports a replica ready (and a restarted one back) only once it can edit.
* Its `edit` is a streaming method: every denoising step comes back as an event, then the result,
  unsaved (the app saves it, so the replicas need no shared storage and a cancelled job writes
  nothing). A cancelled stream (Serve cancels the generator) sets the replica-side token: the edit
  stops after its current step.
* It reports its row (node, device, state, progress, memory) to the board once a second and at every
  step; the app reads the board, never a busy replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from hidream_ui.config import AppConfig
from hidream_ui.engine.errors import EditCancelled, EngineError
from hidream_ui.engine.status import DeviceRow

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.edits import EditRequest

logger = logging.getLogger(__name__)

REPORT_INTERVAL = 1.0  # seconds between two status reports of an idle replica


# ---------------------------------------------------------------------------------------------- board


class ReplicaBoard:
    """A Ray actor: the replicas' last status rows, by replica label (never waits on a replica)."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[float, DeviceRow, dict]] = {}

    def report(self, label: str, row: DeviceRow, extra: dict) -> None:
        self.rows[label] = (time.time(), row, extra)

    def snapshot(self) -> dict[str, tuple[float, DeviceRow, dict]]:
        return dict(self.rows)


# ---------------------------------------------------------------------------------------------- replica


def keep_replica_server_on_loopback(node_ip: str) -> bool:
    """On a loopback-only cluster (`--ray local`, the tests), binds the replica's own gRPC server to
    127.0.0.1. Ray Serve 2.60 starts an inter-deployment gRPC server in every replica on "[::]:0"
    (every interface) whatever the node's address (`serve/_private/replica.py` `_on_initialized`),
    which would open a port to the network from a cluster that is meant to stay on this machine.
    Serve starts it after the replica's constructor, which calls this. An operator's cluster (a
    non-loopback node) is left as Ray sets it up. Returns whether the bind was redirected."""
    import ipaddress

    try:
        if not ipaddress.ip_address(node_ip).is_loopback:
            return False
        from ray.serve._private import replica as serve_replica
    except (ValueError, ImportError):
        return False
    original = getattr(serve_replica, "add_port_to_grpc_server", None)
    if original is None:  # another Ray version: the ss check in tests/test_ray.py says whether it matters
        logger.warning("cannot keep the Serve replica's gRPC server on 127.0.0.1 with this Ray version")
        return False
    if getattr(original, "hidream_loopback", False):
        return True

    def bind(server, address):
        return original(server, "127.0.0.1:0" if address == "[::]:0" else address)

    bind.hidream_loopback = True
    serve_replica.add_port_to_grpc_server = bind
    return True


class EngineReplica:
    """One engine in a Ray Serve replica (wrapped by `serve.deployment` in `RayEngine.load`)."""

    def __init__(self, config: AppConfig, hide_paths: bool, board: str, namespace: str | None):
        import ray
        from ray import serve

        from hidream_ui.engine.engine import EditEngine

        context = serve.get_replica_context()
        self.node = ray.util.get_node_ip_address()
        keep_replica_server_on_loopback(self.node)
        self.label = f"ray:{context.replica_tag}"
        self.engine = EditEngine(config, hide_paths=hide_paths)
        self.engine.pool_label = self.label  # saved in every result's metadata (`engine`)
        self.board = ray.get_actor(board, namespace=namespace)
        self.jobs = 0
        self.busy = False
        self.last_job: dict[str, Any] = {}
        self._executor = ThreadPoolExecutor(
            1, thread_name_prefix="hidream-replica"
        )  # one computing thread: the device is bound to it
        self._stop = threading.Event()
        self.report()
        self.engine.load()
        self.report()
        threading.Thread(target=self._report_loop, name="hidream-replica-report", daemon=True).start()

    def _report_loop(self) -> None:
        while not self._stop.wait(REPORT_INTERVAL):
            self.report()

    def row(self) -> DeviceRow:
        from hidream_ui.engine.pool import device_row

        row = device_row(self.engine, self.label, busy=self.busy, jobs=self.jobs)
        return dataclasses.replace(row, node=self.node)

    def report(self) -> None:
        """Fire and forget: a slow board never slows an edit."""
        try:
            status = self.engine.status()
            self.board.report.remote(
                self.label,
                self.row(),
                {"counters": dict(status.counters), "attention": status.attention, "last_job": dict(self.last_job)},
            )
        except Exception:  # noqa: BLE001 - a missed report shows as a stale row, never as a failed edit
            logger.debug("status report failed", exc_info=True)

    async def edit(self, request: "EditRequest", speed: str | None = None):
        """Streams ("step", StepInfo) per denoising step, then ("done", EditResult without its
        source image: the caller has it). Cancelled by the caller (Serve cancels this generator):
        the edit stops after its current step."""
        from hidream_ui.edits import RequestError
        from hidream_ui.engine.jobs import CancelToken

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        token = CancelToken()
        put = events.put_nowait

        def on_step(info) -> None:
            token.step = info.step
            loop.call_soon_threadsafe(put, ("step", info))

        def work() -> None:
            try:
                if speed is not None:
                    self.engine.set_speed(speed)
                result = self.engine.edit(request, on_step, save=False, cancel=token)
                loop.call_soon_threadsafe(put, ("done", dataclasses.replace(result, source_image=None)))
            except EditCancelled as exc:
                # Where it really stopped (what the tests and the benchmark read from the board).
                self.last_job.update(steps_run=token.step, stopped=str(exc))
                loop.call_soon_threadsafe(put, ("error", exc))
            except (EngineError, RequestError) as exc:  # user-facing, picklable: raised as is in the app
                loop.call_soon_threadsafe(put, ("error", exc))
            except Exception as exc:  # noqa: BLE001 - any other failure may not pickle: its text travels
                logger.exception("edit failed on %s", self.label)
                loop.call_soon_threadsafe(
                    put, ("error", EngineError(f"the edit failed on replica {self.label}: {type(exc).__name__}: {exc}"))
                )
            finally:  # busy until the computing thread is done, even after the caller went away
                self.busy = False
                self.report()

        self.jobs += 1
        self.busy = True
        self.last_job = {"started": time.time(), "steps": 0, "cancelled_at_step": None, "state": "running"}
        self.report()
        loop.run_in_executor(self._executor, work)
        finished = False
        try:
            yield ("start", self.label)
            while True:
                kind, payload = await events.get()
                if kind == "step":
                    self.last_job["steps"] = payload.step
                    self.report()
                    yield ("step", payload)
                    continue
                finished = True
                self.last_job["state"] = "done" if kind == "done" else f"error: {payload}"
                yield (kind, payload)
                return
        finally:
            if not finished:  # the caller cancelled (or went away): stop the edit after its step
                self.last_job.update(state="cancelled", cancelled_at_step=token.step)
                token.cancel("cancelled by the app")


__all__ = ["REPORT_INTERVAL", "EngineReplica", "ReplicaBoard", "keep_replica_server_on_loopback"]
