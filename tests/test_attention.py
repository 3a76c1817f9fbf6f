"""Attention strategies: exactness against float64 and diffusers, padding collapse, runtime switching.

References are independent of hidream_ui.pipeline.attention: plain float64 softmax attention over the
*expanded* keys (a collapsed token with multiplicity P written out as P copies), and diffusers' own
HiDreamAttnProcessor run in float64 on the expanded sequence.
"""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

import pytest
import torch
from diffusers import HiDreamImageTransformer2DModel
from diffusers.models.transformers.transformer_hidream_image import (
    HiDreamAttention,
    HiDreamAttnProcessor,
    HiDreamImageEmbedND,
)

from hidream_ui.pipeline.attention import flash as attention_flash
from hidream_ui.pipeline.attention import kernels as attention_kernels
from hidream_ui.pipeline.attention import npu as attention_npu
from hidream_ui.pipeline.attention import processor as attention_processor
from hidream_ui.pipeline.attention import registry

FP32_TOL = 1e-4
BF16_TOL = 1e-2

# Strategies whose processors run on this CPU (availability aside) without fakes.
CPU_KERNELS = {
    "sdpa": {},
    "math": {},
    "chunked": {"chunk_size": 5},  # several chunks even at tiny sizes
    "sdpa_math": {},
}


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: thread start-up and barriers cost more than the work, badly so on a loaded
    # 2-core CI box. Restored after each test so nothing leaks into other test modules.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# Independent references and fakes


def expanded_reference(q, k, v, multiplicity):
    """float64 softmax(q k^T / sqrt(d)) v with key j repeated multiplicity[b, j] times (0: dropped).

    (B, S, H, D) in; written with plain ops, repeating keys for real, per sample.
    """
    outs = []
    for b in range(q.shape[0]):
        reps = multiplicity[b].long()
        kb = torch.repeat_interleave(k[b].double(), reps, dim=0)  # (S', H, D)
        vb = torch.repeat_interleave(v[b].double(), reps, dim=0)
        scores = torch.einsum("shd,thd->hst", q[b].double(), kb) / math.sqrt(q.shape[-1])
        outs.append(torch.einsum("hst,thd->shd", torch.softmax(scores, dim=-1), vb))
    return torch.stack(outs)


def relative_error(out, ref):
    return float((out.double() - ref).abs().max() / ref.abs().max())


