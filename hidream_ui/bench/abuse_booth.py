"""The probes of `bench abuse` for issue 58 (booth storage and sessions): a client flooding the cache
with its own results, a kiosk editing picture after picture, a flood of fresh sessions calling the
History refresh, and History refreshes of 55,000 entries (and of as many bytes in fewer objects).
The first two (the cache) are here; the History probes are abuse_history.py, listed here with them.

Each probe gets a `ProbeContext` like those of abuse_probes.py and returns a `ProbeOutcome`; its check
is a pure function of its figures (`*_check`), so the verdict can be tested without an app. Clients
are told apart by the local address they connect from (`client_address`: 127.0.0.1 for the attacker,
127.0.0.2 for the honest client of every probe, other 127.x.y.z for newcomers and floods), as the
server keys its storage and its limits on the address. The cache is sampled on a thread
(`CacheSampler`: the files of the app's GRADIO_TEMP_DIR that count against --cache-max-files, i.e. all
but the examples' copies it holds from the start).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from hidream_ui.bench.abuse_app import _MB, AbuseApp, client_address
from hidream_ui.bench.abuse_client import (
    CallResult,
    edit_data,
    file_data,
    new_session,
    queue_call,
    upload,
)
from hidream_ui.bench.abuse_history import history_cpu, session_flood
from hidream_ui.bench.abuse_kit import (
    BASE_ARGS,
    ProbeContext,
    ProbeOutcome,
    ProbeSpec,
    attacker_apple,
    start_honest_when,
    tally_answers,
    upload_one,
)
from hidream_ui.bench.abuse_samplers import CacheSampler

# The finding 1: a cap of 60 files, 8-step edits with a preview every step.
FLOOD_CACHE_FILES = 60
FLOOD_STEPS = 8
# The finding 2 at small caps (--quick): one visitor refused from the 36th picture at 40 files.
KIOSK_QUICK_CACHE_FILES = 40
KIOSK_STEPS = 1  # the cheapest edit: one step at the draft size
HONEST_STEPS = 2
NEWCOMER_TIMEOUT = 60.0


def _flag(args: list[str], name: str, default: int) -> int:
    """The value of `--name N` in an app's arguments (the last one wins), else `default`."""
    value = default
    for index, arg in enumerate(args[:-1]):
        if arg == name:
            value = int(args[index + 1])
    return value


def cache_caps(args: list[str]) -> tuple[int, int]:
    """(--cache-max-files, --cache-max-mb in bytes) the app runs with: its flags, else its defaults."""
    from hidream_ui.config import AppConfig  # the app's defaults, not a copy of them

    defaults = AppConfig()
    return (
        _flag(args, "--cache-max-files", defaults.cache_max_files),
        _flag(args, "--cache-max-mb", defaults.cache_max_mb) * _MB,
    )


def within_caps(figures: dict) -> bool:
    """Every cache sample within --cache-max-files and --cache-max-mb (and at least one sample)."""
    return (
        bool(figures.get("cache_samples"))
        and figures.get("cache_files_max") is not None
        and figures["cache_files_max"] <= figures["cache_max_files"]
        and figures["cache_mb_max"] <= figures["cache_max_mb"]
    )


def _is_full(result: dict) -> bool:
    """An answer saying the server's space is full (503), the failure finding 1 found."""
    return result.get("upload_status") == 503 or "503" in str(result.get("edit", ""))


def visit(
    app: AbuseApp,
    address: str | None,
    label: str,
    *,
    steps: int = HONEST_STEPS,
    timeout: float = NEWCOMER_TIMEOUT,
    session: str | None = None,
) -> dict:
    """A visitor's first upload (a picture of its own) and edit of it, from `address`:
    {"address", "upload_status", "upload_error", "edit", "seconds", "ok"}."""
    import httpx

    started = time.monotonic()
    out: dict[str, Any] = {
        "address": address or "127.0.0.1",
        "upload_status": None,
        "upload_error": None,
        "edit": None,
        "seconds": None,
        "ok": False,
    }
    try:
        with app.http(timeout=timeout, address=address) as http:
            code, paths = upload(http, [(f"{label}.png", attacker_apple())], timeout=timeout)
            out["upload_status"] = code
            if code != 200:
                out["upload_error"] = str(paths)[:200]
            else:
                fn_index = app.dependency("edit")[0]
                result = queue_call(
                    app,
                    http,
                    fn_index,
                    edit_data(file_data(paths[0], f"{label}.png"), f"{label}: make it green", steps),
                    session or new_session(label),
                    timeout=timeout,
                )
                out["edit"] = result.short()
                out["ok"] = result.ran
    except httpx.HTTPError as exc:
        out["upload_error"] = out["upload_error"] or f"{type(exc).__name__}: {exc}"
    out["seconds"] = round(time.monotonic() - started, 2)
    return out


# ---------------------------------------------------------------------------------------------
# 1. One client fills the cache with its own results and previews
# ---------------------------------------------------------------------------------------------


