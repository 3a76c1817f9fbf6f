"""Offline builder of random-weight HiDream checkpoints in the upstream folder layout.

The real weights (HiDream-I1-Full, HiDream-E1-1, HiDream-E1-Full and Llama-3.1-8B-Instruct, ~50 GB) can
never be downloaded on a test machine. This module writes the same folders, file names, config keys, tokenizer
files and safetensors key names with tiny random weights, so that the project's loader (plain diffusers /
transformers ``from_pretrained`` calls) takes exactly the code path it takes for the 17B release:

```
<out_dir>/
  hidream_ui_tiny.json                    marker: profile, seed, format version
  Llama-3.1-8B-Instruct/                  LlamaForCausalLM + byte-level BPE tokenizer.json (Llama-3 specials)
  HiDream-I1-Full/                        model_index.json, scheduler/, text_encoder{,_2,_3}/,
                                          tokenizer{,_2,_3}/, transformer/ (sharded), vae/
  HiDream-E1-1/transformer/               same architecture as I1, different weights (sharded)
  HiDream-E1-Full/HiDream-E1-Full.safetensors   peft-wrapped LoRA keys + a few replaced plain keys
```

Everything is deterministic: the same profile and seed give byte-identical trees. Each tensor is drawn from its
own generator seeded by ``sha256(seed, stream, tensor name)``, so the order of generation does not matter and
the large "bench" profile can be written shard by shard without holding a whole model in memory. Tokenizers are
constructed from fixed vocabularies and merges (the ``tokenizers`` trainers are not deterministic).

Nothing heavy is imported at module import time: torch, diffusers, transformers, tokenizers, safetensors and
peft are imported inside the functions that need them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import stat
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


logger = logging.getLogger(__name__)

# Bump whenever the bytes written for a given (profile, seed) change: ensure_tiny() keys its cache on it.
FORMAT_VERSION = 2

MARKER_FILENAME = "hidream_ui_tiny.json"
LLAMA_DIRNAME = "Llama-3.1-8B-Instruct"
I1_DIRNAME = "HiDream-I1-Full"
E1_1_DIRNAME = "HiDream-E1-1"
E1_FULL_DIRNAME = "HiDream-E1-Full"
E1_FULL_FILENAME = "HiDream-E1-Full.safetensors"

# The adapter HiDream-E1-Full is trained with (upstream inference.py adds exactly this LoraConfig to the
# HiDream-I1-Full transformer before loading the checkpoint with strict=False).
E1_FULL_LORA_TARGETS: tuple[str, ...] = (
    "to_k",
    "to_q",
    "to_v",
    "to_out",
    "to_k_t",
    "to_q_t",
    "to_v_t",
    "to_out_t",
    "w1",
    "w2",
    "w3",
    "final_layer.linear",
)
E1_FULL_LORA_RANK = 16
E1_FULL_LORA_ALPHA = 16
# Non-LoRA keys the tiny E1-Full checkpoint replaces (names as in the adapter-wrapped state_dict). The real file's
# plain keys are not documented; these exercise the "reload_keys" path of the editing pipeline.
E1_FULL_PLAIN_KEYS: tuple[str, ...] = (
    "x_embedder.proj.weight",
    "x_embedder.proj.bias",
    "t_embedder.timestep_embedder.linear_1.weight",
    "t_embedder.timestep_embedder.linear_1.bias",
)

CACHE_ENV_VAR = "HIDREAM_UI_CACHE"


@dataclass(frozen=True)
class TinyProfile:
    """Geometry of the HiDream transformer for one tiny profile (the text encoders are tiny in every profile)."""

    name: str
    description: str
    num_layers: int
    num_single_layers: int
    num_attention_heads: int
    attention_head_dim: int
    axes_dims_rope: tuple[int, ...]
    max_resolution: tuple[int, int]
    llama_layers: tuple[int, ...]
    transformer_shards: int
    patch_size: int = 2
    latent_channels: int = 16
    num_routed_experts: int = 4
    num_activated_experts: int = 2

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def max_seq(self) -> int:
        return self.max_resolution[0] * self.max_resolution[1] // (self.patch_size * self.patch_size)

    def transformer_config(self) -> dict[str, Any]:
        """The ``HiDreamImageTransformer2DModel`` init arguments (what ``transformer/config.json`` holds)."""
        return {
            "patch_size": self.patch_size,
            "in_channels": self.latent_channels,
            "out_channels": self.latent_channels,
            "num_layers": self.num_layers,
            "num_single_layers": self.num_single_layers,
            "attention_head_dim": self.attention_head_dim,
            "num_attention_heads": self.num_attention_heads,
            # [T5 d_model, Llama hidden]: diffusers projects the Llama layers with [1] and T5 with [0].
            "caption_channels": [_TEXT.t5_d_model, _TEXT.llama_hidden],
            "text_emb_dim": _TEXT.clip_l_projection + _TEXT.clip_g_projection,
            "num_routed_experts": self.num_routed_experts,
            "num_activated_experts": self.num_activated_experts,
            "axes_dims_rope": list(self.axes_dims_rope),
            "max_resolution": list(self.max_resolution),
            "llama_layers": list(self.llama_layers),
            "force_inference_output": False,
        }


@dataclass(frozen=True)
class _TextGeometry:
    """Tiny text side shared by all profiles; names follow the real encoders they stand in for."""

    clip_l_hidden: int = 32
    clip_l_projection: int = 16
    clip_l_layers: int = 2
    clip_l_heads: int = 2
    clip_g_hidden: int = 48
    clip_g_projection: int = 16
    clip_g_layers: int = 2
    clip_g_heads: int = 4
    # Long-context CLIP: the HiDream pipeline pads CLIP prompts to min(max_sequence_length, 218) tokens.
    clip_max_positions: int = 248
    t5_d_model: int = 32
    t5_d_kv: int = 8
    t5_d_ff: int = 64
    t5_heads: int = 4
    t5_layers: int = 2
    t5_extra_ids: int = 100
    llama_hidden: int = 32
    llama_intermediate: int = 64
    llama_layers: int = 4
    llama_heads: int = 2
    llama_kv_heads: int = 1
    vae_block_out_channels: tuple[int, ...] = (8, 8, 16, 16)
    vae_norm_num_groups: int = 4


_TEXT = _TextGeometry()

PROFILES: Mapping[str, TinyProfile] = MappingProxyType(
    {
        "tiny": TinyProfile(
            name="tiny",
            description="a few MB; for tests and the offline demo",
            num_layers=2,
            num_single_layers=2,
            num_attention_heads=2,
            attention_head_dim=16,
            axes_dims_rope=(8, 4, 4),
            max_resolution=(16, 16),
            llama_layers=(0, 1, 2, 3),
            transformer_shards=2,
        ),
        "bench": TinyProfile(
            name="bench",
            description="the real attention geometry (20 heads x 128, max_seq 4096) with 1 double + 1 single block",
            num_layers=1,
            num_single_layers=1,
            num_attention_heads=20,
            attention_head_dim=128,
            axes_dims_rope=(64, 32, 32),
            max_resolution=(128, 128),
            llama_layers=(2, 3),
            transformer_shards=4,
        ),
    }
)


@dataclass(frozen=True)
class TinyMarker:
    """Content of ``hidream_ui_tiny.json``: what was built and by which format version."""

    profile: str
    seed: int
    format_version: int


def default_cache_root() -> Path:
    """Where ``ensure_tiny`` keeps its builds: ``$HIDREAM_UI_CACHE`` if set, else ``~/.cache/hidream_ui``."""
    configured = os.environ.get(CACHE_ENV_VAR)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "hidream_ui"


def read_marker(path: str | os.PathLike[str]) -> TinyMarker | None:
    """Return the marker of a tiny build at ``path``, or None if ``path`` is not one (or the marker is broken)."""
    marker_path = Path(path) / MARKER_FILENAME
    try:
        data = json.loads(marker_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    profile, seed, version = data.get("profile"), data.get("seed"), data.get("format_version")
    if not isinstance(profile, str) or type(seed) is not int or type(version) is not int:
        return None
    return TinyMarker(profile=profile, seed=seed, format_version=version)


def is_tiny_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is the top folder of a finished tiny build (of any profile, seed or format version)."""
    return read_marker(path) is not None