def kernel_inputs(dtype, seed=0, batch=2, seq=23, heads=2, head_dim=16):
    """q/k/v plus a collapse-encoded key layout: per sample one collapsed key with a different P,
    and its key zeroed like the processor does."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq, heads, head_dim, generator=gen) for _ in range(3))
    multiplicity = torch.ones(batch, seq)
    positions, counts = [7, 15], [37.0, 5.0]
    for b in range(batch):
        multiplicity[b, positions[b]] = counts[b]
        k[b, positions[b]] = 0.0
    bias = torch.log(multiplicity)  # float32 (B, S)
    return q.to(dtype), k.to(dtype), v.to(dtype), bias, multiplicity


class FakeNpuFusion:
    """Stands in for torch_npu.npu_fusion_attention: checks what it is given, computes with torch.

    Implements the documented semantics: out = softmax(scale * (pse + q k^T)) v, layout BSND or
    BNSD, fp16/bf16 only, returns a 7-tuple whose first element is the output.
    """

    def __init__(self, layout="BSND", pse_rows="1"):
        self.layout = layout
        self.pse_rows = pse_rows
        self.calls = []

    def __call__(
        self,
        query,
        key,
        value,
        head_num,
        input_layout,
        *,
        pse=None,
        padding_mask=None,
        atten_mask=None,
        scale=1.0,
        keep_prob=1.0,
    ):
        assert input_layout == self.layout, f"layout {input_layout!r}, expected {self.layout!r}"
        assert query.dtype in (torch.float16, torch.bfloat16), f"dtype {query.dtype}"
        assert key.dtype == value.dtype == query.dtype
        assert query.is_contiguous() and key.is_contiguous() and value.is_contiguous()
        if input_layout == "BSND":
            batch, seq, heads, dim = query.shape
            q, k, v = (t.transpose(1, 2).float() for t in (query, key, value))
        else:
            batch, heads, seq, dim = query.shape
            q, k, v = (t.float() for t in (query, key, value))
        assert key.shape == value.shape == query.shape
        assert head_num == heads, f"head_num {head_num} but the tensors have {heads} heads"
        assert scale == pytest.approx(1.0 / math.sqrt(dim)), f"scale {scale} (kernel default is 1.0)"
        assert keep_prob == 1.0 and atten_mask is None and padding_mask is None
        logits = q @ k.transpose(-1, -2)
        if pse is not None:
            rows = 1 if self.pse_rows == "1" else seq
            assert pse.shape == (batch, heads, rows, seq), f"pse shape {tuple(pse.shape)}"
            assert pse.dtype == query.dtype
            logits = logits + pse.float()
        out = torch.softmax(scale * logits, dim=-1) @ v
        if input_layout == "BSND":
            out = out.transpose(1, 2)
        self.calls.append({"layout": input_layout, "pse": None if pse is None else tuple(pse.shape)})
        return out.to(query.dtype), None, None, None, 0, 0, 0


class FakeFlashAttn:
    """Stands in for flash_attn.flash_attn_func: (B, S, H, D), no bias, optional log-sum-exp."""

    def __init__(self, dtypes=(torch.float16, torch.bfloat16)):
        self.dtypes = dtypes
        self.calls = []

    def __call__(
        self,
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
    ):
        assert q.dtype in self.dtypes and k.dtype == v.dtype == q.dtype, f"dtype {q.dtype}"
        assert q.dim() == 4 and q.shape == k.shape == v.shape
        assert softmax_scale == pytest.approx(q.shape[-1] ** -0.5)
        assert dropout_p == 0.0 and causal is False and alibi_slopes is None
        logits = torch.einsum("bshd,bthd->bhst", q.float(), k.float()) * softmax_scale
        lse = torch.logsumexp(logits, dim=-1)  # (B, H, S) float32, as flash-attn returns it
        out = torch.einsum("bhst,bthd->bshd", torch.softmax(logits, dim=-1), v.float()).to(q.dtype)
        self.calls.append({"return_attn_probs": return_attn_probs})
        return (out, lse, None) if return_attn_probs else out


# ---------------------------------------------------------------------------------------------
# Kernels against the float64 expanded reference


@pytest.mark.parametrize("name", sorted(CPU_KERNELS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_cpu_kernels_match_float64_expanded_reference(name, dtype, tol):
    q, k, v, bias, multiplicity = kernel_inputs(dtype)
    processor = registry.get_strategy(name).make_processor(**CPU_KERNELS[name])
    ref = expanded_reference(q, k, v, multiplicity)
    assert relative_error(processor.attend(q, k, v, bias), ref) <= tol
    # Without a bias (no collapsed tokens) too.
    plain = expanded_reference(q, k, v, torch.ones_like(multiplicity))
    assert relative_error(processor.attend(q, k, v, None), plain) <= tol


def test_forced_flash_backend_processor_runs_on_cpu_kernel():
    # sdpa_flash is only *offered* on CUDA, but its processor logic (sdpa_kernel + mask) is
    # exercised here with torch's CPU flash kernel.
    q, k, v, bias, multiplicity = kernel_inputs(torch.float32)
    processor = registry.get_strategy("sdpa_flash").make_processor()
    assert processor.strategy_name == "sdpa_flash"
    assert relative_error(processor.attend(q, k, v, bias), expanded_reference(q, k, v, multiplicity)) <= FP32_TOL


@pytest.mark.parametrize("layout", ["BSND", "BNSD"])
@pytest.mark.parametrize("pse_layout", ["BN1S", "BNSS"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_npu_fusion_against_fake(layout, pse_layout, dtype):
    q, k, v, bias, multiplicity = kernel_inputs(dtype)
    fake = FakeNpuFusion(layout=layout, pse_rows="1" if pse_layout == "BN1S" else "S")
    processor = registry.get_strategy("npu_fusion").make_processor(
        fusion_fn=fake, input_layout=layout, pse_layout=pse_layout
    )
    out = processor.attend(q, k, v, bias)
    assert out.shape == q.shape and out.dtype == dtype
    assert relative_error(out, expanded_reference(q, k, v, multiplicity)) <= BF16_TOL
    out_plain = processor.attend(q, k, v, None)
    assert relative_error(out_plain, expanded_reference(q, k, v, torch.ones_like(multiplicity))) <= BF16_TOL
    assert [c["pse"] is not None for c in fake.calls] == [True, False]


def test_npu_fusion_rejects_float32_and_oversized_heads():
    processor = attention_npu.NpuFusionProcessor(fusion_fn=FakeNpuFusion())
    q, k, v, bias, _ = kernel_inputs(torch.float32)
    with pytest.raises(TypeError, match="float16/bfloat16"):
        processor.attend(q, k, v, bias)
    big = torch.zeros(1, 4, 1, 528, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim <= 512"):
        processor.attend(big, big, big, None)
    with pytest.raises(ValueError, match="pse_layout"):
        attention_npu.NpuFusionProcessor(pse_layout="B1SS")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attn_against_fake(dtype):
    q, k, v, bias, multiplicity = kernel_inputs(dtype)
    fake = FakeFlashAttn()
    processor = registry.get_strategy("flash_attn").make_processor(flash_fn=fake)
    out = processor.attend(q, k, v, bias)
    assert out.dtype == dtype
    assert relative_error(out, expanded_reference(q, k, v, multiplicity)) <= BF16_TOL
    assert (
        relative_error(processor.attend(q, k, v, None), expanded_reference(q, k, v, torch.ones_like(multiplicity)))
        <= BF16_TOL
    )
    # The log-sum-exp is only requested when there is a bias to add.
    assert [c["return_attn_probs"] for c in fake.calls] == [True, False]


def test_flash_attn_multiplicity_correction_is_exact_in_float32():
    # A permissive fake lets the log-sum-exp correction be checked at float32 precision, with
    # several biased keys per sample and a different count per sample.
    q, k, v, _, _ = kernel_inputs(torch.float32, seed=3)
    multiplicity = torch.ones(2, q.shape[1])
    multiplicity[0, [2, 9, 20]] = torch.tensor([3.0, 100.0, 2.0])
    multiplicity[1, 4] = 4096.0
    processor = attention_flash.FlashAttnProcessor(flash_fn=FakeFlashAttn(dtypes=(torch.float32,)))
    out = processor.attend(q, k, v, torch.log(multiplicity))
    assert relative_error(out, expanded_reference(q, k, v, multiplicity)) <= 1e-5


# ---------------------------------------------------------------------------------------------
# The whole processor on diffusers' HiDreamAttention modules


def make_attention_module(single, seed=0):
    torch.manual_seed(seed)
    module = HiDreamAttention(query_dim=32, heads=2, dim_head=16, processor=HiDreamAttnProcessor(), single=single)
    with torch.no_grad():  # non-trivial RMSNorm weights so the norm-then-cast path matters
        for name, param in module.named_parameters():
            if "rms_norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
    return module.eval()


def module_case(single, axes, seed=0):
    """Collapsed module inputs (one -P mask entry per sample) and, per sample, the same sequence
    with that token written out as P copies with mask 0 (upstream padding).

    Returns (collapsed kwargs, [(expanded kwargs, keep, n_image_expanded) per sample]); `keep`
    indexes the expanded image tokens so that they line up with the collapsed ones (the first
    copy stands for all of them: the copies are identical).
    """
    gen = torch.Generator().manual_seed(seed)
    batch, n_image, n_text, dim = 2, 9, 5, 32
    pads = [6, 3]  # multiplicity of the collapsed token (last image position), per sample
    image = torch.randn(batch, n_image, dim, generator=gen)
    text = torch.randn(batch, n_text, dim, generator=gen)
    image_ids = torch.randint(0, 6, (batch, n_image, 3), generator=gen).float()
    image[:, -1] = 0.3  # the padded token's content (zeros upstream; any value works)
    image_ids[:, -1] = 0.0
    mask = torch.ones(batch, n_image)
    mask[:, 2] = 0.0  # an ordinary padded key (multiplier 0, multiplicity 1) as well
    for b in range(batch):
        mask[b, -1] = -float(pads[b])

    def kwargs(img, ids, m, txt):
        text_ids = torch.zeros(img.shape[0], n_text, 3)
        rope = HiDreamImageEmbedND(theta=10000, axes_dim=list(axes))(torch.cat([ids, text_ids], dim=1))
        if single:
            return dict(
                norm_hidden_states=torch.cat([img, txt], dim=1),
                image_rotary_emb=rope,
                hidden_states_masks=torch.cat([m, torch.ones(img.shape[0], n_text)], dim=1),
            )
        return dict(
            norm_hidden_states=img, norm_encoder_hidden_states=txt, image_rotary_emb=rope, hidden_states_masks=m
        )

    expanded = []
    for b in range(batch):
        reps = torch.ones(n_image, dtype=torch.long)
        reps[-1] = pads[b]
        img = torch.repeat_interleave(image[b : b + 1], reps, dim=1)
        ids = torch.repeat_interleave(image_ids[b : b + 1], reps, dim=1)
        m = torch.repeat_interleave(mask[b : b + 1].clamp(min=0), reps, dim=1)  # copies are plain 0 pads
        expanded.append((kwargs(img, ids, m, text[b : b + 1]), list(range(n_image)), img.shape[1]))
    return kwargs(image, image_ids, mask, text), expanded


def align_expanded(outputs, keep, n_image, single):
    """Expanded-sequence module outputs restricted to the positions of the collapsed sequence."""
    if single:
        (out,) = outputs
        return [out[:, keep + list(range(n_image, out.shape[1]))]]
    image_out, text_out = outputs
    return [image_out[:, keep], text_out]


def as_list(outputs, single):
    return [outputs] if single else list(outputs)


@pytest.mark.parametrize("single", [False, True], ids=["double", "single"])
@pytest.mark.parametrize("axes", [(8, 4, 4), (4, 2, 2)], ids=["rope-full", "rope-half"])
@pytest.mark.parametrize("name", sorted(CPU_KERNELS))
def test_module_matches_diffusers_float64_on_expanded_padding(single, axes, name):
    module = make_attention_module(single)
    reference = make_attention_module(single).double()  # same seed: same weights, diffusers processor
    collapsed, expanded = module_case(single, axes)
    module.set_processor(registry.get_strategy(name).make_processor(**CPU_KERNELS[name]))
    with torch.no_grad():
        got = as_list(module(**collapsed), single)
        for b, (kwargs, keep, n_image) in enumerate(expanded):
            ref = reference(**{k: v.double() for k, v in kwargs.items()})
            for g, want in zip(got, align_expanded(as_list(ref, single), keep, n_image, single)):
                assert relative_error(g[b : b + 1], want) <= FP32_TOL


@pytest.mark.parametrize("single", [False, True], ids=["double", "single"])
@pytest.mark.parametrize("axes", [(8, 4, 4), (4, 2, 2)], ids=["rope-full", "rope-half"])
def test_sdpa_processor_is_bitwise_diffusers_without_collapse(single, axes):
    # Upstream 0/1 masks: no bias, so the sdpa strategy issues the very same kernel call.
    module = make_attention_module(single)
    collapsed, _ = module_case(single, axes)
    kwargs = dict(collapsed)
    kwargs["hidden_states_masks"] = kwargs["hidden_states_masks"].clamp(min=0)
    with torch.no_grad():
        want = module(**kwargs)
        module.set_processor(attention_kernels.SdpaProcessor())
        got = module(**kwargs)
    for g, w in zip((got,) if single else got, (want,) if single else want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("name", sorted(CPU_KERNELS) + ["npu_fusion", "flash_attn"])
@pytest.mark.parametrize("single", [False, True], ids=["double", "single"])
def test_collapsed_equals_expanded_for_every_strategy(name, single):
    # The padding-collapse contract, per strategy: one -P entry == P zero entries.
    options = dict(CPU_KERNELS.get(name, {}))
    dtype, tol = torch.float32, 1e-5
    if name == "npu_fusion":
        options, dtype, tol = {"fusion_fn": FakeNpuFusion()}, torch.bfloat16, BF16_TOL
    if name == "flash_attn":
        options, dtype, tol = {"flash_fn": FakeFlashAttn()}, torch.bfloat16, BF16_TOL
    module = make_attention_module(single).to(dtype)
    module.set_processor(registry.get_strategy(name).make_processor(**options))
    collapsed, expanded = module_case(single, (8, 4, 4))

    def cast(kwargs):  # masks stay float32, as the pipeline sends them
        return {k: v if k == "hidden_states_masks" else v.to(dtype) for k, v in kwargs.items()}

    with torch.no_grad():
        got = as_list(module(**cast(collapsed)), single)
        for b, (kwargs, keep, n_image) in enumerate(expanded):
            want = align_expanded(as_list(module(**cast(kwargs)), single), keep, n_image, single)
            for g, w in zip(got, want):
                assert g.dtype == dtype
                assert relative_error(g[b : b + 1].float(), w.double()) <= tol


def test_mask_length_mismatch_names_both_sizes():
    module = make_attention_module(single=True)
    module.set_processor(attention_kernels.SdpaProcessor())
    collapsed, _ = module_case(True, (8, 4, 4))
    collapsed["hidden_states_masks"] = collapsed["hidden_states_masks"][:, :-1]
    with pytest.raises(ValueError, match="13 entries .* 14 tokens"):
        module(**collapsed)


# ---------------------------------------------------------------------------------------------
# Registry, availability, apply()


class Device(SimpleNamespace):
    """DeviceInfo-like: only `.type` (and `.index`) matter to attention."""


def test_registry_lists_every_strategy_with_reasons():
    names = registry.strategy_names()
    for required in (
        "auto",
        "sdpa",
        "math",
        "chunked",
        "npu_fusion",
        "flash_attn",
        "sdpa_flash",
        "sdpa_efficient",
        "sdpa_cudnn",
        "sdpa_math",
    ):
        assert required in names
    statuses = registry.list_strategies(Device(type="cpu", index=None), torch.float32)
    assert [s.name for s in statuses] == list(names)
    by_name = {s.name: s for s in statuses}
    assert {n for n, s in by_name.items() if s.available} == {"auto", "sdpa", "math", "chunked", "sdpa_math"}
    assert all(s.reason and s.description for s in statuses)
    assert "'sdpa'" in by_name["auto"].reason
    assert "cpu" in by_name["sdpa_flash"].reason


def test_npu_and_flash_report_why_they_are_unavailable_here():
    cpu = registry.list_strategies("cpu", torch.bfloat16)
    reasons = {s.name: s.reason for s in cpu if not s.available}
    assert "NPU" in reasons["npu_fusion"] and "cpu" in reasons["npu_fusion"]
    assert "CUDA" in reasons["flash_attn"]
    npu = Device(type="npu", index=0)
    ok, reason = registry.get_strategy("npu_fusion").is_available(npu, torch.float32)
    assert not ok and "float16/bfloat16" in reason
    ok, reason = registry.get_strategy("npu_fusion").is_available(npu, torch.bfloat16)
    if importlib.util.find_spec("torch_npu") is None:
        assert not ok and "torch_npu is not installed" in reason
        assert registry.resolve("auto", npu, torch.bfloat16).name == "sdpa"
    cuda = Device(type="cuda", index=0)
    ok, reason = registry.get_strategy("flash_attn").is_available(cuda, torch.float32)
    assert not ok and "float16/bfloat16" in reason
    if importlib.util.find_spec("flash_attn") is None:
        ok, reason = registry.get_strategy("flash_attn").is_available(cuda, torch.bfloat16)
        assert not ok and "not installed" in reason
        assert registry.resolve("auto", cuda, torch.bfloat16).name == "sdpa"


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown attention strategy 'flash3'.*sdpa.*chunked"):
        registry.get_strategy("flash3")
    with pytest.raises(ValueError, match="resolve"):
        registry.get_strategy("auto").make_processor()


TINY_GEOMETRY = dict(
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=2,
    num_single_layers=2,
    num_attention_heads=2,
    attention_head_dim=16,
    axes_dims_rope=(8, 4, 4),
    num_routed_experts=4,
    num_activated_experts=2,
    max_resolution=(16, 16),
    llama_layers=[0, 1, 2, 3],
    caption_channels=[32, 32],
    text_emb_dim=32,
)


@pytest.fixture
def tiny_transformer():
    torch.manual_seed(0)
    return HiDreamImageTransformer2DModel(**TINY_GEOMETRY).eval()


def transformer_kwargs(batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        timesteps=torch.tensor([300.0] * batch),
        encoder_hidden_states_t5=torch.randn(batch, 6, 32, generator=gen),
        encoder_hidden_states_llama3=torch.randn(4, batch, 5, 32, generator=gen),
        pooled_embeds=torch.randn(batch, 32, generator=gen),
        return_dict=False,
    )


def collapsed_transformer_inputs(latents, transformer):
    """Pre-patchified real tokens + one collapsed pad token (mask -P), as the pipeline sends them."""
    batch, channels, height, width = latents.shape
    p = transformer.config.patch_size
    ph, pw = height // p, width // p
    n = ph * pw
    pad = transformer.max_seq - n
    tokens = latents.reshape(batch, channels, ph, p, pw, p).permute(0, 2, 4, 3, 5, 1).reshape(batch, n, -1)
    tokens = torch.cat([tokens, tokens.new_zeros(batch, 1, tokens.shape[-1])], dim=1)
    ids = torch.zeros(n + 1, 3)
    ids[:n, 1] = torch.arange(ph).repeat_interleave(pw)
    ids[:n, 2] = torch.arange(pw).repeat(ph)
    mask = torch.ones(batch, n + 1)
    mask[:, n] = -float(pad)
    return dict(
        hidden_states=tokens,
        hidden_states_masks=mask,
        img_ids=ids.expand(batch, -1, -1),
        img_sizes=torch.tensor([[ph, pw]] * batch),
    )


def snapshot(transformer):
    """Everything apply() must not change: tensors (values and storage) and every module's attributes
    except the attention modules' `processor`."""
    tensors = {k: (v.data_ptr(), v.clone()) for k, v in transformer.state_dict().items()}
    modules = {}
    for name, module in transformer.named_modules():
        attrs = {}
        for key, value in vars(module).items():
            if isinstance(module, HiDreamAttention) and key == "processor":
                continue
            # Containers (_parameters, _modules, hooks...) by content, everything else by identity.
            attrs[key] = tuple((k, id(v)) for k, v in value.items()) if isinstance(value, dict) else id(value)
        modules[name] = (id(module), attrs)
    return tensors, modules


