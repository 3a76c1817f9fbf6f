"""One whole `train-tiny` run (`train`): a random build, the VAE, the prompt embeddings, the transformer, and the
asset folder it writes with its record (the command that redoes it, versions, lineage)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from hidream_ui.lab import words
from hidream_ui.lab.scoring import PROFILE
from hidream_ui.lab.train.data import Seeds, world_prompts
from hidream_ui.lab.train.loop import train_transformer
from hidream_ui.lab.train.settings import CLI_KNOBS, TrainReport, TrainSettings
from hidream_ui.lab.train.vae import latent_stats, load_vae, train_vae
from hidream_ui.model.layout import E11_DIR, I1_DIR, LLAMA_DIR
from hidream_ui.model.tiny import trained
from hidream_ui.model.tiny.profiles import PROFILES


def train(
    out: Path,
    settings: TrainSettings,
    log: Callable[[str], None] = print,
    vae_from: Path | None = None,
    init_from: Path | None = None,
) -> TrainReport:
    """Train the VAE (or take it from `vae_from`), then the transformer, and write the asset folder `out`.
    `init_from`: fine-tune instead: the transformer starts from that run's weights, and its VAE and text
    encoders are taken too (the transformer only knows their latents and embeddings)."""
    import torch

    from hidream_ui.model.tiny.build import build_tiny

    started = time.perf_counter()
    torch.set_num_threads(settings.threads)
    out = Path(out)
    spec = PROFILES[PROFILE]
    scratch = Path(tempfile.mkdtemp(prefix="train-tiny-"))
    try:
        base = build_tiny(scratch / "base", PROFILE, settings.seed, trained_weights=False)
        log(f"train-tiny: random {PROFILE} build (seed {settings.seed}) in {time.perf_counter() - started:.1f} s")
        if init_from is not None:
            # The text encoders are random weights that depend on the build's seed: a fine-tune must keep the
            # ones its transformer learned to read (the prompt embeddings below and the written asset).
            trained.overlay(base, Path(init_from))
        if settings.word_encoders:
            words.apply(base, words.DIRECTION_SEED, world_prompts())
            log("train-tiny: text encoders set to distinct words (words.py)")
        prompts = world_prompts()
        negative = _negative_prompt()
        embeds = prompt_embeddings(base, [*prompts, negative])
        seeds = Seeds(settings.seed)

        if init_from is not None:
            vae_from = init_from
        if vae_from is not None:  # the VAE (and its latent statistics) of an earlier run, as it was
            vae, vae_loss, shift, scale = load_vae(base, Path(vae_from))
            log(f"train-tiny: VAE from {vae_from} (its final loss {vae_loss:.5f})")
        else:
            vae, vae_loss = train_vae(base, settings, seeds, log)
            shift, scale = latent_stats(vae, seeds, torch)
        log(f"train-tiny: VAE latents shift {shift:.4f} scale {scale:.4f}")

        text_parts = {
            k: v for k, v in trained.part_tensors(base).items() if k.split("/")[0] not in ("vae", "transformer")
        }

        def save(ema, loss: float, step: int) -> dict:
            tensors = dict(text_parts)
            tensors.update({f"vae/{k}": v for k, v in vae.state_dict().items()})
            tensors.update({f"transformer/{k}": v for k, v in ema.state_dict().items()})
            meta = run_meta(
                settings, shift, scale, vae_loss, loss, time.perf_counter() - started, step, vae_from, init_from
            )
            trained.write_asset(out, tensors, meta)
            return meta

        init = transformer_tensors(Path(init_from)) if init_from is not None else None
        if init is not None:
            log(f"train-tiny: transformer from {init_from} (fine-tune)")
        transformer, ema, loss = train_transformer(
            spec, vae, shift, scale, embeds, len(prompts), settings, seeds, prompts, log, save, init
        )
        meta = save(ema, loss, settings.steps)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.perf_counter() - started
    size = sum(p.stat().st_size for p in out.iterdir())
    log(f"train-tiny: wrote {out} ({size / 1e6:.2f} MB) in {seconds:.0f} s")
    return TrainReport(out=out, seconds=seconds, vae_loss=vae_loss, loss=loss, meta=meta)


def run_meta(
    settings: TrainSettings,
    shift: float,
    scale: float,
    vae_loss: float,
    loss: float,
    seconds: float,
    step: int,
    vae_from: Path | None = None,
    init_from: Path | None = None,
) -> dict:
    import torch

    if init_from is not None:
        start = f"--init-from {init_from}"
    elif vae_from is not None:
        start = f"--vae-from {vae_from}"
    else:
        start = f"--vae-steps {settings.vae_steps}"
    defaults = TrainSettings()
    knobs = "".join(
        f" --{name.replace('_', '-')} {getattr(settings, name)}"
        for name in CLI_KNOBS
        if getattr(settings, name) != getattr(defaults, name)
    )
    if settings.word_encoders:
        knobs += " --word-encoders"
    command = (
        f"python -m hidream_ui train-tiny OUT --steps {settings.steps} {start}{knobs} --seed {settings.seed} "
        f"--threads {settings.threads}"
    )

    meta = {
        "profile": PROFILE,
        "vae": {"scaling_factor": round(scale, 6), "shift_factor": round(shift, 6)},
        "command": command,
        "settings": {k: getattr(settings, k) for k in TrainSettings.__dataclass_fields__},
        "transformer_steps_done": step,
        "final_vae_loss": round(vae_loss, 6),
        "final_loss": round(loss, 6),
        "train_seconds": round(seconds, 1),
        "versions": {"torch": torch.__version__, **_versions()},
    }
    if init_from is not None:
        meta["init_from"] = _lineage(Path(init_from))
    return meta


def _lineage(weights: Path) -> dict:
    """How the weights a fine-tune starts from were made (their command and time, and theirs in turn): the
    fine-tune's own command names only a folder, which may be gone by the time someone wants to redo it."""
    meta = trained.read_meta(weights)
    return {key: meta[key] for key in ("command", "train_seconds", "init_from", "decoder_finetune") if key in meta}


