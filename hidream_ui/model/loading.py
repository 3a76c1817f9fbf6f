"""Loading the pipeline onto a device: streamed into the target dtype, E1-Full's LoRA attached, the
refine stage's weight sets.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from hidream_ui.device import memory as device_memory  # device_memory.snapshot: looked up per call
from hidream_ui.device.pool_spec import placement_for
from hidream_ui.model.fp8 import apply_fp8, load_streamed, weight_files
from hidream_ui.model.geometry import Geometry, geometry_for
from hidream_ui.model.layout import E1_FULL_FILE, e1_full_lora_config
from hidream_ui.model.plans import TEXT_ENCODERS, MemoryPlan, apply_plan
from hidream_ui.model.settings import ModelSettings
from hidream_ui.model.sources import ModelError, ModelSources, _is_local, resolve_sources, verify_sources
from hidream_ui.model.tiny.profiles import FULL_PROFILE_NAME

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from hidream_ui.device.backends import DeviceInfo
    from hidream_ui.model.plans import MemoryPlan
    from hidream_ui.pipeline.edit_pipeline import HiDreamEditPipeline  # lazy, like torch above: planning needs neither


ProgressFn = Callable[[float, str], None]  # (fraction 0..1, message) while loading


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
    pipeline: "HiDreamEditPipeline"
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
    plan: "MemoryPlan | None" = None  # the memory plan the model was placed with

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


# transformers / diffusers build models under process-global patches (meta-device init swaps
# nn.Module's parameter registration; torch's default dtype is set to the load dtype and restored
# after), so two builds in two threads corrupt each other ("Cannot copy out of meta tensor", or a
# default dtype left at bf16 for the whole process). Every model build holds this lock: loads (an
# engine pool loads its engines one after the other, in the background, the first serving as soon
# as it is ready) and the planner's meta-device builds (model/planner.py). Reentrant: the `full`
# profile's in-memory build runs inside a load.
BUILD_LOCK = threading.RLock()


def _under_build_lock(load):
    """One load at a time per process (BUILD_LOCK)."""

    @functools.wraps(load)
    def locked(*args, **kwargs):
        with BUILD_LOCK:
            return load(*args, **kwargs)

    return locked


@_under_build_lock
def load_model(
    config: ModelSettings,
    device: "DeviceInfo",
    dtype: "torch.dtype",
    on_progress: ProgressFn | None = None,
    sources: ModelSources | None = None,
    plan: "MemoryPlan | None" = None,
) -> LoadedModel:
    """Loads the pipeline for `config.variant` onto `device` in `dtype`, placed by `plan` (the
    memory plan; None: everything resident in bf16 storage, i.e. `full`) and `--placement`; one load
    at a time per process.

    Weights go straight into `dtype` (diffusers/transformers stream the safetensors shards into
    an empty model), so a bf16 checkpoint never exists as an fp32 copy on the host; an fp8 plan's
    transformer is streamed tensor by tensor straight into fp8 (model/fp8.py).
    """
    plan = plan or MemoryPlan(name="full", weights="bf16", requested="full", requested_weights="bf16")
    fp8 = plan.weights == "fp8"
    import torch
    from transformers import AutoTokenizer, LlamaModel

    from hidream_ui.pipeline.edit_pipeline import HiDreamEditPipeline  # lazy, like torch above: planning needs neither

    # diffusers has no variable of its own for its tqdm bars: the hub's stands for them too (the CLI's
    # quiet default sets it, cli/quiet.py; a user may set it for the app).
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().lower() in ("1", "true", "yes", "on"):
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()

    progress = on_progress or (lambda fraction, message: None)
    start = time.perf_counter()
    sources = sources or resolve_sources(config)
    problems = verify_sources(sources)
    if problems:
        raise ModelError("the configured model is incomplete:\n  " + "\n  ".join(problems))

    progress(0.05, f"loading Llama text encoder from {sources.llama}")
    tokenizer_4 = AutoTokenizer.from_pretrained(sources.llama, **_load_kwargs(sources.llama))
    if sources.tiny_profile == FULL_PROFILE_NAME:
        text_encoder_4 = None  # made in memory with the other parts below
    else:
        # LlamaModel, not LlamaForCausalLM: HiDream only reads hidden states, and the 8B LM head
        # (128k x 4096) would cost 1 GB of memory for nothing. Default attention implementation
        # (sdpa): asking for attentions at load would force the slow eager path.
        text_encoder_4 = LlamaModel.from_pretrained(sources.llama, dtype=dtype, **_load_kwargs(sources.llama))

    progress(0.35, "loading transformer")
    uses_lora = sources.variant == "e1-full"
    swap_sets: dict[str, torch.Tensor] = {}
    made: dict = {}  # components made in memory (the full profile), passed to the pipeline as they are
    if sources.tiny_profile == FULL_PROFILE_NAME:
        made = _release_parts(config, sources, plan, device, dtype)
        text_encoder_4 = made.pop("text_encoder_4")
        transformer = made.pop("transformer")
    elif sources.variant == "e1.1":
        transformer = _load_transformer(
            Path(sources.e1) if _is_local(sources.e1) else sources.e1, dtype, fp8, config.transformer_file
        )
        if config.refiner == "i1":
            progress(0.5, "loading HiDream-I1-Full transformer weights for the refine stage")
            swap_sets = _differing_tensors(transformer, Path(sources.i1) / "transformer", dtype)
        elif _is_local(sources.e1) and config.transformer_file is None:
            _attach_mag_ratios(transformer, Path(sources.e1) / "transformer")
    else:
        transformer = _load_transformer(Path(sources.i1) if _is_local(sources.i1) else sources.i1, dtype, fp8, None)
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
            sources.i1,
            transformer=transformer,
            tokenizer_4=tokenizer_4,
            text_encoder_4=text_encoder_4,
            dtype=dtype,
            **made,
            **_load_kwargs(sources.i1),
        )
    finally:
        diffusers_logging.set_verbosity(verbosity)
    pipeline.set_progress_bar_config(disable=True)

    tconf = dict(transformer.config)
    geometry = geometry_for(sources.variant, tconf, dict(pipeline.vae.config))
    transformer.max_seq = geometry.max_seq
    pipeline.geometry = geometry

    progress(0.8, f"placing the model on {device.torch_device}: memory plan {plan.label}")
    if fp8:
        apply_fp8(transformer, dtype)  # diffusers wants layerwise casting installed before group offloading
    apply_plan(
        pipeline,
        plan,
        device,
        placement_for(config.placement, device.torch_device, "device"),
        encoders_placed="encoders" in dict(config.placement),
    )

    swap = None
    if swap_sets:
        swap = _make_swap(transformer, swap_sets, device)
    for module in pipeline.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval().requires_grad_(False)
    weight_bytes = _bytes_read(sources, config.refiner)
    loaded = LoadedModel(
        pipeline=pipeline,
        sources=sources,
        device=device,
        dtype=dtype,
        geometry=geometry,
        refiner=config.refiner,
        text_encoders=pipeline.text_encoder_mode,
        swap=swap,
        uses_lora=uses_lora,
        load_seconds=time.perf_counter() - start,
        weight_bytes=weight_bytes,
        plan=plan,
    )
    progress(1.0, f"model ready in {loaded.load_seconds:.1f} s")
    return loaded


def _release_parts(
    config: ModelSettings, sources: ModelSources, plan: "MemoryPlan", device: "DeviceInfo", dtype
) -> dict:
    """The full profile: every part at the release's dimensions, random weights made in memory."""
    from hidream_ui.model.tiny.in_memory import release_parts  # looked up per call: tests replace it

    if sources.variant != "e1.1" or config.refiner != "e1" or config.transformer_file is not None:
        raise ModelError(
            "--tiny-profile full makes E1.1 in memory only: it has no E1-Full LoRA file, no second "
            "weight set for --refiner i1 and no --transformer-file"
        )
    spec = plan.spec
    where = {
        "transformer": spec.transformer == "resident",
        "vae": True,
        **{name: spec.encoders == "resident" for name in TEXT_ENCODERS},
    }
    placement = {name: device.torch_device if resident else "cpu" for name, resident in where.items()}
    # Parts --placement puts on another card are made there, not on the engine's device (the planner counted
    # them there: making them here first would need the very memory the split saves).
    placed = placement_for(config.placement, device.torch_device, "device")
    placement["vae"] = placed.vae
    if "encoders" in dict(config.placement):
        placement.update({name: placed.encoders for name in TEXT_ENCODERS})
    return release_parts(
        Path(sources.llama),
        Path(sources.i1),
        dtype,
        fp8=plan.weights == "fp8",
        seed=config.tiny_seed,
        placement=placement,
    )


