"""Text encoder weights under which the world's words differ: a designed initialisation of the tiny encoders.

Why: the trained model must tell which shape an instruction names, and the random tiny encoders blur the
shape words (Llama's hidden states of "make the circle red" and "make the square red" have a cosine of 0.98;
docs/lab-notebook.md, "Which shape?"). A head learning which tokens the word names reaches 0.90 balanced
accuracy in 1500 steps under these encoders, 0.72 under the random ones (measured there). Trained together
with the transformer, the encoders make the words *less* distinct, so they are set once and stay frozen.

The design keeps every class, shape and loading path; only values change. Each encoder becomes a bag of words:
- every world word's token embedding (but the fillers', zero) is one of `WORD_DIMS` orthonormal directions in
  the first `WORD_DIMS` dims (the same direction for a word in every tokenizer's spellings of it), and no
  other token has a component there;
- the first layer's attention has zero queries and keys, so it averages its inputs uniformly (causally for
  CLIP and Llama) and writes that average of the words into the next `WORD_DIMS` dims: every token (and the
  CLIP end token the pooled output reads) carries the whole instruction;
- every other attention output and MLP output is zero, so the later layers pass the stream through; the
  final norms keep their role.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

WORD_DIMS = 16  # room for one orthonormal direction per world word (14 without the fillers)
# Gain of the words' average written by the first layer: about the size of one word's own embedding.
CONTEXT_GAIN = 0.4
# Llama's hidden states reach the transformer without a norm but for the last layer's: a word's embedding of
# this norm gives them about the size the random encoder gave (7-12); T5 and the pooled CLIP output pass
# through final norms, whose gains keep the random encoders' sizes (pooled: about 4.8 instead of 8.8).
LLAMA_SCALE = 12.0
POOLED_GAIN = 0.55
PARTS = ("clip_l", "clip_g", "t5", "llama")
# The seed of the words' directions: a design constant, not the run's seed, so that a fine-tune with another
# seed keeps the encoders its start learned to read.
DIRECTION_SEED = 0
# Words that are in every instruction's frame ("make the ...", "remove the ..."): no direction, so the average
# holds what tells instructions apart.
FILLERS = ("make", "the")
# How each part numbers its layers in its keys.
_LAYER_KEYS = {
    "clip_l": r"text_model\.encoder\.layers\.(\d+)\.",
    "clip_g": r"text_model\.encoder\.layers\.(\d+)\.",
    "t5": r"encoder\.block\.(\d+)\.",
    "llama": r"model\.layers\.(\d+)\.",
}


def apply(root: Path, seed: int, prompts: Iterable[str]) -> None:
    """Rewrite the text encoders of the tiny build at `root` with the design above: `prompts` (every instruction
    of the world) through its tokenizers give the world words' token ids; `seed` picks the words' directions."""
    from transformers import AutoTokenizer, CLIPTokenizer

    from hidream_ui.model.layout import I1_DIR, LLAMA_DIR
    from hidream_ui.model.tiny import trained, world

    tokenizers = {
        "clip_l": CLIPTokenizer.from_pretrained(root / I1_DIR / "tokenizer", local_files_only=True),
        "clip_g": CLIPTokenizer.from_pretrained(root / I1_DIR / "tokenizer_2", local_files_only=True),
        "t5": AutoTokenizer.from_pretrained(root / I1_DIR / "tokenizer_3", local_files_only=True),
        "llama": AutoTokenizer.from_pretrained(root / LLAMA_DIR, local_files_only=True),
    }
    prompts = list(prompts)
    token_ids = {part: word_token_ids(tokenizer, prompts) for part, tokenizer in tokenizers.items()}
    directions = word_directions([w for w in world.WORDS if w not in FILLERS], seed)
    tensors = {k: v for k, v in trained.part_tensors(root).items() if k.split("/")[0] in PARTS}
    trained.replace_parts(root, distinct_word_tensors(tensors, token_ids, directions), PARTS)


def layer_count(tensors: Iterable[str], part: str) -> int:
    """How many layers `part` has, from its keys ("<part>/<key>")."""
    pattern = re.compile(re.escape(part) + "/" + _LAYER_KEYS[part])
    found = {int(m.group(1)) for key in tensors if (m := pattern.match(key))}
    if not found:
        raise ValueError(f"no {part} layers among the tensors")
    return max(found) + 1


def word_directions(words: Iterable[str], seed: int) -> dict[str, "torch.Tensor"]:
    """One orthonormal direction of R^WORD_DIMS per word (seeded)."""
    import torch

    words = list(words)
    if len(words) > WORD_DIMS:
        raise ValueError(f"{len(words)} words do not fit {WORD_DIMS} orthonormal directions")
    generator = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(WORD_DIMS, WORD_DIMS, generator=generator))
    return {word: basis[:, i].contiguous() for i, word in enumerate(words)}


def word_token_ids(tokenizer, sentences: Iterable[str]) -> dict[str, set[int]]:
    """Token ids each word of `sentences` gets from `tokenizer` (a word can have two: "make" first, " make"
    later). Every word must be one token: the tiny tokenizers learn the world's words whole."""
    ids: dict[str, set[int]] = {}
    for sentence in sentences:
        words = sentence.split()
        tokens = tokenizer(sentence, add_special_tokens=False).input_ids
        if len(tokens) != len(words):
            raise ValueError(
                f"{type(tokenizer).__name__} splits {sentence!r} into {len(tokens)} tokens, not one per "
                f"word ({len(words)})"
            )
        for word, token in zip(words, tokens):
            ids.setdefault(word, set()).add(int(token))
    return ids


