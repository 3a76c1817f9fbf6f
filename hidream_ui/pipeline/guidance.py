"""Guidance arithmetic and stage scheduling of HiDream-E1 editing (pure tensor maths, no model)."""

from __future__ import annotations

import torch


def combine_edit_guidance(
    u: torch.Tensor,
    ic: torch.Tensor,
    fc: torch.Tensor,
    guidance_scale: float,
    image_guidance_scale: float,
    clip_cfg_norm: bool,
) -> torch.Tensor:
    """Editing-stage guidance from the unconditional, image-conditioned and fully conditioned predictions."""
    if clip_cfg_norm:
        text_guided = ic + guidance_scale * (fc - ic)
        # Rescale so the text-guided prediction is never longer (per pixel, over channels) than fc.
        ratio = fc.norm(dim=1, keepdim=True) / (text_guided.norm(dim=1, keepdim=True) + 1e-8)
        text_guided = text_guided * ratio.clamp(0, 1)
        return u + image_guidance_scale * (text_guided - u)
    return u + image_guidance_scale * (ic - u) + guidance_scale * (fc - ic)


def combine_refine_guidance(u: torch.Tensor, c: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    return u + guidance_scale * (c - u)


def refine_start_step(num_inference_steps: int, refine_strength: float) -> int:
    """First step of the refine stage (== num_inference_steps when there is none)."""
    return int(num_inference_steps * (1.0 - refine_strength))
