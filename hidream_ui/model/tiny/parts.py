"""The upstream folders, one writer per part: Llama-3.1-8B-Instruct, HiDream-I1-Full (model index,
scheduler, CLIP-L, CLIP-G, T5, VAE), the HiDream transformers and the E1-Full LoRA file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hidream_ui.model.layout import E1_FULL_LORA_ALPHA, E1_FULL_LORA_RANK, E1_FULL_LORA_TARGETS
from hidream_ui.model.tiny.files import _library_versions, _write_json, _write_text
from hidream_ui.model.tiny.profiles import _TEXT, E1_FULL_PLAIN_KEYS, TinyProfile
from hidream_ui.model.tiny.tokenizers import (
    _CLIP_BOS,
    _CLIP_EOS,
    _LLAMA_BOS,
    _LLAMA_CHAT_TEMPLATE,
    _LLAMA_EOS,
    _LLAMA_SPECIALS,
    _LLAMA_SPLIT,
    _SPM_SPACE,
    _T5_EOS,
    _T5_PAD,
    _T5_UNK,
    _added_token,
    _added_token_decoder,
    _sentencepiece_model,
    _Vocabularies,
)
from hidream_ui.model.tiny.weights import (
    _checkpoint_specs,
    _on_meta,
    _random_tensor,
    _write_diffusers_weights,
    _write_hf_weights,
    _write_weights,
)

if TYPE_CHECKING:
    import torch


# --------------------------------------------------------------------------------------------------------------
# Llama-3.1-8B-Instruct


def _write_llama(folder: Path, vocab: _Vocabularies, seed: int, max_length: int | None = None) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import LlamaConfig, LlamaForCausalLM

    _, transformers_version = _library_versions()
    bos, eos = vocab.llama_id(_LLAMA_BOS), vocab.llama_id(_LLAMA_EOS)
    stop_ids = [vocab.llama_id("<|end_of_text|>"), vocab.llama_id("<|eom_id|>"), eos]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": stop_ids,
        "hidden_act": "silu",
        "hidden_size": _TEXT.llama_hidden,
        "initializer_range": 0.02,
        "intermediate_size": _TEXT.llama_intermediate,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": _TEXT.llama_heads,
        "num_hidden_layers": _TEXT.llama_layers,
        "num_key_value_heads": _TEXT.llama_kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": transformers_version,
        "use_cache": True,
        "vocab_size": vocab.llama_size,
    }
    _write_json(folder / "config.json", config)
    _write_json(
        folder / "generation_config.json",
        {
            "bos_token_id": bos,
            "do_sample": True,
            "eos_token_id": stop_ids,
            "temperature": 0.6,
            "top_p": 0.9,
            "transformers_version": transformers_version,
        },
    )

    tokenizer = Tokenizer(
        BPE(vocab=dict(vocab.llama_vocab), merges=list(vocab.llama_merges), ignore_merges=True, fuse_unk=False)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _LLAMA_SPECIALS])
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{_LLAMA_BOS} $A",
                pair=f"{_LLAMA_BOS} $A {_LLAMA_BOS}:1 $B:1",
                special_tokens=[(_LLAMA_BOS, bos)],
            ),
        ]
    )
    _write_text(folder / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    _write_json(
        folder / "tokenizer_config.json",
        {
            "added_tokens_decoder": {str(vocab.llama_id(t)): _added_token_decoder(t) for t in _LLAMA_SPECIALS},
            "bos_token": _LLAMA_BOS,
            "chat_template": _LLAMA_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": True,
            "eos_token": _LLAMA_EOS,
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": max_length or 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    _write_json(
        folder / "special_tokens_map.json",
        {"bos_token": _added_token(_LLAMA_BOS), "eos_token": _added_token(_LLAMA_EOS)},
    )
    model_config = LlamaConfig.from_dict({k: v for k, v in config.items() if k != "transformers_version"})
    model = _on_meta(lambda: LlamaForCausalLM(model_config))
    _write_hf_weights(folder, model, seed, "llama", n_shards=2)


# --------------------------------------------------------------------------------------------------------------
# HiDream-I1-Full: model_index, scheduler, CLIP-L, CLIP-G, T5, VAE


def _write_model_index(folder: Path) -> None:
    diffusers_version, _ = _library_versions()
    # Llama (text_encoder_4 / tokenizer_4) is not part of the HiDream repository: callers pass it explicitly.
    _write_json(
        folder / "model_index.json",
        {
            "_class_name": "HiDreamImagePipeline",
            "_diffusers_version": diffusers_version,
            "scheduler": ["diffusers", "UniPCMultistepScheduler"],
            "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
            "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
            "text_encoder_3": ["transformers", "T5EncoderModel"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "tokenizer_2": ["transformers", "CLIPTokenizer"],
            "tokenizer_3": ["transformers", "T5Tokenizer"],
            "transformer": ["diffusers", "HiDreamImageTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        },
    )


def _scheduler_config() -> dict[str, Any]:
    """HiDream-I1-Full's scheduler as published since the official 2025-04-17 update: diffusers'
    UniPCMultistepScheduler configured as flow matching with shift 3 (before that update the repo shipped
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)). The key set is that of the
    diffusers release the HiDream team saved it with; newer keys load with their defaults."""
    diffusers_version, _ = _library_versions()
    return {
        "_class_name": "UniPCMultistepScheduler",
        "_diffusers_version": diffusers_version,
        "beta_end": 0.02,
        "beta_schedule": "linear",
        "beta_start": 0.0001,
        "disable_corrector": [],
        "dynamic_thresholding_ratio": 0.995,
        "final_sigmas_type": "zero",
        "flow_shift": 3.0,
        "lower_order_final": True,
        "num_train_timesteps": 1000,
        "predict_x0": True,
        "prediction_type": "flow_prediction",
        "rescale_betas_zero_snr": False,
        "sample_max_value": 1.0,
        "solver_order": 2,
        "solver_p": None,
        "solver_type": "bh2",
        "steps_offset": 0,
        "thresholding": False,
        "timestep_spacing": "linspace",
        "trained_betas": None,
        "use_beta_sigmas": False,
        "use_exponential_sigmas": False,
        "use_flow_sigmas": True,
        "use_karras_sigmas": False,
    }


def _write_clip(model_folder: Path, tokenizer_folder: Path, vocab: _Vocabularies, seed: int, big: bool) -> None:
    """CLIP-L (``big=False``, quick_gelu) or CLIP-G (``big=True``, gelu, "!" as pad token like OpenCLIP bigG)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    _, transformers_version = _library_versions()
    hidden = _TEXT.clip_g_hidden if big else _TEXT.clip_l_hidden
    config = {
        "architectures": ["CLIPTextModelWithProjection"],
        "attention_dropout": 0.0,
        # bos 0 / eos 2 / pad 1 are the legacy ids the released configs carry; eos_token_id == 2 selects CLIP's
        # argmax(input_ids) pooling, which finds <|endoftext|> because it has the largest id.
        "bos_token_id": 0,
        "dropout": 0.0,
        "eos_token_id": 2,
        "hidden_act": "gelu" if big else "quick_gelu",
        "hidden_size": hidden,
        "initializer_factor": 1.0,
        "initializer_range": 0.02,
        "intermediate_size": 4 * hidden,
        "layer_norm_eps": 1e-05,
        "max_position_embeddings": _TEXT.clip_max_positions,
        "model_type": "clip_text_model",
        "num_attention_heads": _TEXT.clip_g_heads if big else _TEXT.clip_l_heads,
        "num_hidden_layers": _TEXT.clip_g_layers if big else _TEXT.clip_l_layers,
        "pad_token_id": 1,
        "projection_dim": _TEXT.clip_g_projection if big else _TEXT.clip_l_projection,
        "torch_dtype": "bfloat16",
        "transformers_version": transformers_version,
        "vocab_size": len(vocab.clip_vocab),
    }
    _write_json(model_folder / "config.json", config)
    model_config = CLIPTextConfig.from_dict({k: v for k, v in config.items() if k != "transformers_version"})
    model = _on_meta(lambda: CLIPTextModelWithProjection(model_config))
    _write_hf_weights(model_folder, model, seed, "clip_g" if big else "clip_l", n_shards=1)

    # The released CLIP tokenizers are slow-format files only (vocab.json + merges.txt, no tokenizer.json).
    pad = "!" if big else _CLIP_EOS
    _write_text(tokenizer_folder / "vocab.json", json.dumps(dict(vocab.clip_vocab), ensure_ascii=False) + "\n")
    merges = "".join(f"{a} {b}\n" for a, b in vocab.clip_merges)
    _write_text(tokenizer_folder / "merges.txt", "#version: 0.2\n" + merges)
    decoder = {str(vocab.clip_vocab[t]): _added_token_decoder(t) for t in (_CLIP_BOS, _CLIP_EOS)}
    if big:
        decoder[str(vocab.clip_vocab[pad])] = _added_token_decoder(pad)
    _write_json(
        tokenizer_folder / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "added_tokens_decoder": decoder,
            "bos_token": _CLIP_BOS,
            "clean_up_tokenization_spaces": True,
            "do_lower_case": True,
            "eos_token": _CLIP_EOS,
            "errors": "replace",
            "model_max_length": 77,
            "pad_token": pad,
            "tokenizer_class": "CLIPTokenizer",
            "unk_token": _CLIP_EOS,
        },
    )
    _write_json(
        tokenizer_folder / "special_tokens_map.json",
        {
            "bos_token": _added_token(_CLIP_BOS),
            "eos_token": _added_token(_CLIP_EOS),
            "pad_token": _added_token(pad),
            "unk_token": _added_token(_CLIP_EOS),
        },
    )


