"""The `full` profile's parts: every model at the release's dimensions (profiles.RELEASE_CONFIGS) with
random weights made in memory, never written to disk (~61 GB in bf16). For measurements on machines
large enough (`bench memory --profile full --device cuda`).

Each part's config is the tiny build's config.json (special token ids, activations, rope scaling:
everything the tiny tokenizers and scheduler agree with) with the release's dimensions laid over it.
Weights are drawn one tensor at a time straight into their storage dtype (fp8 for the transformer
layers an fp8 plan stores that way), on the device when the plan keeps the part resident there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from hidream_ui.model.fp8 import STORAGE_DTYPE_NAME, fp8_parameter_names
from hidream_ui.model.tiny import profiles

if TYPE_CHECKING:  # pragma: no cover
    import torch

# pipeline component -> (part in RELEASE_CONFIGS, folder of its config in the tiny build, relative to the I1 folder;
# None: the Llama folder)
_PARTS = {
    "text_encoder": ("clip_l", "text_encoder"),
    "text_encoder_2": ("clip_g", "text_encoder_2"),
    "text_encoder_3": ("t5", "text_encoder_3"),
    "text_encoder_4": ("llama", None),
    "vae": ("vae", "vae"),
    "transformer": ("transformer", "transformer"),
}


def _merged(folder: Path, dims: Mapping[str, Any]) -> dict[str, Any]:
    """The tiny config with the release's dimensions over it (the planner reads the same merge)."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config.update(dims)
    return config


def instantiate(part: str, config: Mapping[str, Any]):
    """One part (a RELEASE_CONFIGS key) from its config, on whatever device context the caller set (`meta`
    for the planner, empty weights here). The one home of "which class is each part"."""
    from diffusers import AutoencoderKL, HiDreamImageTransformer2DModel
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        LlamaConfig,
        LlamaModel,
        T5Config,
        T5EncoderModel,
    )

    public = {k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"}
    if part == "transformer":
        return HiDreamImageTransformer2DModel.from_config(public)
    if part == "vae":
        return AutoencoderKL.from_config(public)
    if part == "llama":
        return LlamaModel(LlamaConfig.from_dict(public))
    if part == "t5":
        return T5EncoderModel(T5Config.from_dict(public))
    return CLIPTextModelWithProjection(CLIPTextConfig.from_dict(public))


def _fill(module, dtype: "torch.dtype", device: str, seed: int, low: set[str], low_dtype) -> None:
    """Replaces every meta parameter with random values made on `device` in its storage dtype."""
    import torch
    from accelerate.utils import set_module_tensor_to_device

    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in list(module.named_parameters()):
        shape = tuple(param.shape)
        value = torch.empty(shape, dtype=dtype, device=device)
        if len(shape) == 1:
            value.normal_(1.0 if not name.endswith("bias") else 0.0, 0.02, generator=generator)
        else:
            fan_in = 1
            for size in shape[1:]:
                fan_in *= size
            value.normal_(0.0, fan_in**-0.5, generator=generator)
        if name in low:
            value = value.to(low_dtype)
        set_module_tensor_to_device(module, name, device, value=value, dtype=value.dtype)
    for name, buffer in list(module.named_buffers()):
        if buffer.device.type == "meta":
            raise RuntimeError(f"{type(module).__name__}.{name}: buffer left on meta")


def release_parts(
    llama_folder: Path, i1_folder: Path, dtype: "torch.dtype", *, fp8: bool, seed: int, placement: Mapping[str, str]
) -> dict[str, Any]:
    """The six models at the release's dimensions, keyed by pipeline component. `placement[component]`
    is where each is made ("cpu" or the device)."""
    import torch
    from accelerate import init_empty_weights

    parts = {}
    for offset, (component, (part, folder)) in enumerate(_PARTS.items()):
        config_folder = llama_folder if folder is None else i1_folder / folder
        config = _merged(config_folder, profiles.RELEASE_CONFIGS[part])
        with init_empty_weights(include_buffers=False):
            module = instantiate(part, config)
        low = fp8_parameter_names(module) if fp8 and component == "transformer" else set()
        _fill(module, dtype, placement.get(component, "cpu"), seed + offset, low, getattr(torch, STORAGE_DTYPE_NAME))
        parts[component] = module.eval().requires_grad_(False)
    return parts


__all__ = ["instantiate", "release_parts"]