def results_flood_check(figures: dict) -> bool:
    """Held when the honest newcomer's first upload and edit succeeded after the flood, no honest
    client saw a 503, and the cache stayed within its caps in every sample."""
    newcomer = figures.get("newcomer") or {}
    return bool(
        newcomer.get("upload_status") == 200
        and newcomer.get("ok")
        and not figures.get("honest_saw_503")
        and within_caps(figures)
    )


def results_flood(ctx: ProbeContext) -> ProbeOutcome:
    app = ctx.app
    edits = 14 if ctx.quick else 40
    workers = 2  # within --max-jobs-per-client 2: the queue always holds the attacker's next edit
    max_files, max_bytes = cache_caps(app.args)
    fn_index = app.dependency("edit")[0]
    counter = itertools.count()
    results: list[CallResult] = []
    lock = threading.Lock()
    with CacheSampler(app, max_files, max_bytes) as cache:
        path = upload_one(app, "mine.png", attacker_apple())

        def attacker(_: int) -> None:
            with app.http(timeout=120) as http:
                while ctx.left() > 0:
                    index = next(counter)
                    if index >= edits:
                        return
                    data = edit_data(file_data(path, "mine.png"), f"results flood {index}", FLOOD_STEPS, seed=index)
                    result = queue_call(app, http, fn_index, data, new_session("flood"), timeout=max(1.0, ctx.left()))
                    with lock:
                        results.append(result)

        threads = [threading.Thread(target=attacker, args=(i,), daemon=True) for i in range(workers)]
        for thread in threads:
            thread.start()
        start_honest_when(ctx, lambda: len(results) >= 1, 20.0)
        for thread in threads:
            thread.join(timeout=max(0.0, ctx.left()))
        flood_end = cache.samples[-1][1] if cache.samples else None
        # An honest second address, right after the flood: the visitors got 503 for ten minutes.
        newcomer = visit(app, client_address("127.0.0.3"), "newcomer")
        ctx.honest.finish(ctx.deadline)
    honest = ctx.honest.result
    figures = {
        "edits_wanted": edits,
        "edits_sent": len(results),
        "steps": FLOOD_STEPS,
        "preview_every": 1,
        "attacker_edits": tally_answers(results),
        "cache_files_after_flood": flood_end,
        "newcomer": newcomer,
        "honest_saw_503": _is_full(newcomer) or bool(honest and honest.status == 503),
        **cache.figures(),
    }
    check = results_flood_check(figures)
    text = (
        f"{figures['attacker_edits']['ran']} of {edits} flood edits ran; cache peak {figures['cache_files_max']} "
        f"files / {figures['cache_mb_max']} MB (caps {max_files} / {figures['cache_max_mb']:.0f} MB, "
        f"{figures['cache_samples_over_cap']} of {figures['cache_samples']} samples over); newcomer upload "
        f"{newcomer['upload_status']}, edit {newcomer['edit']}"
    )
    sent = (
        f"one upload, then {edits} queued /edit of it ({FLOOD_STEPS} steps, --preview-every 1), each with a new "
        f"session_hash, {workers} at a time, from one address; then a second address uploads and edits"
    )
    return ProbeOutcome(sent, check, text, figures)


# ---------------------------------------------------------------------------------------------
# 2. A kiosk: one address uploads and edits picture after picture
# ---------------------------------------------------------------------------------------------


def kiosk_check(figures: dict) -> bool:
    """Held when every wanted upload and edit succeeded, every newcomer's first upload and edit
    succeeded (at least one tried), and the cache stayed within its caps in every sample."""
    wanted = figures.get("edits_wanted")
    newcomers = figures.get("newcomers") or []
    return bool(
        wanted
        and figures.get("uploads_ok") == wanted
        and figures.get("edits_ran") == wanted
        and newcomers
        and all(n.get("ok") for n in newcomers)
        and within_caps(figures)
    )


def _quarters(values: list[float]) -> list[float]:
    """The mean of each quarter of `values` in order (a slowdown as the client's files pile up shows)."""
    size = len(values) / 4
    parts = [values[round(i * size) : round((i + 1) * size)] for i in range(4)]
    return [round(sum(part) / len(part), 3) for part in parts if part]


