"""The VAE of a run: trained on world images (with an optional locality loss), or taken from an earlier run's
asset folder, and its latent shift and scale."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from hidream_ui.lab import world
from hidream_ui.lab.scoring import pixels
from hidream_ui.lab.train.data import Seeds
from hidream_ui.lab.train.schedule import set_lr
from hidream_ui.lab.train.settings import TrainSettings
from hidream_ui.model.layout import I1_DIR
from hidream_ui.model.tiny import trained


def train_vae(base: Path, settings: TrainSettings, seeds: Seeds, log):
    import torch
    from diffusers import AutoencoderKL

    config = dict(AutoencoderKL.load_config(base / I1_DIR / "vae"))
    torch.manual_seed(settings.seed)
    vae = AutoencoderKL.from_config(config).float().train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=settings.vae_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(settings.seed + 1)
    loss_value = float("nan")
    started = time.perf_counter()
    for step in range(settings.vae_steps):
        set_lr(optimizer, settings.vae_lr, step, settings.vae_steps, settings.warmup)
        images = []
        while len(images) < settings.vae_batch:
            case = world.make_case(seeds.next())
            images += [case.source, case.target]
        x = pixels(images[: settings.vae_batch], torch)
        z = vae.encode(x).latent_dist.mode()
        locality = None  # the locality loss of this batch, when weighed
        if settings.vae_locality:
            still = torch.from_numpy(still_cells(images[: settings.vae_batch], z.shape[-2:]))
            locality = locality_loss(z, still)
        # Small latent noise: the decoder must also read the transformer's slightly-off latents.
        noisy = z + 0.05 * z.detach().std() * torch.randn(z.shape, generator=generator)
        y = vae.decode(noisy).sample
        loss = torch.nn.functional.mse_loss(y, x) + 1e-4 * z.pow(2).mean()
        if locality is not None:
            loss = loss + settings.vae_locality * locality
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        loss_value = float(loss.detach())
        if step % settings.log_every == 0 or step == settings.vae_steps - 1:
            psnr = 10 * math.log10(4.0 / max(float(torch.nn.functional.mse_loss(y.detach(), x)), 1e-12))
            still_change = "" if locality is None else f" still-cell change {float(locality.detach()):.4f}"
            log(
                f"vae step {step + 1}/{settings.vae_steps} loss {loss_value:.5f} psnr {psnr:.1f} dB{still_change} "
                f"({time.perf_counter() - started:.0f} s)"
            )
    return vae.eval().requires_grad_(False), loss_value


def still_cells(images: list, grid: tuple[int, int]) -> np.ndarray:
    """(pairs, rows, columns) bool: for each (source, target) pair of `images` (sources at even, targets at odd
    positions, (128, 128, 3) arrays), the latent cells of a `grid` (the latents' rows and columns) in which no
    pixel differs between the two."""
    rows, columns = grid
    pairs = len(images) // 2
    return np.array(
        [~world.moved_cells(images[2 * k], images[2 * k + 1], rows, columns) for k in range(pairs)], dtype=bool
    ).reshape(pairs, rows, columns)


def locality_loss(z, still):
    """Mean squared latent change between each pair's source (z[2k]) and target (z[2k + 1]) over the cells
    `still` marks (still_cells), in units of the batch's latent variance (so the encoder cannot escape it by
    shrinking its latents); 0 where no cell is still."""
    pairs = still.shape[0]
    change = (z[0 : 2 * pairs : 2] - z[1 : 2 * pairs : 2]).pow(2).mean(dim=1) / z.detach().var().clamp_min(1e-8)
    mask = still.to(change.dtype)
    return (change * mask).sum() / mask.sum().clamp_min(1.0)


def latent_stats(vae, seeds: Seeds, torch) -> tuple[float, float]:
    images = []
    while len(images) < 64:
        case = world.make_case(seeds.next())
        images += [case.source, case.target]
    with torch.no_grad():
        z = vae.encode(pixels(images, torch)).latent_dist.mode()
    shift = float(z.mean())
    return shift, 1.0 / max(float(z.std()), 1e-6)


def load_vae(base: Path, source: Path):
    """(vae, its final loss, latent shift, latent scale) from an asset folder a run wrote."""
    from diffusers import AutoencoderKL
    from safetensors.torch import load_file

    meta = trained.read_meta(source)
    vae = AutoencoderKL.from_config(dict(AutoencoderKL.load_config(base / I1_DIR / "vae"))).float()
    tensors = load_file(str(source / trained.WEIGHTS_FILE))
    vae.load_state_dict({k[len("vae/") :]: v.float() for k, v in tensors.items() if k.startswith("vae/")})
    stats = meta["vae"]
    return (
        vae.eval().requires_grad_(False),
        float(meta.get("final_vae_loss", float("nan"))),
        float(stats["shift_factor"]),
        float(stats["scaling_factor"]),
    )