def _embed(
    table: "torch.Tensor", ids: Mapping[str, set[int]], directions: Mapping[str, "torch.Tensor"], scale: float = 1.0
) -> None:
    """No token but a world word has a component in the word dims (the average then holds the instruction's
    words and nothing else); a word without a direction (a filler: "make", "the") embeds as zero."""
    table[:, :WORD_DIMS] = 0.0
    for word, tokens in ids.items():
        for token in tokens:
            table[token].zero_()
            if word in directions:
                table[token, :WORD_DIMS] = scale * directions[word]


def _average_into_context(v: "torch.Tensor", o: "torch.Tensor", scale: float = 1.0) -> None:
    """v: (inner, hidden) copies the word dims into the first WORD_DIMS value dims; o: (hidden, inner) writes
    them, times CONTEXT_GAIN x `scale`, into dims WORD_DIMS..2*WORD_DIMS. Every head attends uniformly (zero queries and
    keys), so it does not matter how many heads those value dims span."""
    import torch

    v.zero_()
    o.zero_()
    eye = torch.eye(WORD_DIMS)
    v[:WORD_DIMS, :WORD_DIMS] = eye
    o[WORD_DIMS : 2 * WORD_DIMS, :WORD_DIMS] = scale * CONTEXT_GAIN * eye


def _ones(tensors, key) -> None:
    tensors[key].fill_(1.0)


def _zero(tensors, *keys) -> None:
    for key in keys:
        tensors[key].zero_()


def distinct_word_tensors(
    tensors: Mapping[str, "torch.Tensor"],
    token_ids: Mapping[str, Mapping[str, set[int]]],
    directions: Mapping[str, "torch.Tensor"],
) -> dict[str, "torch.Tensor"]:
    """A copy of the text parts of `tensors` (keyed "<part>/<key>" as in weights.safetensors) with the bag-of-
    words design above. `token_ids[part]`: word -> its token ids in that part's tokenizer; a word without a direction
    (FILLERS) embeds as zero."""
    import torch

    out = {key: value.detach().clone().float() for key, value in tensors.items() if key.split("/")[0] in PARTS}
    for part in ("clip_l", "clip_g"):
        p = f"{part}/text_model."
        _embed(out[p + "embeddings.token_embedding.weight"], token_ids[part], directions)
        # No position embedding: the pooled end token must not depend on how long the instruction is.
        _zero(out, p + "embeddings.position_embedding.weight")
        for layer in range(layer_count(out, part)):
            q = f"{p}encoder.layers.{layer}."
            _zero(
                out,
                *(q + f"self_attn.{n}_proj.{w}" for n in ("q", "k") for w in ("weight", "bias")),
                q + "self_attn.v_proj.bias",
                q + "self_attn.out_proj.bias",
                q + "mlp.fc2.weight",
                q + "mlp.fc2.bias",
                q + "layer_norm1.bias",
            )
            _ones(out, q + "layer_norm1.weight")
            if layer == 0:
                _average_into_context(out[q + "self_attn.v_proj.weight"], out[q + "self_attn.out_proj.weight"])
            else:
                _zero(out, q + "self_attn.out_proj.weight")
        out[p + "final_layer_norm.weight"].fill_(POOLED_GAIN)
        _zero(out, p + "final_layer_norm.bias")
        # The pooled output reads the end token's context dims: the average of the instruction's words.
        projection = out[f"{part}/text_projection.weight"]
        projection.zero_()
        projection[:, WORD_DIMS : 2 * WORD_DIMS] = torch.eye(projection.shape[0], WORD_DIMS)
    t5 = "t5/encoder."
    _embed(out["t5/shared.weight"], token_ids["t5"], directions)
    for layer in range(layer_count(out, "t5")):
        q = f"{t5}block.{layer}.layer."
        _zero(out, q + "0.SelfAttention.q.weight", q + "0.SelfAttention.k.weight", q + "1.DenseReluDense.wo.weight")
        _ones(out, q + "0.layer_norm.weight")
        if layer == 0:
            _zero(out, q + "0.SelfAttention.relative_attention_bias.weight")  # uniform over the unmasked tokens
            _average_into_context(out[q + "0.SelfAttention.v.weight"], out[q + "0.SelfAttention.o.weight"])
        else:
            _zero(out, q + "0.SelfAttention.o.weight")
    _ones(out, t5 + "final_layer_norm.weight")
    llama = "llama/model."
    _embed(out[llama + "embed_tokens.weight"], token_ids["llama"], directions, LLAMA_SCALE)
    for layer in range(layer_count(out, "llama")):
        q = f"{llama}layers.{layer}."
        _zero(out, q + "self_attn.q_proj.weight", q + "self_attn.k_proj.weight", q + "mlp.down_proj.weight")
        _ones(out, q + "input_layernorm.weight")
        if layer == 0:
            # One key/value head: every query head reads the same average; only the first one writes it.
            _average_into_context(out[q + "self_attn.v_proj.weight"], out[q + "self_attn.o_proj.weight"], LLAMA_SCALE)
        else:
            _zero(out, q + "self_attn.o_proj.weight")
    _ones(out, llama + "norm.weight")
    return out
