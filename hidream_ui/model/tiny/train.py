"""`train-tiny OUT [--steps N] [--seed S]`: trains the `trained` tiny profile on the synthetic world.

Data comes from world.py on the fly (training seeds only, below HELD_OUT_SEED_START). Two phases:

1. The VAE learns to reconstruct world images (pixel MSE, latents kept near unit size); its latent shift and
   scale are then measured so latents enter the transformer about N(0, 1), like the release's.
2. The E1 transformer learns exactly the two calls the pipeline makes (pipeline/edit_pipeline.py):
   - edit stage: input ``cat([x_t, source], width)`` (16 x 32 latent), instruction text; its output's left
     half is read. Condition dropout: the source replaced by zeros (the pipeline's unconditional branch is
     ``zeros`` + the instruction under CLIP CFG norm) and the text replaced by the negative prompt (the
     image-conditioned branch), so E1.1's three-way guidance has something to combine;
   - refine stage: input ``x_t`` alone (16 x 16), the target prompt (E1.1: the instruction itself) or the
     negative prompt, at the low noise levels the refine share of the schedule covers.
   Flow matching as the scheduler reads it (UniPC, flow_prediction, flow sigmas): ``x_t = (1 - s) x_0 + s e``
   at timestep ``1000 s``; the scheduler wants ``e - x_0`` and the pipeline negates the transformer's output,
   so the transformer is trained towards ``x_0 - e``. Noise levels are drawn through the schedule's shift 3.

The text encoders keep the random weights of the build (seed S): the transformer learns to read them. The
embeddings of every prompt the world has are computed once with the pipeline's own `encode_text`.

Deterministic for a seed on one machine (one thread by default; the RNGs are all seeded generators).
"""

from __future__ import annotations

import argparse
import copy
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from hidream_ui.model.layout import E11_DIR, I1_DIR, LLAMA_DIR
from hidream_ui.model.tiny import trained, words, world
from hidream_ui.model.tiny.profiles import PROFILES
from hidream_ui.model.tiny.scoring import PROFILE, eval_pipeline, pixels, summarize, to_images

FLOW_SHIFT = 3.0  # the scheduler's flow_shift (parts._scheduler_config)
# Highest refine-stage noise level trained: at 4 steps with refine strength 0.3 the refine stage starts at 0.75.
REFINE_MAX_SIGMA = 0.8
# --decoder-own: the share of each decoder batch from the pipeline's own latents. Three quarters broke the VAE's
# round trip (84-97 % of 96 true targets), a quarter kept it (99-100 %, the median as before) with the same gain in
# untouched PSNR (docs/model-weights.md, "The decoder on the pipeline's own latents, a quarter of each batch").
DECODER_OWN_SHARE = 0.25
# True training targets whose round trip a decoder fine-tune checks when it ends.
ROUND_TRIP_CASES = 96


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 16000  # transformer steps
    vae_steps: int = 3000
    seed: int = 0
    batch: int = 12  # edit-stage samples per step
    refine_batch: int = 4  # refine-stage samples per step
    vae_batch: int = 8
    lr: float = 6e-4
    vae_lr: float = 2e-3
    # Weight of the VAE's locality loss (0: none). Trained on reconstruction alone, the encoder writes the
    # background colour into every latent: a background edit moved the latents of the shape interiors, whose
    # pixels stay, by twice the latent std (docs/model-weights.md). This loss charges, for each source/target
    # pair of a VAE batch, the latent change on the cells where no pixel changes (in units of the latent variance).
    vae_locality: float = 0.0
    warmup: int = 100
    # Share of edit-stage noise levels drawn uniformly instead of through the schedule's shift: shift 3 puts
    # only 8 % of draws below 0.2, where the last steps decide how exactly the untouched region comes back.
    uniform_share: float = 0.5
    # Lowest edit-stage noise level drawn (0: the whole range). Raised, every edit sample lies in
    # [edit_noise_min, 1], where the input holds almost nothing of the target: the edit and the untouched shapes'
    # colours must come from the source and the instruction. (1500 steps of it did not teach the model which
    # shape a word names: docs/model-weights.md, "Which shape?".)
    edit_noise_min: float = 0.0
    # Which shape? (docs/model-weights.md). `word_encoders`: the text encoders get the bag-of-words design of
    # words.py (the world's words orthonormal) instead of random weights, and stay frozen. Grounding: a
    # training-only linear head on the target's image tokens after block `ground_block` learns which shape
    # tokens the instruction names (a class-balanced cross-entropy over the shape tokens of recolours and
    # removes in scenes of two or three shapes, input all noise): `ground_steps` steps of it alone before the
    # flow-matching steps, then `ground_weight` x it beside the flow loss on `ground_batch` more cases a step;
    # `ground_flow` x the flow loss of those cases too (what the edit must get right once it knows the shape).
    # The flow loss alone never taught it: with the loss beside it from the start the head stayed at chance.
    word_encoders: bool = False
    ground_steps: int = 0
    ground_weight: float = 0.0
    ground_block: int = 1
    ground_batch: int = 8
    ground_flow: float = 0.0
    # Share of the flow loss's training cases that are background edits (None: the world's mix, a third).
    # Background edits were the weak kind (12.5 % after the runs of docs/model-weights.md): this weighs them.
    background_share: float | None = None
    # Content drift (see _train_transformer): on this share of the fully conditioned edit samples, the noisy
    # input's content is pulled towards another case's by `drift` x noise level, the target staying this case's.
    drift_share: float = 0.5
    drift: float = 0.5
    # Self drift: on this share of the fully conditioned edit samples, the content pulled in is the model's own
    # clean estimate from pure noise (one call without gradient, the first step's hedge that sampling commits
    # to), at full strength (x noise level) instead of another case's at `drift`. One call at s = 1 scored better
    # than the sampled edit (docs/model-weights.md): the later steps keep the input's errors.
    self_drift: float = 0.0
    # Refine self drift: on this share of the refine samples with the instruction, the content pulled in (by 1 x
    # noise level) is the edit stage's clean estimate of the edit from a level drawn between the sample's and 1:
    # at sampling time the refine stage goes on from the edit stage's latents, not from the noised target.
    refine_self_drift: float = 0.0
    image_drop: float = 0.1
    text_drop: float = 0.1
    pool: int = 1024  # latent pairs kept; `fresh` of them replaced by new cases every step
    fresh: int = 2
    ema: float = 0.999
    threads: int = 1
    log_every: int = 50
    checkpoint_every: int = 0  # also write OUT every this many transformer steps (0: only at the end)


@dataclass
class TrainReport:
    out: Path
    seconds: float
    vae_loss: float
    loss: float
    meta: dict = field(default_factory=dict)


# TrainSettings fields with a train-tiny flag of their own (--refine-batch ...): the recorded command names
# those that differ from the defaults.
CLI_KNOBS = (
    "batch",
    "refine_batch",
    "lr",
    "warmup",
    "edit_noise_min",
    "ground_steps",
    "ground_weight",
    "ground_flow",
    "background_share",
    "vae_locality",
    "self_drift",
    "refine_self_drift",
)


def _sigma(u):
    """The scheduler's shifted noise level for a uniform draw (flow_shift 3: most steps at high noise)."""
    return FLOW_SHIFT * u / (1 + (FLOW_SHIFT - 1) * u)


def world_prompts() -> list[str]:
    """Every instruction the world can give, in a fixed order (index = prompt id)."""
    edits = [world.Edit("recolour", s, c) for s in world.SHAPES for c in world.COLOURS]
    edits += [world.Edit("remove", s, "") for s in world.SHAPES]
    edits += [world.Edit("background", "background", b) for b in world.BACKGROUNDS]
    return [e.instruction for e in edits]


