"""Attention strategies: `registry` (names, availability, switching), `processor` (shared by all),
`kernels` (pure torch), `npu` (Ascend fused attention), `flash` (FlashAttention 2).

Attention strategies for HiDream's transformer, switchable at runtime.

Why this exists: diffusers' `HiDreamAttnProcessor` calls `F.scaled_dot_product_attention`
directly, so `DIFFUSERS_ATTN_BACKEND` / `set_attention_backend` do nothing for HiDream, and the
CUDA flash-attn package does not exist on Ascend NPUs. Picking a kernel therefore means
installing another processor on every `HiDreamAttention` module (the `attn1` of each double- and
single-stream block). That is cheap and keeps the weights in place, so a 17B model never has to be
reloaded to compare kernels or to fall back.

Structure
---------
Every strategy shares one processor body (`HiDreamStrategyProcessor`) that reproduces diffusers'
projections exactly (RMS-normed q/k cast back to the hidden dtype, image and text projections
concatenated in double-stream blocks, rope on the full head or on its first half, the same split
of the output projections) and differs only in `attend(q, k, v, key_bias)`, which works on
(batch, seq, heads, head_dim) tensors. `key_bias` is None or a float32 (batch, seq) additive
logit bias per key.

Padding-collapse mask encoding (project convention, see the pipeline)
---------------------------------------------------------------------
`hidden_states_masks` is a float (batch, seq) tensor. 1: normal token. 0: padded token, key
multiplied by 0 (upstream semantics: the padded key still gets softmax weight exp(0) and its
value still contributes). -P (P >= 1): ONE token standing for P identical padded tokens; its key
is zeroed like a pad and its logit gets + log(P) for every query, which is exactly what P copies
would contribute. So the key multiplier is max(mask, 0) and the key bias is log(max(-mask, 1)).
A mask without negative entries needs no bias at all (kernels keep their fast mask-free path).

Strategies
----------
sdpa, math, chunked, npu_fusion, flash_attn, sdpa_flash, sdpa_efficient, sdpa_cudnn, sdpa_math and
auto (resolved per device and dtype by `resolve`). `list_strategies` says which run here and why
not; `apply` installs one on a transformer. See each processor's docstring for how it handles the
key bias.

Concurrency: `sdpa_*` strategies force a backend with `torch.nn.attention.sdpa_kernel`, which
flips process-global flags while the call runs; the engine therefore runs edits and `apply()`
under one lock, and nothing else in the process should run SDPA concurrently.
"""