def _load_transformer(root, dtype, fp8: bool, single_file: Path | None):
    """The transformer from `root`/transformer (a local folder or a hub id), or from `single_file` (its
    config still from `root`): bf16 through diffusers' loaders, fp8 streamed tensor by tensor."""
    from diffusers import HiDreamImageTransformer2DModel

    if not fp8:
        if single_file is not None:
            return HiDreamImageTransformer2DModel.from_single_file(
                str(single_file), config=str(root), subfolder="transformer", dtype=dtype, **_load_kwargs(str(root))
            )
        return HiDreamImageTransformer2DModel.from_pretrained(
            root, subfolder="transformer", dtype=dtype, **_load_kwargs(str(root))
        )
    if not isinstance(root, Path):
        raise ModelError(
            f"--weights fp8 streams local weight files; {root!r} is a hub id: download it and give --model-dir"
        )
    folder = root / "transformer"
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return load_streamed(config, weight_files(single_file or folder), dtype, fp8=True)


def _attach_mag_ratios(transformer, folder: Path) -> None:
    """The checkpoint's MagCache calibration, when its folder has one (pipeline/speed/mag_ratios.py). Only for
    E1.1 with its own weights in both stages: another refine weight set or file would have other ratios."""
    from hidream_ui.pipeline.speed import mag_ratios

    try:
        ratios = mag_ratios.read(folder)
    except ValueError as error:
        raise ModelError(str(error)) from error
    if ratios is not None:
        setattr(transformer, mag_ratios.ATTRIBUTE, ratios)


