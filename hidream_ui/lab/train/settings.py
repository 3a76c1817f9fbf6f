"""What one `train-tiny` run is set to (TrainSettings) and what it reports; the knobs its recorded command names."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


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
    # pixels stay, by twice the latent std (docs/lab-notebook.md). This loss charges, for each source/target
    # pair of a VAE batch, the latent change on the cells where no pixel changes (in units of the latent variance).
    vae_locality: float = 0.0
    warmup: int = 100
    # Share of edit-stage noise levels drawn uniformly instead of through the schedule's shift: shift 3 puts
    # only 8 % of draws below 0.2, where the last steps decide how exactly the untouched region comes back.
    uniform_share: float = 0.5
    # Lowest edit-stage noise level drawn (0: the whole range). Raised, every edit sample lies in
    # [edit_noise_min, 1], where the input holds almost nothing of the target: the edit and the untouched shapes'
    # colours must come from the source and the instruction. (1500 steps of it did not teach the model which
    # shape a word names: docs/lab-notebook.md, "Which shape?".)
    edit_noise_min: float = 0.0
    # Which shape? (docs/lab-notebook.md). `word_encoders`: the text encoders get the bag-of-words design of
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
    # Background edits were the weak kind (12.5 % after the runs of docs/lab-notebook.md): this weighs them.
    background_share: float | None = None
    # Content drift (see train_transformer): on this share of the fully conditioned edit samples, the noisy
    # input's content is pulled towards another case's by `drift` x noise level, the target staying this case's.
    drift_share: float = 0.5
    drift: float = 0.5
    # Self drift: on this share of the fully conditioned edit samples, the content pulled in is the model's own
    # clean estimate from pure noise (one call without gradient, the first step's hedge that sampling commits
    # to), at full strength (x noise level) instead of another case's at `drift`. One call at s = 1 scored better
    # than the sampled edit (docs/lab-notebook.md): the later steps keep the input's errors.
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