class _Seeds:
    """Training case seeds: a seeded stream below HELD_OUT_SEED_START (never an evaluation case)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng([seed, 22])

    def next(self) -> int:
        return int(self.rng.integers(0, world.HELD_OUT_SEED_START))


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
        embeds = _prompt_embeddings(base, [*prompts, negative])
        seeds = _Seeds(settings.seed)

        if init_from is not None:
            vae_from = init_from
        if vae_from is not None:  # the VAE (and its latent statistics) of an earlier run, as it was
            vae, vae_loss, shift, scale = _load_vae(base, Path(vae_from))
            log(f"train-tiny: VAE from {vae_from} (its final loss {vae_loss:.5f})")
        else:
            vae, vae_loss = _train_vae(base, settings, seeds, log)
            shift, scale = _latent_stats(vae, seeds, torch)
        log(f"train-tiny: VAE latents shift {shift:.4f} scale {scale:.4f}")

        text_parts = {
            k: v for k, v in trained.part_tensors(base).items() if k.split("/")[0] not in ("vae", "transformer")
        }

        def save(ema, loss: float, step: int) -> dict:
            tensors = dict(text_parts)
            tensors.update({f"vae/{k}": v for k, v in vae.state_dict().items()})
            tensors.update({f"transformer/{k}": v for k, v in ema.state_dict().items()})
            meta = _meta(
                settings, shift, scale, vae_loss, loss, time.perf_counter() - started, step, vae_from, init_from
            )
            trained.write_asset(out, tensors, meta)
            return meta

        init = _transformer_tensors(Path(init_from)) if init_from is not None else None
        if init is not None:
            log(f"train-tiny: transformer from {init_from} (fine-tune)")
        transformer, ema, loss = _train_transformer(
            spec, vae, shift, scale, embeds, len(prompts), settings, seeds, prompts, log, save, init
        )
        meta = save(ema, loss, settings.steps)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.perf_counter() - started
    size = sum(p.stat().st_size for p in out.iterdir())
    log(f"train-tiny: wrote {out} ({size / 1e6:.2f} MB) in {seconds:.0f} s")
    return TrainReport(out=out, seconds=seconds, vae_loss=vae_loss, loss=loss, meta=meta)


def _meta(
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


def _prompt_embeddings(base: Path, texts: list[str]):
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


# ------------------------------------------------------------------------------------------------ VAE


def _train_vae(base: Path, settings: TrainSettings, seeds: _Seeds, log):
    import torch
    from diffusers import AutoencoderKL

    config = dict(AutoencoderKL.load_config(base / I1_DIR / "vae"))
    torch.manual_seed(settings.seed)
    vae = AutoencoderKL.from_config(config).float().train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=settings.vae_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(settings.seed + 1)
    loss_value = float("nan")
    started = time.perf_counter()
    for step in range(settings.vae_steps):
        _set_lr(optimizer, settings.vae_lr, step, settings.vae_steps, settings.warmup)
        images = []
        while len(images) < settings.vae_batch:
            case = world.make_case(seeds.next())
            images += [case.source, case.target]
        x = pixels(images[: settings.vae_batch], torch)
        z = vae.encode(x).latent_dist.mode()
        locality = None  # the locality loss of this batch, when weighed
        if settings.vae_locality:
            still = torch.from_numpy(still_cells(images[: settings.vae_batch], z.shape[-2:]))
            locality = locality_loss(z, still)
        # Small latent noise: the decoder must also read the transformer's slightly-off latents.
        noisy = z + 0.05 * z.detach().std() * torch.randn(z.shape, generator=generator)
        y = vae.decode(noisy).sample
        loss = torch.nn.functional.mse_loss(y, x) + 1e-4 * z.pow(2).mean()
        if locality is not None:
            loss = loss + settings.vae_locality * locality
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        loss_value = float(loss.detach())
        if step % settings.log_every == 0 or step == settings.vae_steps - 1:
            psnr = 10 * math.log10(4.0 / max(float(torch.nn.functional.mse_loss(y.detach(), x)), 1e-12))
            still_change = "" if locality is None else f" still-cell change {float(locality):.4f}"
            log(
                f"vae step {step + 1}/{settings.vae_steps} loss {loss_value:.5f} psnr {psnr:.1f} dB{still_change} "
                f"({time.perf_counter() - started:.0f} s)"
            )
    return vae.eval().requires_grad_(False), loss_value


def still_cells(images: list, grid: tuple[int, int]) -> np.ndarray:
    """(pairs, rows, columns) bool: for each (source, target) pair of `images` (sources at even, targets at odd
    positions, (128, 128, 3) arrays), the latent cells of a `grid` (the latents' rows and columns) in which no
    pixel differs between the two."""
    rows, columns = grid
    pairs = len(images) // 2
    return np.array(
        [~world.moved_cells(images[2 * k], images[2 * k + 1], rows, columns) for k in range(pairs)], dtype=bool
    ).reshape(pairs, rows, columns)


def locality_loss(z, still):
    """Mean squared latent change between each pair's source (z[2k]) and target (z[2k + 1]) over the cells
    `still` marks (still_cells), in units of the batch's latent variance (so the encoder cannot escape it by
    shrinking its latents); 0 where no cell is still."""
    pairs = still.shape[0]
    change = (z[0 : 2 * pairs : 2] - z[1 : 2 * pairs : 2]).pow(2).mean(dim=1) / z.detach().var().clamp_min(1e-8)
    mask = still.to(change.dtype)
    return (change * mask).sum() / mask.sum().clamp_min(1.0)


def _transformer_tensors(source: Path) -> dict:
    """The transformer state dict (fp32) of an asset folder a run wrote."""
    from safetensors.torch import load_file

    trained.read_meta(source)  # a clear error when `source` is not a run's folder
    tensors = load_file(str(source / trained.WEIGHTS_FILE))
    prefix = "transformer/"
    return {k[len(prefix) :]: v.float() for k, v in tensors.items() if k.startswith(prefix)}


def _load_vae(base: Path, source: Path):
    """(vae, its final loss, latent shift, latent scale) from an asset folder a run wrote."""
    from diffusers import AutoencoderKL
    from safetensors.torch import load_file

    meta = trained.read_meta(source)
    vae = AutoencoderKL.from_config(dict(AutoencoderKL.load_config(base / I1_DIR / "vae"))).float()
    tensors = load_file(str(source / trained.WEIGHTS_FILE))
    vae.load_state_dict({k[len("vae/") :]: v.float() for k, v in tensors.items() if k.startswith("vae/")})
    stats = meta["vae"]
    return (
        vae.eval().requires_grad_(False),
        float(meta.get("final_vae_loss", float("nan"))),
        float(stats["shift_factor"]),
        float(stats["scaling_factor"]),
    )


def _latent_stats(vae, seeds: _Seeds, torch) -> tuple[float, float]:
    images = []
    while len(images) < 64:
        case = world.make_case(seeds.next())
        images += [case.source, case.target]
    with torch.no_grad():
        z = vae.encode(pixels(images, torch)).latent_dist.mode()
    shift = float(z.mean())
    return shift, 1.0 / max(float(z.std()), 1e-6)


# ------------------------------------------------------------------------------------------------ transformer


class _Pool:
    """Latent pairs (source, target) and prompt ids of training cases; a few replaced by fresh cases each step.
    With `tokens` (tokens per image side): only cases that ask which shape (`asks_which_shape`), each with its
    target tokens' labels (`shape_tokens`), which `sample` returns fourth. With `background_share`: that share of
    the cases drawn are background edits, the rest recolours and removes."""

    def __init__(
        self,
        size: int,
        encode,
        seeds: _Seeds,
        prompt_ids: dict[str, int],
        torch,
        tokens: int = 0,
        background_share: float | None = None,
    ):
        self.encode, self.seeds, self.prompt_ids, self.torch, self.tokens = encode, seeds, prompt_ids, torch, tokens
        # Its own stream, drawn only when asked: without a share the seeds (hence the default run) are unchanged.
        self.kind_rng = np.random.default_rng(seeds.next()) if background_share is not None else None
        self.background_share = background_share
        cases = [self._draw() for _ in range(size)]
        sources, targets = [], []
        for start in range(0, size, 32):  # encoded in chunks: one image at a time is slow, all at once is big
            chunk = cases[start : start + 32]
            sources.append(encode(pixels([c.source for c in chunk], torch)))
            targets.append(encode(pixels([c.target for c in chunk], torch)))
        self.source, self.target = torch.cat(sources), torch.cat(targets)
        self.prompt = torch.tensor([prompt_ids[c.instruction] for c in cases])
        if tokens:
            self.labels = torch.stack([self._labels(c) for c in cases])
        self.rng = np.random.default_rng(seeds.next())

    def _draw(self) -> world.Case:
        background = None if self.kind_rng is None else bool(self.kind_rng.random() < self.background_share)
        while True:
            case = world.make_case(self.seeds.next())
            if self.tokens and not asks_which_shape(case):
                continue
            if background is None or (case.edit.kind == "background") == background:
                return case

    def _labels(self, case: world.Case):
        return self.torch.from_numpy(shape_tokens(case, self.tokens))

    def refresh(self, count: int) -> None:
        for slot in self.rng.integers(0, len(self.prompt), size=count):
            case = self._draw()
            latents = self.encode(pixels([case.source, case.target], self.torch))
            self.source[slot], self.target[slot] = latents[0], latents[1]
            self.prompt[slot] = self.prompt_ids[case.instruction]
            if self.tokens:
                self.labels[slot] = self._labels(case)

    def sample(self, count: int):
        index = self.torch.from_numpy(self.rng.integers(0, len(self.prompt), size=count))
        picked = (self.source[index], self.target[index], self.prompt[index])
        return (*picked, self.labels[index]) if self.tokens else picked


# A token counts as a shape's when the shape covers at least this share of its pixels (docs/model-weights.md).
SHAPE_TOKEN_COVER = 0.3


def asks_which_shape(case: world.Case) -> bool:
    """Whether the case's edit must pick one shape among others: a recolour or remove with two or three shapes."""
    return case.edit.kind != "background" and len(case.scene.shapes) > 1