def build_tiny(out_dir: str | os.PathLike[str], profile: str = "tiny", seed: int = 0) -> Path:
    """Build the tiny checkpoint for ``profile``/``seed`` into ``out_dir`` and return ``out_dir``.

    The tree is written into a temporary sibling folder and renamed into place, so ``out_dir`` is either absent,
    the previous content, or the complete new build, never half written. An existing non-empty ``out_dir`` is only
    replaced if it is itself a tiny build (it carries the marker file); anything else raises ``FileExistsError``.
    """
    spec = _resolve_profile(profile)
    seed = _check_seed(seed)
    out_dir = Path(out_dir).expanduser().absolute()
    _refuse_foreign_folder(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    staging = _build_in_staging(out_dir, spec, seed)
    try:
        _refuse_foreign_folder(out_dir)  # again: something may have appeared while we were building
        if out_dir.exists() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        if out_dir.exists():
            # A previous tiny build: move it aside first so the swap is two renames, then delete it.
            retired = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            os.rename(out_dir, retired)
            try:
                os.rename(staging, out_dir)
            except BaseException:
                os.rename(retired, out_dir)
                raise
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def tiny_path(profile: str = "tiny", seed: int = 0, cache_root: str | os.PathLike[str] | None = None) -> Path:
    """Where `ensure_tiny` keeps the build for ``profile``/``seed`` (built or not)."""
    spec = _resolve_profile(profile)
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    return root.absolute() / f"tiny-{spec.name}-seed{_check_seed(seed)}-v{FORMAT_VERSION}"


def ensure_tiny(
    profile: str = "tiny", seed: int = 0, cache_root: str | os.PathLike[str] | None = None
) -> Path:
    """Return the cached tiny build for ``profile``/``seed``, building it on first use.

    The build lives in ``<cache_root>/tiny-<profile>-seed<seed>-v<FORMAT_VERSION>``. Concurrent callers are safe:
    each builds in its own temporary folder and renames it into place; a caller that loses the race discards its
    copy and returns the winner's.
    """
    spec = _resolve_profile(profile)
    seed = _check_seed(seed)
    target = tiny_path(profile, seed, cache_root)
    root = target.parent
    expected = TinyMarker(profile=spec.name, seed=seed, format_version=FORMAT_VERSION)
    if read_marker(target) == expected:
        return target
    _refuse_unexpected_cache_entry(target, expected)
    root.mkdir(parents=True, exist_ok=True)

    staging = _build_in_staging(target, spec, seed)
    try:
        if target.exists() and not any(target.iterdir()):
            target.rmdir()
        os.rename(staging, target)
    except OSError:
        # Lost the race (the target appeared meanwhile and is not empty): keep the winner's finished build.
        shutil.rmtree(staging, ignore_errors=True)
        if read_marker(target) != expected:
            raise
        logger.info("another process finished %s first; discarded this build", target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def main(argv: list[str] | None = None) -> int:
    """``make-tiny DIR [--profile tiny|bench] [--seed N]``: build a tiny checkpoint and print a short summary."""
    parser = argparse.ArgumentParser(
        prog="python -m hidream_ui make-tiny",
        description="Write a random-weight HiDream checkpoint (I1-Full, E1-1, E1-Full, Llama-3.1) in the "
        "upstream folder layout, for offline tests and demos.",
    )
    parser.add_argument(
        "dir", type=Path, metavar="DIR", help="output folder (must be absent, empty or a previous tiny build)"
    )
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="tiny",
        help="tiny: a few MB; bench: real attention geometry, ~3 GB (default: tiny)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed; same seed, same bytes (default: 0)")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    try:
        out = build_tiny(args.dir, profile=args.profile, seed=args.seed)
    except (FileExistsError, ValueError) as error:
        print(f"make-tiny: error: {error}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started

    print(f"Built HiDream tiny checkpoint (profile={args.profile}, seed={args.seed}) in {out}")
    total = 0
    for child in sorted(out.iterdir()):
        if child.is_dir():
            size = _tree_bytes(child)
            total += size
            print(f"  {child.name + '/':<26} {size:>15,d} bytes")
    total += (out / MARKER_FILENAME).stat().st_size
    print(f"  total {total:,d} bytes in {seconds:.1f} s")
    return 0


# --------------------------------------------------------------------------------------------------------------
# Orchestration


def _resolve_profile(profile: str) -> TinyProfile:
    try:
        return PROFILES[profile]
    except KeyError:
        raise ValueError(
            f"unknown tiny profile {profile!r}; choose one of {', '.join(sorted(PROFILES))}"
        ) from None


def _check_seed(seed: int) -> int:
    if type(seed) is not int or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return seed


def _refuse_foreign_folder(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a folder; choose another output path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not is_tiny_checkpoint(out_dir):
        raise FileExistsError(
            f"{out_dir} is not empty and is not a previous tiny build (no {MARKER_FILENAME}); refusing to "
            "overwrite it. Choose an empty or new folder, or delete this one yourself."
        )


def _refuse_unexpected_cache_entry(target: Path, expected: TinyMarker) -> None:
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        found = read_marker(target)
        what = f"a tiny build with marker {found}" if found else "something that is not a tiny build"
        raise FileExistsError(
            f"cache entry {target} holds {what}, expected {expected}; delete it so it can be rebuilt"
        )


def _build_in_staging(final_path: Path, spec: TinyProfile, seed: int) -> Path:
    """Build the whole tree into a fresh hidden sibling of ``final_path`` and return that folder."""
    final_path.parent.mkdir(parents=True, exist_ok=True)
    staging = final_path.with_name(f".{final_path.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        _build_tree(staging, spec, seed)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def _build_tree(root: Path, spec: TinyProfile, seed: int) -> None:
    """Write every component of one build into ``root`` (an empty folder); the marker goes last."""
    started = time.perf_counter()
    vocab = _Vocabularies.build()
    _write_llama(root / LLAMA_DIRNAME, vocab, seed)
    i1 = root / I1_DIRNAME
    _write_model_index(i1)
    _write_json(i1 / "scheduler" / "scheduler_config.json", _scheduler_config())
    _write_clip(i1 / "text_encoder", i1 / "tokenizer", vocab, seed, big=False)
    _write_clip(i1 / "text_encoder_2", i1 / "tokenizer_2", vocab, seed, big=True)
    _write_t5(i1 / "text_encoder_3", i1 / "tokenizer_3", vocab, seed)
    _write_vae(i1 / "vae", seed)
    _write_transformer(i1 / "transformer", spec, seed, stream="i1/transformer")
    _write_transformer(root / E1_1_DIRNAME / "transformer", spec, seed, stream="e1_1/transformer")
    _write_e1_full(root / E1_FULL_DIRNAME / E1_FULL_FILENAME, spec, seed)
    marker = {
        "builder": "hidream_ui.tiny",
        "format_version": FORMAT_VERSION,
        "profile": spec.name,
        "seed": seed,
        "layout": {
            "llama": LLAMA_DIRNAME,
            "i1": I1_DIRNAME,
            "e1_1": E1_1_DIRNAME,
            "e1_full": f"{E1_FULL_DIRNAME}/{E1_FULL_FILENAME}",
        },
    }
    _write_json(root / MARKER_FILENAME, marker)
    logger.info("built tiny %s (seed %d) in %.1f s", spec.name, seed, time.perf_counter() - started)


# --------------------------------------------------------------------------------------------------------------
# Small writers


def _json_text(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_json_text(obj), encoding="utf-8")


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _library_versions() -> tuple[str, str]:
    import diffusers
    import transformers

    return diffusers.__version__, transformers.__version__


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


def _default_file_mode(folder: Path) -> int:
    """The mode a plain new file gets here (0o644 under the usual umask). safetensors writes through a private
    temporary file and would leave the weights 0o600, unlike every other file of the tree."""
    probe = folder / f".mode-probe-{uuid.uuid4().hex[:8]}"
    probe.touch()
    try:
        return stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink()


def _write_hf_weights(folder: Path, model: torch.nn.Module, seed: int, stream: str, n_shards: int) -> None:
    _write_weights(
        folder,
        specs=_checkpoint_specs(model),
        make=lambda spec: _random_tensor(seed, stream, spec),
        single_name="model.safetensors",
        shard_prefix="model",
        index_name="model.safetensors.index.json",
        n_shards=n_shards,
    )


def _write_diffusers_weights(folder: Path, model: torch.nn.Module, seed: int, stream: str, n_shards: int) -> None:
    _write_weights(
        folder,
        specs=_checkpoint_specs(model),
        make=lambda spec: _random_tensor(seed, stream, spec),
        single_name="diffusion_pytorch_model.safetensors",
        shard_prefix="diffusion_pytorch_model",
        index_name="diffusion_pytorch_model.safetensors.index.json",
        n_shards=n_shards,
    )


def _on_meta(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Instantiate a model without allocating its weights: only names and shapes are needed here."""
    import torch

    with torch.device("meta"):
        return factory()


# --------------------------------------------------------------------------------------------------------------
# Tokenizer vocabularies (fixed, no trainer involved)

# Words that get whole-word tokens. Any text still tokenizes (byte-level BPE falls back to bytes, the T5 Unigram
# vocabulary has every ASCII character), these just keep typical prompts short.
_WORDS: tuple[str, ...] = (
    "a", "an", "the", "of", "in", "on", "at", "to", "and", "or", "with", "without", "into", "from", "by", "for",
    "is", "are", "it", "its", "this", "that", "make", "change", "turn", "convert", "add", "remove", "replace",
    "keep", "put", "give", "edit", "editing", "instruction", "target", "description", "image", "photo", "picture",
    "style", "ghibli", "anime", "cartoon", "painting", "sketch", "oil", "watercolor", "cat", "dog", "bird",
    "horse", "person", "man", "woman", "child", "face", "hair", "hat", "shirt", "dress", "sign", "text", "says",
    "holding", "wearing", "sitting", "standing", "tree", "flower", "house", "car", "street", "city", "sky",
    "cloud", "sun", "moon", "night", "day", "snow", "rain", "water", "sea", "beach", "mountain", "forest",
    "background", "foreground", "light", "dark", "red", "green", "blue", "yellow", "black", "white", "pink",
    "purple", "orange", "brown", "gray", "small", "large", "big", "old", "new", "young", "happy", "sad",
    "low", "high", "quality", "resolution", "blur", "blurry", "distorted", "detailed", "realistic", "bright",
    "color", "colors",
)
_CLIP_BOS = "<|startoftext|>"
_CLIP_EOS = "<|endoftext|>"
# Llama-3.1 special tokens in their real order (ids 128000..128010 in the 8B release).
_LLAMA_SPECIALS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
_LLAMA_BOS = "<|begin_of_text|>"
_LLAMA_EOS = "<|eot_id|>"  # the Instruct model's eos (tokenizer_config); generation stops on three ids
# Llama-3's pre-tokenizer split (contractions, letters, 1-3 digit groups, punctuation runs, newlines, spaces).
_LLAMA_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
_T5_PAD, _T5_EOS, _T5_UNK = "<pad>", "</s>", "<unk>"
_SPM_SPACE = "\u2581"


def _byte_table() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for every raw byte, in vocabulary-rank order (GPT-2's mapping, used by
    CLIP and Llama-3 alike): printable Latin-1 bytes stand for themselves and come first, the other bytes map to
    code points from 256 up and follow in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    table = {b: chr(b) for b in printable}
    for shift, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + shift)
    return table


def _chain_merges(words: Sequence[Sequence[str]], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Left-to-right merges that build each word from its symbols; new tokens are appended to ``vocab``."""
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for symbols in words:
        current = symbols[0]
        for symbol in symbols[1:]:
            pair = (current, symbol)
            current = current + symbol
            if pair not in seen:
                seen.add(pair)
                merges.append(pair)
            if current not in vocab:
                vocab[current] = len(vocab)
    return merges


@dataclass(frozen=True)
class _Vocabularies:
    llama_vocab: Mapping[str, int]
    llama_merges: tuple[tuple[str, str], ...]
    clip_vocab: Mapping[str, int]
    clip_merges: tuple[tuple[str, str], ...]
    t5_pieces: tuple[tuple[str, float], ...]  # sentencepiece pieces (no sentinels), ids 0..n-1

    @staticmethod
    def build() -> _Vocabularies:
        table = _byte_table()
        alphabet = list(table.values())

        def as_bytes(text: str) -> list[str]:
            return [table[b] for b in text.encode("utf-8")]

        llama_vocab = {symbol: i for i, symbol in enumerate(alphabet)}
        llama_words = [as_bytes(w) for w in _WORDS if len(w) > 1]
        llama_words += [as_bytes(" " + w) for w in _WORDS]
        llama_words += [as_bytes(" " + w.capitalize()) for w in _WORDS] + [as_bytes(w.capitalize()) for w in _WORDS]
        llama_merges = _chain_merges(llama_words, llama_vocab)

        clip_vocab = {symbol: i for i, symbol in enumerate(alphabet)}
        clip_vocab.update({symbol + "</w>": 256 + i for i, symbol in enumerate(alphabet)})
        clip_words = [as_bytes(w)[:-1] + [as_bytes(w)[-1] + "</w>"] for w in _WORDS if len(w) > 1]
        clip_merges = _chain_merges(clip_words, clip_vocab)
        # The real CLIP vocabulary ends with these two; the legacy pooling (config eos_token_id == 2) takes the
        # hidden state at argmax(input_ids), which is the end-of-text token only if it has the largest id.
        clip_vocab[_CLIP_BOS] = len(clip_vocab)
        clip_vocab[_CLIP_EOS] = len(clip_vocab)

        chars = [chr(c) for c in range(33, 127)]
        pieces: list[tuple[str, float]] = [(_T5_PAD, 0.0), (_T5_EOS, 0.0), (_T5_UNK, 0.0), (_SPM_SPACE, -4.0)]
        # Whole words beat their letters (higher log-probability), so common words are single tokens.
        pieces += [(_SPM_SPACE + w, -5.0 - 0.01 * i) for i, w in enumerate(_WORDS)]
        pieces += [(_SPM_SPACE + w.capitalize(), -6.0 - 0.01 * i) for i, w in enumerate(_WORDS)]
        pieces += [(c, -10.0 - 0.01 * i) for i, c in enumerate(chars)]
        pieces += [(_SPM_SPACE + c, -10.5 - 0.01 * i) for i, c in enumerate(chars)]
        # sentencepiece rejects duplicate pieces ("▁a" is both a word and a spaced letter): keep the first.
        seen: set[str] = set()
        pieces = [(p, s) for p, s in pieces if not (p in seen or seen.add(p))]
        return _Vocabularies(
            llama_vocab=MappingProxyType(llama_vocab),
            llama_merges=tuple(llama_merges),
            clip_vocab=MappingProxyType(clip_vocab),
            clip_merges=tuple(clip_merges),
            t5_pieces=tuple(pieces),
        )

    @property
    def llama_size(self) -> int:
        return len(self.llama_vocab) + len(_LLAMA_SPECIALS)

    def llama_id(self, token: str) -> int:
        return len(self.llama_vocab) + _LLAMA_SPECIALS.index(token)

    @property
    def t5_sentinels(self) -> tuple[str, ...]:
        # Like T5's real vocabulary: <extra_id_99> right after the sentencepiece pieces, <extra_id_0> last.
        return tuple(f"<extra_id_{i}>" for i in range(_TEXT.t5_extra_ids - 1, -1, -1))

    @property
    def t5_size(self) -> int:
        return len(self.t5_pieces) + _TEXT.t5_extra_ids


def _added_token(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def _added_token_decoder(content: str) -> dict[str, Any]:
    return {**_added_token(content), "special": True}


# --------------------------------------------------------------------------------------------------------------
# Llama-3.1-8B-Instruct


def _write_llama(folder: Path, vocab: _Vocabularies, seed: int) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import LlamaConfig, LlamaForCausalLM

    _, transformers_version = _library_versions()
    bos, eos = vocab.llama_id(_LLAMA_BOS), vocab.llama_id(_LLAMA_EOS)
    stop_ids = [vocab.llama_id("<|end_of_text|>"), vocab.llama_id("<|eom_id|>"), eos]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": stop_ids,
        "hidden_act": "silu",
        "hidden_size": _TEXT.llama_hidden,
        "initializer_range": 0.02,
        "intermediate_size": _TEXT.llama_intermediate,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": _TEXT.llama_heads,
        "num_hidden_layers": _TEXT.llama_layers,
        "num_key_value_heads": _TEXT.llama_kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": transformers_version,
        "use_cache": True,
        "vocab_size": vocab.llama_size,
    }
    _write_json(folder / "config.json", config)
    _write_json(
        folder / "generation_config.json",
        {
            "bos_token_id": bos,
            "do_sample": True,
            "eos_token_id": stop_ids,
            "temperature": 0.6,
            "top_p": 0.9,
            "transformers_version": transformers_version,
        },
    )

    tokenizer = Tokenizer(
        BPE(vocab=dict(vocab.llama_vocab), merges=list(vocab.llama_merges), ignore_merges=True, fuse_unk=False)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _LLAMA_SPECIALS])
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{_LLAMA_BOS} $A",
                pair=f"{_LLAMA_BOS} $A {_LLAMA_BOS}:1 $B:1",
                special_tokens=[(_LLAMA_BOS, bos)],
            ),
        ]
    )
    _write_text(folder / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    _write_json(
        folder / "tokenizer_config.json",
        {
            "added_tokens_decoder": {str(vocab.llama_id(t)): _added_token_decoder(t) for t in _LLAMA_SPECIALS},
            "bos_token": _LLAMA_BOS,
            "chat_template": _LLAMA_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": True,
            "eos_token": _LLAMA_EOS,
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    _write_json(
        folder / "special_tokens_map.json",
        {"bos_token": _added_token(_LLAMA_BOS), "eos_token": _added_token(_LLAMA_EOS)},
    )
    model_config = LlamaConfig.from_dict({k: v for k, v in config.items() if k != "transformers_version"})
    model = _on_meta(lambda: LlamaForCausalLM(model_config))
    _write_hf_weights(folder, model, seed, "llama", n_shards=2)


# --------------------------------------------------------------------------------------------------------------
# HiDream-I1-Full: model_index, scheduler, CLIP-L, CLIP-G, T5, VAE


def _write_model_index(folder: Path) -> None:
    diffusers_version, _ = _library_versions()
    # Llama (text_encoder_4 / tokenizer_4) is not part of the HiDream repository: callers pass it explicitly.
    _write_json(
        folder / "model_index.json",
        {
            "_class_name": "HiDreamImagePipeline",
            "_diffusers_version": diffusers_version,
            "scheduler": ["diffusers", "UniPCMultistepScheduler"],
            "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
            "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
            "text_encoder_3": ["transformers", "T5EncoderModel"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "tokenizer_2": ["transformers", "CLIPTokenizer"],
            "tokenizer_3": ["transformers", "T5Tokenizer"],
            "transformer": ["diffusers", "HiDreamImageTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        },
    )


def _scheduler_config() -> dict[str, Any]:
    """HiDream-I1-Full's scheduler as published since the official 2025-04-17 update: diffusers'
    UniPCMultistepScheduler configured as flow matching with shift 3 (before that update the repo shipped
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)). The key set is that of the
    diffusers release the HiDream team saved it with; newer keys load with their defaults."""
    diffusers_version, _ = _library_versions()
    return {
        "_class_name": "UniPCMultistepScheduler",
        "_diffusers_version": diffusers_version,
        "beta_end": 0.02,
        "beta_schedule": "linear",
        "beta_start": 0.0001,
        "disable_corrector": [],
        "dynamic_thresholding_ratio": 0.995,
        "final_sigmas_type": "zero",
        "flow_shift": 3.0,
        "lower_order_final": True,
        "num_train_timesteps": 1000,
        "predict_x0": True,
        "prediction_type": "flow_prediction",
        "rescale_betas_zero_snr": False,
        "sample_max_value": 1.0,
        "solver_order": 2,
        "solver_p": None,
        "solver_type": "bh2",
        "steps_offset": 0,
        "thresholding": False,
        "timestep_spacing": "linspace",
        "trained_betas": None,
        "use_beta_sigmas": False,
        "use_exponential_sigmas": False,
        "use_flow_sigmas": True,
        "use_karras_sigmas": False,
    }


def _write_clip(model_folder: Path, tokenizer_folder: Path, vocab: _Vocabularies, seed: int, big: bool) -> None:
    """CLIP-L (``big=False``, quick_gelu) or CLIP-G (``big=True``, gelu, "!" as pad token like OpenCLIP bigG)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    _, transformers_version = _library_versions()
    hidden = _TEXT.clip_g_hidden if big else _TEXT.clip_l_hidden
    config = {
        "architectures": ["CLIPTextModelWithProjection"],
        "attention_dropout": 0.0,
        # bos 0 / eos 2 / pad 1 are the legacy ids the released configs carry; eos_token_id == 2 selects CLIP's
        # argmax(input_ids) pooling, which finds <|endoftext|> because it has the largest id.
        "bos_token_id": 0,
        "dropout": 0.0,
        "eos_token_id": 2,
        "hidden_act": "gelu" if big else "quick_gelu",
        "hidden_size": hidden,
        "initializer_factor": 1.0,
        "initializer_range": 0.02,
        "intermediate_size": 4 * hidden,
        "layer_norm_eps": 1e-05,
        "max_position_embeddings": _TEXT.clip_max_positions,
        "model_type": "clip_text_model",
        "num_attention_heads": _TEXT.clip_g_heads if big else _TEXT.clip_l_heads,
        "num_hidden_layers": _TEXT.clip_g_layers if big else _TEXT.clip_l_layers,
        "pad_token_id": 1,
        "projection_dim": _TEXT.clip_g_projection if big else _TEXT.clip_l_projection,
        "torch_dtype": "bfloat16",
        "transformers_version": transformers_version,
        "vocab_size": len(vocab.clip_vocab),
    }
    _write_json(model_folder / "config.json", config)
    model_config = CLIPTextConfig.from_dict({k: v for k, v in config.items() if k != "transformers_version"})
    model = _on_meta(lambda: CLIPTextModelWithProjection(model_config))
    _write_hf_weights(model_folder, model, seed, "clip_g" if big else "clip_l", n_shards=1)

    # The released CLIP tokenizers are slow-format files only (vocab.json + merges.txt, no tokenizer.json).
    pad = "!" if big else _CLIP_EOS
    _write_text(tokenizer_folder / "vocab.json", json.dumps(dict(vocab.clip_vocab), ensure_ascii=False) + "\n")
    merges = "".join(f"{a} {b}\n" for a, b in vocab.clip_merges)
    _write_text(tokenizer_folder / "merges.txt", "#version: 0.2\n" + merges)
    decoder = {str(vocab.clip_vocab[t]): _added_token_decoder(t) for t in (_CLIP_BOS, _CLIP_EOS)}
    if big:
        decoder[str(vocab.clip_vocab[pad])] = _added_token_decoder(pad)
    _write_json(
        tokenizer_folder / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "added_tokens_decoder": decoder,
            "bos_token": _CLIP_BOS,
            "clean_up_tokenization_spaces": True,
            "do_lower_case": True,
            "eos_token": _CLIP_EOS,
            "errors": "replace",
            "model_max_length": 77,
            "pad_token": pad,
            "tokenizer_class": "CLIPTokenizer",
            "unk_token": _CLIP_EOS,
        },
    )
    _write_json(
        tokenizer_folder / "special_tokens_map.json",
        {
            "bos_token": _added_token(_CLIP_BOS),
            "eos_token": _added_token(_CLIP_EOS),
            "pad_token": _added_token(pad),
            "unk_token": _added_token(_CLIP_EOS),
        },
    )


def _write_t5(model_folder: Path, tokenizer_folder: Path, vocab: _Vocabularies, seed: int) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import Unigram
    from transformers import T5Config, T5EncoderModel

    _, transformers_version = _library_versions()
    config = {
        "architectures": ["T5EncoderModel"],
        "classifier_dropout": 0.0,
        "d_ff": _TEXT.t5_d_ff,
        "d_kv": _TEXT.t5_d_kv,
        "d_model": _TEXT.t5_d_model,
        "decoder_start_token_id": 0,
        "dense_act_fn": "gelu_new",
        "dropout_rate": 0.1,
        "eos_token_id": 1,
        "feed_forward_proj": "gated-gelu",
        "initializer_factor": 1.0,
        "is_encoder_decoder": True,
        "is_gated_act": True,
        "layer_norm_epsilon": 1e-06,
        "model_type": "t5",
        "num_decoder_layers": _TEXT.t5_layers,
        "num_heads": _TEXT.t5_heads,
        "num_layers": _TEXT.t5_layers,
        "output_past": True,
        "pad_token_id": 0,
        "relative_attention_max_distance": 128,
        "relative_attention_num_buckets": 32,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": transformers_version,
        "use_cache": True,
        # Padded to a multiple of 128 beyond the tokenizer, as T5's 32128 rows for 32100 tokens.
        "vocab_size": -(-vocab.t5_size // 128) * 128,
    }
    _write_json(model_folder / "config.json", config)
    model_config = T5Config.from_dict({k: v for k, v in config.items() if k != "transformers_version"})
    model = _on_meta(lambda: T5EncoderModel(model_config))
    _write_hf_weights(model_folder, model, seed, "t5", n_shards=2)

    sentinels = vocab.t5_sentinels
    unigram_vocab = list(vocab.t5_pieces) + [(s, 0.0) for s in sentinels]
    tokenizer = Tokenizer(Unigram(unigram_vocab, unk_id=2, byte_fallback=False))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPM_SPACE, prepend_scheme="always", split=True)
    tokenizer.decoder = decoders.Metaspace(replacement=_SPM_SPACE, prepend_scheme="always", split=True)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (_T5_PAD, _T5_EOS, _T5_UNK, *sentinels)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=["$A", _T5_EOS], pair=["$A", _T5_EOS, "$B", _T5_EOS], special_tokens=[(_T5_EOS, 1)]
    )
    _write_text(tokenizer_folder / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    (tokenizer_folder / "spiece.model").write_bytes(_sentencepiece_model(vocab.t5_pieces))
    first_sentinel = len(vocab.t5_pieces)
    decoder = {str(i): _added_token_decoder(t) for i, t in enumerate((_T5_PAD, _T5_EOS, _T5_UNK))}
    decoder.update({str(first_sentinel + i): _added_token_decoder(t) for i, t in enumerate(sentinels)})
    in_order = [f"<extra_id_{i}>" for i in range(_TEXT.t5_extra_ids)]
    _write_json(
        tokenizer_folder / "tokenizer_config.json",
        {
            "add_prefix_space": True,
            "added_tokens_decoder": decoder,
            "additional_special_tokens": in_order,
            "clean_up_tokenization_spaces": True,
            "eos_token": _T5_EOS,
            "extra_ids": _TEXT.t5_extra_ids,
            "legacy": True,
            "model_max_length": 512,
            "pad_token": _T5_PAD,
            "sp_model_kwargs": {},
            "tokenizer_class": "T5Tokenizer",
            "unk_token": _T5_UNK,
        },
    )
    _write_json(
        tokenizer_folder / "special_tokens_map.json",
        {
            "additional_special_tokens": in_order,
            "eos_token": _added_token(_T5_EOS),
            "pad_token": _added_token(_T5_PAD),
            "unk_token": _added_token(_T5_UNK),
        },
    )


def _sentencepiece_model(pieces: Sequence[tuple[str, float]]) -> bytes:
    """A unigram ``spiece.model`` holding exactly ``pieces``, serialized directly (no training, so it is
    deterministic). Sentinels are not pieces: like T5's real model they exist only as added tokens."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    model = spm.ModelProto()
    kinds = {_T5_PAD: spm.ModelProto.SentencePiece.CONTROL, _T5_EOS: spm.ModelProto.SentencePiece.CONTROL}
    kinds[_T5_UNK] = spm.ModelProto.SentencePiece.UNKNOWN
    for piece, score in pieces:
        entry = model.pieces.add()
        entry.piece = piece
        entry.score = score
        entry.type = kinds.get(piece, spm.ModelProto.SentencePiece.NORMAL)
    trainer = model.trainer_spec
    trainer.model_type = spm.TrainerSpec.UNIGRAM
    trainer.vocab_size = len(pieces)
    trainer.pad_id, trainer.eos_id, trainer.unk_id, trainer.bos_id = 0, 1, 2, -1
    trainer.pad_piece, trainer.eos_piece, trainer.unk_piece = _T5_PAD, _T5_EOS, _T5_UNK
    normalizer = model.normalizer_spec
    normalizer.name = "identity"  # T5's nmt_nfkc needs a compiled charsmap blob; identity needs none
    normalizer.add_dummy_prefix = True
    normalizer.remove_extra_whitespaces = True
    normalizer.escape_whitespaces = True
    return model.SerializeToString(deterministic=True)


def _vae_config() -> dict[str, Any]:
    diffusers_version, _ = _library_versions()
    blocks = len(_TEXT.vae_block_out_channels)
    return {
        "_class_name": "AutoencoderKL",
        "_diffusers_version": diffusers_version,
        "act_fn": "silu",
        "block_out_channels": list(_TEXT.vae_block_out_channels),
        "down_block_types": ["DownEncoderBlock2D"] * blocks,
        "force_upcast": True,
        "in_channels": 3,
        "latent_channels": 16,
        "latents_mean": None,
        "latents_std": None,
        "layers_per_block": 2,
        "mid_block_add_attention": True,
        "norm_num_groups": _TEXT.vae_norm_num_groups,
        "out_channels": 3,
        "sample_size": 1024,
        # Flux's VAE, which HiDream uses: latents are (z - shift) * scale.
        "scaling_factor": 0.3611,
        "shift_factor": 0.1159,
        "up_block_types": ["UpDecoderBlock2D"] * blocks,
        "use_post_quant_conv": False,
        "use_quant_conv": False,
    }


def _write_vae(folder: Path, seed: int) -> None:
    from diffusers import AutoencoderKL

    config = _vae_config()
    _write_json(folder / "config.json", config)
    model = _on_meta(lambda: AutoencoderKL(**{k: v for k, v in config.items() if not k.startswith("_")}))
    # bf16 like the released Flux VAE; from_pretrained(torch_dtype=...) casts on load.
    _write_diffusers_weights(folder, model, seed, "vae", n_shards=1)


# --------------------------------------------------------------------------------------------------------------
# HiDream transformers: I1-Full, E1-1 and the E1-Full LoRA file


def _transformer_on_meta(spec: TinyProfile) -> torch.nn.Module:
    from diffusers import HiDreamImageTransformer2DModel

    return _on_meta(lambda: HiDreamImageTransformer2DModel(**spec.transformer_config()))


def _write_transformer(folder: Path, spec: TinyProfile, seed: int, stream: str) -> None:
    diffusers_version, _ = _library_versions()
    config = {
        "_class_name": "HiDreamImageTransformer2DModel",
        "_diffusers_version": diffusers_version,
        **spec.transformer_config(),
    }
    _write_json(folder / "config.json", config)
    _write_diffusers_weights(folder, _transformer_on_meta(spec), seed, stream, n_shards=spec.transformer_shards)


def _write_e1_full(path: Path, spec: TinyProfile, seed: int) -> None:
    """The E1-Full file: every LoRA tensor of the adapter-wrapped I1 transformer plus E1_FULL_PLAIN_KEYS, with
    key names taken from the wrapped model's own state_dict so ``load_state_dict(strict=False)`` has no
    unexpected keys."""
    from peft import LoraConfig

    model = _transformer_on_meta(spec)
    model.add_adapter(
        LoraConfig(
            r=E1_FULL_LORA_RANK,
            lora_alpha=E1_FULL_LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=list(E1_FULL_LORA_TARGETS),
            init_lora_weights="gaussian",
        )
    )
    wrapped = {tensor.name: tensor for tensor in _checkpoint_specs(model)}
    missing = [key for key in E1_FULL_PLAIN_KEYS if key not in wrapped]
    if missing:
        raise RuntimeError(
            f"E1-Full plain keys {missing} are not in the adapter-wrapped transformer's state_dict: the installed "
            "diffusers renamed transformer modules; update E1_FULL_PLAIN_KEYS in hidream_ui/tiny.py"
        )
    specs = [
        tensor
        for name, tensor in wrapped.items()
        if ".lora_A." in name or ".lora_B." in name or name in E1_FULL_PLAIN_KEYS
    ]
    _write_weights(
        path.parent,
        specs=specs,
        make=lambda tensor: _random_tensor(seed, "e1_full", tensor),
        single_name=path.name,
        shard_prefix=path.stem,
        index_name=f"{path.name}.index.json",
        n_shards=1,
    )
