"""Scoring trained tiny weights on held-out cases: the pipeline they load into, the pixels it is fed, the summary.

Shared by `train-tiny`'s training and evaluation (lab/train/) and its one-call probe (lab/probe.py), so neither
imports the other.
"""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from hidream_ui.lab import world
from hidream_ui.model.tiny import trained

PROFILE = "trained"


def pixels(images, torch):
    """uint8 (N, 128, 128, 3) -> float (N, 3, 128, 128) in [-1, 1], as the pipeline's image processor makes."""
    array = np.stack(images).astype(np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(0, 3, 1, 2).contiguous()


def to_images(x) -> np.ndarray:
    """The inverse of `pixels`: a decoder's float (N, 3, 128, 128) output, clipped to [-1, 1], as uint8
    (N, 128, 128, 3)."""
    return ((x.detach().clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()


@contextmanager
def eval_pipeline(weights: Path):
    """The editing pipeline of `weights` laid over a fresh build (a scratch folder, removed afterwards)."""
    import torch

    from hidream_ui.config import AppConfig
    from hidream_ui.device.detect import resolve_device
    from hidream_ui.model.loading import load_model
    from hidream_ui.model.tiny.build import build_tiny

    torch.set_num_threads(1)  # one edit at a time on a shared machine: more threads only wait for each other
    scratch = Path(tempfile.mkdtemp(prefix="train-tiny-eval-"))
    try:
        root = build_tiny(scratch / "model", PROFILE, 0, trained_weights=False)
        trained.overlay(root, Path(weights))
        yield load_model(AppConfig(model_dir=root), resolve_device("cpu"), torch.float32).pipeline
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def summarize(scores: list[dict]) -> dict:
    """Success overall and per edit kind, the untouched PSNR median and `colour_ok` of world.score verdicts."""
    result: dict = {"cases": len(scores), "success": _rate(scores)}
    for kind in world.EDIT_KINDS:
        result[kind] = _rate([s for s in scores if s["kind"] == kind])
    finite = [min(s["untouched_psnr_db"], 99.0) for s in scores]
    result["untouched_psnr_median_db"] = round(float(np.median(finite)), 2) if finite else None
    result["colour_ok"] = round(sum(s["colour_ok"] for s in scores) / max(1, len(scores)), 3)
    return result


def _rate(scores: list[dict]) -> float | None:
    return round(sum(s["success"] for s in scores) / len(scores), 3) if scores else None
