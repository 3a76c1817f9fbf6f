"""Deterministic random weights: every tensor from (seed, stream, name), written as sharded safetensors."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hidream_ui.model.tiny.files import _default_file_mode, _write_json

if TYPE_CHECKING:
    import torch


# --------------------------------------------------------------------------------------------------------------
# Deterministic random weights


@dataclass(frozen=True)
class _TensorSpec:
    name: str
    shape: tuple[int, ...]


_EMBEDDING_SUFFIXES = (
    "embed_tokens.weight",
    "token_embedding.weight",
    "position_embedding.weight",
    "shared.weight",
    "relative_attention_bias.weight",
)


def _derive_seed(seed: int, stream: str, name: str) -> int:
    digest = hashlib.sha256(f"hidream_ui.tiny/{seed}/{stream}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _random_tensor(seed: int, stream: str, spec: _TensorSpec) -> torch.Tensor:
    """One float32 tensor of a well-scaled random init, a pure function of (seed, stream, name, shape)."""
    import torch

    generator = torch.Generator(device="cpu")
    generator.manual_seed(_derive_seed(seed, stream, spec.name))
    values = torch.randn(spec.shape, generator=generator, dtype=torch.float32)
    if spec.name.endswith("bias"):
        values.mul_(0.02)
    elif len(spec.shape) == 1:
        # Norm scales: around one, so normalised activations keep their size.
        values.mul_(0.02).add_(1.0)
    elif spec.name.endswith(_EMBEDDING_SUFFIXES):
        values.mul_(0.02)
    else:
        # Linear/conv weights (LoRA A and B included): variance-preserving, so deep stacks neither explode nor
        # vanish and a nonzero LoRA B visibly changes the output.
        fan_in = 1
        for dim in spec.shape[1:]:
            fan_in *= dim
        values.mul_(fan_in**-0.5)
    return values


def _checkpoint_specs(model: torch.nn.Module) -> list[_TensorSpec]:
    """What ``save_pretrained`` would store: the state_dict minus tied duplicates, in state_dict order."""
    unique_params = {name for name, _ in model.named_parameters()}
    all_params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return [
        _TensorSpec(name, tuple(tensor.shape))
        for name, tensor in model.state_dict().items()
        if name in unique_params or name not in all_params
    ]


def _shard_groups(specs: Sequence[_TensorSpec], n_shards: int, itemsize: int) -> list[list[_TensorSpec]]:
    """Split ``specs`` (kept in order) into exactly ``min(n_shards, len(specs))`` contiguous, non-empty groups of
    roughly equal byte size. Pure arithmetic on shapes, so the split is fixed for a given architecture."""
    n = max(1, min(n_shards, len(specs)))
    sizes = [itemsize * _numel(s.shape) for s in specs]
    total = max(1, sum(sizes))
    groups: list[list[_TensorSpec]] = [[] for _ in range(n)]
    offset, previous = 0, 0
    for index, (spec, size) in enumerate(zip(specs, sizes)):
        by_bytes = min(n - 1, offset * n // total)
        shard = min(previous + 1, by_bytes) if index else 0
        shard = max(shard, n - (len(specs) - index), previous)  # leave one tensor for every remaining shard
        groups[shard].append(spec)
        offset, previous = offset + size, shard
    return groups


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _write_weights(
    folder: Path,
    *,
    specs: Sequence[_TensorSpec],
    make: Callable[[_TensorSpec], torch.Tensor],
    single_name: str,
    shard_prefix: str,
    index_name: str,
    n_shards: int,
) -> None:
    """Write bf16 safetensors, one shard at a time (only one shard's tensors are ever alive).

    ``n_shards == 1`` writes ``single_name`` without an index, like ``save_pretrained`` does for small models;
    otherwise ``<shard_prefix>-0000K-of-0000N.safetensors`` plus ``index_name`` with the usual weight_map.
    """
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    file_mode = _default_file_mode(folder)
    groups = _shard_groups(specs, n_shards, itemsize=2)
    weight_map: dict[str, str] = {}
    for number, group in enumerate(groups, start=1):
        filename = f"{shard_prefix}-{number:05d}-of-{len(groups):05d}.safetensors" if len(groups) > 1 else single_name
        tensors = {spec.name: make(spec).to(torch.bfloat16).contiguous() for spec in group}
        save_file(tensors, str(folder / filename), metadata={"format": "pt"})
        os.chmod(folder / filename, file_mode)
        del tensors
        weight_map.update({spec.name: filename for spec in group})
    if len(groups) > 1:
        total_size = sum(2 * _numel(spec.shape) for spec in specs)
        _write_json(folder / index_name, {"metadata": {"total_size": total_size}, "weight_map": weight_map})


def _write_random_weights(
    folder: Path, model: torch.nn.Module, seed: int, stream: str, n_shards: int, stem: str
) -> None:
    """`model`'s parameters as seeded random tensors, in files named `<stem>.safetensors` (sharded:
    `<stem>-0000K-of-0000N.safetensors` and `<stem>.safetensors.index.json`)."""
    _write_weights(
        folder,
        specs=_checkpoint_specs(model),
        make=lambda spec: _random_tensor(seed, stream, spec),
        single_name=f"{stem}.safetensors",
        shard_prefix=stem,
        index_name=f"{stem}.safetensors.index.json",
        n_shards=n_shards,
    )


def _write_hf_weights(folder: Path, model: torch.nn.Module, seed: int, stream: str, n_shards: int) -> None:
    _write_random_weights(folder, model, seed, stream, n_shards, stem="model")  # transformers' file names


def _write_diffusers_weights(folder: Path, model: torch.nn.Module, seed: int, stream: str, n_shards: int) -> None:
    _write_random_weights(folder, model, seed, stream, n_shards, stem="diffusion_pytorch_model")  # diffusers'


def _on_meta(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Instantiate a model without allocating its weights: only names and shapes are needed here."""
    import torch

    with torch.device("meta"):
        return factory()