def shape_tokens(case: world.Case, tokens: int) -> np.ndarray:
    """float32 (2, tokens * tokens), row-major like the transformer's image tokens: [0] 1 on the tokens of the
    shape the instruction names, [1] 1 on the tokens of any shape (the ones the grounding loss scores)."""
    cell = world.SIZE // tokens
    named = np.zeros((tokens, tokens), bool)
    shapes = np.zeros((tokens, tokens), bool)
    for shape in case.scene.shapes:
        cover = world.shape_mask(shape).reshape(tokens, cell, tokens, cell).mean(axis=(1, 3)) >= SHAPE_TOKEN_COVER
        shapes |= cover
        if shape.kind == case.edit.target:
            named |= cover
    return np.stack([named.reshape(-1), shapes.reshape(-1)]).astype(np.float32)


class _Grounding:
    """The training-only grounding head (TrainSettings.ground_*): one linear layer, after a layer norm, on the
    target half's image tokens of one block, which it reads through a forward hook. Not part of the weights."""

    # Noise levels of the cases scored beside the flow loss: where the input shows almost nothing of the answer.
    MIN_SIGMA = 0.9

    def __init__(self, model, spec, block: int, torch):
        self.torch = torch
        self.head = torch.nn.Linear(spec.inner_dim, 1)
        self.rows = spec.max_resolution[0] // spec.patch_size
        self.cols = spec.max_resolution[1] // spec.patch_size
        kept = self.kept = {}
        blocks = [*model.double_stream_blocks, *model.single_stream_blocks]
        if not 0 <= block < len(blocks):
            raise ValueError(f"ground_block {block} is not a block of this transformer (0..{len(blocks) - 1})")

        def keep(module, inputs, output):  # a closure, not a method: copy.deepcopy(model) must not copy the head
            kept["hidden"] = output[0] if isinstance(output, tuple) else output

        blocks[block].register_forward_hook(keep)

    def target_tokens(self, hidden):
        """(B, rows * cols, D) of a block's output: the image tokens come first, row-major over the
        [target | source] input, the first `cols` of each row being the target's."""
        b = hidden.shape[0]
        hidden = hidden[:, : self.rows * 2 * self.cols].reshape(b, self.rows, 2 * self.cols, -1)[:, :, : self.cols]
        return hidden.reshape(b, self.rows * self.cols, -1)

    def logits(self):
        """The head's logits of the last forward's target tokens, (B, rows * cols)."""
        hidden = self.target_tokens(self.kept.pop("hidden"))
        return self.head(self.torch.nn.functional.layer_norm(hidden, hidden.shape[-1:]))[..., 0]

    def loss(self, logits, labels):
        """Class-balanced cross-entropy over each image's shape tokens, and its balanced accuracy."""
        torch = self.torch
        named, scored = labels[:, 0], labels[:, 1]
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, named, reduction="none")
        positives = (named * scored).sum(1).clamp(min=1)
        negatives = ((1 - named) * scored).sum(1).clamp(min=1)
        loss = 0.5 * ((bce * named * scored).sum(1) / positives + (bce * (1 - named) * scored).sum(1) / negatives)
        with torch.no_grad():
            hit = (logits > 0).float()
            accuracy = 0.5 * (
                (hit * named * scored).sum(1) / positives + ((1 - hit) * (1 - named) * scored).sum(1) / negatives
            )
        return loss.mean(), float(accuracy.mean())


def make_transformer(spec, seed: int):
    """A fresh transformer of the profile (diffusers' init, adaLN and output layers zeroed so every block
    starts as the identity, but for the copy head: `copy_head_init`), with the max_seq the loader sets for
    E1.1 (the H x 2W edit input)."""
    import torch
    from diffusers import HiDreamImageTransformer2DModel

    torch.manual_seed(seed)
    model = HiDreamImageTransformer2DModel.from_config(spec.transformer_config()).float()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ("adaLN_modulation" in name or name.startswith("final_layer")):
                module.weight.zero_()
                if module.bias is not None:
                    module.bias.zero_()
    copy_head_init(model, spec)
    model.max_seq = 2 * spec.max_seq
    return model


# The copy head's rotary pairs (index within an image axis: frequencies 1 and 0.215 rad per token with
# 12 dims per axis), its pair norm before the RMSNorm and the RMSNorm gain: softmax mass ~0.9 on the one key
# (measured by tests/test_tiny_trained.py), which is what the logits' margin over the neighbours gives.
COPY_PAIRS = (0, 1)
COPY_PAIR_NORM = 4.0
COPY_GAIN = 2.0


