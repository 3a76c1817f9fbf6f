"""Live previews: a cheap latent -> RGB picture of what a denoising step predicts.

Decoding with the VAE every few steps would cost about as much as a step on the real model, so
the preview is a linear map (16 latent channels -> RGB, plus a bias) fitted once per loaded model
(on the first edit that shows previews) to that model's own VAE: a few synthetic pictures (colour
fields, gradients, blocks) are encoded and each latent cell is matched, by least squares, with the
mean colour of the pixels it covers.
A preview is then one small matrix product on the device at the latent's resolution (1/8 of the
image's side) and one copy of a few KB to the host.

What is previewed is the step's estimate of the clean image (x0 = x_t - sigma * v, the pipeline's
"x0"), not the noisy latent: from the first steps on it shows the layout of the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

__all__ = ["LatentToRGB", "fit_latent_rgb", "fit_pictures"]

FIT_SIDE = 128  # pixels per side of the fitting pictures (any multiple of 16 works): 256 latent cells each
FIT_PICTURES = 6


@dataclass(frozen=True)
class LatentToRGB:
    """rgb = latent . weight + bias, per latent cell, in [0, 1]; `residual`: the fit's RMS error (0..1)."""

    weight: torch.Tensor  # (C, 3) float32
    bias: torch.Tensor  # (3,) float32
    residual: float

    def to(self, device) -> "LatentToRGB":
        return LatentToRGB(self.weight.to(device), self.bias.to(device), self.residual)

    @torch.no_grad()
    def image(self, latent: torch.Tensor) -> Image.Image:
        """The picture of one latent (C, h, w) (pipeline space: shifted and scaled), h x w pixels."""
        weight, bias = self.weight.to(latent.device), self.bias.to(latent.device)
        rgb = torch.einsum("chw,ck->hwk", latent.float(), weight) + bias
        pixels = (rgb.clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
        return Image.fromarray(pixels, mode="RGB")


def fit_pictures(count: int = FIT_PICTURES, side: int = FIT_SIDE, seed: int = 0) -> list[Image.Image]:
    """Synthetic pictures that span the colours and edges a preview has to show: per picture a
    gradient between two random colours under random coloured blocks."""
    rng = np.random.default_rng(seed)
    pictures = []
    ramp = np.linspace(0.0, 1.0, side, dtype=np.float32)
    for index in range(count):
        a, b = rng.random(3, dtype=np.float32), rng.random(3, dtype=np.float32)
        t = ramp[None, :, None] if index % 2 else ramp[:, None, None]
        pixels = np.broadcast_to(a * (1 - t) + b * t, (side, side, 3)).copy()
        for _ in range(int(rng.integers(3, 9))):
            x0, y0 = (int(v) for v in rng.integers(0, side - 16, 2))
            w, h = (int(v) for v in rng.integers(16, side // 2, 2))
            pixels[y0 : y0 + h, x0 : x0 + w] = rng.random(3, dtype=np.float32)
        pictures.append(Image.fromarray((pixels * 255).round().astype(np.uint8), mode="RGB"))
    return pictures


@torch.no_grad()
def fit_latent_rgb(pipe, pictures: list[Image.Image] | None = None) -> LatentToRGB:
    """Fits the map to `pipe`'s VAE (one batched encode of `pictures`, default `fit_pictures()`)."""
    pictures = pictures or fit_pictures()
    side_w, side_h = pictures[0].size
    vae = pipe.vae
    pixels = pipe.image_processor.preprocess(pictures, height=side_h, width=side_w)
    pixels = pixels.to(device=vae.device, dtype=vae.dtype)
    latents = vae.encode(pixels).latent_dist.mode()
    latents = ((latents - vae.config.shift_factor) * vae.config.scaling_factor).float().cpu()  # (N, C, h, w)
    n, channels, h, w = latents.shape
    # Each latent cell's target: the mean colour of the pixels it covers, in [0, 1].
    target = torch.stack([torch.from_numpy(np.asarray(p, dtype=np.float32) / 255.0) for p in pictures])  # N,H,W,3
    target = torch.nn.functional.adaptive_avg_pool2d(target.permute(0, 3, 1, 2), (h, w))  # N,3,h,w
    x = latents.permute(0, 2, 3, 1).reshape(-1, channels)
    y = target.permute(0, 2, 3, 1).reshape(-1, 3)
    design = torch.cat([x, torch.ones(x.shape[0], 1)], dim=1).double()
    solution = torch.linalg.lstsq(design, y.double()).solution.float()  # (C + 1, 3)
    residual = float(((design.float() @ solution - y) ** 2).mean().sqrt())
    return LatentToRGB(weight=solution[:channels].contiguous(), bias=solution[channels].contiguous(), residual=residual)
