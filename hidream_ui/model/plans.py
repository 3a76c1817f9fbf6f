"""Memory plans: named placements of the pipeline's parts on the device (`--memory`), installed with
diffusers' own offloading hooks (`apply_group_offloading`), never with hand-written `.to()` swaps.

| plan | transformer | text encoders | VAE |
|---|---|---|---|
| `full` | resident | resident | resident |
| `encoders-offload` | resident | streamed to the device block by block, only while encoding | resident |
| `encoders-cpu` | resident | run on the host | resident |
| `blocks` | streamed block by block from (pinned) host memory | streamed only while encoding | resident |
| `sequential` | streamed leaf by leaf | streamed leaf by leaf | resident |

`PLANS` is ordered from the fastest to the slowest: `auto` (model/planner.py) takes the first that fits.
The text encoders run once per new text (the engine caches their outputs), so the encoder plans cost
only on new instructions. The planner's memory model mirrors what these hooks keep on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from hidream_ui.device.backends import DeviceInfo
    from hidream_ui.device.pool_spec import Placement


@dataclass(frozen=True)
class PlanSpec:
    """What one plan does with each part. `transformer` / `encoders`: "resident" (on the device),
    "host" (computes on the host), "blocks" (block-level group offloading) or "leaf" (leaf-level)."""

    name: str
    transformer: str
    encoders: str
    description: str
    # Rough speed relative to `full` for an edit with a cached instruction, from where the weights must
    # travel each step (an estimate, not a measurement: `bench memory` measures; see README).
    relative_speed: float


PLAN_SPECS: Mapping[str, PlanSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            PlanSpec("full", "resident", "resident", "everything resident on the device", 1.0),
            PlanSpec(
                "encoders-offload",
                "resident",
                "blocks",
                "text encoders streamed to the device only to encode; transformer and VAE resident",
                1.0,
            ),
            PlanSpec(
                "encoders-cpu", "resident", "host", "text encoders run on the host; transformer and VAE resident", 1.0
            ),
            PlanSpec(
                "blocks",
                "blocks",
                "blocks",
                "transformer blocks streamed from pinned host memory group by group, encoders offloaded",
                0.5,
            ),
            PlanSpec("sequential", "leaf", "leaf", "leaf-level streaming: the smallest and slowest", 0.15),
        )
    }
)
PLANS: tuple[str, ...] = tuple(PLAN_SPECS)  # fastest first
MEMORY_CHOICES: tuple[str, ...] = ("auto", *PLANS)
WEIGHTS: tuple[str, ...] = ("bf16", "fp8")
WEIGHT_CHOICES: tuple[str, ...] = ("auto", *WEIGHTS)
# `--text-encoders` (the older lever) as an alias: "device" leaves the choice to --memory (default auto).
TEXT_ENCODERS_ALIAS: Mapping[str, str | None] = MappingProxyType(
    {"device": None, "cpu": "encoders-cpu", "offload": "encoders-offload"}
)
# Where the text encoders live for code that runs them outside the pipeline (the local rewriter's Llama).
ENCODER_MODE = MappingProxyType({"resident": "device", "host": "cpu", "blocks": "offload", "leaf": "offload"})
# The modules the block-level hooks recurse into (a T5 stack, a CLIP text transformer and its encoder), so a
# text encoder streams layer by layer instead of moving whole; Llama's `layers` is a top-level ModuleList already.
ENCODER_BLOCK_MODULES: tuple[str, ...] = ("encoder", "text_model")
TEXT_ENCODERS: tuple[str, ...] = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")


class PlanRefused(ValueError):
    """A plan cannot be used (does not fit, or does not compose with another option); the message says why."""


@dataclass(frozen=True)
class MemoryPlan:
    """The resolved plan: what the engine, the status panel and every result's metadata show."""

    name: str  # one of PLANS
    weights: str  # "bf16" (the compute dtype) | "fp8"
    requested: str  # what was asked for: "auto" or a plan name
    requested_weights: str  # "auto" | "bf16" | "fp8"
    predicted_peak: int | None = None  # device bytes, from the planner
    host_bytes: int | None = None  # host RAM the plan needs for weights held there
    free: int | None = None  # the device's free bytes the choice was made against
    working_size: tuple[int, int] | None = None  # the size the prediction is for
    reason: str = ""  # why this plan (auto) or that it was asked for

    @property
    def spec(self) -> PlanSpec:
        return PLAN_SPECS[self.name]

    @property
    def label(self) -> str:
        auto = " (auto)" if self.requested == "auto" else ""
        return f"{self.name} · {self.weights}{auto}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def use_streams(device: "DeviceInfo") -> bool:
    # Prefetch on a side stream where the backend has streams (CUDA, torch_npu): the next group's copy
    # overlaps the current group's compute. diffusers refuses streams for a CPU onload device.
    return device.type in ("cuda", "npu")


def _group_offload(module: "torch.nn.Module", device: "DeviceInfo", level: str, block_modules=None) -> None:
    from diffusers.hooks import apply_group_offloading

    streams = use_streams(device)
    kwargs: dict[str, Any] = {"num_blocks_per_group": 1} if level == "block_level" else {}
    if block_modules:
        kwargs["block_modules"] = list(block_modules)
    apply_group_offloading(
        module,
        onload_device=device.torch_device,
        offload_device="cpu",
        offload_type=level,
        use_stream=streams,
        record_stream=streams,
        non_blocking=streams,
        **kwargs,
    )