def _write_t5(
    model_folder: Path, tokenizer_folder: Path, vocab: _Vocabularies, seed: int, max_length: int | None = None
) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import Unigram
    from transformers import T5Config, T5EncoderModel

    _, transformers_version = _library_versions()
    config = {
        "architectures": ["T5EncoderModel"],
        "classifier_dropout": 0.0,
        "d_ff": _TEXT.t5_d_ff,
        "d_kv": _TEXT.t5_d_kv,
        "d_model": _TEXT.t5_d_model,
        "decoder_start_token_id": 0,
        "dense_act_fn": "gelu_new",
        "dropout_rate": 0.1,
        "eos_token_id": 1,
        "feed_forward_proj": "gated-gelu",
        "initializer_factor": 1.0,
        "is_encoder_decoder": True,
        "is_gated_act": True,
        "layer_norm_epsilon": 1e-06,
        "model_type": "t5",
        "num_decoder_layers": _TEXT.t5_layers,
        "num_heads": _TEXT.t5_heads,
        "num_layers": _TEXT.t5_layers,
        "output_past": True,
        "pad_token_id": 0,
        "relative_attention_max_distance": 128,
        "relative_attention_num_buckets": 32,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": transformers_version,
        "use_cache": True,
        # Padded to a multiple of 128 beyond the tokenizer, as T5's 32128 rows for 32100 tokens.
        "vocab_size": -(-vocab.t5_size // 128) * 128,
    }
    _write_json(model_folder / "config.json", config)
    model_config = T5Config.from_dict({k: v for k, v in config.items() if k != "transformers_version"})
    model = _on_meta(lambda: T5EncoderModel(model_config))
    _write_hf_weights(model_folder, model, seed, "t5", n_shards=2)

    sentinels = vocab.t5_sentinels
    unigram_vocab = list(vocab.t5_pieces) + [(s, 0.0) for s in sentinels]
    tokenizer = Tokenizer(Unigram(unigram_vocab, unk_id=2, byte_fallback=False))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPM_SPACE, prepend_scheme="always", split=True)
    tokenizer.decoder = decoders.Metaspace(replacement=_SPM_SPACE, prepend_scheme="always", split=True)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (_T5_PAD, _T5_EOS, _T5_UNK, *sentinels)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=["$A", _T5_EOS], pair=["$A", _T5_EOS, "$B", _T5_EOS], special_tokens=[(_T5_EOS, 1)]
    )
    _write_text(tokenizer_folder / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    (tokenizer_folder / "spiece.model").write_bytes(_sentencepiece_model(vocab.t5_pieces))
    first_sentinel = len(vocab.t5_pieces)
    decoder = {str(i): _added_token_decoder(t) for i, t in enumerate((_T5_PAD, _T5_EOS, _T5_UNK))}
    decoder.update({str(first_sentinel + i): _added_token_decoder(t) for i, t in enumerate(sentinels)})
    in_order = [f"<extra_id_{i}>" for i in range(_TEXT.t5_extra_ids)]
    _write_json(
        tokenizer_folder / "tokenizer_config.json",
        {
            "add_prefix_space": True,
            "added_tokens_decoder": decoder,
            "additional_special_tokens": in_order,
            "clean_up_tokenization_spaces": True,
            "eos_token": _T5_EOS,
            "extra_ids": _TEXT.t5_extra_ids,
            "legacy": True,
            "model_max_length": max_length or 512,
            "pad_token": _T5_PAD,
            "sp_model_kwargs": {},
            "tokenizer_class": "T5Tokenizer",
            "unk_token": _T5_UNK,
        },
    )
    _write_json(
        tokenizer_folder / "special_tokens_map.json",
        {
            "additional_special_tokens": in_order,
            "eos_token": _added_token(_T5_EOS),
            "pad_token": _added_token(_T5_PAD),
            "unk_token": _added_token(_T5_UNK),
        },
    )


def _vae_config(spec: TinyProfile | None = None) -> dict[str, Any]:
    diffusers_version, _ = _library_versions()
    channels = (spec.vae_block_out_channels if spec is not None else None) or _TEXT.vae_block_out_channels
    blocks = len(channels)
    return {
        "_class_name": "AutoencoderKL",
        "_diffusers_version": diffusers_version,
        "act_fn": "silu",
        "block_out_channels": list(channels),
        "down_block_types": ["DownEncoderBlock2D"] * blocks,
        "force_upcast": True,
        "in_channels": 3,
        # No profile (the shared text-side builds): the profile defaults, so each number has one home.
        "latent_channels": (spec or TinyProfile).latent_channels,
        "latents_mean": None,
        "latents_std": None,
        "layers_per_block": (spec or TinyProfile).vae_layers_per_block,
        "mid_block_add_attention": True,
        "norm_num_groups": (spec.vae_norm_num_groups if spec is not None else None) or _TEXT.vae_norm_num_groups,
        "out_channels": 3,
        "sample_size": 1024,
        # Flux's VAE, which HiDream uses: latents are (z - shift) * scale.
        "scaling_factor": 0.3611,
        "shift_factor": 0.1159,
        "up_block_types": ["UpDecoderBlock2D"] * blocks,
        "use_post_quant_conv": False,
        "use_quant_conv": False,
    }


def _write_vae(folder: Path, seed: int, spec: TinyProfile | None = None) -> None:
    from diffusers import AutoencoderKL

    config = _vae_config(spec)
    _write_json(folder / "config.json", config)
    model = _on_meta(lambda: AutoencoderKL(**{k: v for k, v in config.items() if not k.startswith("_")}))
    # bf16 like the released Flux VAE; from_pretrained(torch_dtype=...) casts on load.
    _write_diffusers_weights(folder, model, seed, "vae", n_shards=1)


# --------------------------------------------------------------------------------------------------------------
# HiDream transformers: I1-Full, E1-1 and the E1-Full LoRA file


def _transformer_on_meta(spec: TinyProfile) -> torch.nn.Module:
    from diffusers import HiDreamImageTransformer2DModel

    return _on_meta(lambda: HiDreamImageTransformer2DModel(**spec.transformer_config()))


def _write_transformer(folder: Path, spec: TinyProfile, seed: int, stream: str) -> None:
    diffusers_version, _ = _library_versions()
    config = {
        "_class_name": "HiDreamImageTransformer2DModel",
        "_diffusers_version": diffusers_version,
        **spec.transformer_config(),
    }
    _write_json(folder / "config.json", config)
    _write_diffusers_weights(folder, _transformer_on_meta(spec), seed, stream, n_shards=spec.transformer_shards)


def _write_e1_full(path: Path, spec: TinyProfile, seed: int) -> None:
    """The E1-Full file: every LoRA tensor of the adapter-wrapped I1 transformer plus E1_FULL_PLAIN_KEYS, with
    key names taken from the wrapped model's own state_dict so ``load_state_dict(strict=False)`` has no
    unexpected keys."""
    from peft import LoraConfig

    model = _transformer_on_meta(spec)
    model.add_adapter(
        LoraConfig(
            r=E1_FULL_LORA_RANK,
            lora_alpha=E1_FULL_LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=list(E1_FULL_LORA_TARGETS),
            init_lora_weights="gaussian",
        )
    )
    wrapped = {tensor.name: tensor for tensor in _checkpoint_specs(model)}
    missing = [key for key in E1_FULL_PLAIN_KEYS if key not in wrapped]
    if missing:
        raise RuntimeError(
            f"E1-Full plain keys {missing} are not in the adapter-wrapped transformer's state_dict: the installed "
            "diffusers renamed transformer modules; update E1_FULL_PLAIN_KEYS in hidream_ui/model/tiny/profiles.py"
        )
    specs = [
        tensor
        for name, tensor in wrapped.items()
        if ".lora_A." in name or ".lora_B." in name or name in E1_FULL_PLAIN_KEYS
    ]
    _write_weights(
        path.parent,
        specs=specs,
        make=lambda tensor: _random_tensor(seed, "e1_full", tensor),
        single_name=path.name,
        shard_prefix=path.stem,
        index_name=f"{path.name}.index.json",
        n_shards=1,
    )
