"""Measures a checkpoint's MagCache ratios (mag_ratios.py holds them) by running real edits.

Its own file because it drives the cache install (cache.py -> library.py), which reads the ratios from
mag_ratios.py: keeping the measuring out of mag_ratios.py keeps that chain free of a circle.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterable
from typing import Any

from hidream_ui.pipeline.speed.cache import apply_step_cache, remove_step_cache
from hidream_ui.pipeline.speed.library import calibration_state
from hidream_ui.pipeline.speed.mag_ratios import STAGES, MagRatios


def calibrate(pipeline, edits: Iterable[Callable[[], Any]], steps: int, refine_strength: float) -> MagRatios:
    """Runs every edit (a callable that calls `pipeline` once, with `steps` and `refine_strength`) with
    MagCache calibrating, and averages each stage's ratios over the edits. Leaves no cache installed."""
    transformer = pipeline.transformer
    apply_step_cache(transformer, "magcache:0.06")  # the threshold is unused while calibrating
    curves: dict[str, list[list[float]]] = {stage: [] for stage in STAGES}
    try:
        state = calibration_state(transformer)
        for edit in edits:
            state.start_calibration()
            # diffusers prints each finished curve ("copy these values"); the average is what we keep.
            with contextlib.redirect_stdout(io.StringIO()):
                edit()
            for stage, curve in state.take_calibration().items():
                curves[stage].append(curve)
    finally:
        remove_step_cache(transformer)
    if not curves["edit"] or not curves["refine"]:
        raise ValueError("MagCache calibration needs at least one edit with both stages (refine strength > 0)")
    return MagRatios(
        edit=_mean(curves["edit"]),
        refine=_mean(curves["refine"]),
        steps=steps,
        refine_strength=refine_strength,
        cases=len(curves["edit"]),
    )


def _mean(curves: list[list[float]]) -> tuple[float, ...]:
    length = min(len(c) for c in curves)
    return tuple(sum(c[i] for c in curves) / len(curves) for i in range(length))
