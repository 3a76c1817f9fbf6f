"""bench/fidelity.py: PSNR and SSIM of an output against a reference, over the picture or a region."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hidream_ui.bench import fidelity


def _pair(spread: int = 40):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (128, 128, 3), dtype=np.uint8)
    b = np.clip(a.astype(int) + rng.integers(-spread, spread, a.shape), 0, 255).astype(np.uint8)
    return a, b


def test_ssim_is_the_fields_ssim():
    """The same pair through scikit-image 0.26 (`structural_similarity(a, b, gaussian_weights=True, sigma=1.5,
    use_sample_covariance=False, data_range=255, channel_axis=2)`, run once by hand: it is not a dependency)
    gives 0.9548826884483135; scikit-image leaves out a 5-pixel border, so the same crop of our map is compared."""
    a, b = _pair()
    assert fidelity.ssim_map(a, b)[5:-5, 5:-5].mean() == pytest.approx(0.9548826884483135, abs=1e-9)


def test_identical_pictures_are_at_the_cap_and_one():
    a, _ = _pair()
    mask = np.zeros(a.shape[:2], bool)
    mask[10:20, 10:20] = True
    assert fidelity.compare(a, a.copy(), mask) == {
        "psnr_db": fidelity.PSNR_CAP_DB,
        "ssim": 1.0,
        "untouched_psnr_db": fidelity.PSNR_CAP_DB,
        "untouched_ssim": 1.0,
    }


def test_psnr_of_a_known_error_and_over_a_region_only():
    a = np.full((8, 8, 3), 100, np.uint8)
    b = a.copy()
    b[:4] += 10  # the top half off by 10 levels
    top, bottom = np.zeros((8, 8), bool), np.zeros((8, 8), bool)
    top[:4], bottom[4:] = True, True
    assert fidelity.psnr_db(a, b, top) == pytest.approx(20 * math.log10(255 / 10))
    assert fidelity.psnr_db(a, b) == pytest.approx(10 * math.log10(255**2 / 50))  # MSE 100 on half the pixels
    assert fidelity.psnr_db(a, b, bottom) == fidelity.PSNR_CAP_DB
    assert fidelity.psnr_db(a, b, np.zeros((8, 8), bool)) == fidelity.PSNR_CAP_DB  # nothing to compare
    with pytest.raises(ValueError, match="shape"):
        fidelity.psnr_db(a, b[:4])


def test_region_figures_see_only_the_region():
    a, b = _pair()
    region = np.zeros(a.shape[:2], bool)
    region[:, :64] = True
    b[:, :64] = a[:, :64]  # the left half kept exactly
    close = fidelity.compare(b, a, region)
    assert close["untouched_psnr_db"] == fidelity.PSNR_CAP_DB
    assert close["psnr_db"] < 30 and close["ssim"] < close["untouched_ssim"] < 1.0  # the window crosses the seam
    assert close["untouched_ssim"] > 0.95


def test_more_noise_is_less_fidelity():
    a, little = _pair(5)
    _, much = _pair(60)
    assert fidelity.ssim(a, much) < fidelity.ssim(a, little) < 1.0
    assert fidelity.psnr_db(a, much) < fidelity.psnr_db(a, little)


def test_spread_is_median_and_fifth_percentile():
    values = [float(v) for v in range(1, 101)]
    assert fidelity.spread(values) == {"median": 50.5, "p5": pytest.approx(5.95)}
    assert fidelity.spread([]) == {"median": None, "p5": None}