def test_apply_switches_every_attention_module_and_nothing_else(tiny_transformer):
    transformer = tiny_transformer
    modules = registry.hidream_attention_modules(transformer)
    assert len(modules) == 4  # 2 double-stream + 2 single-stream
    assert registry.current_strategy(transformer) is None  # diffusers' default processor
    before = snapshot(transformer)
    latents = torch.randn(2, 16, 8, 16, generator=torch.Generator().manual_seed(1))
    kwargs = {**transformer_kwargs(), **collapsed_transformer_inputs(latents, transformer)}
    outputs = {}
    with torch.no_grad():
        for name in ("sdpa", "math", "chunked", "sdpa_math"):
            assert registry.apply(transformer, name, "cpu", torch.float32) == name
            assert registry.current_strategy(transformer) == name
            assert all(m.processor.strategy_name == name for m in modules)
            outputs[name] = transformer(**kwargs)[0]
    after = snapshot(transformer)
    assert before[1] == after[1]
    assert before[0].keys() == after[0].keys()
    for key, (ptr, value) in before[0].items():
        assert after[0][key][0] == ptr and torch.equal(after[0][key][1], value), key
    for name, out in outputs.items():
        assert relative_error(out, outputs["math"].double()) <= FP32_TOL, name


def test_collapsed_transformer_matches_upstream_padding(tiny_transformer):
    # End to end: diffusers pads a non-square latent to max_seq tokens itself; the collapsed input
    # with any of our strategies must give the same prediction.
    transformer = tiny_transformer
    latents = torch.randn(2, 16, 8, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for module in registry.hidream_attention_modules(transformer):
            module.set_processor(HiDreamAttnProcessor())
        upstream = transformer(hidden_states=latents, **transformer_kwargs())[0]
        for name in ("sdpa", "chunked"):
            registry.apply(transformer, name, "cpu", torch.float32)
            ours = transformer(**transformer_kwargs(), **collapsed_transformer_inputs(latents, transformer))[0]
            assert relative_error(ours, upstream.double()) <= FP32_TOL, name


def test_apply_auto_reports_what_it_resolved_to(tiny_transformer):
    assert registry.apply(tiny_transformer, "auto", Device(type="cpu", index=None), torch.float32) == "sdpa"
    assert registry.current_strategy(tiny_transformer) == "sdpa"


@pytest.mark.parametrize(
    "name,options,error,match",
    [
        ("npu_fusion", {}, attention_processor.AttentionUnavailable, "needs an Ascend NPU"),
        ("flash_attn", {}, attention_processor.AttentionUnavailable, "CUDA"),
        ("sdpa_efficient", {}, attention_processor.AttentionUnavailable, "cuda"),
        ("nope", {}, ValueError, "unknown attention strategy"),
        ("chunked", {"chunk_size": 0}, ValueError, "chunk_size"),
        ("math", {"bogus": 1}, TypeError, "bogus"),
    ],
)
def test_failed_apply_leaves_the_transformer_untouched(tiny_transformer, name, options, error, match):
    registry.apply(tiny_transformer, "math", "cpu", torch.float32)
    processors = [m.processor for m in registry.hidream_attention_modules(tiny_transformer)]
    with pytest.raises(error, match=match) as info:
        registry.apply(tiny_transformer, name, "cpu", torch.float32, **options)
    if error is attention_processor.AttentionUnavailable:
        assert info.value.name == name and info.value.reason
    assert [m.processor for m in registry.hidream_attention_modules(tiny_transformer)] == processors
    assert registry.current_strategy(tiny_transformer) == "math"


def test_apply_rejects_a_model_without_hidream_attention():
    with pytest.raises(ValueError, match="no HiDreamAttention"):
        registry.apply(torch.nn.Linear(2, 2), "sdpa", "cpu", torch.float32)


def test_mask_terms_are_cached_per_tensor_and_invalidated_by_in_place_edits():
    processor = attention_kernels.SdpaProcessor()
    mask = torch.tensor([[1.0, 0.0, -4.0]])
    multiplier, bias = processor._masks.get(mask)
    assert torch.equal(multiplier, torch.tensor([[1.0, 0.0, 0.0]]))
    assert torch.allclose(bias, torch.tensor([[0.0, 0.0, math.log(4.0)]]))
    assert processor._masks.get(mask)[1] is bias  # same tensor: cached
    mask[0, 2] = 1.0
    assert processor._masks.get(mask)[1] is None  # edited in place: recomputed, no bias left
    assert processor._masks.get(mask.clone())[1] is None


# ---------------------------------------------------------------------------------------------
# Benchmark smoke test


def test_bench_attention_tiny_report_structure(capsys):
    import json

    from hidream_ui.bench import attention as bench_attention

    report = bench_attention.run(profile="tiny", repeats=1, json_out=True, sizes=(64,))
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(report))
    assert report["benchmark"] == "attention" and report["auto_resolves_to"] == "sdpa"
    assert {s["name"] for s in report["strategies"]} == set(registry.strategy_names())
    (row,) = report["kernels"]
    assert row["shape"]["seq"] == 32 + 1 + 24 and row["shape"]["pad_tokens"] == 32
    assert set(row["strategies"]) == {"sdpa", "math", "chunked", "sdpa_math"}
    for name, result in row["strategies"].items():
        assert result["median_s"] > 0 and len(result["times_s"]) == 1
        assert result["peak_bytes"] >= 0 and result["estimate_bytes"] > 0
        assert result["rel_error"] <= FP32_TOL, name
    assert set(report["checks"]) >= {"chunked_peak_over_math_peak", "sdpa_time_over_math_time"}
    transformer = report["transformer"]
    assert set(transformer["strategies"]) == {"sdpa", "math", "chunked", "sdpa_math"}
    for name, result in transformer["strategies"].items():
        assert result["median_s"] > 0
        assert result["rel_diff_vs_sdpa"] <= FP32_TOL, name
    text = bench_attention.format_table(report)
    assert "64x64" in text and "chunked" in text


