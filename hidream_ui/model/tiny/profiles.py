"""The tiny checkpoint's profiles (sizes per part), its marker file and format version."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

# Bump whenever the bytes written for a given (profile, seed) change: ensure_tiny() keys its cache on it.
FORMAT_VERSION = 4

MARKER_FILENAME = "hidream_ui_tiny.json"
# Single-file copies of the E1.1 transformer (for --transformer-file): diffusers keys, and the ComfyUI
# repackaged layout (every key under "model.diffusion_model.").
SINGLE_FILE_DIR = "single_file"
SINGLE_FILES = {"diffusers": "hidream_e1_1_diffusers.safetensors", "comfyui": "hidream_e1_1_comfyui_bf16.safetensors"}
COMFYUI_PREFIX = "model.diffusion_model."
# Non-LoRA keys the tiny E1-Full checkpoint replaces (names as in the adapter-wrapped state_dict). The real file's
# plain keys are not documented; these exercise the "reload_keys" path of the editing pipeline.
E1_FULL_PLAIN_KEYS: tuple[str, ...] = (
    "x_embedder.proj.weight",
    "x_embedder.proj.bias",
    "t_embedder.timestep_embedder.linear_1.weight",
    "t_embedder.timestep_embedder.linear_1.bias",
)

# Where the offline model is built (env_names.py: its deprecated old name HIDREAM_UI_CACHE still works).
CACHE_ENV_VAR = "HIDREAM_MODEL_CACHE"


@dataclass(frozen=True)
class TinyProfile:
    """Geometry of the HiDream transformer for one tiny profile (the text encoders are tiny in every profile)."""

    name: str
    description: str
    num_layers: int
    num_single_layers: int
    num_attention_heads: int
    attention_head_dim: int
    axes_dims_rope: tuple[int, ...]
    max_resolution: tuple[int, int]
    llama_layers: tuple[int, ...]
    transformer_shards: int
    patch_size: int = 2
    latent_channels: int = 16
    num_routed_experts: int = 4
    num_activated_experts: int = 2
    # The VAE (None: the shared tiny VAE of _TextGeometry, two resnets per level).
    vae_block_out_channels: tuple[int, ...] | None = None
    vae_layers_per_block: int = 2
    # GroupNorm groups of the VAE (None: the shared tiny value). Two channels per group normalise a flat map to
    # +-1 and lose its level: a VAE that must reproduce flat colours needs several channels per group.
    vae_norm_num_groups: int | None = None
    # Tokens T5 and Llama pad every prompt to (their tokenizers' model_max_length; None: the released
    # tokenizers' values). The trained model's instructions are at most 6 tokens: 16 keeps its attention short.
    text_tokens: int | None = None
    # Extra whole-word tokens for every tokenizer (the trained model's world words).
    extra_words: tuple[str, ...] = ()
    # Trained weights in the repository (relative to assets/): the build overlays them on the random ones.
    weights_asset: str | None = None

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def max_seq(self) -> int:
        return self.max_resolution[0] * self.max_resolution[1] // (self.patch_size * self.patch_size)

    def transformer_config(self) -> dict[str, Any]:
        """The ``HiDreamImageTransformer2DModel`` init arguments (what ``transformer/config.json`` holds)."""
        return {
            "patch_size": self.patch_size,
            "in_channels": self.latent_channels,
            "out_channels": self.latent_channels,
            "num_layers": self.num_layers,
            "num_single_layers": self.num_single_layers,
            "attention_head_dim": self.attention_head_dim,
            "num_attention_heads": self.num_attention_heads,
            # [T5 d_model, Llama hidden]: diffusers projects the Llama layers with [1] and T5 with [0].
            "caption_channels": [_TEXT.t5_d_model, _TEXT.llama_hidden],
            "text_emb_dim": _TEXT.clip_l_projection + _TEXT.clip_g_projection,
            "num_routed_experts": self.num_routed_experts,
            "num_activated_experts": self.num_activated_experts,
            "axes_dims_rope": list(self.axes_dims_rope),
            "max_resolution": list(self.max_resolution),
            "llama_layers": list(self.llama_layers),
            "force_inference_output": False,
        }


@dataclass(frozen=True)
class _TextGeometry:
    """Tiny text side shared by all profiles; names follow the real encoders they stand in for."""

    clip_l_hidden: int = 32
    clip_l_projection: int = 16
    clip_l_layers: int = 2
    clip_l_heads: int = 2
    clip_g_hidden: int = 48
    clip_g_projection: int = 16
    clip_g_layers: int = 2
    clip_g_heads: int = 4
    # Long-context CLIP: the HiDream pipeline pads CLIP prompts to min(max_sequence_length, 218) tokens.
    clip_max_positions: int = 248
    t5_d_model: int = 32
    t5_d_kv: int = 8
    t5_d_ff: int = 64
    t5_heads: int = 4
    t5_layers: int = 2
    t5_extra_ids: int = 100
    llama_hidden: int = 32
    llama_intermediate: int = 64
    llama_layers: int = 4
    llama_heads: int = 2
    llama_kv_heads: int = 1
    vae_block_out_channels: tuple[int, ...] = (8, 8, 16, 16)
    vae_norm_num_groups: int = 4


_TEXT = _TextGeometry()

PROFILES: Mapping[str, TinyProfile] = MappingProxyType(
    {
        "tiny": TinyProfile(
            name="tiny",
            description="a few MB; for tests and the offline demo",
            num_layers=2,
            num_single_layers=2,
            num_attention_heads=2,
            attention_head_dim=16,
            axes_dims_rope=(8, 4, 4),
            max_resolution=(16, 16),
            llama_layers=(0, 1, 2, 3),
            transformer_shards=2,
        ),
        "bench": TinyProfile(
            name="bench",
            description="the real attention geometry (20 heads x 128, max_seq 4096) with 1 double + 1 single block",
            num_layers=1,
            num_single_layers=1,
            num_attention_heads=20,
            attention_head_dim=128,
            axes_dims_rope=(64, 32, 32),
            max_resolution=(128, 128),
            llama_layers=(2, 3),
            transformer_shards=4,
        ),
        # Trained on the synthetic world of world.py (`train-tiny`): weights ship in assets/tiny_trained/.
        "trained": TinyProfile(
            name="trained",
            description="trained on the synthetic shapes world (recolour, remove, background); 128x128",
            num_layers=2,
            num_single_layers=2,
            # 96 dims: each token's stream carries its noisy latent patch and the source patch the copy heads
            # bring (copy_heads, lab/train/model.py); with 16 latent channels (2 x 2 x 16 = 64 numbers a patch)
            # 64 dims could not hold both. Wider would not fit the 8 MB budget with four MoE blocks: from 97 dims
            # on, the experts' hidden size rounds up to 512.
            num_attention_heads=3,
            attention_head_dim=32,
            # More rotary dims per image axis than the release's 1:2:2 split: with theta 10000 an 8-dim axis has
            # one usable frequency over 16 columns (offsets 0 and 6 look alike), and the edit must find the
            # source token 8 columns to the right of each target token to copy it. 12 dims give two.
            axes_dims_rope=(8, 12, 12),
            max_resolution=(16, 16),
            llama_layers=(0, 1, 2, 3),
            transformer_shards=1,
            # 4, not the release's 16: a patch of 2 x 2 x 4 = 16 numbers leaves the 96-dim stream room for the
            # source patch and the instruction. Measured (docs/lab-notebook.md, "Fewer latent channels"): the
            # VAE still reconstructs the world better (36 against 32 dB), and the training chain of the 16-channel
            # weights, one fine-tune longer, edits 90 % of the benchmark's held-out cases against 57 %.
            latent_channels=4,
            vae_block_out_channels=(16, 32, 32, 32),
            vae_layers_per_block=1,
            vae_norm_num_groups=2,
            text_tokens=16,
            # world.WORDS (not imported: profiles stay free of the world); tests/test_tiny_trained.py checks it.
            extra_words=(
                "make",
                "the",
                "remove",
                "background",
                "circle",
                "square",
                "triangle",
                "red",
                "green",
                "blue",
                "yellow",
                "purple",
                "orange",
                "white",
                "black",
                "gray",
            ),
            weights_asset="tiny_trained",
        ),
        # HiDream's real block count at a small width: what step caching's speed-up depends on (bench speed).
        "deep": TinyProfile(
            name="deep",
            description="the real block count (16 double + 32 single blocks) at a small width (4 heads x 32)",
            num_layers=16,
            num_single_layers=32,
            num_attention_heads=4,
            attention_head_dim=32,
            axes_dims_rope=(16, 8, 8),
            max_resolution=(32, 32),
            llama_layers=(0, 1, 2, 3) + (3,) * 44,  # one per block, the last repeated, as the release does
            transformer_shards=2,
        ),
    }
)


@dataclass(frozen=True)
class TinyMarker:
    """Content of ``hidream_ui_tiny.json``: what was built and by which format version."""

    profile: str
    seed: int
    format_version: int


# --------------------------------------------------------------------------------------------------------------
# The `full` profile: every part at the real release's dimensions, taken from the published config.json files of
# HiDream-ai/HiDream-I1-Full (transformer/, text_encoder/, text_encoder_2/, text_encoder_3/, vae/), HiDream-ai/
# HiDream-E1-1 (transformer/: same architecture as I1-Full) and meta-llama/Llama-3.1-8B-Instruct. Never written to
# disk (~61 GB in bf16): the planner reads these configs (parameter bytes counted on the `meta` device, no memory)
# and benchmarks build random bf16 weights from them in memory on the target. Only the keys that decide the
# parameter shapes are kept.

FULL_PROFILE_NAME = "full"

RELEASE_CONFIGS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "transformer": MappingProxyType(
            {
                "patch_size": 2,
                "in_channels": 16,
                "out_channels": 16,
                "num_layers": 16,
                "num_single_layers": 32,
                "attention_head_dim": 128,
                "num_attention_heads": 20,
                "caption_channels": [4096, 4096],
                "text_emb_dim": 2048,
                "num_routed_experts": 4,
                "num_activated_experts": 2,
                "axes_dims_rope": [64, 32, 32],
                "max_resolution": [128, 128],
                "llama_layers": [*range(32), *([31] * 16)],
                "force_inference_output": False,
            }
        ),
        # LlamaModel (no LM head, see model/loading.py) of Llama-3.1-8B-Instruct.
        "llama": MappingProxyType(
            {
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "vocab_size": 128256,
                "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-05,
                "rope_theta": 500000.0,
                "tie_word_embeddings": False,
            }
        ),
        # T5-XXL encoder (text_encoder_3, T5EncoderModel).
        "t5": MappingProxyType(
            {
                "d_model": 4096,
                "d_ff": 10240,
                "d_kv": 64,
                "num_heads": 64,
                "num_layers": 24,
                "vocab_size": 32128,
                "feed_forward_proj": "gated-gelu",
                "relative_attention_num_buckets": 32,
                "relative_attention_max_distance": 128,
                "is_encoder_decoder": True,
            }
        ),
        # Long-context CLIP-L / CLIP-G (CLIPTextModelWithProjection, 248 positions).
        "clip_l": MappingProxyType(
            {
                "hidden_size": 768,
                "intermediate_size": 3072,
                "num_hidden_layers": 12,
                "num_attention_heads": 12,
                "projection_dim": 768,
                "vocab_size": 49408,
                "max_position_embeddings": 248,
                "hidden_act": "quick_gelu",
            }
        ),
        "clip_g": MappingProxyType(
            {
                "hidden_size": 1280,
                "intermediate_size": 5120,
                "num_hidden_layers": 32,
                "num_attention_heads": 20,
                "projection_dim": 1280,
                "vocab_size": 49408,
                "max_position_embeddings": 248,
                "hidden_act": "gelu",
            }
        ),
        # The FLUX-style 16-channel VAE (AutoencoderKL).
        "vae": MappingProxyType(
            {
                "in_channels": 3,
                "out_channels": 3,
                "latent_channels": 16,
                "block_out_channels": [128, 256, 512, 512],
                "down_block_types": ["DownEncoderBlock2D"] * 4,
                "up_block_types": ["UpDecoderBlock2D"] * 4,
                "layers_per_block": 2,
                "norm_num_groups": 32,
                "scaling_factor": 0.3611,
                "shift_factor": 0.1159,
                "use_quant_conv": False,
                "use_post_quant_conv": False,
                "sample_size": 1024,
            }
        ),
    }
)
