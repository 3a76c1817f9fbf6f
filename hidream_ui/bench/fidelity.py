"""Fidelity of an output to a reference output (a fast mode's edit against exact's edit of the same case):
PSNR and SSIM over the whole image or over a region. numpy only, on the world's 128 px canvases.

SSIM is Wang et al. (2004) as the field computes it (scikit-image's `structural_similarity(...,
gaussian_weights=True, sigma=1.5, use_sample_covariance=False)`): an 11-tap Gaussian window (sigma 1.5) over
each RGB channel, K1 = 0.01, K2 = 0.03, L = 255; the SSIM map is averaged over the channels and over the
pixels of the region (edges reflected, so the map covers every pixel and a region can be any mask).
"""

from __future__ import annotations

import math

import numpy as np

# PSNR of identical pixels is infinite; JSON has no infinity, and a median needs a number: cap it.
PSNR_CAP_DB = 100.0
SSIM_SIGMA = 1.5
SSIM_RADIUS = 5  # 11 taps
_C1 = (0.01 * 255) ** 2
_C2 = (0.03 * 255) ** 2


def psnr_db(a: np.ndarray, b: np.ndarray, mask: np.ndarray | None = None) -> float:
    """PSNR in dB of two uint8 images over `mask` (all pixels when None), capped at PSNR_CAP_DB (identical
    pixels, or an empty mask, give the cap)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a64.shape != b64.shape:
        raise ValueError(f"images differ in shape: {a64.shape} and {b64.shape}")
    diff = a64 - b64 if mask is None else (a64 - b64)[np.asarray(mask, bool)]
    if diff.size == 0:
        return PSNR_CAP_DB
    mse = float(np.mean(diff * diff))
    return PSNR_CAP_DB if mse == 0 else min(PSNR_CAP_DB, 10 * math.log10(255.0**2 / mse))


def _gaussian_blur(x: np.ndarray) -> np.ndarray:
    """Separable Gaussian filter over the two image axes of an (H, W, C) float array, edges reflected."""
    taps = np.exp(-0.5 * (np.arange(-SSIM_RADIUS, SSIM_RADIUS + 1) / SSIM_SIGMA) ** 2)
    taps /= taps.sum()
    r = SSIM_RADIUS
    padded = np.pad(x, ((r, r), (r, r), (0, 0)), mode="reflect")
    rows = sum(w * padded[i : i + x.shape[0], :, :] for i, w in enumerate(taps))
    return sum(w * rows[:, i : i + x.shape[1], :] for i, w in enumerate(taps))


def ssim_map(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(H, W) SSIM of two (H, W, 3) uint8 images, averaged over the channels."""
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if x.shape != y.shape or x.ndim != 3:
        raise ValueError(f"expected two (H, W, C) images of one shape, got {x.shape} and {y.shape}")
    mx, my = _gaussian_blur(x), _gaussian_blur(y)
    vx = _gaussian_blur(x * x) - mx * mx
    vy = _gaussian_blur(y * y) - my * my
    cxy = _gaussian_blur(x * y) - mx * my
    s = ((2 * mx * my + _C1) * (2 * cxy + _C2)) / ((mx * mx + my * my + _C1) * (vx + vy + _C2))
    return s.mean(axis=2)


def ssim(a: np.ndarray, b: np.ndarray, mask: np.ndarray | None = None) -> float:
    """Mean SSIM over `mask` (all pixels when None); 1.0 for identical images or an empty mask."""
    values = ssim_map(a, b)
    if mask is not None:
        values = values[np.asarray(mask, bool)]
    return 1.0 if values.size == 0 else float(values.mean())


def compare(output: np.ndarray, reference: np.ndarray, region: np.ndarray) -> dict[str, float]:
    """The four fidelity figures of one output against its reference: whole image and `region`."""
    whole = ssim_map(output, reference)
    region = np.asarray(region, bool)
    return {
        "psnr_db": psnr_db(output, reference),
        "ssim": float(whole.mean()),
        "untouched_psnr_db": psnr_db(output, reference, region),
        "untouched_ssim": float(whole[region].mean()) if region.any() else 1.0,
    }


def spread(values: list[float]) -> dict[str, float | None]:
    """{median, p5}: the median and the 5th percentile (linear interpolation) of `values`."""
    if not values:
        return {"median": None, "p5": None}
    return {"median": float(np.median(values)), "p5": float(np.percentile(values, 5))}
