"""What an edit gives back: its timings, the engine facts saved with it (`RunInfo`) and the result
(`EditResult`) with the one metadata dict written into its PNG and sidecar (results.py saves it).

Part of the edit schema (hidream_ui.edits re-exports every name); PIL and the standard library only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from PIL import Image

from hidream_ui.edit_values import cap_name

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.edits import EditParams
    from hidream_ui.rewrite.prompt import RewriteResult


@dataclass(frozen=True)
class Timings:
    """Seconds spent in each phase of one pipeline call (shared by the items of a batch call)."""

    load: float = 0.0  # model load this call waited for
    text_encode: float = 0.0  # text encoders (0 when every text came from the prompt cache)
    prepare: float = 0.0  # resizing, latents, scheduler
    denoise: float = 0.0  # first to last denoising step
    per_step: float = 0.0
    decode: float = 0.0  # VAE decode and post-processing
    total: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunInfo:
    """Engine facts saved with every result: which model, where, how. Metadata keys as named here."""

    variant: str
    model_source: str  # "tiny" | "real"
    model_paths: dict[str, Any] | None
    device: str
    device_name: str
    dtype: str
    attention: str | None
    refiner: str
    versions: dict[str, str]
    batch_size: int = 1  # items in the pipeline call that produced the result
    engine: str | None = None  # the pool's engine that ran it ("npu:1", "cpu#2"), with --devices
    memory_plan: dict[str, Any] | None = None  # MemoryPlan.to_dict(): plan, weights, prediction (model/plans.py)
    # Speed modes of the call (README "Speed modes"): moe, compile, cache, skipped_fraction; None: exact.
    speed: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class EditResult:
    image: Image.Image  # the edited image at source_size
    source_image: Image.Image  # the source after EXIF transpose and mode conversion
    params: "EditParams"  # validated, seed resolved
    working_size: tuple[int, int]
    source_size: tuple[int, int]
    timings: Timings
    peak_memory_bytes: int | None
    info: RunInfo  # engine facts: variant, model_source, model paths, device, dtype, ...
    saved_png: Path | None = None
    saved_json: Path | None = None
    source_name: str | None = None
    rewrite: "RewriteResult | None" = None  # the rewriter's answer the instruction came from, if any
    # What `metadata()` returned when the result was saved (results.py): built once, read by the UI.
    saved_metadata: dict[str, Any] | None = None
    # The image this result was made from: {"file", "sha256", "of"} (results.py `parent_of` defines
    # it; set by the result store before saving). A source that is an earlier result names that PNG.
    parent: dict[str, Any] | None = None
    source_sha256: str | None = None  # from the request (EditRequest.source_sha256)
    # A region edit: the feather (source pixels) of the pixel composite; the mask is `params.mask`.
    mask_feather: int | None = None

    METADATA_FORMAT = "hidream_ui/1"

    def metadata(self) -> dict[str, Any]:
        """JSON-ready description of this result (written into the PNG and the sidecar).

        The core keys come first and win over an ``info`` entry of the same name, so an engine
        fact can never disguise the params that reproduce the image. A rewritten instruction adds
        ``rewrite``: the user's request (``original``), the rewriter's lines, the prompt it composed
        and whether the user changed that prompt before editing (``edited``); ``params.instruction``
        stays the text actually used, so ``EditParams.from_dict(metadata["params"])`` reproduces the edit.
        """
        core: dict[str, Any] = {
            "format": self.METADATA_FORMAT,
            "params": self.params.to_dict(),
            "working_size": list(self.working_size),
            "source_size": list(self.source_size),
            "source_name": cap_name(self.source_name),
            "timings": self.timings.to_dict(),
            "peak_memory_bytes": self.peak_memory_bytes,
        }
        if self.parent is not None:
            core["parent"] = dict(self.parent)
        if self.params.mask is not None:
            core["mask"] = {**self.params.mask.to_dict(), "feather": self.mask_feather}
        if self.rewrite is not None:
            composed = self.rewrite.compose(self.info.variant)
            core["rewrite"] = {
                **self.rewrite.to_dict(),
                "prompt": composed,
                "edited": self.params.instruction != composed.strip(),
            }
        for key, value in self.info.to_dict().items():
            core.setdefault(str(key), value)
        return _jsonable(core)


def _jsonable(value: Any) -> Any:
    """Convert to JSON-native types so that write -> read gives back an equal dict."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        # NaN/inf would make the JSON invalid for strict readers (browsers, jq).
        return value if math.isfinite(value) else None
    if isinstance(value, Path):
        return str(value)
    return str(value)  # torch.dtype, torch.device, versions: their str() is the useful form
