"""Where the weights come from, checking them before a load, and loading them for E1.1 / E1-Full.

The same functions load the real 17B checkpoints and the offline tiny checkpoint (built by
`hidream_ui.tiny` in the upstream folder layout): there is no separate "test" loading path.

Upstream layout (what users of the NPU port keep on disk under one folder)::

    BASE/Llama-3.1-8B-Instruct/   config.json, tokenizer files, model-*.safetensors + index
    BASE/HiDream-I1-Full/         model_index.json, scheduler/, vae/, text_encoder{,_2,_3}/,
                                  tokenizer{,_2,_3}/, transformer/ (sharded + index)
    BASE/HiDream-E1-1/transformer/        (E1.1: sharded + diffusion_pytorch_model.safetensors.index.json)
    BASE/HiDream-E1-Full/HiDream-E1-Full.safetensors   (E1-Full: LoRA keys + a few plain keys)

Weight sets per stage (see README "Refine stage weights"):
- E1.1, refiner "e1" (default): upstream's demo snapshots `transformer.state_dict()` as its
  "editing" set, but that dict aliases the parameters, so after loading E1.1 both of its sets
  hold the E1.1 weights. Both stages therefore run on E1.1: we load E1.1 once and copy nothing.
- E1.1, refiner "i1": the documented intent (refine on HiDream-I1-Full). The I1 tensors that
  differ are kept as a second set and swapped in at the refine switch (`WeightSwap`).
- E1-Full: a LoRA on the I1 transformer; the refine stage disables the adapters. Upstream's
  "refine" copy of the few non-LoRA keys aliases the loaded parameters too, so its refine stage
  keeps E1-Full's values for them: refiner "e1" reproduces that; "i1" restores I1's originals.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .config import AppConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .devices import DeviceInfo

logger = logging.getLogger(__name__)

LLAMA_DIR = "Llama-3.1-8B-Instruct"
I1_DIR = "HiDream-I1-Full"
E11_DIR = "HiDream-E1-1"
E1_FULL_DIR = "HiDream-E1-Full"
E1_FULL_FILE = "HiDream-E1-Full.safetensors"
HUB_IDS = {
    "llama": "meta-llama/Llama-3.1-8B-Instruct",
    "i1": "HiDream-ai/HiDream-I1-Full",
    "e1.1": "HiDream-ai/HiDream-E1-1",
    "e1-full": "HiDream-ai/HiDream-E1-Full",
}
# LoRA geometry of the E1-Full release (as upstream attaches it before loading the file).
E1_FULL_LORA_TARGETS = (
    "to_k", "to_q", "to_v", "to_out", "to_k_t", "to_q_t", "to_v_t", "to_out_t", "w1", "w2", "w3",
    "final_layer.linear",
)
E1_FULL_LORA_RANK = 16
I1_COMPONENTS = ("scheduler", "vae", "text_encoder", "text_encoder_2", "text_encoder_3",
                 "tokenizer", "tokenizer_2", "tokenizer_3", "transformer")
ProgressFn = Callable[[float, str], None]


class ModelError(RuntimeError):
    """The configured model cannot be used; the message names what is missing or wrong."""


@dataclass(frozen=True)
class ModelSources:
    """Resolved locations of the three parts a variant needs."""

    variant: str
    llama: str
    i1: str
    e1: str
    kind: str  # "tiny" or "real"
    tiny_profile: str | None = None

    def to_dict(self) -> dict:
        return {"variant": self.variant, "kind": self.kind, "llama": self.llama, "i1": self.i1,
                "e1": self.e1, "tiny_profile": self.tiny_profile}


@dataclass(frozen=True)
class Geometry:
    """Sizes derived from the transformer and VAE configs (so the tiny model scales the same rules).

    `image_size` is the side of the largest working area for E1.1 (1024 for the real model),
    `e1_full_side` the fixed E1-Full working side (768), `max_seq` the token budget the
    transformer pads non-square inputs to (E1.1: 8192, E1-Full: 4608 for the real model).
    """

    vae_scale: int
    patch_size: int
    image_size: int
    e1_full_side: int
    max_seq: int

    @property
    def multiple(self) -> int:
        return self.vae_scale * self.patch_size


def geometry_for(variant: str, transformer_config, vae_config) -> Geometry:
    vae_scale = 2 ** (len(vae_config["block_out_channels"]) - 1)
    patch = int(transformer_config["patch_size"])
    res = transformer_config["max_resolution"]
    base_tokens = int(res[0]) * int(res[1]) // (patch * patch)
    unit = vae_scale * patch
    side_tokens = int(round(base_tokens ** 0.5))
    image_size = side_tokens * unit  # real: 64 * 16 = 1024
    # E1-Full works at 768 = 3/4 of E1.1's 1024 side; keep the ratio for smaller test models.
    e1_full_side = max(unit, (image_size * 3 // 4) // unit * unit)
    if variant == "e1.1":
        max_seq = 2 * base_tokens  # the edit input is H x 2W: twice the largest image
    else:
        max_seq = 2 * (e1_full_side // unit) ** 2
    return Geometry(vae_scale=vae_scale, patch_size=patch, image_size=image_size,
                    e1_full_side=e1_full_side, max_seq=max_seq)


def read_geometry(sources: "ModelSources") -> Geometry:
    """The geometry from the transformer and VAE config files, without reading any weight.

    Raises OSError / ValueError / KeyError when the configs are not on local disk (a hub id, a
    tiny checkpoint not built yet) or are not HiDream configs.
    """
    transformer_root = sources.e1 if sources.variant == "e1.1" else sources.i1
    configs = []
    for folder in (Path(transformer_root) / "transformer", Path(sources.i1) / "vae"):
        configs.append(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    return geometry_for(sources.variant, configs[0], configs[1])


def resolve_sources(config: AppConfig, *, build_tiny: bool = True) -> ModelSources:
    """Decides where each part comes from: explicit part > --model-dir > the tiny checkpoint."""
    if config.uses_tiny_model:
        from . import tiny

        if build_tiny:
            base = tiny.ensure_tiny(profile=config.tiny_profile, seed=config.tiny_seed)
        else:
            base = tiny.tiny_path(profile=config.tiny_profile, seed=config.tiny_seed)
        return _sources_in(base, config.variant, kind="tiny", tiny_profile=config.tiny_profile)
    base = config.model_dir
    e1_default = E11_DIR if config.variant == "e1.1" else E1_FULL_DIR

    def pick(explicit: str | None, folder: str, hub_key: str) -> str:
        if explicit:
            return explicit
        if base is not None:
            return str(base / folder)
        return HUB_IDS[hub_key]

    kind = "real"
    if base is not None and _is_tiny(base):
        kind = "tiny"
    return ModelSources(
        variant=config.variant,
        llama=pick(config.llama, LLAMA_DIR, "llama"),
        i1=pick(config.i1, I1_DIR, "i1"),
        e1=pick(config.e1, e1_default, config.variant),
        kind=kind,
    )


def _is_tiny(base: Path) -> bool:
    return (Path(base) / "hidream_ui_tiny.json").is_file()


def _sources_in(base: Path, variant: str, *, kind: str, tiny_profile: str | None = None) -> ModelSources:
    e1 = base / (E11_DIR if variant == "e1.1" else E1_FULL_DIR)
    return ModelSources(variant=variant, llama=str(base / LLAMA_DIR), i1=str(base / I1_DIR), e1=str(e1),
                        kind=kind, tiny_profile=tiny_profile)


def _is_local(source: str) -> bool:
    # A hub id is "org/name" and does not exist on disk; anything that exists, or looks like a path, is local.
    return os.path.exists(source) or source.startswith((".", "/", "~")) or source.count("/") != 1


# ----------------------------------------------------------------------------------------------
# Verification: name exactly what is missing before a multi-minute load starts.
# ----------------------------------------------------------------------------------------------


def _check_weights_folder(folder: Path, index_name: str, single_name: str, problems: list[str]) -> None:
    """Checks a folder with either one safetensors file or an index naming its shards."""
    index = folder / index_name
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            problems.append(f"{index}: unreadable index ({exc})")
            return
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).is_file():
                problems.append(f"{folder / shard}: shard listed in {index.name} is missing")
    elif not (folder / single_name).is_file():
        problems.append(f"{folder}: no {index_name} and no {single_name}")


def _check_config(folder: Path, problems: list[str], name: str = "config.json") -> None:
    if not (folder / name).is_file():
        problems.append(f"{folder / name}: missing")


def verify_sources(sources: ModelSources) -> list[str]:
    """Returns human-readable problems (empty when every local file a load needs is present).

    Hub ids are not checked here (they need the network); their problems surface at load.
    """
    problems: list[str] = []
    if _is_local(sources.llama):
        llama = Path(sources.llama).expanduser()
        if not llama.is_dir():
            problems.append(f"{llama}: Llama folder does not exist")
        else:
            _check_config(llama, problems)
            if not (llama / "tokenizer.json").is_file():
                problems.append(f"{llama / 'tokenizer.json'}: missing")
            _check_weights_folder(llama, "model.safetensors.index.json", "model.safetensors", problems)
    if _is_local(sources.i1):
        i1 = Path(sources.i1).expanduser()
        if not i1.is_dir():
            problems.append(f"{i1}: HiDream-I1-Full folder does not exist")
        else:
            _check_config(i1, problems, "model_index.json")
            for component in I1_COMPONENTS:
                folder = i1 / component
                if not folder.is_dir():
                    problems.append(f"{folder}: missing component folder")
                    continue
                if component == "scheduler":
                    _check_config(folder, problems, "scheduler_config.json")
                elif component.startswith("tokenizer"):
                    if not any(folder.iterdir()):
                        problems.append(f"{folder}: empty tokenizer folder")
                elif component == "transformer" or component == "vae":
                    _check_config(folder, problems)
                    _check_weights_folder(folder, "diffusion_pytorch_model.safetensors.index.json",
                                          "diffusion_pytorch_model.safetensors", problems)
                else:
                    _check_config(folder, problems)
                    _check_weights_folder(folder, "model.safetensors.index.json", "model.safetensors", problems)
    if _is_local(sources.e1):
        e1 = Path(sources.e1).expanduser()
        if sources.variant == "e1.1":
            folder = e1 / "transformer"
            if not folder.is_dir():
                problems.append(f"{folder}: HiDream-E1-1 transformer folder does not exist")
            else:
                _check_config(folder, problems)
                _check_weights_folder(folder, "diffusion_pytorch_model.safetensors.index.json",
                                      "diffusion_pytorch_model.safetensors", problems)
        else:
            path = e1 / E1_FULL_FILE if e1.is_dir() or not e1.suffix else e1
            if not path.is_file():
                problems.append(f"{path}: HiDream-E1-Full LoRA checkpoint is missing")
    return problems


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


@dataclass
class WeightSwap:
    """A second weight set for some transformer parameters, swapped in for the refine stage.

    Holds only the tensors that differ from the active set. Where the device has room the
    inactive tensors stay on the device and a swap exchanges storage pointers (zero copies);
    otherwise they live in (pinned, when the device supports it) host memory and a swap copies
    each differing tensor both ways through a temporary on the device.
    """

    params: dict[str, "torch.nn.Parameter"]
    inactive: dict[str, "torch.Tensor"]
    on_device: bool
    active: str = "edit"  # which set the parameters hold now: "edit" or "refine"
    swaps: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.inactive.values())

    def use(self, which: str) -> None:
        if which not in ("edit", "refine"):
            raise ValueError(f"weight set {which!r} must be 'edit' or 'refine'")
        if which == self.active:
            return
        import torch

        start = time.perf_counter()
        with torch.no_grad():
            for name, param in self.params.items():
                other = self.inactive[name]
                if self.on_device:
                    self.inactive[name], param.data = param.data, other
                else:
                    current = param.data.clone()
                    param.data.copy_(other, non_blocking=True)
                    other.copy_(current)
                    self.bytes_copied += 2 * param.numel() * param.element_size()
        self.active = which
        self.swaps += 1
        self.seconds += time.perf_counter() - start


@dataclass
class LoadedModel:
    pipeline: object  # HiDreamEditPipeline
    sources: ModelSources
    device: "DeviceInfo"
    dtype: "torch.dtype"
    geometry: Geometry
    refiner: str
    text_encoders: str
    swap: WeightSwap | None = None
    uses_lora: bool = False
    load_seconds: float = 0.0
    weight_bytes: int = 0
    stats: dict = field(default_factory=dict)

    def use_stage_weights(self, stage: str) -> None:
        """Puts the transformer in the state of `stage` ("edit" or "refine")."""
        transformer = self.pipeline.transformer
        if self.uses_lora:
            if stage == "edit":
                transformer.enable_adapters()
            else:
                transformer.disable_adapters()
        if self.swap is not None:
            self.swap.use(stage)


def _load_kwargs(source: str) -> dict:
    return {"local_files_only": True} if _is_local(source) else {}


def _weights_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*.safetensors")) if Path(folder).exists() else 0


def _bytes_read(sources: ModelSources, refiner: str) -> int:
    """Bytes of the weight files a load reads (local sources only; hub downloads are not counted)."""
    total = 0
    if _is_local(sources.llama):
        total += _weights_bytes(Path(sources.llama))
    if _is_local(sources.i1):
        i1 = Path(sources.i1)
        total += _weights_bytes(i1) - _weights_bytes(i1 / "transformer")
        if sources.variant == "e1-full" or refiner == "i1":
            total += _weights_bytes(i1 / "transformer")
    if _is_local(sources.e1):
        total += _weights_bytes(Path(sources.e1))
    return total


def load_model(config: AppConfig, device: "DeviceInfo", dtype: "torch.dtype",
               on_progress: ProgressFn | None = None, sources: ModelSources | None = None) -> LoadedModel:
    """Loads the pipeline for `config.variant` onto `device` in `dtype`.

    Weights go straight into `dtype` (diffusers/transformers stream the safetensors shards into
    an empty model), so a bf16 checkpoint never exists as an fp32 copy on the host.
    """
    import torch
    from diffusers import HiDreamImageTransformer2DModel
    from transformers import AutoTokenizer, LlamaModel

    from .pipeline import HiDreamEditPipeline

    progress = on_progress or (lambda fraction, message: None)
    start = time.perf_counter()
    sources = sources or resolve_sources(config)
    problems = verify_sources(sources)
    if problems:
        raise ModelError("the configured model is incomplete:\n  " + "\n  ".join(problems))

    progress(0.05, f"loading Llama text encoder from {sources.llama}")
    tokenizer_4 = AutoTokenizer.from_pretrained(sources.llama, **_load_kwargs(sources.llama))
    # LlamaModel, not LlamaForCausalLM: HiDream only reads hidden states, and the 8B LM head
    # (128k x 4096) would cost 1 GB of memory for nothing. Default attention implementation
    # (sdpa): asking for attentions at load would force the slow eager path.
    text_encoder_4 = LlamaModel.from_pretrained(sources.llama, dtype=dtype, **_load_kwargs(sources.llama))

    progress(0.35, "loading transformer")
    uses_lora = sources.variant == "e1-full"
    swap_sets: dict[str, torch.Tensor] = {}
    if sources.variant == "e1.1":
        transformer = HiDreamImageTransformer2DModel.from_pretrained(
            sources.e1, subfolder="transformer", dtype=dtype, **_load_kwargs(sources.e1))
        if config.refiner == "i1":
            progress(0.5, "loading HiDream-I1-Full transformer weights for the refine stage")
            swap_sets = _differing_tensors(transformer, Path(sources.i1) / "transformer", dtype)
    else:
        transformer = HiDreamImageTransformer2DModel.from_pretrained(
            sources.i1, subfolder="transformer", dtype=dtype, **_load_kwargs(sources.i1))
        plain_originals = _attach_e1_full(transformer, sources.e1, dtype)
        if config.refiner == "i1":
            swap_sets = plain_originals

    progress(0.65, "loading VAE, CLIP and T5 encoders")
    from diffusers.utils import logging as diffusers_logging

    # diffusers warns that text_encoder_4 is not a LlamaForCausalLM: intended (see above), so hush it.
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        pipeline = HiDreamEditPipeline.from_pretrained(
            sources.i1, transformer=transformer, tokenizer_4=tokenizer_4, text_encoder_4=text_encoder_4,
            dtype=dtype, **_load_kwargs(sources.i1))
    finally:
        diffusers_logging.set_verbosity(verbosity)
    pipeline.set_progress_bar_config(disable=True)

    tconf = dict(transformer.config)
    geometry = geometry_for(sources.variant, tconf, dict(pipeline.vae.config))
    transformer.max_seq = geometry.max_seq
    pipeline.geometry = geometry

    progress(0.8, f"moving to {device.torch_device}")
    text_device = device.torch_device if config.text_encoders == "device" else "cpu"
    for name in ("vae", "transformer"):
        getattr(pipeline, name).to(device.torch_device)
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4"):
        getattr(pipeline, name).to(text_device)
    pipeline.text_encoder_mode = config.text_encoders
    pipeline.compute_device = device.torch_device

    swap = None
    if swap_sets:
        swap = _make_swap(transformer, swap_sets, device)
    for module in pipeline.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval().requires_grad_(False)
    weight_bytes = _bytes_read(sources, config.refiner)
    loaded = LoadedModel(
        pipeline=pipeline, sources=sources, device=device, dtype=dtype, geometry=geometry,
        refiner=config.refiner, text_encoders=config.text_encoders, swap=swap, uses_lora=uses_lora,
        load_seconds=time.perf_counter() - start, weight_bytes=weight_bytes,
    )
    progress(1.0, f"model ready in {loaded.load_seconds:.1f} s")
    return loaded


def _attach_e1_full(transformer, e1_source: str, dtype) -> dict:
    """Adds the E1-Full LoRA to the I1 transformer; returns owned copies of the overwritten plain keys."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import load_file

    path = Path(e1_source)
    if path.is_dir():
        path = path / E1_FULL_FILE
    if not path.is_file():
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(repo_id=e1_source, filename=E1_FULL_FILE))
    transformer.add_adapter(LoraConfig(
        r=E1_FULL_LORA_RANK, lora_alpha=E1_FULL_LORA_RANK, lora_dropout=0.0,
        target_modules=list(E1_FULL_LORA_TARGETS), init_lora_weights="gaussian"))
    state = load_file(str(path))
    own = transformer.state_dict(keep_vars=True)
    unexpected = sorted(k for k in state if k not in own)
    if unexpected:
        raise ModelError(f"{path}: {len(unexpected)} keys do not fit the I1 transformer, e.g. {unexpected[:3]}")
    originals = {}
    with torch.no_grad():
        for key, value in state.items():
            target = own[key]
            if "lora" not in key:
                # `.clone()`: state_dict() aliases the parameter, and we are about to overwrite it.
                originals[key] = target.detach().clone()
            target.data.copy_(value.to(dtype=target.dtype))
    return originals