def apply_plan(
    pipeline,
    plan: MemoryPlan,
    device: "DeviceInfo",
    placement: "Placement | None" = None,
    *,
    encoders_placed: bool = False,
) -> None:
    """Places the pipeline's parts (all on the host, as loaded) for `plan` on `device`.

    Resident parts move once; streamed parts get diffusers' group-offloading hooks, which move
    each group to the device just before it runs and back after (prefetching the next group on a
    side stream where the backend has one). fp8 storage (model/fp8.py) is installed before this,
    as diffusers requires layerwise casting before group offloading.

    `placement` (`--placement`, device/pool_spec.py) names the VAE's device and, where
    `encoders_placed`, the text encoders' device: encoders placed on a card of their own are resident
    there whatever the plan says for them (putting them on a second card is the point of the flag).
    """
    spec = plan.spec
    transformer = pipeline.transformer
    if spec.transformer == "resident":
        transformer.to(device.torch_device)
    else:
        _group_offload(transformer, device, "block_level" if spec.transformer == "blocks" else "leaf_level")
    pipeline.vae.to(placement.vae if placement is not None else device.torch_device)
    pipeline.compute_device = device.torch_device
    if placement is not None and encoders_placed:
        for name in TEXT_ENCODERS:
            getattr(pipeline, name).to(placement.encoders)
        pipeline.text_encoder_mode = ENCODER_MODE["resident"]
        return
    for name in TEXT_ENCODERS:
        encoder = getattr(pipeline, name)
        if spec.encoders == "resident":
            encoder.to(device.torch_device)
        elif spec.encoders == "host":
            encoder.to("cpu")
        elif spec.encoders == "blocks":
            _group_offload(encoder, device, "block_level", ENCODER_BLOCK_MODULES)
        else:
            _group_offload(encoder, device, "leaf_level")
    pipeline.text_encoder_mode = ENCODER_MODE[spec.encoders]


def installed_hooks(module: "torch.nn.Module") -> dict[str, int]:
    """Counts diffusers hooks by name on `module`'s submodules (what a plan installed: for tests, status)."""
    counts: dict[str, int] = {}
    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        if registry is None:
            continue
        for name in registry.hooks:
            counts[name] = counts.get(name, 0) + 1
    return counts


def check_compatible(plan_name: str, *, refiner: str) -> str | None:
    """Why `plan_name` cannot be used with these options (None when it can)."""
    spec = PLAN_SPECS[plan_name]
    if refiner == "i1" and spec.transformer != "resident":
        # The refine weight set swaps parameter storage (model/loading.py WeightSwap); streamed groups keep
        # their own host copies of each parameter and would bring the old set back on the next onload.
        return (
            f"--memory {plan_name} streams the transformer, which keeps its own host copy of every weight; "
            "--refiner i1 swaps weights in place and would be undone. Use --refiner e1 or a plan that keeps "
            "the transformer resident (full, encoders-offload, encoders-cpu, possibly with --weights fp8)"
        )
    return None


def requested_plan(config) -> str:
    """--memory with the --text-encoders alias folded in (also for configs built without `validate`)."""
    alias = TEXT_ENCODERS_ALIAS.get(config.text_encoders)
    return alias if alias is not None and config.memory == "auto" else config.memory


class MemoryOptionError(ValueError):
    """A --memory / --weights / --text-encoders / --transformer-file value that cannot be used; the
    message names it (config.validate turns it into a ConfigError)."""


def validate_memory_options(config):
    """Checks --memory / --weights / --transformer-file and folds the `--text-encoders` alias into --memory.
    Returns the config (with `memory` set from the alias when only --text-encoders was given); raises
    MemoryOptionError naming the bad value."""
    error = MemoryOptionError
    if config.memory not in MEMORY_CHOICES:
        raise error(f"memory={config.memory!r} is not one of: {', '.join(MEMORY_CHOICES)}")
    if config.weights not in WEIGHT_CHOICES:
        raise error(f"weights={config.weights!r} is not one of: {', '.join(WEIGHT_CHOICES)}")
    alias = TEXT_ENCODERS_ALIAS.get(config.text_encoders)
    if alias is not None:
        if config.memory == "auto":
            config = dataclasses.replace(config, memory=alias)
        elif config.memory != alias:
            raise error(
                f"text_encoders={config.text_encoders!r} means memory={alias!r}, but memory="
                f"{config.memory!r} was asked for: give one of them"
            )
    if config.memory != "auto":
        reason = check_compatible(config.memory, refiner=config.refiner)
        if reason:
            raise error(reason)
    path = config.transformer_file
    if path is not None:
        if path.suffix != ".safetensors":
            raise error(f"transformer_file={str(path)!r} must be a .safetensors file")
        if not path.is_file():
            raise error(f"transformer_file={str(path)!r} does not exist")
        if config.variant != "e1.1":
            raise error(
                f"transformer_file={str(path)!r} replaces the E1.1 transformer; e1-full loads its "
                "LoRA onto HiDream-I1-Full (use --i1 for another I1 folder)"
            )
    return config


__all__ = [
    "ENCODER_MODE",
    "MEMORY_CHOICES",
    "MemoryOptionError",
    "MemoryPlan",
    "PLANS",
    "PLAN_SPECS",
    "PlanRefused",
    "PlanSpec",
    "TEXT_ENCODERS_ALIAS",
    "WEIGHTS",
    "WEIGHT_CHOICES",
    "apply_plan",
    "check_compatible",
    "installed_hooks",
    "use_streams",
]