def torch_threads(count: int) -> None:
    import torch

    torch.set_num_threads(count)


def _versions() -> dict:
    import diffusers
    import transformers

    return {"diffusers": diffusers.__version__, "transformers": transformers.__version__}


def _negative_prompt() -> str:
    from hidream_ui.edits import EditSettings

    return EditSettings().negative_prompt


def _load_pipeline(root: Path, transformer=None):
    """The editing pipeline of a tiny build in fp32 on the CPU (what `auto` picks there), text encoders on it."""
    import torch
    from transformers import AutoTokenizer, LlamaModel

    from hidream_ui.pipeline.edit_pipeline import HiDreamEditPipeline

    tokenizer_4 = AutoTokenizer.from_pretrained(root / LLAMA_DIR, local_files_only=True)
    text_encoder_4 = LlamaModel.from_pretrained(root / LLAMA_DIR, dtype=torch.float32, local_files_only=True)
    extra = {"transformer": transformer} if transformer is not None else {}
    pipeline = HiDreamEditPipeline.from_pretrained(
        root / I1_DIR,
        tokenizer_4=tokenizer_4,
        text_encoder_4=text_encoder_4,
        dtype=torch.float32,
        local_files_only=True,
        **extra,
    )
    pipeline.compute_device = "cpu"
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def prompt_embeddings(base: Path, texts: list[str]):
    """Stacked embeddings of `texts` (t5 (N, L, D), llama (layers, N, L, D), pooled (N, D)), by the
    pipeline's own encode_text on the build's text encoders."""
    import torch
    from diffusers import HiDreamImageTransformer2DModel

    from hidream_ui.pipeline.edit_pipeline import PromptEmbeds

    transformer = HiDreamImageTransformer2DModel.from_pretrained(
        base / E11_DIR, subfolder="transformer", dtype=torch.float32, local_files_only=True
    )
    pipeline = _load_pipeline(base, transformer)
    with torch.no_grad():
        return PromptEmbeds.cat([pipeline.encode_text(t) for t in texts])


def transformer_tensors(source: Path) -> dict:
    """The transformer state dict (fp32) of an asset folder a run wrote."""
    from safetensors.torch import load_file

    trained.read_meta(source)  # a clear error when `source` is not a run's folder
    tensors = load_file(str(source / trained.WEIGHTS_FILE))
    prefix = "transformer/"
    return {k[len(prefix) :]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
