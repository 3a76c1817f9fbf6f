"""`train-tiny OUT --eval-only --eval N --one-call S[,S...]`: what one transformer call makes of the truth.

Each held-out edit's true target is noised to level s (``x_t = (1 - s) x0 + s e``), the transformer is called
once as the pipeline calls it, without guidance, and its clean estimate ``x_t - s v`` is decoded and scored like
an edit. Two calls per level:

- the edit stage: ``[x_t | source]`` with the instruction;
- the refine stage: ``x_t`` alone with the instruction (E1.1's target prompt), no source.

This takes the sampler, the guidance and the model's own trajectory out of the picture: at s = 1 the input holds
nothing of the target, yet the source and the instruction fix it, so a model that had learned the edit would get
it in one call. Besides the edit's verdicts it counts the **untouched shapes that keep their colour** (every shape
the instruction does not name; for a background edit, every shape): at high noise their colour can come only
from the source, through the copy heads (lab/train/model.py, copy_heads). And it asks whether the model knows
which shape a word names (`_grounding`): the answer on every weight trained so far is no (docs/lab-notebook.md,
"Which shape?").
Once per run it also says how local the VAE's latents are (`latent_locality`): where the target's latents differ
from the source's, against where its pixels do, which is what the edit stage has to predict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from hidream_ui.lab import scoring, world

STAGES = ("edit", "refine")
# A latent pixel counts as changed when the mean over channels of |target - source| is above this. The latents are
# the scaled ones the transformer sees (about unit variance), so 0.15 is a change the model has to make, not
# rounding. The shares depend on it; docs/lab-notebook.md ("Which shape?") gives them at 0.05 and 0.3 too.
LATENT_CHANGE = 0.15


def kept_shapes(case: world.Case, out: np.ndarray) -> tuple[int, int]:
    """(untouched shapes whose eroded interior is nearest their own colour in `out`, a (128, 128, 3) uint8
    image; untouched shapes)."""
    named = case.edit.target if case.edit.kind != "background" else None
    kept = total = 0
    for shape in case.scene.shapes:
        if shape.kind == named:
            continue
        inner = world.erode(world.shape_mask(shape))
        total += 1
        kept += world.nearest(out[inner].astype(np.float64).mean(axis=0), world.COLOURS) == shape.colour
    return kept, total


def one_call(weights: Path, cases: int, levels: list[float], log: Callable[[str], None] = print) -> dict:
    """{stage: {s: summary}} for the weights in `weights` (an asset folder) on `cases` held-out edits, and
    `latents`: latent_locality's figures. The summary is scoring.summarize's (success, per kind, untouched PSNR
    median, colour_ok) plus `shapes_kept`."""
    import torch

    from hidream_ui.pipeline.edit_pipeline import PromptEmbeds

    held_out = world.held_out_cases(cases)
    results: dict = {stage: {} for stage in STAGES}
    with scoring.eval_pipeline(weights) as pipeline, torch.no_grad():
        vae = pipeline.vae

        def encode(images):
            z = vae.encode(scoring.pixels(images, torch)).latent_dist.mode()
            return (z - vae.config.shift_factor) * vae.config.scaling_factor

        def decode(latents):
            x = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor).sample
            return scoring.to_images(x)

        source = encode([c.source for c in held_out])
        target = encode([c.target for c in held_out])
        text = PromptEmbeds.cat([pipeline.encode_text(c.instruction) for c in held_out])
        width = source.shape[-1]
        results["latents"] = latent_locality(held_out, source, target)
        for kind, found in results["latents"].items():
            log(
                f"the VAE, {kind} ({found['cases']} cases): the latents change on {found['latents']:.1%} of the "
                f"latent pixels, the pixels on {found['pixels']:.1%}; the latents change more than one latent pixel "
                f"away from every changed pixel on {found['far']:.1%}"
                + (
                    ""
                    if found["still"] is None
                    else f"; where no pixel changes, the latents change on {found['still']:.1%}"
                )
            )
        for s in levels:
            # One noise draw per case and level, the same for both stages.
            noise = torch.cat(
                [
                    torch.randn(target[:1].shape, generator=torch.Generator().manual_seed(c.seed % 2**31))
                    for c in held_out
                ]
            )
            x_t = (1 - s) * target + s * noise
            timestep = torch.full((len(held_out),), 1000.0 * s)
            inputs = {"edit": torch.cat([x_t, source], dim=-1), "refine": x_t}
            for stage in STAGES:
                v = pipeline.predict(inputs[stage], timestep, text)[..., :width]
                images = decode(x_t - s * v)
                scores = [world.score(c, img) for c, img in zip(held_out, images)]
                counts = np.array([kept_shapes(c, img) for c, img in zip(held_out, images)]).sum(axis=0)
                summary = scoring.summarize(scores)
                summary["shapes_kept"] = round(float(counts[0]) / max(1, int(counts[1])), 3)
                results[stage][s] = summary
                log(
                    f"one call, {stage} stage, noise {s:g}: success {summary['success']}, colour_ok "
                    f"{summary['colour_ok']}, untouched PSNR {summary['untouched_psnr_median_db']} dB, untouched "
                    f"shapes keep their colour {int(counts[0])}/{int(counts[1])}"
                )
            found = _grounding(pipeline, held_out, source, noise, s)
            results["edit"][s].update(found)
            log(
                f"one call, edit stage, noise {s:g}: the edit lands on the shape the instruction names for "
                f"{found['grounded']:.0%} of {found['grounding_cases']} instructions (picking a shape at random: "
                f"{found['grounding_chance']:.0%})"
            )
    return results


def latent_locality(held_out: list[world.Case], source, target, threshold: float = LATENT_CHANGE) -> dict:
    """{edit kind: {cases, latents, pixels, far, still}}: the share of latent pixels whose latents change from
    `source` to `target` (the held-out cases' encodings, (N, C, h, w)), the share whose cell of the image has a
    pixel that changes, and the share whose latents change more than one latent pixel away from every such cell.
    The ring of one is the encoder's reach at any edge; an edit the VAE keeps local has `far` near 0, so the model
    has to change only what the instruction touches. `far` cannot see a background edit (nearly every cell has a
    changed pixel), so `still` asks directly: of the cells where no pixel changes (a background edit's shape
    interiors), the share whose latents change, averaged over the cases that have such cells (None: none has)."""
    rows, columns = source.shape[-2:]
    changed = ((target - source).abs().mean(dim=1) > threshold).numpy()  # (N, h, w)
    sums: dict[str, list] = {}
    for case, latents in zip(held_out, changed):
        pixels = world.moved_cells(case.source, case.target, rows, columns)
        near = np.pad(pixels, 1)
        near = np.max(
            [near[1 + dy : 1 + dy + rows, 1 + dx : 1 + dx + columns] for dy in (-1, 0, 1) for dx in (-1, 0, 1)], axis=0
        )  # dilated by one latent pixel
        row = sums.setdefault(case.edit.kind, [0, 0.0, 0.0, 0.0, []])
        row[0] += 1
        row[1] += float(latents.mean())
        row[2] += float(pixels.mean())
        row[3] += float((latents & ~near).mean())
        if (~pixels).any():
            row[4].append(float(latents[~pixels].mean()))
    return {
        kind: {
            "cases": n,
            "latents": round(a / n, 3),
            "pixels": round(b / n, 3),
            "far": round(c / n, 3),
            "still": round(float(np.mean(still)), 3) if still else None,
        }
        for kind, (n, a, b, c, still) in sorted(sums.items())
    }


def _grounding(pipeline, held_out: list[world.Case], source, noise, s: float) -> dict:
    """Does the model know which shape a word names? For each held-out recolour or remove of a scene with two or
    three shapes, the instruction is given naming each shape in turn (same verb and colour; a shape that already
    has the colour is left out), one edit-stage call each from the same input: the source noised to level s, so
    that the input favours no instruction. The instruction naming shape k should change shape k: `grounded` is
    the share of instructions whose estimate departs most from the mean of the scene's estimates on the shape
    they name; `grounding_chance` what picking one of the scene's shapes at random would score."""
    import torch

    from hidream_ui.pipeline.edit_pipeline import PromptEmbeds

    hits = total = 0
    chance = 0.0
    width = source.shape[-1]
    for index, case in enumerate(held_out):
        edit = case.edit
        named = [shape for shape in case.scene.shapes if edit.kind == "remove" or shape.colour != edit.value]
        if edit.kind == "background" or len(named) < 2:
            continue
        text = PromptEmbeds.cat(
            [pipeline.encode_text(world.Edit(edit.kind, shape.kind, edit.value).instruction) for shape in named]
        )
        x_t = ((1 - s) * source[index : index + 1] + s * noise[index : index + 1]).expand(len(named), -1, -1, -1)
        hidden = torch.cat([x_t, source[index : index + 1].expand_as(x_t)], dim=-1)
        v = pipeline.predict(hidden, torch.full((len(named),), 1000.0 * s), text)[..., :width]
        estimates = x_t - s * v
        departure = (estimates - estimates.mean(0, keepdim=True)).pow(2).sum(1)  # (shapes, h, w) latent pixels
        rows, columns = departure.shape[-2:]
        cells = [
            world.shape_mask(shape).reshape(rows, world.SIZE // rows, columns, world.SIZE // columns).any(axis=(1, 3))
            for shape in named
        ]
        for k in range(len(named)):
            energy = [float(departure[k][torch.from_numpy(cell)].sum()) for cell in cells]
            hits += int(np.argmax(energy)) == k
            total += 1
            chance += 1 / len(named)
    return {
        "grounded": round(hits / max(1, total), 3),
        "grounding_cases": total,
        "grounding_chance": round(chance / max(1, total), 3),
    }
