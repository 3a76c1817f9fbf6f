"""Region edits: keep the source outside a mask (white = may change, black = keep).

Two parts, because neither alone keeps the source:

1. In latent space, at every denoising step (the pipeline's loop): outside the mask the latent is
   replaced by the source latent noised to the step's sigma with the *starting* noise of the edit
   (flow matching: x_t = (1 - sigma) * x0 + sigma * noise). The transformer then sees a consistent
   picture (the kept part is where the source would be at that noise level), so the edited region
   is made to fit around it; the same noise keeps a seed reproducible. At the last step sigma is 0
   and the kept latents equal the source's.
2. In pixels, after the result is back at the source size (`composite`): the VAE's round trip and
   the resize back to the source size would still touch every pixel, so the source is pasted
   over the edit outside the mask with a feathered edge. Beyond the feather the result's pixels are
   the source's own.

Without a mask none of this runs: the pipeline's arithmetic is the same as before, bit for bit.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from PIL import Image, ImageFilter

__all__ = ["latent_mask", "keep_outside", "feather_px", "composite", "mask_at"]


def mask_at(mask: Image.Image, size: tuple[int, int]) -> Image.Image:
    """The binary ("L", 0 / 255) mask stretched to `size` (its aspect is the source's: checked in edits.py)."""
    if mask.size == size:
        return mask
    return mask.resize(size, resample=Image.Resampling.BILINEAR).point(lambda v: 255 if v >= 128 else 0)


def latent_mask(masks: Sequence[Image.Image | None], latent_size: tuple[int, int], device, dtype) -> torch.Tensor:
    """(B, 1, h, w) with 1 where the latent may change, 0 where it keeps the source. `masks` are at the
    working size (None: all may change). A latent cell any part of which may change may change: the
    edit gets the whole cell at the mask's edge, and the pixel composite draws the exact line."""
    height, width = latent_size
    planes = []
    for mask in masks:
        if mask is None:
            planes.append(np.ones((height, width), dtype=np.float32))
            continue
        # BOX resampling averages each cell's pixels: > 0 means part of the cell is white.
        cells = np.asarray(mask.convert("L").resize((width, height), resample=Image.Resampling.BOX), dtype=np.float32)
        planes.append((cells > 0).astype(np.float32))
    return torch.from_numpy(np.stack(planes)[:, None]).to(device=device, dtype=dtype)


def keep_outside(
    latents: torch.Tensor, mask: torch.Tensor, source: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor | float
) -> torch.Tensor:
    """`latents` inside the mask, the source noised to `sigma` with `noise` outside it."""
    sigma = torch.as_tensor(sigma, device=latents.device, dtype=latents.dtype)
    kept = (1 - sigma) * source + sigma * noise
    return mask * latents + (1 - mask) * kept


def feather_px(source_size: tuple[int, int], working_size: tuple[int, int], vae_scale: int) -> int:
    """The feather of the pixel composite, in source pixels: one latent cell (the resolution the mask
    acted at in the latents) at the source's scale, at least 4 px, even (two box passes of half)."""
    scale = max(source_size[0] / working_size[0], source_size[1] / working_size[1])
    width = max(4, math.ceil(vae_scale * scale))
    return width + (width % 2)


def composite(edited: Image.Image, source: Image.Image, mask: Image.Image, feather: int) -> Image.Image:
    """`edited` inside the mask, `source` outside, blended over a `feather`-pixel band on each side of
    the mask's edge (two box blurs of radius feather / 2: a weight reaches exactly `feather` px past
    the edge, so pixels farther out are the source's own, bit for bit)."""
    if edited.size != source.size:
        raise ValueError(f"composite: the edit is {edited.size}, the source {source.size}; expected one size")
    binary = mask_at(mask, source.size)
    radius = feather // 2
    soft = binary
    if radius > 0:
        for _ in range(2):
            soft = soft.filter(ImageFilter.BoxBlur(radius))
    weight = np.asarray(soft, dtype=np.float32)[..., None] / 255.0
    src = np.asarray(source.convert("RGB"), dtype=np.float32)
    out = np.asarray(edited.convert("RGB"), dtype=np.float32)
    blended = src + weight * (out - src)  # weight 0: src exactly
    return Image.fromarray(np.clip(np.rint(blended), 0, 255).astype(np.uint8), mode="RGB")
