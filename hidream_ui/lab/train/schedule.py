"""Noise levels and learning rates of a run: the scheduler's shifted flow levels, the edit stage's draws, the
warm-up and cosine decay."""

from __future__ import annotations

import math

from hidream_ui.lab.train.settings import TrainSettings

FLOW_SHIFT = 3.0  # the scheduler's flow_shift (parts._scheduler_config)


# Highest refine-stage noise level trained: at 4 steps with refine strength 0.3 the refine stage starts at 0.75.
REFINE_MAX_SIGMA = 0.8


def shifted_sigma(u):
    """The scheduler's shifted noise level for a uniform draw (flow_shift 3: most steps at high noise)."""
    return FLOW_SHIFT * u / (1 + (FLOW_SHIFT - 1) * u)


def unshift(sigma: float) -> float:
    """The uniform draw whose shifted noise level is `sigma` (inverse of shifted_sigma)."""
    return sigma / (FLOW_SHIFT - (FLOW_SHIFT - 1) * sigma)


def edit_sigmas(settings: TrainSettings, rand):
    """Edit-stage noise levels of one batch: a share uniform, the rest through the schedule's shift, then
    squeezed into [edit_noise_min, 1] (with the default 0 exactly the draws, so earlier runs reproduce)."""
    import torch

    u = rand(settings.batch)
    sigma = torch.where(rand(settings.batch) < settings.uniform_share, u, shifted_sigma(u))
    if settings.edit_noise_min:
        sigma = settings.edit_noise_min + (1 - settings.edit_noise_min) * sigma
    return sigma


def set_lr(optimizer, peak: float, step: int, total: int, warmup: int) -> None:
    """Linear warm-up, then cosine down to a tenth of the peak."""
    if step < warmup:
        lr = peak * (step + 1) / warmup
    else:
        progress = (step - warmup) / max(1, total - warmup)
        lr = peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
    for group in optimizer.param_groups:
        group["lr"] = lr
