"""A model's sizes from its configs alone, before anything loads: every part is instantiated on torch's
`meta` device (no memory, no weights read) and its parameters counted the way the memory plans' hooks
group them (model/plans.py). The planner (model/planner.py) predicts peaks from these.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from hidream_ui.model.fp8 import fp8_module_names
from hidream_ui.model.loading import BUILD_LOCK
from hidream_ui.model.plans import ENCODER_BLOCK_MODULES, PlanRefused
from hidream_ui.model.settings import ModelSettings
from hidream_ui.model.sources import resolve_sources
from hidream_ui.model.tiny import profiles
from hidream_ui.model.tiny.in_memory import instantiate

ENCODER_PARTS = ("clip_l", "clip_g", "t5", "llama")


@dataclass(frozen=True)
class PartSize:
    """Element counts of one part, grouped as the plans' hooks group them."""

    total: int
    fp8: int = 0  # elements `--weights fp8` stores as float8 (transformer only)
    unmatched: int = 0  # block level: elements outside the block groups (resident during the whole forward)
    max_block: int = 0  # block level: the largest group
    nonleaf: int = 0  # leaf level: elements outside any leaf layer
    max_leaf: int = 0  # leaf level: the largest leaf
    max_fp8_leaf: int = 0  # the largest fp8 layer (its compute-dtype copy lives during its forward)


@dataclass(frozen=True)
class ModelSizes:
    """What the planner knows about a model, from its configs."""

    transformer: PartSize
    encoders: Mapping[str, PartSize]
    vae: PartSize
    inner_dim: int
    unit: int  # pixels per token side (VAE scale x patch)
    vae_channels: int  # the VAE's first block width
    llama_layers: int
    llama_hidden: int
    heads: int = 0  # the transformer's attention heads (the math path's score matrices)

    @property
    def encoder_total(self) -> int:
        return sum(part.total for part in self.encoders.values())


def _count(module, seen: set[int] | None = None) -> int:
    """Elements of `module`'s parameters not counted yet (`seen`: ids of counted ones; tied weights, such as
    T5's shared embedding, count once)."""
    seen = set() if seen is None else seen
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def _leaf_layers():
    from diffusers.hooks._common import _GO_LC_SUPPORTED_PYTORCH_LAYERS

    return _GO_LC_SUPPORTED_PYTORCH_LAYERS


def _block_groups(module, block_modules=(), seen: set[int] | None = None) -> tuple[int, int]:
    """(unmatched elements, largest group) under diffusers' block-level grouping: each element of a top-level
    ModuleList/Sequential is a group, children named in `block_modules` are grouped recursively, the rest is
    the module's unmatched group."""
    import torch

    seen = set() if seen is None else seen
    unmatched, largest = 0, 0
    for name, child in module.named_children():
        if name in block_modules:
            sub_unmatched, sub_largest = _block_groups(child, block_modules, seen)
            unmatched += sub_unmatched
            largest = max(largest, sub_largest)
        elif isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
            largest = max([largest, *(_count(block, seen) for block in child)])
        else:
            unmatched += _count(child, seen)
    for p in module.parameters(recurse=False):
        if id(p) not in seen:
            seen.add(id(p))
            unmatched += p.numel()
    return unmatched, largest


def _part_size(module, block_modules=(), fp8_names: set[str] | None = None) -> PartSize:
    leaves = [m for m in module.modules() if isinstance(m, _leaf_layers())]
    seen: set[int] = set()
    leaf_counts = [_count(m, seen) for m in leaves]
    unmatched, largest = _block_groups(module, block_modules)
    fp8, max_fp8 = 0, 0
    if fp8_names is not None:
        modules = dict(module.named_modules())
        counts = [_count(modules[name]) for name in fp8_names]
        fp8, max_fp8 = sum(counts), max(counts, default=0)
    total = _count(module)
    return PartSize(
        total=total,
        fp8=fp8,
        unmatched=unmatched,
        max_block=largest,
        nonleaf=total - sum(leaf_counts),
        max_leaf=max(leaf_counts, default=0),
        max_fp8_leaf=max_fp8,
    )


def _public(config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items() if not k.startswith("_")}


@functools.lru_cache(maxsize=8)
def _sizes_cached(key: str) -> ModelSizes:
    import torch

    configs = json.loads(key)
    # Under the build lock: transformers sets torch's process-wide default dtype while it builds a
    # model, so a build here beside a pool engine's load could leave the process at bf16.
    with BUILD_LOCK, torch.device("meta"):
        transformer = instantiate("transformer", configs["transformer"])
        encoders = {part: instantiate(part, configs[part]) for part in ENCODER_PARTS}
        vae = instantiate("vae", configs["vae"])
    tconf, vconf, lconf = configs["transformer"], configs["vae"], configs["llama"]
    return ModelSizes(
        transformer=_part_size(transformer, fp8_names=set(fp8_module_names(transformer))),
        encoders={name: _part_size(module, ENCODER_BLOCK_MODULES) for name, module in encoders.items()},
        vae=_part_size(vae),
        inner_dim=int(tconf["num_attention_heads"]) * int(tconf["attention_head_dim"]),
        unit=2 ** (len(vconf["block_out_channels"]) - 1) * int(tconf["patch_size"]),
        vae_channels=int(vconf["block_out_channels"][0]),
        llama_layers=int(lconf["num_hidden_layers"]),
        llama_hidden=int(lconf["hidden_size"]),
        heads=int(tconf["num_attention_heads"]),
    )


def sizes_from_configs(configs: Mapping[str, Mapping[str, Any]]) -> ModelSizes:
    """Part sizes from the configs of transformer, llama, t5, clip_l, clip_g and vae (meta device: no memory)."""
    return _sizes_cached(json.dumps({k: _public(v) for k, v in configs.items()}, sort_keys=True))


class ConfigsUnavailable(PlanRefused):
    """The part configs are not on local disk (a hub id not downloaded yet): nothing to predict from."""


def read_configs(config: ModelSettings) -> dict[str, dict[str, Any]]:
    """The part configs of the configured model from its config files (the tiny checkpoint is built first
    if needed); for the `full` profile, the tiny files with the release's dimensions laid over them, as
    model/tiny/in_memory.py makes it. No weight is read."""

    sources = resolve_sources(config)
    i1 = Path(sources.i1)
    transformer_root = Path(sources.e1) if sources.variant == "e1.1" else i1
    folders = {
        "transformer": transformer_root / "transformer",
        "llama": Path(sources.llama),
        "t5": i1 / "text_encoder_3",
        "clip_l": i1 / "text_encoder",
        "clip_g": i1 / "text_encoder_2",
        "vae": i1 / "vae",
    }
    full = sources.tiny_profile == profiles.FULL_PROFILE_NAME
    out = {}
    for part, folder in folders.items():
        path = folder / "config.json"
        try:
            out[part] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigsUnavailable(f"cannot plan: {path} is not readable ({exc})") from None
        if full:
            out[part].update(_public(profiles.RELEASE_CONFIGS[part]))
    return out