def kiosk_lockout(ctx: ProbeContext) -> ProbeOutcome:
    app = ctx.app
    edits = 60 if ctx.quick else 300
    every = 15 if ctx.quick else 50  # a newcomer from a new address every `every` pictures
    per_session = 10  # a new visitor (a page load: a new session) every 10 pictures
    max_files, max_bytes = cache_caps(app.args)
    fn_index = app.dependency("edit")[0]
    rows: list[dict] = []
    newcomers: list[dict] = []
    helpers: list[threading.Thread] = []

    def newcomer(at: int, number: int) -> None:
        newcomers.append({"at_picture": at, **visit(app, client_address(f"127.0.1.{number}"), f"newcomer{number}")})

    started = time.monotonic()
    with CacheSampler(app, max_files, max_bytes) as cache:
        ctx.honest.start()
        with app.http(timeout=120) as http:
            session = new_session("kiosk")
            for index in range(edits):
                if ctx.left() <= 0:
                    break
                if index % per_session == 0:
                    session = new_session("kiosk")
                if index % every == every // 2:
                    helper = threading.Thread(target=newcomer, args=(index, len(helpers) + 1), daemon=True)
                    helper.start()
                    helpers.append(helper)
                row: dict[str, Any] = {"picture": index + 1}
                picture_start = time.monotonic()
                code, paths = upload(http, [(f"visitor{index}.png", attacker_apple())])
                row["upload_status"] = code
                if code != 200:
                    row["error"] = str(paths)[:200]
                else:
                    result = queue_call(
                        app,
                        http,
                        fn_index,
                        edit_data(file_data(paths[0], f"visitor{index}.png"), f"kiosk picture {index}", KIOSK_STEPS),
                        session,
                        timeout=max(1.0, min(120.0, ctx.left())),
                    )
                    row["ran"] = result.ran
                    if not result.ran:
                        row["error"] = result.short()
                row["seconds"] = time.monotonic() - picture_start
                rows.append(row)
        edits_seconds = time.monotonic() - started
        for helper in helpers:
            helper.join(timeout=NEWCOMER_TIMEOUT)
        # And one more once the kiosk is done: "at any point" includes after its last picture.
        newcomer(len(rows), len(helpers) + 1)
        ctx.honest.finish(ctx.deadline)
    failures = [
        {k: v for k, v in row.items() if k != "seconds"}
        for row in rows
        if row.get("upload_status") != 200 or not row.get("ran")
    ]
    refused_uploads: dict[str, int] = {}
    for row in rows:
        if row.get("upload_status") != 200:
            key = str(row.get("upload_status"))
            refused_uploads[key] = refused_uploads.get(key, 0) + 1
    newcomers.sort(key=lambda n: n["at_picture"])
    figures = {
        "edits_wanted": edits,
        "edits_sent": len(rows),
        "uploads_ok": sum(1 for row in rows if row.get("upload_status") == 200),
        "uploads_refused": refused_uploads,
        "edits_ran": sum(1 for row in rows if row.get("ran")),
        "first_failure": failures[0] if failures else None,
        "failures": len(failures),
        "edit_settings": f"{KIOSK_STEPS} step, draft",
        "seconds_for_edits": round(edits_seconds, 1),
        "seconds_per_picture": round(edits_seconds / len(rows), 3) if rows else None,
        "seconds_per_picture_by_quarter": _quarters([row["seconds"] for row in rows]),
        "newcomers": newcomers,
        "newcomers_ok": sum(1 for n in newcomers if n.get("ok")),
        **cache.figures(),
    }
    check = kiosk_check(figures)
    first = figures["first_failure"]
    text = (
        f"{figures['edits_ran']} of {edits} pictures uploaded and edited in {figures['seconds_for_edits']} s"
        + (f" (first failure at picture {first['picture']}: {first.get('error', '')[:80]})" if first else "")
        + f"; newcomers {figures['newcomers_ok']}/{len(newcomers)} ok; cache peak {figures['cache_files_max']} "
        f"files / {figures['cache_mb_max']} MB (caps {max_files} / {figures['cache_max_mb']:.0f} MB)"
    )
    sent = (
        f"one address: {edits} x (upload a new picture, one queued /edit of it, {KIOSK_STEPS} step, draft), a new "
        f"session every {per_session}; a new address's first upload and edit every {every} pictures and after "
        f"the last"
    )
    return ProbeOutcome(sent, check, text, figures)


# ---------------------------------------------------------------------------------------------


def _flood_args(quick: bool) -> tuple[list[str], None]:
    return [*BASE_ARGS, "--preview-every", "1", "--cache-max-files", str(FLOOD_CACHE_FILES)], None


def _kiosk_args(quick: bool) -> tuple[list[str], None]:
    # The "done when" runs with the default limits; --quick at the small cap of its finding.
    return ([*BASE_ARGS, "--cache-max-files", str(KIOSK_QUICK_CACHE_FILES)] if quick else [*BASE_ARGS]), None


PROBES: dict[str, ProbeSpec] = {
    "results-flood": ProbeSpec(results_flood, _flood_args, budget=lambda quick: 60.0 if quick else 120.0),
    "kiosk-lockout": ProbeSpec(kiosk_lockout, _kiosk_args, budget=lambda quick: 120.0 if quick else 600.0),
    "session-flood": ProbeSpec(
        session_flood,
        lambda quick: ([*BASE_ARGS], None),
        budget=lambda quick: 60.0 if quick else 120.0,
        session_capacity=lambda quick: 60 if quick else 300,
    ),
    "history-cpu": ProbeSpec(
        history_cpu, lambda quick: ([*BASE_ARGS], None), budget=lambda quick: 40.0 if quick else 60.0
    ),
}

__all__ = [
    "PROBES",
    "results_flood_check",
    "kiosk_check",
    "within_caps",
    "cache_caps",
]
