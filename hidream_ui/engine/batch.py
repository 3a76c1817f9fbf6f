"""Batches: many images x many instructions sharing one set of settings.

Planning (no torch): `plan_batch` opens the sources and expands the request into items (which
exist, in which order, with which seed), checking every limit before any work starts. Execution:
`execute` runs a plan on an engine that holds its lock (`EditEngine.run_batch` is the entry
point); it reuses the plan the caller made (the Batch tab plans once, to show the item count).
"""

from __future__ import annotations

import random
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from PIL import Image

from hidream_ui.edits import (
    SEED_MAX,
    EditParams,
    EditRequest,
    EditResult,
    EditSettings,
    RequestError,
    validated_seed,
)
from hidream_ui.engine.errors import EditCancelled, EngineError, OutOfMemory

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.config import AppConfig
    from hidream_ui.engine.engine import EditEngine
    from hidream_ui.engine.jobs import CancelToken, StepFn
    from hidream_ui.rewrite.prompt import RewriteResult

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
    settings: EditSettings  # shared by every item
    seed: int = 3  # the first item's seed; -1: every item gets a random one
    mode: str = "matrix"  # "matrix": every image x every instruction; "paired": line i with image i
    seed_policy: str = "fixed"  # "fixed": `seed` for all; "increment": +1 per item; "random"
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
    # Set when the instruction was rewritten (`RewriteService.rewrite_items`): the line as the user
    # wrote it and the rewriter's answer; `instruction` is then the composed prompt that runs.
    original_instruction: str | None = None
    rewrite: "RewriteResult | None" = None

    def manifest_row(self) -> dict:
        row = {
            "index": self.index,
            "source": self.source_name,
            "instruction": self.instruction,
            "seed": self.seed,
            "status": self.status,
            "error": self.error,
            "seconds": self.seconds,
        }
        if self.rewrite is not None:
            row["original_instruction"] = self.original_instruction
            row["rewrite"] = self.rewrite.to_dict()
        if self.result is not None:
            row["output"] = self.result.saved_png.name if self.result.saved_png else None
            row["working_size"] = list(self.result.working_size)
            row["timings"] = self.result.timings.to_dict()
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


def plan_items(
    request: BatchRequest, source_names: list[str], max_items: int, rng: random.Random | None = None
) -> list[BatchItem]:
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
    check_item_count(request, len(source_names), max_items)
    if request.mode == "matrix":
        pairs = [(i, text) for i in range(len(source_names)) for text in request.instructions]
    else:
        if len(request.instructions) != len(source_names):
            raise RequestError(
                "instructions",
                f"{len(request.instructions)} lines",
                f"exactly one line per image in paired mode ({len(source_names)} images)",
            )
        pairs = list(enumerate(request.instructions))
    base = validated_seed(request.seed)
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
        items.append(
            BatchItem(
                index=index,
                source_index=source_index,
                source_name=source_names[source_index],
                instruction=text,
                seed=seed,
            )
        )
    return items


def check_item_count(request: BatchRequest, images: int, max_items: int) -> None:
    """Refuses a batch of more than `max_items` items. Called with the number of sources before
    any is decoded (an upper bound: some may not open), and again with the images that opened."""
    count = images * len(request.instructions) if request.mode == "matrix" else min(images, len(request.instructions))
    if count > max_items:
        raise RequestError(
            "batch", f"{count} items", f"at most {max_items} items per batch (images x instructions); split the batch"
        )


def item_params(settings: EditSettings, item: BatchItem) -> EditParams:
    return settings.params(item.instruction, item.seed).validated()


def open_sources(
    sources, open_fn, max_total_pixels: int | None = None, cancel: "CancelToken | None" = None
) -> tuple[list[tuple[str, Image.Image]], list[tuple[str, str]]]:
    """Opens every source with `open_fn`; returns (opened, rejected) keeping upload order.

    `max_total_pixels` bounds what one batch holds decoded at once: once the images opened so far
    reach it, the remaining sources are rejected with the reason (each image alone is bounded by
    `open_fn`'s own limit, checked from its header). `cancel` is checked before each source:
    a batch stopped while its images are decoded raises `EditCancelled`.
    """
    opened, rejected = [], []
    total = 0
    for source in sources:
        if cancel is not None and cancel.cancelled:
            raise EditCancelled(
                f"Stopped while opening the images ({cancel.reason or 'cancelled'}); nothing was edited."
            )
        if max_total_pixels is not None and total >= max_total_pixels:
            rejected.append(
                (
                    source.name,
                    f"not opened: the batch's images already hold {total:,} pixels "
                    f"(at most {max_total_pixels:,} per batch); split the batch",
                )
            )
            continue
        try:
            image = open_fn(source.data, name=source.name)
        except ValueError as exc:  # ImageError is a ValueError; anything else is a bug and propagates
            rejected.append((source.name, str(exc)))
            continue
        total += image.width * image.height
        opened.append((source.name, image))
    return opened, rejected


# ---------------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------------

MAX_BATCH_SIZE = 64  # items per transformer call
# Decoded pixels one batch may hold, in units of the per-image limit (--max-pixels): 4 x 25 MP by
# default, ~300 MB as RGB. Enough for 64 items of a 1024 px source, far from a memory bomb.
BATCH_PIXEL_BUDGET = 4
MAX_REASONS_SHOWN = 5  # rejected files named in the error of a batch where none opened