def test_bench_skips_what_does_not_fit_the_budget():
    from hidream_ui.bench import attention as bench_attention

    report = bench_attention.run(
        profile="tiny",
        repeats=1,
        sizes=(128,),
        strategies=["sdpa", "math"],
        memory_budget_gb=0.5 * 2 * 3 * 2 * 152 * 152 * 4 / 1024**3,
        transformer=False,
    )
    results = report["kernels"][0]["strategies"]
    assert "median_s" in results["sdpa"]
    assert results["math"]["skipped"].startswith("needs ") and "budget" in results["math"]["skipped"]


def test_one_host_sync_per_mask_per_forward(monkeypatch):
    # The derived bias (and its text-padded version) is computed once per mask tensor and shared
    # by all blocks, so kernels that cache on the bias tensor see the same object every block.
    calls = []
    original = attention_processor.key_terms
    monkeypatch.setattr(attention_processor, "key_terms", lambda mask: calls.append(mask) or original(mask))
    seen = []
    processor = attention_flash.FlashAttnProcessor(flash_fn=FakeFlashAttn())  # built after the patch
    original_attend = processor.attend
    processor.attend = lambda q, k, v, bias: seen.append(bias) or original_attend(q, k, v, bias)
    module = make_attention_module(single=False).to(torch.bfloat16)
    module.set_processor(processor)
    collapsed, _ = module_case(False, (8, 4, 4))
    kwargs = {k: v if k == "hidden_states_masks" else v.to(torch.bfloat16) for k, v in collapsed.items()}
    with torch.no_grad():
        for _ in range(3):
            module(**kwargs)
    assert len(calls) == 1
    assert len(seen) == 3 and seen[0] is seen[1] is seen[2]
