"""Batch requests: many images x many instructions sharing one set of parameters.

Pure planning (no torch): which items exist, in which order, with which seed, and the limits
checked before any work starts. The engine executes the plan (`EditEngine.run_batch`).
"""

from __future__ import annotations

import dataclasses
import random
import secrets
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from hidream_ui.requests import SEED_MAX, EditParams, EditResult, RequestError

MODES = ("matrix", "paired")
SEED_POLICIES = ("fixed", "increment", "random")


@dataclass(frozen=True)
class BatchSource:
    """One uploaded file: its display name and anything `imaging.open_image` accepts."""

    name: str
    data: Any


@dataclass(frozen=True)
class BatchRequest:
    sources: tuple[BatchSource, ...]
    instructions: tuple[str, ...]
    params: EditParams  # shared; its instruction is replaced per item
    mode: str = "matrix"  # "matrix": every image x every instruction; "paired": line i with image i
    seed_policy: str = "fixed"  # "fixed": params.seed for all; "increment": +1 per item; "random"
    batch_size: int | None = None  # items per transformer call; None = chosen from free memory


@dataclass
class BatchItem:
    index: int
    source_index: int
    source_name: str
    instruction: str
    seed: int
    status: str = "pending"  # pending | ok | error | cancelled
    error: str | None = None
    result: EditResult | None = None
    seconds: float | None = None

    def manifest_row(self) -> dict:
        row = {"index": self.index, "source": self.source_name, "instruction": self.instruction, "seed": self.seed,
               "status": self.status, "error": self.error, "seconds": self.seconds}
        if self.result is not None:
            row["output"] = self.result.saved_png.name if self.result.saved_png else None
            row["working_size"] = list(self.result.working_size)
            row["timings"] = dict(self.result.timings)
        return row


@dataclass
class BatchResult:
    items: list[BatchItem]
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (file name, reason)
    cancelled: bool = False
    seconds: float = 0.0
    stats: dict = field(default_factory=dict)

    @property
    def ok(self) -> list[BatchItem]:
        return [item for item in self.items if item.status == "ok"]

    @property
    def errors(self) -> list[BatchItem]:
        return [item for item in self.items if item.status == "error"]


def clean_instructions(text_or_lines) -> tuple[str, ...]:
    """One instruction per non-empty line (a string) or per non-empty list entry."""
    lines = text_or_lines.splitlines() if isinstance(text_or_lines, str) else list(text_or_lines or [])
    return tuple(line.strip() for line in lines if line and line.strip())


def plan_items(request: BatchRequest, source_names: list[str], max_items: int,
               rng: random.Random | None = None) -> list[BatchItem]:
    """Expands the request into items in a stable order (image-major for matrix mode).

    `source_names` are the images that opened (rejected uploads are not planned). Raises
    RequestError for an unknown mode/policy, no instructions, a paired-count mismatch, or more
    items than `max_items` -- all before any work starts.
    """
    if request.mode not in MODES:
        raise RequestError("mode", request.mode, f"one of {', '.join(MODES)}")
    if request.seed_policy not in SEED_POLICIES:
        raise RequestError("seed_policy", request.seed_policy, f"one of {', '.join(SEED_POLICIES)}")
    if not request.instructions:
        raise RequestError("instructions", "", "at least one instruction (one per line)")
    if not source_names:
        raise RequestError("images", [], "at least one readable image")
    if request.mode == "matrix":
        pairs = [(i, text) for i in range(len(source_names)) for text in request.instructions]
    else:
        if len(request.instructions) != len(source_names):
            raise RequestError("instructions", f"{len(request.instructions)} lines",
                               f"exactly one line per image in paired mode ({len(source_names)} images)")
        pairs = list(enumerate(request.instructions))
    if len(pairs) > max_items:
        raise RequestError("batch", f"{len(pairs)} items",
                           f"at most {max_items} items per batch (images x instructions); split the batch")
    base = request.params.seed
    if request.seed_policy == "random" or base == -1:
        draw = (lambda: rng.randint(0, SEED_MAX)) if rng is not None else (lambda: secrets.randbelow(SEED_MAX + 1))
    items = []
    for index, (source_index, text) in enumerate(pairs):
        if request.seed_policy == "random" or base == -1:
            seed = draw()
        elif request.seed_policy == "increment":
            seed = (base + index) % (SEED_MAX + 1)
        else:
            seed = base
        items.append(BatchItem(index=index, source_index=source_index, source_name=source_names[source_index],
                               instruction=text, seed=seed))
    return items


def item_params(shared: EditParams, item: BatchItem) -> EditParams:
    return dataclasses.replace(shared, instruction=item.instruction, seed=item.seed).validated()


def open_sources(sources, open_fn) -> tuple[list[tuple[str, Image.Image]], list[tuple[str, str]]]:
    """Opens every source with `open_fn`; returns (opened, rejected) keeping upload order."""
    opened, rejected = [], []
    for source in sources:
        try:
            opened.append((source.name, open_fn(source.data, name=source.name)))
        except ValueError as exc:  # ImageError is a ValueError; anything else is a bug and propagates
            rejected.append((source.name, str(exc)))
    return opened, rejected
