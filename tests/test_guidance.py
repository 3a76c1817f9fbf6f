"""Guidance arithmetic and stage scheduling, checked against direct element-wise computation."""

import math

import pytest
import torch

from hidream_ui.edits import target_prompt
from hidream_ui.pipeline.guidance import combine_edit_guidance, combine_refine_guidance, refine_start_step


def direct_edit(u, ic, fc, g, ig, norm):
    """Per-element loops over known tensors: the formula as written in the issue."""
    out = torch.empty_like(u)
    b, c, h, w = u.shape
    for bi in range(b):
        for y in range(h):
            for x in range(w):
                uu, ii, ff = u[bi, :, y, x], ic[bi, :, y, x], fc[bi, :, y, x]
                if norm:
                    t = ii + g * (ff - ii)
                    norm_ff, norm_t = math.sqrt(float((ff**2).sum())), math.sqrt(float((t**2).sum()))
                    scale = min(max(norm_ff / (norm_t + 1e-8), 0.0), 1.0)
                    t = t * scale
                    out[bi, :, y, x] = uu + ig * (t - uu)
                else:
                    out[bi, :, y, x] = uu + ig * (ii - uu) + g * (ff - ii)
    return out


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("g, ig", [(3.0, 1.5), (5.0, 4.0), (1.0, 1.0)])
def test_edit_guidance_matches_direct_computation(norm, g, ig):
    gen = torch.Generator().manual_seed(0)
    u, ic, fc = (torch.randn(2, 4, 3, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    got = combine_edit_guidance(u, ic, fc, g, ig, norm)
    torch.testing.assert_close(got, direct_edit(u, ic, fc, g, ig, norm), rtol=1e-12, atol=1e-12)


def test_clip_cfg_norm_rescale_is_active_and_bounded():
    # fc small, ic far away: the text-guided vector is long, so the ratio < 1 kicks in.
    u = torch.zeros(1, 2, 1, 1, dtype=torch.float64)
    ic = torch.tensor([10.0, 0.0], dtype=torch.float64).view(1, 2, 1, 1)
    fc = torch.tensor([0.0, 1.0], dtype=torch.float64).view(1, 2, 1, 1)
    t = ic + 3.0 * (fc - ic)  # (-20, 3)
    expected = t * (1.0 / t.norm())
    got = combine_edit_guidance(u, ic, fc, 3.0, 1.0, True)
    torch.testing.assert_close(got, expected)
    assert abs(float(got.norm()) - 1.0) < 1e-9
    # Without the norm the same inputs give the plain formula, which is much longer.
    assert float(combine_edit_guidance(u, ic, fc, 3.0, 1.0, False).norm()) > 10


def test_refine_guidance():
    u, c = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0])
    torch.testing.assert_close(combine_refine_guidance(u, c, 2.5), torch.tensor([6.0, -5.5]))


@pytest.mark.parametrize("steps, strength, expected", [(28, 0.3, 19), (28, 0.0, 28), (28, 1.0, 0), (10, 0.25, 7)])
def test_refine_start_step(steps, strength, expected):
    assert refine_start_step(steps, strength) == expected


def test_target_prompt_parsing():
    e1full = "Editing Instruction: make it snowy. Target Image Description: a snowy street at night."
    assert target_prompt(e1full) == "a snowy street at night."
    assert target_prompt("make it snowy") == "make it snowy"
    # The marker is matched exactly (case as upstream): a lowercase variant is not a target description.
    assert target_prompt("target image description: x") == "target image description: x"