def _differing_tensors(transformer, folder: Path, dtype) -> dict:
    """Reads another weight set shard by shard, keeping only tensors that differ from the active ones."""
    import torch
    from safetensors import safe_open

    params = dict(transformer.named_parameters())
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    else:
        shards = ["diffusion_pytorch_model.safetensors"]
    kept = {}
    for shard in shards:
        with safe_open(str(folder / shard), framework="pt") as handle:
            for key in handle.keys():
                if key not in params:
                    continue
                value = handle.get_tensor(key).to(dtype)
                if not torch.equal(value, params[key].detach().to("cpu")):
                    kept[key] = value
    return kept


def _make_swap(transformer, tensors: dict, device: "DeviceInfo") -> WeightSwap:

    params = dict(transformer.named_parameters())
    # LoRA-wrapped modules rename "x.weight" to "x.base_layer.weight" in named_parameters.
    resolved = {}
    for key in tensors:
        name = key if key in params else key.replace(".weight", ".base_layer.weight").replace(
            ".bias", ".base_layer.bias")
        if name not in params:
            raise ModelError(f"refine weight {key!r} has no parameter in the transformer")
        resolved[key] = name
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    on_device = device.type == "cpu" or _fits_on_device(device, total)
    inactive = {}
    for key, tensor in tensors.items():
        if on_device:
            inactive[resolved[key]] = tensor.to(device.torch_device)
        else:
            inactive[resolved[key]] = tensor.pin_memory() if device.type in ("cuda", "npu") else tensor
    return WeightSwap(params={resolved[k]: params[resolved[k]] for k in tensors}, inactive=inactive,
                      on_device=on_device)


def _fits_on_device(device: "DeviceInfo", nbytes: int) -> bool:
    from .memory import snapshot

    free = snapshot(device).free
    # Keep a quarter of the free memory for activations: an edit at 1024^2 needs several GB.
    return free is not None and nbytes < 0.75 * free
