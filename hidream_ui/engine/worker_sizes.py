"""Sizes on a worker's loaded model: the working-size plan of a source, the working resolutions it can
take, and how many batch items fit in one transformer call.

A mixin of `EditEngine` (engine/engine.py), which owns `config`, `_model`, `model` and `_backends`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hidream_ui.edits import WORKING_SIDE_MIN
from hidream_ui.engine.errors import EngineError
from hidream_ui.model.layout import PROMPT_TOKENS

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.config import AppConfig
    from hidream_ui.geometry import WorkingPlan
    from hidream_ui.model.loading import LoadedModel

logger = logging.getLogger(__name__)

# Numeric working sides the UI offers, where the model can take them (see `working_sides`).
OFFERED_SIDES = (512, 768, 1024)


def working_sides(geometry) -> list[int]:
    """The offered numeric sides that a model of `geometry` can run: at least the requests'
    minimum side, and within its token budget. A side N works at N x N (E1-Full) or at an N x N
    area (E1.1), and the edit input is H x 2W latents: 2 (N / multiple)^2 tokens at most."""
    return [
        side
        for side in OFFERED_SIDES
        if side >= WORKING_SIDE_MIN and 2 * (side // geometry.multiple) ** 2 <= geometry.max_seq
    ]


class WorkingSizes:
    """The size questions of the worker (see the module's docstring)."""

    config: "AppConfig"
    _model: "LoadedModel | None"
    _backends: object
    model: "LoadedModel"

    def working_plan(self, source_size: tuple[int, int], working_resolution) -> "WorkingPlan":
        """The working-size plan for a source of `source_size` on the loaded model.

        Raises EngineError, before any work, when the size needs more tokens than the model's
        budget (the edit input is H x 2W latents; more than max_seq cannot be padded or collapsed).
        """
        from hidream_ui.geometry import working_plan

        model = self.model
        geometry = model.geometry
        plan = working_plan(
            source_size,
            variant=model.sources.variant,
            image_size=geometry.image_size,
            working_resolution=working_resolution,
            fixed_size=(geometry.e1_full_side, geometry.e1_full_side),
        )
        width, height = plan.working_size
        tokens = (height // geometry.multiple) * (2 * width // geometry.multiple)
        if tokens > geometry.max_seq:
            sides = working_sides(geometry)
            hint = (
                f"choose 'auto', 'draft' or a side of at most {sides[-1]}"
                if sides
                else f"this model works at most at {geometry.image_size} px, below the smallest numeric side "
                f"({WORKING_SIDE_MIN}): choose 'auto' or 'draft'"
            )
            raise EngineError(
                f"working size {width}x{height} needs {tokens} tokens, more than this model's {geometry.max_seq}: "
                f"{hint}"
            )
        return plan

    def working_resolution_choices(self) -> list[str]:
        """The working resolutions this model can take ("auto", "draft" and the numeric sides that
        fit): from the loaded model, else from the checkpoint's config files (no weights read).
        Only "auto" and "draft" while the geometry cannot be known yet (tiny model not built)."""
        geometry = self._model.geometry if self._model is not None else self._geometry_from_configs()
        return ["auto", "draft", *(str(side) for side in (working_sides(geometry) if geometry else ()))]

    def _geometry_from_configs(self):
        from hidream_ui.model.geometry import read_geometry
        from hidream_ui.model.sources import ModelError, resolve_sources

        try:
            return read_geometry(resolve_sources(self.config, build_tiny=False))
        except (ModelError, OSError, ValueError, KeyError) as exc:
            logger.debug("geometry unknown before load: %s", exc)
            return None

    def auto_batch_size(self, working_size: tuple[int, int]) -> int:
        """Items per transformer call that fit in free device memory (1..8).

        Estimate per item: three guidance copies of the collapsed token sequence, times the
        hidden width, times ~24 live activations per token in a block (q/k/v/out, MoE experts,
        norms), in the model dtype. Deliberately rough and conservative; `batch_size` overrides.
        """
        from hidream_ui.device.memory import snapshot

        model = self.model
        config = model.pipeline.transformer.config
        unit = model.geometry.multiple
        tokens = 2 * (working_size[0] // unit) * (working_size[1] // unit) + 4 * PROMPT_TOKENS
        inner = config.num_attention_heads * config.attention_head_dim
        element = 2 if str(model.dtype) in ("torch.bfloat16", "torch.float16") else 4
        per_item = 3 * tokens * inner * element * 24
        free = snapshot(model.device, backends=self._backends).free
        if not free:
            return 1
        return max(1, min(8, int(free * 0.8 // per_item)))


__all__ = ["OFFERED_SIDES", "WorkingSizes", "working_sides"]
