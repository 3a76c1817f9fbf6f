"""`RayEngine`: the executor over Ray Serve replicas, behind the same `Engine` interface as the pool.

`--ray ADDRESS` (env `HIDREAM_RAY_ADDRESS`) gives the app a RayEngine instead of an EnginePool; the
UI, the queue, admission, kiosk, cancel and the runner hold it unchanged (engine/protocol.py).

* Each replica (`EngineReplica`, engine/ray_replica.py) owns one worker on one device: `num_gpus=1`
  on CUDA, the `NPU` resource on Ascend, CPUs on CPU (`ray_env.placement`); `--replicas N` of them,
  or `MIN-MAX` for Serve's autoscaling.
* `max_ongoing_requests=1`: Serve's router gives a job to a free replica and queues the rest (the
  app's own queue and admission stay in front of it; the device lane's concurrency is the replica count).
* Progress: every denoising step comes back from the replica as an event, then the unsaved result,
  which the app saves (`Engine.edit`: the same save path as the pool, region masks included).
* Cancel: the job's token is watched while the stream runs; once set, the Serve request is
  cancelled, which cancels the replica's generator, which sets the replica-side token: the edit
  stops after its current step.
* A replica that dies mid-job: that job fails with a message naming the replica (the work is lost,
  not retried: it may have been what killed it); a job that could not start on a dead replica is
  sent once more (Serve routes it to a live one). Serve restarts the replica meanwhile.
* `/status`: `status()` reads the replicas' board (never a replica, which may be busy) and adds the
  cluster's totals.
* A head at HOST:PORT is asked before the app serves (`cli.app.ray_engine` calls
  `ray_env.check_cluster`, one gRPC call; `connect` asks again at load): a cluster that refuses
  (nothing listening, no token, a wrong token) stops the app at start with one line, which users see
  before any edit; `--ray-token-file` is applied there too. Constructing a RayEngine connects nothing.

What it cannot do is declared in `RAY_CAPABILITIES` (the UI hides those controls and the System
panel shows the reasons); a call that asks anyway gets an EngineError with the same reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from hidream_ui.config import AppConfig
from hidream_ui.engine.errors import EditCancelled, EngineError
from hidream_ui.engine.protocol import Capabilities, Engine
from hidream_ui.engine.ray_env import LOCAL, connect, disconnect, placement
from hidream_ui.engine.ray_replica import EngineReplica, ReplicaBoard, keep_replica_server_on_loopback
from hidream_ui.engine.status import DeviceRow, EngineStatus, Progress, PromptCacheStats

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.edits import EditResult
    from hidream_ui.engine.batch import BatchPlan, BatchResult
    from hidream_ui.engine.jobs import CancelToken

logger = logging.getLogger(__name__)

APP_PREFIX = "hidream"
STALE_AFTER = 5.0  # a replica silent this long is shown as "unreachable" (dead, or being replaced)
FORGET_AFTER = 30.0  # ... and dropped from /status after this long
CANCEL_POLL = 0.05  # seconds between two looks at a running job's token
HEALTH_CHECK_PERIOD = 2.0  # Serve pings each replica this often (a dead one is replaced sooner)

# What a Ray executor cannot do, each with the sentence the System panel shows (and an EngineError says).
RAY_CAPABILITIES = Capabilities.without(
    compare="Compare needs one worker held for several edits; Ray replicas serve one edit each",
    attention="Attention is set at start-up with --ray (--attention); replicas cannot switch it while serving",
    local_rewriter="The local rewriter runs the Llama on the app's own device; with --ray the model lives in "
    "the replicas (use --rewriter-url)",
    previews="Live previews do not cross the replica boundary yet; the progress bar still shows every step",
)


def unsupported(capability: str) -> EngineError:
    """The EngineError for a call that needs a capability Ray lacks (its reason, and where to read more)."""
    return EngineError(f"not available with --ray: {RAY_CAPABILITIES.missing[capability]} (see docs/cluster.md)")


# ---------------------------------------------------------------------------------------------- engine


class RayEngine(Engine):
    """The `Engine` interface over Ray Serve replicas (see the module's docstring)."""

    def __init__(
        self,
        config: AppConfig,
        address: str | None = None,
        replicas: str | int | None = None,
        *,
        hide_paths: bool = False,
        verbose: bool = False,
        name: str | None = None,
    ):
        if replicas is not None:  # a caller's own count (the cluster bench) over --replicas
            config = config.replace(replicas=str(replicas))
        self.config = config
        self.address = address or config.ray
        if self.address is None:
            raise EngineError("RayEngine needs a cluster address: --ray ADDRESS (or HIDREAM_RAY_ADDRESS)")
        self.min_replicas, self.max_replicas = config.replica_bounds
        self._hide_paths = hide_paths
        self._verbose = verbose
        self.app_name = name or f"{APP_PREFIX}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._handle = None
        self._board = None
        self._owned = False
        self._speed: str | None = None
        # Jobs at once before the cluster is asked (the app sizes its device lane at start-up):
        # --replicas, else the --devices count, else one until the replicas run.
        self._size = max(1, self.min_replicas or len([d for d in config.devices if d != "all"]))
        self._status_cache: tuple[float, dict] | None = None
        self._jobs = 0
        self._shadow = None  # an unloaded EditEngine: facts read from the checkpoint's configs
        # Nothing connects here (the engine interface's rule): the app asks the head first
        # (`cli.app.ray_engine` -> `ray_env.check_cluster`), and `connect` asks it again at load.
        self._token_file = config.ray_token_file

    # ------------------------------------------------------------------ lifecycle
    @property
    def capabilities(self) -> Capabilities:
        return RAY_CAPABILITIES

    @property
    def size(self) -> int:
        """Jobs at once: the replica count (the autoscaling maximum when it scales)."""
        return self.max_replicas or self._size

    @property
    def loaded(self) -> bool:
        return self._handle is not None

    @property
    def hide_paths(self) -> bool:
        return self._hide_paths

    def load(self, on_progress: Callable[[float, str], None] | None = None) -> None:
        """Connects, deploys the replicas and waits until Serve reports them running (each has
        loaded its model). Later calls return at once."""
        if self._handle is not None:
            return None
        with self._lock:
            if self._handle is not None:
                return None
            import ray
            from ray import serve

            from hidream_ui.engine.ray_env import default_replicas

            if on_progress is not None:
                on_progress(0.0, f"connecting to the Ray cluster at {self.address}")
            self._owned = connect(self.address, verbose=self._verbose, token_file=self._token_file)
            resources = ray.cluster_resources()
            where = placement(self.config, resources)
            if not self.min_replicas:  # one per --devices entry, else one per device of the cluster
                named = [name for name in self.config.devices if name != "all"]
                self._size = len(named) or default_replicas(where.kind, resources)
            namespace = ray.get_runtime_context().namespace
            board_name = f"{self.app_name}-board"
            self._board = ray.remote(num_cpus=0)(ReplicaBoard).options(name=board_name).remote()
            serve.start(proxy_location="Disabled")  # handles only: no HTTP proxy, no port
            scaling: dict[str, Any] = (
                {"num_replicas": self._size}
                if self.max_replicas is None
                else {
                    "autoscaling_config": {
                        "min_replicas": self.min_replicas,
                        "max_replicas": self.max_replicas,
                        "target_ongoing_requests": 1,
                    }
                }
            )
            deployment = serve.deployment(EngineReplica, name="EngineReplica").options(
                ray_actor_options=where.options,
                max_ongoing_requests=1,
                health_check_period_s=HEALTH_CHECK_PERIOD,
                **scaling,
            )
            replica_config = dataclasses.replace(self.config, devices=(), device=where.device)
            if on_progress is not None:
                on_progress(0.1, f"starting {self.size} replica(s) on {where.kind}; each loads the model")
            self._handle = serve.run(
                deployment.bind(replica_config, self._hide_paths, board_name, namespace),
                name=self.app_name,
                route_prefix=None,
            )
            if on_progress is not None:
                on_progress(1.0, "replicas running")
        return None

    def shutdown(self) -> None:
        """Deletes this app's replicas and board; disconnects when this engine connected."""
        with self._lock:
            if self._handle is None and self._board is None:
                return
            import ray
            from ray import serve

            try:
                serve.delete(self.app_name)
            finally:
                if self._board is not None:
                    ray.kill(self._board)
                self._handle = self._board = None
                self._status_cache = None
                if self._owned:
                    # Serve itself is stopped only on a cluster of our own: on a shared one other
                    # applications may be running on it (this app's own were deleted above).
                    disconnect(serve_too=self.address == LOCAL)
                    self._owned = False

    # ------------------------------------------------------------------ jobs
    def _execute(self, request, on_step, token, on_preview) -> "EditResult":
        """One edit on a free replica, unsaved (`Engine.edit` saves it here, in the app); progress per
        step through `on_step`. `on_preview` gets nothing: live previews do not cross the replica
        boundary (a replica's events stream steps only; `capabilities.previews` is False)."""
        request = request.validated()
        if token.cancelled:
            raise EditCancelled(f"edit cancelled before it started: {token.reason or 'cancelled'}")
        self.load()
        self._jobs += 1
        for attempt in (1, 2):
            started: list[str] = []  # the replica's label once it took the job
            try:
                result = self._stream(request, on_step, token, started)
                break
            except _ReplicaLost as exc:
                # Lost mid-job: an error (the job may be what killed it). Lost before it started
                # (routed to a replica that had just died): once more, Serve routes it elsewhere.
                if started or attempt == 2 or token.cancelled:
                    raise EngineError(str(exc)) from None
                logger.warning("retrying a job that could not start: %s", exc)
        return dataclasses.replace(result, source_image=request.image)

    def _stream(self, request, on_step, token, started: list[str]) -> "EditResult":
        import ray

        response = self._handle.options(stream=True).edit.remote(request, self._speed)
        done = threading.Event()

        def watch() -> None:  # cancels the Serve request as soon as the token is set
            while not done.wait(CANCEL_POLL):
                if token.cancelled:
                    response.cancel()
                    return

        watcher = threading.Thread(target=watch, name="hidream-ray-cancel", daemon=True)
        watcher.start()
        try:
            for kind, payload in response:
                if kind == "start":
                    started.append(payload)
                elif kind == "step":
                    token.step = payload.step
                    if on_step is not None and not token.cancelled:
                        on_step(payload)
                elif kind == "done":
                    return payload
                else:
                    raise payload
            raise EngineError("the replica ended the job without a result")
        except EngineError:
            raise
        except (ray.exceptions.TaskCancelledError, asyncio.CancelledError, *_cancelled_errors()) as exc:
            raise EditCancelled(f"edit cancelled: {token.reason or 'cancelled'}") from exc
        except ray.exceptions.RayError as exc:
            if token.cancelled:
                raise EditCancelled(f"edit cancelled: {token.reason or 'cancelled'}") from exc
            where = f" ({started[0]})" if started else ""
            raise _ReplicaLost(
                f"the Ray replica running this job{where} died or became unreachable "
                f"({type(exc).__name__}); the job was lost, nothing was saved. Ray replaces the replica; "
                "run the edit again"
            ) from exc
        finally:
            done.set()

    def _run_plan(self, plan: "BatchPlan", on_item, on_step, token: "CancelToken") -> "BatchResult":
        """A batch as one edit per item over the replicas (`size` at once), each saved here."""
        from hidream_ui.edits import EditRequest
        from hidream_ui.engine.batch import BatchResult, item_params

        started = time.perf_counter()
        lock = threading.Lock()

        def run(item) -> None:
            if token.cancelled:
                item.status, item.error = "cancelled", "not started: the batch was cancelled"
                return
            t0 = time.perf_counter()
            try:
                image = plan.images[item.source_index][1]
                item.result = self.edit(
                    EditRequest(
                        image=image,
                        params=item_params(plan.settings, item),
                        source_name=item.source_name,
                        rewrite=item.rewrite,
                    ),
                    on_step,
                    cancel=token,
                )
                item.status, item.seconds = "ok", round(time.perf_counter() - t0, 4)
            except EditCancelled:
                item.status, item.error = "cancelled", "cancelled before it finished"
                return
            except (EngineError, ValueError) as exc:
                item.status, item.error = "error", str(exc)
            if on_item is not None:
                with lock:
                    on_item(item)

        pending = [item for item in plan.items if item.status == "pending"]
        with ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="hidream-ray-batch") as executor:
            list(executor.map(run, pending))
        return BatchResult(
            items=plan.items,
            rejected=plan.rejected,
            cancelled=token.cancelled,
            seconds=round(time.perf_counter() - started, 4),
            stats={"batch_sizes": {}},
        )

    def run_exclusive(self, state: str, work: Callable, *, cancel: "CancelToken | None" = None):
        """Refused: the model lives in the replicas (the local rewriter is the one caller)."""
        raise unsupported("local_rewriter")

    # ------------------------------------------------------------------ facts
    @property
    def counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for _, _, extra in self._board_rows().values():
            for key, value in extra.get("counters", {}).items():
                total[key] = total.get(key, 0) + value
        return total

    def model_facts(self) -> None:
        """None: the model lives in the replicas, not in this process."""
        return None

    def labels(self) -> list[str]:
        return sorted(self._board_rows())

    def set_attention(self, name: str, engine: str | None = None) -> str:
        raise unsupported("attention")

    def attention_of(self, target: str | None = None) -> str:
        rows = self._board_rows()
        extra = rows.get(target) if target else next(iter(rows.values()), None)
        return (extra[2].get("attention") if extra else None) or self.config.attention

    def attention_choices(self) -> list:
        raise unsupported("attention")

    def auto_attention(self) -> str:
        return "?"

    def set_speed(self, name: str) -> str:
        """The step cache of the next edits on every replica (sent with each job)."""
        from hidream_ui.pipeline.speed.settings import parse_cache

        try:
            self._speed = str(parse_cache(name if isinstance(name, str) else repr(name), "speed"))
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        return self._speed

    def _shadow_engine(self):
        if self._shadow is None:
            from hidream_ui.engine.engine import EditEngine

            self._shadow = EditEngine(dataclasses.replace(self.config, devices=(), device="cpu"))
        return self._shadow

    def working_plan(self, source_size, working_resolution):
        raise EngineError(
            "not available with --ray: working-size plans need the loaded model, which lives in the replicas "
            "(each replica checks its request's size itself)"
        )

    def working_resolution_choices(self) -> list[str]:
        return self._shadow_engine().working_resolution_choices()

    # ------------------------------------------------------------------ status
    def _board_rows(self, fresh: bool = False) -> dict[str, tuple[float, DeviceRow, dict]]:
        """The board's rows (cached for half a second: the panel, /status and the plot ask together)."""
        if self._board is None:
            return {}
        now = time.monotonic()
        if not fresh and self._status_cache is not None and now - self._status_cache[0] < 0.5:
            return self._status_cache[1]
        import ray

        try:
            rows = ray.get(self._board.snapshot.remote(), timeout=2.0)
        except ray.exceptions.RayError as exc:
            logger.warning("replica status unavailable: %s", exc)
            rows = self._status_cache[1] if self._status_cache else {}
        wall = time.time()
        live = self._live_replicas()
        rows = {
            label: value
            for label, value in rows.items()
            if wall - value[0] < FORGET_AFTER and (live is None or label in live)
        }
        self._status_cache = (now, rows)
        return rows

    def _live_replicas(self) -> set[str] | None:
        """Labels of this app's replica actors that are alive (Serve names them
        `SERVE_REPLICA::<app>#<deployment>#<id>`): a dead one leaves /status at once, its
        replacement appears when it starts. None when Ray cannot say (the board's rows then stand)."""
        import ray

        prefix = f"SERVE_REPLICA::{self.app_name}#"
        try:
            actors = ray.util.list_named_actors(all_namespaces=True)
        except ray.exceptions.RayError as exc:
            logger.debug("cannot list the replicas: %s", exc)
            return None
        return {f"ray:{actor['name'].rsplit('#', 1)[-1]}" for actor in actors if actor["name"].startswith(prefix)}

    def device_rows(self, fresh: bool = False) -> list[DeviceRow]:
        """One row per replica; a silent one is "unreachable" (dead, or being replaced by Serve)."""
        wall = time.time()
        rows = []
        for _, (seen, row, _extra) in sorted(self._board_rows(fresh).items(), key=lambda entry: entry[0]):
            if wall - seen > STALE_AFTER:
                row = dataclasses.replace(
                    row,
                    state="unreachable",
                    busy=False,
                    error=f"no report for {wall - seen:.0f} s: dead or being replaced",
                )
            rows.append(row)
        return rows

    def cluster_totals(self) -> dict[str, Any]:
        if self._handle is None:
            return {"address": self.address, "connected": False}
        import ray

        total, free = ray.cluster_resources(), ray.available_resources()
        keys = [key for key in ("CPU", "GPU", "NPU", "memory") if key in total]
        return {
            "address": self.address,
            "connected": True,
            "nodes": len([n for n in ray.nodes() if n.get("Alive")]),
            "resources": {key: total[key] for key in keys},
            "available": {key: free.get(key, 0) for key in keys},
            "replicas": len(self._board_rows()),
            "jobs": self._jobs,
        }

    def status(self) -> EngineStatus:
        rows = self.device_rows()
        states = [row.state for row in rows]
        state = next((s for s in ("editing", "loading", "idle") if s in states), "loading" if not rows else "idle")
        busiest = next((row for row in rows if row.state == state), None)
        return EngineStatus(
            state=state,
            progress=busiest.progress if busiest else Progress(),
            loaded=any(r.loaded for r in rows),
            variant=self.config.variant,
            model_source="tiny" if self.config.uses_tiny_model else "real",
            tiny_profile=self.config.tiny_profile if self.config.uses_tiny_model else None,
            attention=self.attention_of(),
            attention_note=None,
            refiner=self.config.refiner,
            text_encoders=self.config.text_encoders,
            prompt_cache=PromptCacheStats(0, 0, 0),
            counters=self.counters,
            device=f"ray ({self.address})",
            device_type="ray",
            devices=rows,
            cluster=self.cluster_totals(),
        )

    def replica_last_jobs(self) -> dict[str, dict]:
        """Each replica's last job as it reported it (steps run, where it was cancelled): tests, bench."""
        return {label: extra.get("last_job", {}) for label, (_, _, extra) in self._board_rows().items()}


class _ReplicaLost(RuntimeError):
    pass


def _cancelled_errors() -> tuple[type[BaseException], ...]:
    import concurrent.futures

    from ray.serve.exceptions import RequestCancelledError

    return (RequestCancelledError, concurrent.futures.CancelledError)


__all__ = [
    "RAY_CAPABILITIES",
    "EngineReplica",
    "RayEngine",
    "ReplicaBoard",
    "keep_replica_server_on_loopback",
]
