"""The `npu_fusion` strategy's fused q/k RMSNorm and rope (torch_npu.npu_rms_norm, npu_rotary_mul)
against fakes that implement the documented semantics and assert layout and shapes; the pure-torch
processor is the reference."""

from __future__ import annotations

import pytest
import torch
from test_attention import BF16_TOL, FakeNpuFusion, as_list, make_attention_module, module_case, relative_error

from hidream_ui.pipeline.attention import npu as attention_npu
from hidream_ui.pipeline.attention import registry


class FakeRmsNorm:
    """torch_npu.npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd): y = x * rsqrt(mean(x^2) + eps) * gamma."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, gamma, /, epsilon=1e-06):
        assert gamma.dim() == 1 and gamma.shape[0] == x.shape[-1], f"gamma {tuple(gamma.shape)} for x {tuple(x.shape)}"
        assert gamma.dtype == x.dtype
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
        self.calls.append({"shape": tuple(x.shape), "epsilon": epsilon})
        return (x.float() * rstd * gamma.float()).to(x.dtype), rstd


class FakeRotaryMul:
    """torch_npu.npu_rotary_mul(self, r1, r2, rotary_mode='half'): x * r1 + rotate(x) * r2, where
    "interleave" rotates each consecutive pair (x0, x1) to (-x1, x0) and "half" the two halves."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, r1, r2, /, rotary_mode="half"):
        assert x.dim() == 4, f"x must be 4-D (B, S, N, D), got {tuple(x.shape)}"
        batch, seq, _, dim = x.shape
        assert r1.shape == r2.shape and r1.dim() == 4 and r1.shape[1:] == (seq, 1, dim) and r1.shape[0] in (1, batch), (
            f"r1/r2 must be (B or 1, S, 1, D) = (.., {seq}, 1, {dim}), got {tuple(r1.shape)}"
        )
        assert r1.dtype == r2.dtype == x.dtype, f"dtypes {x.dtype}, {r1.dtype}, {r2.dtype}"
        assert rotary_mode == "interleave", f"HiDream's rope rotates pairs: mode {rotary_mode!r}"
        pairs = x.unflatten(-1, (-1, 2))
        rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
        self.calls.append({"shape": tuple(x.shape), "mode": rotary_mode})
        return x * r1 + rotated * r2


@pytest.mark.parametrize("single", [False, True], ids=["double", "single"])
@pytest.mark.parametrize("axes", [(8, 4, 4), (4, 2, 2)], ids=["full-head rope", "half-head rope"])
def test_fused_norm_and_rope_match_the_torch_reference(single, axes):
    dtype = torch.bfloat16
    collapsed, _ = module_case(single, axes)
    inputs = {k: v if k == "hidden_states_masks" else v.to(dtype) for k, v in collapsed.items()}
    module = make_attention_module(single).to(dtype)
    strategy = registry.get_strategy("npu_fusion")
    rms, rope = FakeRmsNorm(), FakeRotaryMul()
    results = {}
    for label, options in (("reference", {"fused_ops": False}), ("fused", {"rms_norm_fn": rms, "rotary_mul_fn": rope})):
        module.set_processor(strategy.make_processor(fusion_fn=FakeNpuFusion(), **options))
        assert module.processor.fused_ops == (label == "fused")
        with torch.no_grad():
            results[label] = as_list(module(**inputs), single)
    for fused, reference in zip(results["fused"], results["reference"]):
        assert fused.dtype == dtype
        assert relative_error(fused, reference) <= BF16_TOL
    streams = 1 if single else 2
    assert len(rms.calls) == 2 * streams  # q and k of each stream
    assert len(rope.calls) == 2  # q and k (image and text concatenated before rope)
    assert all(call["mode"] == "interleave" for call in rope.calls)


def test_the_fake_rope_is_hidreams_rope_and_would_catch_the_half_mode():
    """The fake is the check: interleave over pairs equals diffusers' rope; 'half' would not."""
    from diffusers.models.transformers.transformer_hidream_image import HiDreamImageEmbedND, apply_rope

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 3, 16, generator=gen)
    ids = torch.randint(0, 9, (2, 7, 3), generator=gen).float()
    freqs = HiDreamImageEmbedND(theta=10000, axes_dim=[8, 4, 4])(ids)
    want, _ = apply_rope(x, x, freqs)
    r1, r2 = attention_npu._rope_tables(freqs)
    assert r1.shape == (2, 7, 1, 16)
    torch.testing.assert_close(FakeRotaryMul()(x, r1, r2, "interleave"), want, rtol=1e-5, atol=1e-6)
    half = r1 * x + torch.cat([-x[..., 8:], x[..., :8]], dim=-1) * r2
    assert (half - want).abs().max() > 1e-2


def test_fused_ops_default_follows_torch_npu_and_the_fakes():
    import importlib.util

    installed = importlib.util.find_spec("torch_npu") is not None
    assert attention_npu.NpuFusionProcessor().fused_ops is installed
    assert attention_npu.NpuFusionProcessor(rms_norm_fn=FakeRmsNorm()).fused_ops is installed
    assert attention_npu.NpuFusionProcessor(rms_norm_fn=FakeRmsNorm(), rotary_mul_fn=FakeRotaryMul()).fused_ops