def copy_heads(spec) -> int:
    """How many heads copy: enough value dims for one latent patch (patch x patch x channels), all but one
    head of the block at most (the other heads start free for the instruction)."""
    patch = spec.patch_size * spec.patch_size * spec.latent_channels
    return max(1, min(-(-patch // spec.attention_head_dim), spec.num_attention_heads - 1))


def copy_head_init(model, spec) -> None:
    """The first `copy_heads(spec)` heads of the first double-stream block start out attending from every
    target token to the source token at the same place (8 latent patches to the right in the
    ``[noisy | source]`` input), and the block's attention gate starts open, so the source reaches the
    target's stream from step one.

    Why: an edit model copies everything the instruction does not touch, and a transformer finds that
    position-to-position pattern slowly on its own (the shipped 2000-step model had not: 15 dB PSNR outside
    the edit). The pattern needs no content, only positions: the head's query and key are constants (their
    projection biases; weights zero) whose rotary pairs are set so that HiDream's RoPE makes the score peak
    at a row offset of 0 and a column offset of +W. Training then keeps, sharpens or undoes it like any
    other weight. Only the initial values change: same classes, same objective."""
    import torch

    block = model.double_stream_blocks[0].block
    attention, head_dim = block.attn1, spec.attention_head_dim
    heads = copy_heads(spec) * head_dim  # the copy heads' rows in to_q / to_k
    axes = spec.axes_dims_rope
    columns = spec.max_resolution[1] // spec.patch_size  # the source token's column offset
    query = torch.zeros(head_dim)
    key = torch.zeros(head_dim)
    for axis, offset in ((1, 0), (2, columns)):  # rows: same row; columns: W to the right
        start = sum(axes[:axis])
        for pair in COPY_PAIRS:
            omega = 10000.0 ** (-2 * pair / axes[axis])
            dim = start + 2 * pair
            q = torch.tensor([COPY_PAIR_NORM / math.sqrt(2), COPY_PAIR_NORM / math.sqrt(2)])
            # RoPE rotates a pair at position p by p * omega; q . R(omega * (d - offset)) q peaks at d = offset.
            angle = -omega * offset
            rotation = torch.tensor([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
            query[dim : dim + 2], key[dim : dim + 2] = q, rotation @ q
    with torch.no_grad():
        for linear, bias in ((attention.to_q, query), (attention.to_k, key)):
            linear.weight[:heads].zero_()
            linear.bias[:heads] = bias.repeat(heads // head_dim)
        # HiDream's q/k RMSNorm spans all heads (one RMS over them); its gain is per dimension: raised on
        # the copy heads' dims only.
        for norm in (attention.q_rms_norm, attention.k_rms_norm):
            norm.weight[:heads] = COPY_GAIN
        # adaLN chunks: shift, scale, gate of the image attention first; the gate's bias opens it.
        dim = block.adaLN_modulation[-1].out_features // 12
        block.adaLN_modulation[-1].bias[2 * dim : 3 * dim] = 1.0


def training_mode(model) -> None:
    """Top level in eval mode (its forward then unpatchifies like inference), the MoE layers in train mode
    (their inference path routes under no_grad, so routed experts would get no gradient)."""
    model.eval()
    for module in model.modules():
        if type(module).__name__ in ("MOEFeedForwardSwiGLU", "MoEGate"):
            module.train()


def _train_transformer(spec, vae, shift, scale, embeds, n_prompts, settings, seeds, prompts, log, save, init=None):
    import torch

    def encode(pixels):
        with torch.no_grad():
            return (vae.encode(pixels).latent_dist.mode() - shift) * scale

    model = make_transformer(spec, settings.seed + 2)
    if init is not None:
        model.load_state_dict(init)
    training_mode(model)
    generator = torch.Generator().manual_seed(settings.seed + 3)
    negative = n_prompts  # index of the negative prompt in `embeds`
    width = spec.max_resolution[1]  # latent width of one image
    prompt_ids = {p: i for i, p in enumerate(prompts)}
    grounding = ground_pool = None
    if settings.ground_steps or settings.ground_weight or settings.ground_flow:
        grounding = _Grounding(model, spec, settings.ground_block, torch)
        t0 = time.perf_counter()
        ground_pool = _Pool(settings.pool, encode, seeds, prompt_ids, torch, tokens=grounding.cols)
        log(f"train-tiny: {settings.pool} grounding cases encoded in {time.perf_counter() - t0:.0f} s")
    parameters = [*model.parameters(), *(grounding.head.parameters() if grounding else ())]

    def forward(hidden, sigma, prompt_ids):
        return model(
            hidden_states=hidden,
            timesteps=sigma * 1000,
            encoder_hidden_states_t5=embeds.t5[prompt_ids],
            encoder_hidden_states_llama3=embeds.llama[:, prompt_ids],
            pooled_embeds=embeds.pooled[prompt_ids],
            return_dict=False,
        )[0]

    def rand(n):
        return torch.rand(n, generator=generator)

    def ground_loss(count: int, min_sigma: float):
        """(grounding loss, its balanced accuracy, flow loss) on `count` cases drawn from its pool, the input
        noised to a level in [min_sigma, 1]."""
        source, target, prompt, labels = ground_pool.sample(count)
        s = (min_sigma + (1 - min_sigma) * rand(count)).view(-1, 1, 1, 1)
        noise = torch.randn(target.shape, generator=generator)
        x_t = (1 - s) * target + s * noise
        out = forward(torch.cat([x_t, source], dim=-1), s.view(-1), prompt)[..., :width]
        return (*grounding.loss(grounding.logits(), labels), torch.nn.functional.mse_loss(out, target - noise))

    if settings.ground_steps:
        # The head alone first (a constant rate, all noise): with the flow loss beside it from the first step,
        # it stayed at chance (docs/model-weights.md).
        optimizer = torch.optim.AdamW(parameters, lr=settings.lr, weight_decay=0.0, betas=(0.9, 0.99))
        started, accuracies = time.perf_counter(), []
        for step in range(settings.ground_steps):
            ground_pool.refresh(settings.fresh)
            loss, accuracy, _ = ground_loss(settings.batch, 1.0)
            accuracies.append(accuracy)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            if step % settings.log_every == 0 or step == settings.ground_steps - 1:
                elapsed = time.perf_counter() - started
                log(
                    f"grounding step {step + 1}/{settings.ground_steps} loss {float(loss.detach()):.4f} balanced "
                    f"accuracy {np.mean(accuracies[-settings.log_every :]):.3f} ({elapsed:.0f} s)"
                )

    ema = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.AdamW(parameters, lr=settings.lr, weight_decay=0.0, betas=(0.9, 0.99))
    t0 = time.perf_counter()
    pool = _Pool(settings.pool, encode, seeds, prompt_ids, torch, background_share=settings.background_share)
    log(f"train-tiny: {settings.pool} training cases encoded in {time.perf_counter() - t0:.0f} s")

    started = time.perf_counter()
    accuracies = []
    running = None
    loss_value = float("nan")
    for step in range(settings.steps):
        _set_lr(optimizer, settings.lr, step, settings.steps, settings.warmup)
        pool.refresh(settings.fresh)
        # Edit stage: [x_t | source] with the instruction; dropout gives the unconditional / image-only branches.
        source, target, prompt = pool.sample(settings.batch)
        sigma = _edit_sigmas(settings, rand)
        noise = torch.randn(target.shape, generator=generator)
        s = sigma.view(-1, 1, 1, 1)
        keep_image = rand(settings.batch) >= settings.image_drop
        keep_text = rand(settings.batch) >= settings.text_drop
        # Content drift. Sampling feeds the model its own slightly wrong x_t; a model that reads the content
        # from x_t (a shortcut: in plain training x_t always agrees with the target) carries those errors to
        # the end, while the right answer given source and instruction does not depend on them. So some
        # noisy inputs get another case's content mixed in ((1 - s) * target + s * drift * (other - target)
        # inside the signal), with the regression target still pointing at this case's clean latent: the
        # extra term is folded into the noise, so x_t + s * (target - noise) stays the clean target.
        drifted = (rand(settings.batch) < settings.drift_share) & keep_image & keep_text
        other = target[torch.randperm(settings.batch, generator=generator)]
        pull = drifted.float() * settings.drift
        if settings.self_drift:
            # Self drift (TrainSettings.self_drift): the content pulled in is the model's own first estimate.
            mine = ((rand(settings.batch) < settings.self_drift) & keep_image & keep_text).nonzero().flatten()
            if len(mine):  # `other` is already a copy (indexing with a permutation): written in place
                other[mine] = own_estimate(forward, source[mine], prompt[mine], width, generator)
                pull[mine] = 1.0
        noise = pulled_noise(noise, target, other, pull, s)
        x_t = (1 - s) * target + s * noise
        source = source * keep_image.float().view(-1, 1, 1, 1)
        prompt = torch.where(keep_text, prompt, torch.full_like(prompt, negative))
        out = forward(torch.cat([x_t, source], dim=-1), sigma, prompt)[..., :width]
        loss = torch.nn.functional.mse_loss(out, target - noise)
        if settings.refine_batch:
            # Refine stage: x_t alone, low noise, the target prompt (E1.1: the instruction) or the negative one.
            source, target, prompt = pool.sample(settings.refine_batch)
            sigma = _sigma(rand(settings.refine_batch) * _unshift(REFINE_MAX_SIGMA))
            noise = torch.randn(target.shape, generator=generator)
            s = sigma.view(-1, 1, 1, 1)
            prompt = torch.where(
                rand(settings.refine_batch) < settings.text_drop, torch.full_like(prompt, negative), prompt
            )
            if settings.refine_self_drift:
                # Refine self drift (TrainSettings.refine_self_drift): the content pulled in is the edit stage's
                # estimate of this edit from a higher noise level, which is what the refine stage goes on from.
                mine = (rand(settings.refine_batch) < settings.refine_self_drift) & (prompt != negative)
                mine = mine.nonzero().flatten()
                if len(mine):
                    theirs = target[mine]
                    start = sigma[mine] + (1 - sigma[mine]) * rand(len(mine))
                    level = start.view(-1, 1, 1, 1)
                    noisy = (1 - level) * theirs + level * torch.randn(theirs.shape, generator=generator)
                    estimate = estimate_from(forward, noisy, start, prompt[mine], source[mine])
                    noise[mine] = pulled_noise(noise[mine], theirs, estimate, torch.ones(len(mine)), s[mine])
            out = forward((1 - s) * target + s * noise, sigma, prompt)
            share = settings.refine_batch / (settings.batch + settings.refine_batch)
            loss = (1 - share) * loss + share * torch.nn.functional.mse_loss(out, target - noise)
        flow_value = float(loss.detach())
        if settings.ground_weight or settings.ground_flow:
            ground_pool.refresh(1)
            ground, accuracy, ground_flow = ground_loss(settings.ground_batch, _Grounding.MIN_SIGMA)
            accuracies.append(accuracy)
            loss = loss + settings.ground_weight * ground + settings.ground_flow * ground_flow
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        decay = min(settings.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.lerp_(p, 1 - decay)
        loss_value = flow_value  # the flow-matching loss (the grounding loss is logged beside it)
        running = loss_value if running is None else 0.98 * running + 0.02 * loss_value
        if step % settings.log_every == 0 or step == settings.steps - 1:
            elapsed = time.perf_counter() - started
            grounded = (
                f" grounding balanced accuracy {np.mean(accuracies[-settings.log_every :]):.3f}" if accuracies else ""
            )
            log(
                f"step {step + 1}/{settings.steps} loss {loss_value:.4f} (avg {running:.4f}){grounded} "
                f"lr {optimizer.param_groups[0]['lr']:.2e} ({elapsed:.0f} s, {elapsed / (step + 1):.2f} s/step)"
            )
        if settings.checkpoint_every and (step + 1) % settings.checkpoint_every == 0 and step + 1 < settings.steps:
            save(ema, running, step + 1)
            log(f"train-tiny: checkpoint after {step + 1} steps")
    return model, ema, running if running is not None else loss_value


def pulled_noise(noise, target, other, pull, s):
    """The noise that puts ``x_t = (1 - s) target + s noise'`` on content pulled from `target` towards `other` by
    ``pull x s`` (per sample), while ``x_t + s (target - noise')`` stays exactly `target`: the regression target
    (``target - noise'``) still leads back to this case's clean latent, whatever the input shows."""
    return noise + (pull.view(-1, 1, 1, 1) * (1 - s)) * (other - target)


def own_estimate(forward, source, prompt, width: int, generator):
    """The model's clean estimate of each edit from pure noise (``x_1 = e``, noise level 1), its sources and
    instructions, without gradient: what the first sampling step sees and the later ones commit to."""
    import torch

    pure = torch.randn((*source.shape[:-1], width), generator=generator)
    return estimate_from(forward, pure, torch.ones(len(source)), prompt, source)


def estimate_from(forward, x, level, prompt, source=None):
    """The model's clean estimate from the noisy latents `x` at noise `level` (per sample) with their prompts,
    without gradient: by the edit stage (``[x | source]``) when `source` is given, else by the refine stage."""
    import torch

    width = x.shape[-1]
    with torch.no_grad():
        velocity = forward(x if source is None else torch.cat([x, source], dim=-1), level, prompt)[..., :width]
    return x + level.view(-1, 1, 1, 1) * velocity  # the output is x0 - e, and x = x0 - level * (x0 - e)


def _edit_sigmas(settings: TrainSettings, rand):
    """Edit-stage noise levels of one batch: a share uniform, the rest through the schedule's shift, then
    squeezed into [edit_noise_min, 1] (with the default 0 exactly the draws, so earlier runs reproduce)."""
    import torch

    u = rand(settings.batch)
    sigma = torch.where(rand(settings.batch) < settings.uniform_share, u, _sigma(u))
    if settings.edit_noise_min:
        sigma = settings.edit_noise_min + (1 - settings.edit_noise_min) * sigma
    return sigma


def _unshift(sigma: float) -> float:
    """The uniform draw whose shifted noise level is `sigma` (inverse of _sigma)."""
    return sigma / (FLOW_SHIFT - (FLOW_SHIFT - 1) * sigma)


def _set_lr(optimizer, peak: float, step: int, total: int, warmup: int) -> None:
    """Linear warm-up, then cosine down to a tenth of the peak."""
    if step < warmup:
        lr = peak * (step + 1) / warmup
    else:
        progress = (step - warmup) / max(1, total - warmup)
        lr = peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
    for group in optimizer.param_groups:
        group["lr"] = lr


# ------------------------------------------------------------------------------------------------ decoder


def finetune_decoder(
    source: Path,
    out: Path,
    steps: int,
    seed: int = 0,
    lr: float = 5e-4,
    batch: int = 8,
    log: Callable[[str], None] = print,
    log_every: int = 50,
    own: int = 0,
    own_share: float = DECODER_OWN_SHARE,
    round_trip_cases: int = ROUND_TRIP_CASES,
) -> dict:
    """More training for the VAE's decoder alone, on the weights in `source` (an asset folder); written to
    `out` with every other tensor as it was. The encoder, hence every latent the transformer learned, is
    untouched, so this runs after (or beside) the transformer phase and only sharpens the decoded pixels.

    With `own` > 0, first `own` edits of training cases are sampled by `source`'s own pipeline (the default
    recipe); `own_share` of each batch is then their final latents, to be decoded to the true target. What the
    pipeline hands the decoder is not the encoder's latents of the target: the untouched region comes back less
    exactly (docs/model-weights.md, "The decoder on the pipeline's own latents"). Only the edits whose named region
    came out right are kept: the decoder is to learn fidelity, not to redo the edit without the instruction.

    Afterwards `round_trip_cases` fresh training targets are encoded and decoded and scored like edits (`round_trip`
    in the meta): a decoder that mends the transformer's errors can stop decoding true latents right (three
    quarters of each batch did, docs/model-weights.md), and the oracle and `--one-call` rely on that round trip."""
    import torch
    from diffusers import AutoencoderKL
    from safetensors.torch import load_file

    from hidream_ui.model.tiny.build import build_tiny

    torch.manual_seed(seed)
    source, out = Path(source), Path(out)
    tensors = load_file(str(source / trained.WEIGHTS_FILE))
    meta = trained.read_meta(source)
    scratch = Path(tempfile.mkdtemp(prefix="train-tiny-decoder-"))
    try:
        base = build_tiny(scratch / "base", PROFILE, 0, trained_weights=False)
        config = dict(AutoencoderKL.load_config(base / I1_DIR / "vae"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    vae = AutoencoderKL.from_config(config).float()
    vae.load_state_dict({k[len("vae/") :]: v.float() for k, v in tensors.items() if k.startswith("vae/")})
    vae.requires_grad_(False)
    own_latents = own_targets = None
    if own:
        threads = torch.get_num_threads()  # sampling runs at one thread (eval_pipeline); the steps at the caller's
        own_latents, own_targets = _own_latents(source, vae, own, _Seeds(seed + 13), log)
        torch.set_num_threads(threads)
    decoder = [vae.decoder] + ([vae.post_quant_conv] if vae.post_quant_conv is not None else [])
    params = [p for module in decoder for p in module.parameters()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed + 11)
    seeds = _Seeds(seed + 11)
    picks = np.random.default_rng([seed, 13])  # its own stream: without `own` the run is as before
    per_batch = round(batch * own_share) if own_latents is not None else 0
    started = time.perf_counter()
    loss_value = float("nan")
    for step in range(steps):
        _set_lr(optimizer, lr, step, steps, min(50, steps))
        images = []
        while len(images) < batch - per_batch:
            case = world.make_case(seeds.next())
            images += [case.source, case.target]
        x = pixels(images[: batch - per_batch], torch)
        with torch.no_grad():
            z = vae.encode(x).latent_dist.mode()
        noisy = z + 0.05 * z.std() * torch.randn(z.shape, generator=generator)
        if per_batch:
            index = torch.from_numpy(picks.integers(0, len(own_latents), size=per_batch))
            noisy, x = torch.cat([own_latents[index], noisy]), torch.cat([own_targets[index], x])
        loss = torch.nn.functional.mse_loss(vae.decode(noisy).sample, x)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        loss_value = float(loss.detach())
        if step % log_every == 0 or step == steps - 1:
            log(
                f"decoder step {step + 1}/{steps} loss {loss_value:.5f} psnr "
                f"{10 * math.log10(4.0 / max(loss_value, 1e-12)):.1f} dB ({time.perf_counter() - started:.0f} s)"
            )
    seconds = time.perf_counter() - started
    kept = round_trip(vae, [world.make_case(seeds.next()) for _ in range(round_trip_cases)], torch)
    log(
        f"decoder: round trip of {kept['cases']} fresh training targets: success {kept['success']:.3f}, "
        f"untouched PSNR median {kept['untouched_psnr_median_db']} dB"
    )
    if kept["success"] < 1:
        log(f"decoder: warning: {kept['failed']} of {kept['cases']} true targets no longer decode to a success")
    tensors.update({f"vae/{k}": v for k, v in vae.state_dict().items()})
    own_meta = {"own_edits": own, "own_kept": len(own_latents), "own_share": own_share} if own else {}
    meta = {
        **meta,
        "decoder_finetune": {
            "from": meta.get("command"),
            "steps": steps,
            "seed": seed,
            "lr": lr,
            **own_meta,
            "final_loss": round(loss_value, 6),
            "seconds": round(seconds, 1),
            "round_trip": kept,
        },
    }
    trained.write_asset(out, tensors, meta)
    return meta


def round_trip(vae, cases: list, torch) -> dict:
    """`vae`'s round trip on the true targets of `cases`: ``decode(encode(target))`` scored by world.score (the
    edit's rule), as success rate, failures and untouched PSNR median. 1.0 for a decoder that reads true latents
    right."""
    scores = []
    with torch.no_grad():
        for i in range(0, len(cases), 16):
            chunk = cases[i : i + 16]
            z = vae.encode(pixels([c.target for c in chunk], torch)).latent_dist.mode()
            images = to_images(vae.decode(z).sample)
            scores += [world.score(c, image) for c, image in zip(chunk, images)]
    success = [s["success"] for s in scores]
    return {
        "cases": len(scores),
        "success": round(float(np.mean(success)), 4) if scores else 1.0,
        "failed": len(scores) - sum(success),
        "untouched_psnr_median_db": round(float(np.median([s["untouched_psnr_db"] for s in scores])), 2)
        if scores
        else None,
    }


def _own_latents(weights: Path, vae, count: int, seeds: _Seeds, log: Callable[[str], None]):
    """(latents, target pixels) of `count` training-case edits sampled by the pipeline of `weights` with the
    default recipe: the final latents as the pipeline hands them to `vae`'s decoder, of the edits whose named
    region `vae` decodes right (world.score's `colour_ok`)."""
    import torch
    from PIL import Image

    latents, targets, kept = [], [], 0
    started = time.perf_counter()
    with eval_pipeline(weights) as pipeline:
        scale, shift = pipeline.vae.config.scaling_factor, pipeline.vae.config.shift_factor
        for i in range(count):
            case = world.make_case(seeds.next())
            z = pipeline(
                Image.fromarray(case.source),
                case.instruction,
                output_type="latent",
                generator=torch.Generator().manual_seed(case.seed % (2**31)),
            ).images
            z = z.float() / scale + shift
            with torch.no_grad():
                image = to_images(vae.decode(z).sample)[0]
            if world.score(case, image)["colour_ok"]:
                latents.append(z[0])
                targets.append(pixels([case.target], torch)[0])
                kept += 1
            if i % 100 == 0 or i == count - 1:
                log(f"decoder: sampled {i + 1}/{count} edits, kept {kept} ({time.perf_counter() - started:.0f} s)")
    if not latents:
        raise RuntimeError(f"none of the {count} sampled edits came out right: nothing to fine-tune the decoder on")
    return torch.stack(latents), torch.stack(targets)


# ------------------------------------------------------------------------------------------------ evaluation


def evaluate(weights: Path, cases: int, log: Callable[[str], None] = print, grid: Path | None = None, **call) -> dict:
    """Held-out success through the real loader and pipeline: `weights` (an asset folder) laid over a fresh
    build, loaded by `load_model` (fp32 on the CPU), one edit per case with the default E1.1 settings at the
    world's 128 x 128 (the model's `auto` working size), scored by world.score. With `grid`, the first
    GRID_ROWS cases are drawn there too (`write_grid`)."""
    shots: list | None = [] if grid is not None else None
    with eval_pipeline(weights) as pipeline:
        summary = _score(pipeline, cases, log, call, shots=shots)
    if grid is not None:
        write_grid(shots, grid)
        log(f"wrote {grid} ({len(shots)} cases: source | target | result, the strip green where it succeeded)")
    return summary


GRID_ROWS = 24  # cases a --grid image shows (one row each)
GRID_STRIP = 8  # px: the strip right of a row, green for a success, red for a failure


def write_grid(shots: list[tuple], path: Path) -> None:
    """One row per (case, image, score): the source, the true target and the model's result side by side at
    the world's size, then a strip that says whether the edit succeeded. Failures are seen, not guessed at."""
    from PIL import Image

    rows = []
    for case, image, score in shots:
        result = np.asarray(image.convert("RGB").resize((world.SIZE, world.SIZE), Image.Resampling.NEAREST))
        strip = np.zeros((world.SIZE, GRID_STRIP, 3), np.uint8)
        strip[:] = (40, 170, 60) if score["success"] else (220, 40, 40)
        rows.append(np.concatenate([case.source, case.target, result, strip], axis=1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.concatenate(rows, axis=0)).save(path)


def oracle(
    weights: Path, cases: int, at_steps: list[int], log: Callable[[str], None] = print, **call
) -> dict[int, dict]:
    """Where sampling loses the edit: for each step index k, every held-out edit runs with its latents put,
    after step k, exactly on the true target's noised point (``(1 - s) x0 + s e`` at the next noise level
    s); the model samples on from there as usual. k = -1 puts nothing. The sampler is first order (UniPC of
    order 1 without its corrector, which is Euler for flow matching): a multistep sampler's history would
    still carry the replaced trajectory. One load for every k. Returns {k: summary}."""
    from diffusers import UniPCMultistepScheduler

    with eval_pipeline(weights) as pipeline:
        pipeline.scheduler = UniPCMultistepScheduler.from_config(
            pipeline.scheduler.config, solver_order=1, disable_corrector=list(range(1000))
        )
        return {
            k: _score(pipeline, cases, lambda line, k=k: log(f"oracle after step {k}: {line}"), call, k)
            for k in at_steps
        }


def calibrate_magcache(weights: Path, cases: int, log: Callable[[str], None] = print) -> dict:
    """MagCache's per-stage ratios of `weights` (pipeline/speed/mag_ratios.py), from `cases` edits of the
    training seed range (never a held-out case that `bench quality` scores) with the E1.1 defaults."""
    import torch
    from PIL import Image

    from hidream_ui.edits import EditSettings
    from hidream_ui.pipeline.speed import mag_calibrate

    defaults = EditSettings()
    steps, strength = defaults.num_inference_steps, defaults.refine_strength

    def edit(case):
        return lambda: pipeline(
            Image.fromarray(case.source),
            case.instruction,
            num_inference_steps=steps,
            refine_strength=strength,
            generator=torch.Generator().manual_seed(case.seed),
        )

    with eval_pipeline(weights) as pipeline:
        started = time.perf_counter()
        ratios = mag_calibrate.calibrate(
            pipeline, (edit(world.make_case(seed)) for seed in range(cases)), steps, strength
        )
    log(
        f"MagCache calibration ({cases} edits, {time.perf_counter() - started:.0f} s): edit "
        f"{[round(v, 3) for v in ratios.edit]}, refine {[round(v, 3) for v in ratios.refine]}"
    )
    return ratios.to_json()


def _score(
    pipeline,
    cases: int,
    log: Callable[[str], None],
    call: dict,
    oracle_step: int | None = None,
    shots: list | None = None,
) -> dict:
    import torch
    from PIL import Image

    scores = []
    started = time.perf_counter()
    for case in world.held_out_cases(cases):
        extra = {}
        if oracle_step is not None:
            extra["callback_on_step_end"] = _oracle_callback(pipeline, case, oracle_step, torch)
        image = pipeline(
            Image.fromarray(case.source),
            case.instruction,
            generator=torch.Generator().manual_seed(case.seed % (2**31)),
            **call,
            **extra,
        ).images[0]
        scores.append(world.score(case, image))
        if shots is not None and len(shots) < GRID_ROWS:
            shots.append((case, image, scores[-1]))
    seconds = (time.perf_counter() - started) / max(1, cases)
    summary = summarize(scores)
    summary["seconds_per_edit"] = round(seconds, 3)
    log(f"held-out ({cases} cases): " + ", ".join(f"{k} {v}" for k, v in summary.items() if k != "psnr_db"))
    return summary


def _oracle_callback(pipeline, case, step: int, torch):
    vae = pipeline.vae
    with torch.no_grad():
        x0 = vae.encode(pixels([case.target], torch)).latent_dist.mode()
    x0 = (x0 - vae.config.shift_factor) * vae.config.scaling_factor

    def callback(pipe, i, t, tensors):
        if i != step:
            return tensors
        s = pipe.scheduler.sigmas[i + 1]
        noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(case.seed % (2**31) + i))
        return {"latents": (1 - s) * x0 + s * noise}

    return callback


# ------------------------------------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    defaults = TrainSettings()
    parser = argparse.ArgumentParser(
        prog="python -m hidream_ui train-tiny",
        description="Train the `trained` tiny HiDream-E1 on the synthetic shapes world (CPU) and write its "
        "weights (weights.safetensors + trained.json, the layout of assets/tiny_trained/) into OUT.",
    )
    parser.add_argument("out", type=Path, metavar="OUT", help="output folder (created; files in it are replaced)")
    parser.add_argument("--steps", type=int, default=defaults.steps, help=f"transformer steps ({defaults.steps})")
    parser.add_argument("--vae-steps", type=int, default=defaults.vae_steps, help=f"VAE steps ({defaults.vae_steps})")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the data, init and noise (0)")
    parser.add_argument("--pool", type=int, default=defaults.pool, help=f"latent pairs kept ({defaults.pool})")
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch threads (1: deterministic)")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="K",
        help="also write OUT every K transformer steps (default 0: only at the end)",
    )
    parser.add_argument(
        "--decoder-from",
        type=Path,
        metavar="DIR",
        help="instead of training: fine-tune the VAE decoder of the weights in DIR for "
        "--decoder-steps and write OUT (the encoder, hence the transformer's latents, unchanged)",
    )
    parser.add_argument(
        "--vae-from",
        type=Path,
        metavar="DIR",
        help="take the VAE (and its latent shift and scale) from the weights in DIR instead of "
        "training one (--vae-steps is then ignored)",
    )
    parser.add_argument(
        "--init-from",
        type=Path,
        metavar="DIR",
        help="fine-tune: start the transformer from the weights in DIR and keep DIR's VAE and text encoders",
    )
    parser.add_argument(
        "--batch", type=int, default=defaults.batch, help=f"edit-stage samples per step ({defaults.batch})"
    )
    parser.add_argument(
        "--refine-batch",
        type=int,
        default=defaults.refine_batch,
        help=f"refine-stage samples per step ({defaults.refine_batch}; 0: none)",
    )
    parser.add_argument("--lr", type=float, default=defaults.lr, help=f"peak learning rate ({defaults.lr:g})")
    parser.add_argument(
        "--warmup", type=int, default=defaults.warmup, help=f"learning-rate warm-up steps ({defaults.warmup})"
    )
    parser.add_argument(
        "--edit-noise-min",
        type=float,
        default=defaults.edit_noise_min,
        metavar="S",
        help="draw every edit-stage noise level in [S, 1] (default 0: the whole range; e.g. 0.8 "
        "trains where only the copy heads can bring the source's colours)",
    )
    parser.add_argument(
        "--word-encoders",
        action="store_true",
        help="set the text encoders to the bag-of-words design of words.py (the world's words "
        "distinct; frozen) instead of the build's random or DIR's (--init-from) encoders",
    )
    parser.add_argument(
        "--ground-steps",
        type=int,
        default=defaults.ground_steps,
        metavar="N",
        help="first train a training-only head to find the named shape's tokens for N steps "
        '(default 0: none; docs/model-weights.md, "Which shape?")',
    )
    parser.add_argument(
        "--ground-weight",
        type=float,
        default=defaults.ground_weight,
        metavar="W",
        help="keep that head's loss beside the flow loss with weight W (default 0: not kept)",
    )
    parser.add_argument(
        "--ground-flow",
        type=float,
        default=defaults.ground_flow,
        metavar="W",
        help="add the flow loss of those cases (recolours and removes among several shapes, noise "
        "0.9-1) with weight W (default 0: not added)",
    )
    parser.add_argument(
        "--background-share",
        type=float,
        metavar="P",
        help="draw this share of the flow loss's training cases as background edits, the rest "
        "recolours and removes (default: the world's mix, a third)",
    )
    parser.add_argument(
        "--self-drift",
        type=float,
        default=defaults.self_drift,
        metavar="P",
        help="on this share of the edit samples, pull the noisy input towards the model's own "
        "estimate from pure noise instead of another case (default 0: none)",
    )
    parser.add_argument(
        "--refine-self-drift",
        type=float,
        default=defaults.refine_self_drift,
        metavar="P",
        help="on this share of the refine samples with the instruction, pull the noisy input "
        "towards the edit stage's own estimate from a higher noise level (default 0: none)",
    )
    parser.add_argument(
        "--vae-locality",
        type=float,
        default=defaults.vae_locality,
        metavar="W",
        help="weight of the VAE's locality loss: the latent change, source to target, on cells "
        "where no pixel changes (default 0: reconstruction only)",
    )
    parser.add_argument("--decoder-steps", type=int, default=1000, help="steps of --decoder-from (1000)")
    parser.add_argument("--decoder-lr", type=float, default=5e-4, help="peak learning rate of --decoder-from (5e-4)")
    parser.add_argument(
        "--decoder-own",
        type=int,
        default=0,
        metavar="N",
        help="with --decoder-from: first sample N training edits with DIR's pipeline and train the "
        "decoder on their final latents too (--decoder-own-share of each batch; default 0: none)",
    )
    parser.add_argument(
        "--decoder-own-share",
        type=float,
        metavar="S",
        help="with --decoder-own: the share of each decoder batch taken from those latents, the rest "
        f"reconstructions of fresh training cases ({DECODER_OWN_SHARE}: more broke the VAE's "
        "round trip)",
    )
    parser.add_argument(
        "--eval",
        type=int,
        default=0,
        metavar="N",
        help="then score N held-out cases through the loader and pipeline and record the figures "
        "in OUT/trained.json (what the app's banner quotes; default 0: none)",
    )
    parser.add_argument(
        "--eval-only", action="store_true", help="do not train: score the weights already in OUT (needs --eval N)"
    )
    parser.add_argument(
        "--grid",
        type=Path,
        metavar="PNG",
        help=f"with --eval: also draw the first {GRID_ROWS} held-out cases into PNG (source | "
        "target | result, a strip green where the edit succeeded, red where it failed)",
    )
    parser.add_argument(
        "--calibrate-magcache",
        type=int,
        default=0,
        metavar="N",
        help="then measure MagCache's ratios of the weights in OUT on N training-range edits and "
        "record them in OUT/trained.json (what `--cache magcache:T` uses; docs/speed.md)",
    )
    parser.add_argument(
        "--oracle",
        metavar="K[,K...]",
        help="with --eval-only: instead of scoring, show where sampling loses the edits: put "
        "each edit on its true target's noised point after step K, sample on (first-order "
        "sampler), score; -1 puts nothing (docs/model-weights.md)",
    )
    parser.add_argument(
        "--one-call",
        metavar="S[,S...]",
        help="with --eval-only --eval N: instead of scoring edits, noise each held-out edit's "
        "true target to level S, call the transformer once per stage without guidance and score "
        "its clean estimate, with the untouched shapes that keep their colour and whether the edit "
        'lands on the shape the instruction names (docs/model-weights.md, "Which shape?")',
    )
    args = parser.parse_args(argv)
    for name in ("steps", "vae_steps", "pool", "threads", "batch", "refine_batch", "warmup"):
        if getattr(args, name) < (0 if name in ("steps", "vae_steps", "refine_batch", "warmup") else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not (0 <= args.edit_noise_min < 1):
        parser.error(f"--edit-noise-min must be in [0, 1), got {args.edit_noise_min}")
    for name in ("self_drift", "refine_self_drift"):
        if not (0 <= getattr(args, name) <= 1):
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    if args.vae_locality < 0:
        parser.error(f"--vae-locality must be >= 0, got {args.vae_locality}")
    if args.vae_locality and any(getattr(args, n) is not None for n in ("init_from", "vae_from", "decoder_from")):
        parser.error(
            "--vae-locality weighs a loss of the VAE's training: not with --init-from, --vae-from or "
            "--decoder-from (they take an earlier run's encoder as it is)"
        )
    if args.background_share is not None and not (0 <= args.background_share <= 1):
        parser.error(f"--background-share must be in [0, 1], got {args.background_share}")
    for flag, lr in (("--lr", args.lr), ("--decoder-lr", args.decoder_lr)):
        if not (0 < lr <= 1):
            parser.error(f"{flag} must be in (0, 1], got {lr}")
    if args.decoder_own < 0:
        parser.error(f"--decoder-own must be >= 0, got {args.decoder_own}")
    if args.decoder_own_share is not None and not args.decoder_own:
        parser.error("--decoder-own-share weighs the latents of --decoder-own N: give --decoder-own")
    if args.decoder_own_share is not None and not (0 < args.decoder_own_share <= 1):
        parser.error(f"--decoder-own-share must be in (0, 1], got {args.decoder_own_share}")
    if args.decoder_own and args.decoder_from is None:
        parser.error("--decoder-own samples edits with the weights of --decoder-from DIR: give --decoder-from")
    starts = [
        f"--{name.replace('_', '-')}"
        for name in ("init_from", "vae_from", "decoder_from")
        if getattr(args, name) is not None
    ]
    if len(starts) > 1:
        parser.error(f"{' and '.join(starts)} exclude each other")
    if args.init_from is not None and not (args.init_from / trained.META_FILE).is_file():
        parser.error(f"--init-from: no trained weights in {args.init_from} ({trained.META_FILE} is missing)")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.eval < 0:
        parser.error(f"--eval must be >= 0, got {args.eval}")
    if args.calibrate_magcache < 0:
        parser.error(f"--calibrate-magcache must be >= 0, got {args.calibrate_magcache}")
    if args.eval_only and not (args.eval or args.calibrate_magcache):
        parser.error("--eval-only needs --eval N (how many held-out cases to score) or --calibrate-magcache N")
    if args.eval_only and not (args.out / trained.META_FILE).is_file():
        parser.error(f"--eval-only: no trained weights in {args.out} ({trained.META_FILE} is missing)")
    oracle_steps = _oracle_steps(parser, args.oracle) if args.oracle is not None else None
    if oracle_steps is not None and not (args.eval_only and args.eval):
        parser.error("--oracle needs --eval-only --eval N")
    levels = _noise_levels(parser, args.one_call) if args.one_call is not None else None
    if levels is not None and (not (args.eval_only and args.eval) or oracle_steps is not None):
        parser.error("--one-call needs --eval-only --eval N (and not --oracle)")
    if args.grid is not None and (not args.eval or oracle_steps is not None or levels is not None):
        parser.error("--grid draws what --eval N scores: give --eval N (and not --oracle or --one-call)")
    if args.grid is not None and args.grid.suffix.lower() != ".png":
        parser.error(f"--grid writes a PNG: give a path ending in .png, got {args.grid}")
    settings = TrainSettings(
        steps=args.steps,
        vae_steps=args.vae_steps,
        seed=args.seed,
        pool=args.pool,
        threads=args.threads,
        batch=args.batch,
        refine_batch=args.refine_batch,
        lr=args.lr,
        warmup=args.warmup,
        edit_noise_min=args.edit_noise_min,
        word_encoders=args.word_encoders,
        ground_steps=max(0, args.ground_steps),
        ground_weight=max(0.0, args.ground_weight),
        ground_flow=max(0.0, args.ground_flow),
        background_share=args.background_share,
        vae_locality=args.vae_locality,
        self_drift=args.self_drift,
        refine_self_drift=args.refine_self_drift,
        checkpoint_every=max(0, args.checkpoint_every),
        log_every=max(1, min(defaults.log_every, args.steps // 20 or 1)),
    )
    if args.eval_only:
        pass  # score (or --oracle) the weights already in OUT, below
    elif args.decoder_from is not None:
        torch_threads(args.threads)
        finetune_decoder(
            args.decoder_from,
            args.out,
            args.decoder_steps,
            seed=args.seed,
            lr=args.decoder_lr,
            own=args.decoder_own,
            own_share=DECODER_OWN_SHARE if args.decoder_own_share is None else args.decoder_own_share,
            log=lambda line: print(line, flush=True),
        )
    else:
        train(
            args.out,
            settings,
            log=lambda line: print(line, flush=True),
            vae_from=args.vae_from,
            init_from=args.init_from,
        )
    if args.calibrate_magcache:
        ratios = calibrate_magcache(args.out, args.calibrate_magcache, log=lambda line: print(line, flush=True))
        trained.record_mag_ratios(
            args.out,
            ratios,
            f"python -m hidream_ui train-tiny OUT --eval-only --calibrate-magcache {args.calibrate_magcache}",
        )
    if oracle_steps is not None:
        oracle(args.out, args.eval, oracle_steps, log=lambda line: print(line, flush=True))
    elif levels is not None:
        from hidream_ui.model.tiny.probe import one_call

        one_call(args.out, args.eval, levels, log=lambda line: print(line, flush=True))
    elif args.eval:
        summary = evaluate(args.out, args.eval, log=lambda line: print(line, flush=True), grid=args.grid)
        command = f"python -m hidream_ui train-tiny OUT --eval {args.eval} --eval-only"
        trained.record_held_out(args.out, summary, command)
    return 0


def _noise_levels(parser, text: str) -> list[float]:
    try:
        levels = [float(part) for part in text.split(",")]
    except ValueError:
        parser.error(f"--one-call takes noise levels like 1,0.8,0.5; got {text!r}")
    if not levels or any(not (0 < s <= 1) for s in levels):
        parser.error(f"--one-call noise levels must be in (0, 1]; got {text!r}")
    return levels


def _oracle_steps(parser, text: str) -> list[int]:
    try:
        steps = [int(part) for part in text.split(",")]
    except ValueError:
        parser.error(f"--oracle takes step indices like 2,6,10; got {text!r}")
    if not steps or any(k < -1 for k in steps):
        parser.error(f"--oracle step indices must be -1 or more; got {text!r}")
    return steps


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