def _attach_e1_full(transformer, e1_source: str, dtype) -> dict:
    """Adds the E1-Full LoRA to the I1 transformer; returns owned copies of the overwritten plain keys."""
    import torch
    from safetensors.torch import load_file

    path = Path(e1_source)
    if path.is_dir():
        path = path / E1_FULL_FILE
    if not path.is_file():
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(repo_id=e1_source, filename=E1_FULL_FILE))
    transformer.add_adapter(e1_full_lora_config())
    # peft makes adapter weights in the base layer's dtype: under fp8 storage that would be float8. The LoRA
    # stays in the compute dtype (fp8 skips it); a no-op when the base layers are in `dtype` already.
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_" in name and param.dtype != dtype:
                param.data = param.data.to(dtype)
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
                # The parameter's own dtype: float8 for the fp8-stored linears of an fp8 plan.
                value = handle.get_tensor(key).to(params[key].dtype)
                if not torch.equal(value, params[key].detach().to("cpu")):
                    kept[key] = value
    return kept


def _make_swap(transformer, tensors: dict, device: "DeviceInfo") -> WeightSwap:
    params = dict(transformer.named_parameters())
    # LoRA-wrapped modules rename "x.weight" to "x.base_layer.weight" in named_parameters.
    resolved = {}
    for key in tensors:
        name = (
            key if key in params else key.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        )
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
    return WeightSwap(
        params={resolved[k]: params[resolved[k]] for k in tensors}, inactive=inactive, on_device=on_device
    )


def _fits_on_device(device: "DeviceInfo", nbytes: int) -> bool:
    free = device_memory.snapshot(device).free
    # Keep a quarter of the free memory for activations: an edit at 1024^2 needs several GB.
    return free is not None and nbytes < 0.75 * free
