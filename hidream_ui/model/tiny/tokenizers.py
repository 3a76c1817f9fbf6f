"""Fixed tokenizer vocabularies for the tiny checkpoint (no trainer involved): byte-level BPE for CLIP and
Llama, a Unigram SentencePiece model for T5.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from hidream_ui.model.tiny.profiles import _TEXT

# --------------------------------------------------------------------------------------------------------------
# Tokenizer vocabularies (fixed, no trainer involved)

# Words that get whole-word tokens. Any text still tokenizes (byte-level BPE falls back to bytes, the T5 Unigram
# vocabulary has every ASCII character), these just keep typical prompts short.
_WORDS: tuple[str, ...] = (
    "a",
    "an",
    "the",
    "of",
    "in",
    "on",
    "at",
    "to",
    "and",
    "or",
    "with",
    "without",
    "into",
    "from",
    "by",
    "for",
    "is",
    "are",
    "it",
    "its",
    "this",
    "that",
    "make",
    "change",
    "turn",
    "convert",
    "add",
    "remove",
    "replace",
    "keep",
    "put",
    "give",
    "edit",
    "editing",
    "instruction",
    "target",
    "description",
    "image",
    "photo",
    "picture",
    "style",
    "ghibli",
    "anime",
    "cartoon",
    "painting",
    "sketch",
    "oil",
    "watercolor",
    "cat",
    "dog",
    "bird",
    "horse",
    "person",
    "man",
    "woman",
    "child",
    "face",
    "hair",
    "hat",
    "shirt",
    "dress",
    "sign",
    "text",
    "says",
    "holding",
    "wearing",
    "sitting",
    "standing",
    "tree",
    "flower",
    "house",
    "car",
    "street",
    "city",
    "sky",
    "cloud",
    "sun",
    "moon",
    "night",
    "day",
    "snow",
    "rain",
    "water",
    "sea",
    "beach",
    "mountain",
    "forest",
    "background",
    "foreground",
    "light",
    "dark",
    "red",
    "green",
    "blue",
    "yellow",
    "black",
    "white",
    "pink",
    "purple",
    "orange",
    "brown",
    "gray",
    "small",
    "large",
    "big",
    "old",
    "new",
    "young",
    "happy",
    "sad",
    "low",
    "high",
    "quality",
    "resolution",
    "blur",
    "blurry",
    "distorted",
    "detailed",
    "realistic",
    "bright",
    "color",
    "colors",
)
_CLIP_BOS = "<|startoftext|>"
_CLIP_EOS = "<|endoftext|>"
# Llama-3.1 special tokens in their real order (ids 128000..128010 in the 8B release).
_LLAMA_SPECIALS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
_LLAMA_BOS = "<|begin_of_text|>"
_LLAMA_EOS = "<|eot_id|>"  # the Instruct model's eos (tokenizer_config); generation stops on three ids
# Llama-3's pre-tokenizer split (contractions, letters, 1-3 digit groups, punctuation runs, newlines, spaces).
_LLAMA_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
_T5_PAD, _T5_EOS, _T5_UNK = "<pad>", "</s>", "<unk>"
_SPM_SPACE = "\u2581"


def _byte_table() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for every raw byte, in vocabulary-rank order (GPT-2's mapping, used by
    CLIP and Llama-3 alike): printable Latin-1 bytes stand for themselves and come first, the other bytes map to
    code points from 256 up and follow in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    table = {b: chr(b) for b in printable}
    for shift, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + shift)
    return table


def _chain_merges(words: Sequence[Sequence[str]], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Left-to-right merges that build each word from its symbols; new tokens are appended to ``vocab``."""
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for symbols in words:
        current = symbols[0]
        for symbol in symbols[1:]:
            pair = (current, symbol)
            current = current + symbol
            if pair not in seen:
                seen.add(pair)
                merges.append(pair)
            if current not in vocab:
                vocab[current] = len(vocab)
    return merges


def _bpe(symbols: Sequence[str], ranks: Mapping[tuple[str, str], int]) -> list[str]:
    """CLIP's BPE: merge the best-ranked adjacent pair (all its occurrences) until none has a rank."""
    parts = list(symbols)
    while len(parts) > 1:
        rank, pair = min((ranks.get(p, len(ranks)), p) for p in zip(parts, parts[1:]))
        if rank == len(ranks):
            break
        merged, i = [], 0
        while i < len(parts):
            if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return parts


def _merge_until_whole(symbols: list[str], merges: list[tuple[str, str]], vocab: dict[str, int]) -> None:
    """Append merges until BPE turns ``symbols`` into one token. Chain merges alone do not ensure it (BPE applies
    merges by rank: "green"'s g+r loses to "remove"'s r+e). Appended merges rank last, so they only act where no
    earlier merge does: every word that was one token stays one."""
    for _ in range(len(symbols)):
        parts = _bpe(symbols, {pair: rank for rank, pair in enumerate(merges)})
        if len(parts) == 1:
            return
        merges.append((parts[0], parts[1]))
        vocab.setdefault(parts[0] + parts[1], len(vocab))
    raise RuntimeError(f"could not make {''.join(symbols)!r} one CLIP token")


