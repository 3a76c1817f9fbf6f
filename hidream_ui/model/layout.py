"""The upstream release's folder layout and E1-Full's LoRA geometry: one home for both, read by the
loader and written by the tiny builder.
"""

from __future__ import annotations

# Tokens per text encoder as HiDream's pipeline encodes a prompt: the pipeline's rule, kept there (the
# pipeline imports nothing from the model package); read here by the planner and the trace.
from hidream_ui.pipeline.prompts import PROMPT_TOKENS  # noqa: F401  re-exported

LLAMA_DIR = "Llama-3.1-8B-Instruct"
I1_DIR = "HiDream-I1-Full"
E11_DIR = "HiDream-E1-1"
E1_FULL_DIR = "HiDream-E1-Full"
E1_FULL_FILE = "HiDream-E1-Full.safetensors"
HUB_IDS = {
    "llama": "meta-llama/Llama-3.1-8B-Instruct",
    "i1": "HiDream-ai/HiDream-I1-Full",
    "e1.1": "HiDream-ai/HiDream-E1-1",
    "e1-full": "HiDream-ai/HiDream-E1-Full",
}
# The adapter HiDream-E1-Full is trained with: upstream inference.py adds exactly this LoraConfig to the
# HiDream-I1-Full transformer before loading the checkpoint with strict=False.
E1_FULL_LORA_TARGETS = (
    "to_k",
    "to_q",
    "to_v",
    "to_out",
    "to_k_t",
    "to_q_t",
    "to_v_t",
    "to_out_t",
    "w1",
    "w2",
    "w3",
    "final_layer.linear",
)
E1_FULL_LORA_RANK = 16
E1_FULL_LORA_ALPHA = 16


def e1_full_lora_config():
    """peft's LoraConfig of that adapter, as upstream adds it (peft imported here, on first use)."""
    from peft import LoraConfig

    return LoraConfig(
        r=E1_FULL_LORA_RANK,
        lora_alpha=E1_FULL_LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=list(E1_FULL_LORA_TARGETS),
        init_lora_weights="gaussian",
    )


I1_COMPONENTS = (
    "scheduler",
    "vae",
    "text_encoder",
    "text_encoder_2",
    "text_encoder_3",
    "tokenizer",
    "tokenizer_2",
    "tokenizer_3",
    "transformer",
)
