"""`batch --manifest ... --ray ADDRESS`: the items on Ray Data, an actor pool of engines (one per device).

Each actor builds one engine (a pool of one, on the device Ray gave it: `num_gpus=1`, the `NPU`
resource, or CPUs) and runs `batch_work.run_item` on it, the same function as the local path. The
source's and the mask's bytes travel with the item and the unsaved result comes back (by pickle),
so workers need the model files but no storage shared with the driver, which saves every result
through the result store (`batch_work.save_item`). Rows stream back as they finish.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import TYPE_CHECKING, Iterator

from hidream_ui.cli.batch_work import ItemOutput, ItemTask, run_item

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.cli.batch_manifest import ManifestItem
    from hidream_ui.config import AppConfig


class EditActor:
    """One engine in a Ray Data actor; called with batches of one item (pickled tasks)."""

    def __init__(self, config: "AppConfig"):
        import ray

        from hidream_ui.engine.pool import EnginePool

        self.engine = EnginePool.for_config(config)
        context = ray.get_runtime_context()
        # What the results name: the node and the actor (its id's first characters).
        self.label = f"ray-data:{context.get_node_id()[:8]}:{context.get_actor_id()[:8]}"
        for engine in self.engine.engines:  # the PNG's metadata (`engine`) names the actor too
            engine.pool_label = self.label

    def __call__(self, batch: dict) -> dict:
        outputs = [
            pickle.dumps(run_item(self.engine, pickle.loads(task), engine_label=self.label)) for task in batch["task"]
        ]
        return {"output": outputs}


def run_ray(
    config: "AppConfig",
    items: list["ManifestItem"],
    address: str,
    *,
    replicas: int | None = None,
    verbose: bool = False,
) -> Iterator[ItemOutput]:
    """Yields each item's (unsaved) output as the actors finish them; disconnects from the cluster
    afterwards when this call connected. The cluster's token (`--ray-token-file`) is the config's."""
    from hidream_ui.engine.ray_env import connect, default_replicas, disconnect, placement

    owned = connect(address, verbose=verbose, token_file=config.ray_token_file)
    import ray
    import ray.data

    try:
        ray.data.DataContext.get_current().enable_progress_bars = False  # ours is the one bar (stderr)
        resources = ray.cluster_resources()
        where = placement(config, resources)
        size = replicas or default_replicas(where.kind, resources)
        actor_config = dataclasses.replace(config, devices=(), device=where.device)
        rows = [{"task": pickle.dumps(ItemTask.of(item, carry_bytes=True))} for item in items]
        # One block per item: Ray Data spreads blocks, not rows, over the actors.
        dataset = ray.data.from_items(rows, override_num_blocks=len(rows))
        results = dataset.map_batches(
            EditActor,
            fn_constructor_kwargs={"config": actor_config},
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=size),
            **where.options,
        )
        for row in results.iter_rows():
            yield pickle.loads(row["output"])
    finally:
        if owned:
            disconnect()


__all__ = ["EditActor", "run_ray"]
