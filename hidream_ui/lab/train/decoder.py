"""`train-tiny OUT --decoder-from DIR`: more training for the VAE's decoder alone, and the round trip that checks
it still decodes true latents right."""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from hidream_ui.lab import world
from hidream_ui.lab.scoring import PROFILE, eval_pipeline, pixels, to_images
from hidream_ui.lab.train.data import Seeds
from hidream_ui.lab.train.schedule import set_lr
from hidream_ui.model.layout import I1_DIR
from hidream_ui.model.tiny import trained

# --decoder-own: the share of each decoder batch from the pipeline's own latents. Three quarters broke the VAE's
# round trip (84-97 % of 96 true targets), a quarter kept it (99-100 %, the median as before) with the same gain in
# untouched PSNR (docs/lab-notebook.md, "The decoder on the pipeline's own latents, a quarter of each batch").
DECODER_OWN_SHARE = 0.25


# True training targets whose round trip a decoder fine-tune checks when it ends.
ROUND_TRIP_CASES = 96


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
    exactly (docs/lab-notebook.md, "The decoder on the pipeline's own latents"). Only the edits whose named region
    came out right are kept: the decoder is to learn fidelity, not to redo the edit without the instruction.

    Afterwards `round_trip_cases` fresh training targets are encoded and decoded and scored like edits (`round_trip`
    in the meta): a decoder that mends the transformer's errors can stop decoding true latents right (three
    quarters of each batch did, docs/lab-notebook.md), and the oracle and `--one-call` rely on that round trip."""
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
        own_latents, own_targets = _own_latents(source, vae, own, Seeds(seed + 13), log)
        torch.set_num_threads(threads)
    decoder = [vae.decoder] + ([vae.post_quant_conv] if vae.post_quant_conv is not None else [])
    params = [p for module in decoder for p in module.parameters()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed + 11)
    seeds = Seeds(seed + 11)
    picks = np.random.default_rng([seed, 13])  # its own stream: without `own` the run is as before
    per_batch = round(batch * own_share) if own_latents is not None else 0
    started = time.perf_counter()
    loss_value = float("nan")
    for step in range(steps):
        set_lr(optimizer, lr, step, steps, min(50, steps))
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


def _own_latents(weights: Path, vae, count: int, seeds: Seeds, log: Callable[[str], None]):
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
