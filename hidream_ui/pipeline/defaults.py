"""Upstream HiDream-E1.1's sampling defaults: the pipeline's call defaults, as a diffusers pipeline
keeps them in its signature. The app's edit schema (hidream_ui.edits FIELDS) takes its defaults from
here, so the numbers have one home and the pipeline imports nothing from the app. E1-Full's own
guidance defaults are the app's per-variant table (edits VARIANT_DEFAULTS).
"""

from __future__ import annotations

# Upstream's negative prompt (both variants).
NEGATIVE_PROMPT = "low resolution, blur"
GUIDANCE_SCALE = 3.0
IMAGE_GUIDANCE_SCALE = 1.5
NUM_INFERENCE_STEPS = 28
REFINE_STRENGTH = 0.3
CLIP_CFG_NORM = True
# Exact: the transformer's padded tokens of a non-square input are sent as one (see edit_pipeline.py).
COLLAPSE_PADDING = True
