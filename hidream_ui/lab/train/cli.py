"""`python -m hidream_ui train-tiny OUT ...`: the command's flags, their checks, and which phase runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hidream_ui.lab.train.decoder import DECODER_OWN_SHARE, finetune_decoder
from hidream_ui.lab.train.evaluate import GRID_ROWS, calibrate_magcache, evaluate, oracle
from hidream_ui.lab.train.run import torch_threads, train
from hidream_ui.lab.train.settings import TrainSettings
from hidream_ui.model.tiny import trained


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
        '(default 0: none; docs/lab-notebook.md, "Which shape?")',
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
        "sampler), score; -1 puts nothing (docs/lab-notebook.md)",
    )
    parser.add_argument(
        "--one-call",
        metavar="S[,S...]",
        help="with --eval-only --eval N: instead of scoring edits, noise each held-out edit's "
        "true target to level S, call the transformer once per stage without guidance and score "
        "its clean estimate, with the untouched shapes that keep their colour and whether the edit "
        'lands on the shape the instruction names (docs/lab-notebook.md, "Which shape?")',
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
        from hidream_ui.lab.probe import one_call

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