@dataclass(frozen=True)
class _Vocabularies:
    llama_vocab: Mapping[str, int]
    llama_merges: tuple[tuple[str, str], ...]
    clip_vocab: Mapping[str, int]
    clip_merges: tuple[tuple[str, str], ...]
    t5_pieces: tuple[tuple[str, float], ...]  # sentencepiece pieces (no sentinels), ids 0..n-1

    @staticmethod
    def build(extra_words: Sequence[str] = ()) -> _Vocabularies:
        """The vocabularies; ``extra_words`` (a profile's own: the trained model's world) are made whole-word
        tokens for sure (see _merge_until_whole). No extra words: the same vocabularies as ever."""
        words = _WORDS + tuple(dict.fromkeys(w for w in extra_words if w not in _WORDS))
        table = _byte_table()
        alphabet = list(table.values())

        def as_bytes(text: str) -> list[str]:
            return [table[b] for b in text.encode("utf-8")]

        llama_vocab = {symbol: i for i, symbol in enumerate(alphabet)}
        llama_words = [as_bytes(w) for w in words if len(w) > 1]
        llama_words += [as_bytes(" " + w) for w in words]
        llama_words += [as_bytes(" " + w.capitalize()) for w in words] + [as_bytes(w.capitalize()) for w in words]
        llama_merges = _chain_merges(llama_words, llama_vocab)

        clip_vocab = {symbol: i for i, symbol in enumerate(alphabet)}
        clip_vocab.update({symbol + "</w>": 256 + i for i, symbol in enumerate(alphabet)})
        clip_words = [as_bytes(w)[:-1] + [as_bytes(w)[-1] + "</w>"] for w in words if len(w) > 1]
        clip_merges = _chain_merges(clip_words, clip_vocab)
        for word in dict.fromkeys(extra_words):
            _merge_until_whole(as_bytes(word)[:-1] + [as_bytes(word)[-1] + "</w>"], clip_merges, clip_vocab)
        # The real CLIP vocabulary ends with these two; the legacy pooling (config eos_token_id == 2) takes the
        # hidden state at argmax(input_ids), which is the end-of-text token only if it has the largest id.
        clip_vocab[_CLIP_BOS] = len(clip_vocab)
        clip_vocab[_CLIP_EOS] = len(clip_vocab)

        chars = [chr(c) for c in range(33, 127)]
        pieces: list[tuple[str, float]] = [(_T5_PAD, 0.0), (_T5_EOS, 0.0), (_T5_UNK, 0.0), (_SPM_SPACE, -4.0)]
        # Whole words beat their letters (higher log-probability), so common words are single tokens.
        pieces += [(_SPM_SPACE + w, -5.0 - 0.01 * i) for i, w in enumerate(words)]
        pieces += [(_SPM_SPACE + w.capitalize(), -6.0 - 0.01 * i) for i, w in enumerate(words)]
        pieces += [(c, -10.0 - 0.01 * i) for i, c in enumerate(chars)]
        pieces += [(_SPM_SPACE + c, -10.5 - 0.01 * i) for i, c in enumerate(chars)]
        # sentencepiece rejects duplicate pieces ("▁a" is both a word and a spaced letter): keep the first.
        seen: set[str] = set()
        pieces = [(p, s) for p, s in pieces if not (p in seen or seen.add(p))]
        return _Vocabularies(
            llama_vocab=MappingProxyType(llama_vocab),
            llama_merges=tuple(llama_merges),
            clip_vocab=MappingProxyType(clip_vocab),
            clip_merges=tuple(clip_merges),
            t5_pieces=tuple(pieces),
        )

    @property
    def llama_size(self) -> int:
        return len(self.llama_vocab) + len(_LLAMA_SPECIALS)

    def llama_id(self, token: str) -> int:
        return len(self.llama_vocab) + _LLAMA_SPECIALS.index(token)

    @property
    def t5_sentinels(self) -> tuple[str, ...]:
        # Like T5's real vocabulary: <extra_id_99> right after the sentencepiece pieces, <extra_id_0> last.
        return tuple(f"<extra_id_{i}>" for i in range(_TEXT.t5_extra_ids - 1, -1, -1))

    @property
    def t5_size(self) -> int:
        return len(self.t5_pieces) + _TEXT.t5_extra_ids


def _added_token(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def _added_token_decoder(content: str) -> dict[str, Any]:
    return {**_added_token(content), "special": True}


def _sentencepiece_model(pieces: Sequence[tuple[str, float]]) -> bytes:
    """A unigram ``spiece.model`` holding exactly ``pieces``, serialized directly (no training, so it is
    deterministic). Sentinels are not pieces: like T5's real model they exist only as added tokens."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    model = spm.ModelProto()
    kinds = {_T5_PAD: spm.ModelProto.SentencePiece.CONTROL, _T5_EOS: spm.ModelProto.SentencePiece.CONTROL}
    kinds[_T5_UNK] = spm.ModelProto.SentencePiece.UNKNOWN
    for piece, score in pieces:
        entry = model.pieces.add()
        entry.piece = piece
        entry.score = score
        entry.type = kinds.get(piece, spm.ModelProto.SentencePiece.NORMAL)
    trainer = model.trainer_spec
    trainer.model_type = spm.TrainerSpec.UNIGRAM
    trainer.vocab_size = len(pieces)
    trainer.pad_id, trainer.eos_id, trainer.unk_id, trainer.bos_id = 0, 1, 2, -1
    trainer.pad_piece, trainer.eos_piece, trainer.unk_piece = _T5_PAD, _T5_EOS, _T5_UNK
    normalizer = model.normalizer_spec
    normalizer.name = "identity"  # T5's nmt_nfkc needs a compiled charsmap blob; identity needs none
    normalizer.add_dummy_prefix = True
    normalizer.remove_extra_whitespaces = True
    normalizer.escape_whitespaces = True
    return model.SerializeToString(deterministic=True)
