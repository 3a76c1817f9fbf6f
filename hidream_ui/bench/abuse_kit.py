"""What every probe of `bench abuse` shares: what it gets (`ProbeContext`), returns (`ProbeOutcome`)
and declares (`ProbeSpec`: its run, its app's flags, its budget), the attacker's pictures, and the
small loops the probes are made of (calls on threads, uploads, waiting for a condition)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from hidream_ui.bench import abuse_files
from hidream_ui.bench.abuse_app import AbuseApp
from hidream_ui.bench.abuse_client import CallResult, HonestClient, apple_path, upload
from hidream_ui.bench.abuse_samplers import StatusSampler

_MIB = 1 << 20
BASE_ARGS = ["--max-queue", "16", "--max-jobs-per-client", "2"]


@dataclass
class ProbeContext:
    """What a probe gets: the app, the honest client (start it once the attack is under way), the
    scale and a deadline no loop of the probe may pass."""

    app: AbuseApp
    honest: HonestClient
    quick: bool
    deadline: float
    statuses: StatusSampler
    notes: list[str] = field(default_factory=list)

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


@dataclass
class ProbeOutcome:
    sent: str
    check: bool | None  # None: this probe has no check of its own beyond the common targets
    check_text: str
    figures: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ProbeSpec:
    run: Callable[[ProbeContext], ProbeOutcome]
    app_args: Callable[[bool], tuple[list[str], tuple[str, str] | None]]
    # Without the flag the probe needs (for a flag today's app may not know): what to run instead.
    fallback_args: Callable[[bool], tuple[list[str], tuple[str, str] | None]] | None = None
    # Seconds its attack may take (quick -> seconds); None: the runner's default (90, 25 with --quick).
    budget: Callable[[bool], float] | None = None
    # Gradio's session table capped at this many sessions (abuse_child.py; quick -> cap); None: gradio's 10,000.
    session_capacity: Callable[[bool], int] | None = None


def attacker_png(tag: str = "", side: int = 96) -> bytes:
    """A PNG of the attacker's own (distinct bytes, so it never shares the honest client's cached
    copy, which Gradio names after the content)."""
    return abuse_files.png_of_zeros(side, side, "RGB", text_before={"attacker": tag or uuid.uuid4().hex})


def attacker_apple() -> bytes:
    """The bundled apple with a text chunk of the attacker's: the honest client's pixels (so an edit
    costs what a real one costs; a black image edits many times faster), distinct bytes."""
    import io

    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("attacker", uuid.uuid4().hex)
    with Image.open(apple_path()) as image:
        out = io.BytesIO()
        image.save(out, format="PNG", pnginfo=info)
    return out.getvalue()


def in_threads(count: int, work: Callable[[int], object], timeout: float) -> list:
    results: list = [None] * count

    def one(index: int) -> None:
        try:
            results[index] = work(index)
        except Exception as exc:  # noqa: BLE001 - a call that blew up is an answer too
            results[index] = CallResult(False, None, f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return [r if r is not None else CallResult(False, None, f"no answer in {timeout:.0f} s") for r in results]


def upload_one(app: AbuseApp, name: str, data: bytes) -> str:
    with app.http() as http:
        code, paths = upload(http, [(name, data)])
    if code != 200:
        raise RuntimeError(f"upload of {name} refused: {code} {str(paths)[:200]}")
    return paths[0]


def saved_with(app: AbuseApp, prefix: str) -> int:
    """Results in --output-dir whose sidecar records an instruction starting with `prefix`."""
    count = 0
    for sidecar in app.output_dir.glob("*.json"):
        try:
            params = json.loads(sidecar.read_text(encoding="utf-8")).get("params") or {}
        except (OSError, ValueError):
            continue
        if str(params.get("instruction", "")).startswith(prefix):
            count += 1
    return count


def tally_answers(results: list[CallResult]) -> dict:
    texts: dict[str, int] = {}
    for r in results:
        key = r.short()[:120]
        texts[key] = texts.get(key, 0) + 1
    return {"ran": sum(r.ran for r in results), "refused": sum(r.refused for r in results), "answers": texts}


def wait_until(condition: Callable[[], bool], timeout: float, every: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return condition()


def fixed_args(*extra: str) -> Callable[[bool], tuple[list[str], None]]:
    """A `ProbeSpec.app_args` that is the same with and without --quick: BASE_ARGS and `extra`."""
    return lambda quick: ([*BASE_ARGS, *extra], None)


def start_honest_when(ctx: ProbeContext, condition: Callable[[], bool], timeout: float) -> None:
    """Starts the honest client's edit once `condition()` holds (or after `timeout`): while the
    attack is under way, not before it."""
    wait_until(condition, min(timeout, ctx.left()), every=0.05)
    ctx.honest.start()