@dataclass
class BatchPlan:
    """A checked batch: the opened images, the uploads that did not open, and the items to run."""

    request: BatchRequest
    settings: EditSettings  # validated
    images: list[tuple[str, Image.Image]]  # (name, decoded image) in upload order
    rejected: list[tuple[str, str]]  # (name, reason)
    items: list[BatchItem]


def as_plan(batch: "BatchRequest | BatchPlan", open_fn: Callable, config: "AppConfig") -> "BatchPlan":
    """The plan a batch runs: the caller's (the Batch tab plans once, to count and report items
    before any work), or planned here under the app's limits. The one place a request is planned
    for the engines."""
    if isinstance(batch, BatchPlan):
        return batch
    return plan_batch(batch, open_fn, config.max_batch_items, max_total_pixels=BATCH_PIXEL_BUDGET * config.max_pixels)


def plan_batch(
    request: BatchRequest,
    open_fn: Callable,
    max_items: int,
    rng: random.Random | None = None,
    *,
    opened: tuple[list, list] | None = None,
    max_total_pixels: int | None = None,
) -> BatchPlan:
    """Validates the settings, opens the sources (or takes the caller's `opened` = (images,
    rejected)) and expands the items: every check of a batch, before any work."""
    settings = request.settings.validated()
    if request.batch_size is not None and not 1 <= int(request.batch_size) <= MAX_BATCH_SIZE:
        raise RequestError(
            "batch_size", request.batch_size, f"1..{MAX_BATCH_SIZE} items per transformer call, or empty for auto"
        )
    check_item_count(request, len(request.sources), max_items)  # before any source is decoded
    images, rejected = opened if opened is not None else open_sources(request.sources, open_fn, max_total_pixels)
    if not images:
        # The first few reasons: a zip of 256 refused members would otherwise make a 25 KB message
        # (every one of them is in the report and the manifest).
        shown = [f"{name}: {reason.removeprefix(f'{name}: ')}" for name, reason in rejected[:MAX_REASONS_SHOWN]]
        more = len(rejected) - len(shown)
        reasons = "; ".join(shown) + (f"; and {more} more" if more > 0 else "") if shown else "no files"
        raise RequestError(
            "images", f"{len(rejected)} file(s) that did not open", f"at least one readable image ({reasons})"
        )
    items = plan_items(request, [name for name, _ in images], max_items, rng)
    return BatchPlan(request=request, settings=settings, images=list(images), rejected=list(rejected), items=items)


# ---------------------------------------------------------------------------------------------
# Execution
# ---------------------------------------------------------------------------------------------


def execute(
    engine: "EditEngine", plan: BatchPlan, token: "CancelToken", on_item: Callable | None, on_step: "StepFn | None"
) -> BatchResult:
    """Runs `plan` on `engine`, whose lock the caller holds: groups items by working size, sends
    each group through the transformer in chunks, reports every item through `on_item`.

    A failing chunk marks its items and the rest continue; an out-of-memory retries the chunk
    one item at a time; the token stops the run after the current step and keeps what finished.
    """
    started = time.perf_counter()
    counters_before = dict(engine.counters)
    groups: dict[tuple[int, int], list[BatchItem]] = {}
    for item in plan.items:
        if item.status != "pending":  # already settled before the run (a failed rewrite)
            continue
        # Arithmetic only (no resize); a working size the model cannot take fails the whole
        # batch here, before any item runs.
        size = engine.working_plan(plan.images[item.source_index][1].size, plan.settings.working_resolution)
        groups.setdefault(size.working_size, []).append(item)
    queue: list[list[BatchItem]] = []
    sizes_used = {}
    for size, members in groups.items():
        per_call = int(plan.request.batch_size or engine.auto_batch_size(size))
        sizes_used["x".join(map(str, size))] = per_call
        queue.extend(members[i : i + per_call] for i in range(0, len(members), per_call))

    def report(item: BatchItem) -> None:
        if on_item is not None:
            on_item(item)

    cancelled = False
    while queue:
        chunk = queue.pop(0)
        if token.cancelled:
            cancelled = True
            break
        t0 = time.perf_counter()
        try:
            results = engine._run(
                [
                    EditRequest(
                        image=plan.images[it.source_index][1],
                        params=item_params(plan.settings, it),
                        source_name=it.source_name,
                        rewrite=it.rewrite,
                    )
                    for it in chunk
                ],
                on_step,
                token=token,
            )
            results = engine.results.save(results, token)  # the device lock is free again here
        except EditCancelled:
            cancelled = True
            for it in chunk:
                it.status, it.error = "cancelled", "cancelled before it finished"
            break
        except OutOfMemory as exc:
            if len(chunk) > 1:
                queue[:0] = [[it] for it in chunk]  # retry one at a time
                continue
            chunk[0].status, chunk[0].error = "error", str(exc)
            report(chunk[0])
            continue
        except (EngineError, RequestError, ValueError) as exc:
            for it in chunk:
                it.status, it.error = "error", str(exc)
                report(it)
            continue
        seconds = (time.perf_counter() - t0) / len(chunk)
        for it, result in zip(chunk, results):
            it.status, it.result, it.seconds = "ok", result, round(seconds, 4)
            report(it)
    for item in plan.items:
        if item.status == "pending":
            item.status, item.error = "cancelled", "not started: the batch was cancelled"
    stats = {k: engine.counters[k] - counters_before.get(k, 0) for k in engine.counters}
    stats["batch_sizes"] = sizes_used
    return BatchResult(
        items=plan.items,
        rejected=plan.rejected,
        cancelled=cancelled,
        seconds=round(time.perf_counter() - started, 4),
        stats=stats,
    )
