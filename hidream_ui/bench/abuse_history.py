"""The History probes of `bench abuse` for issue 58: a flood of fresh sessions calling the History
refresh (against a capped session table, abuse_child.py), and History refreshes of 55,000 entries
(and of as many bytes in fewer objects) from four clients. Like abuse_booth.py's, each check is a
pure function of the figures (`*_check`), so the verdict can be tested without an app."""

from __future__ import annotations

import json
import re
import threading
import time

from hidream_ui.bench.abuse_app import AbuseApp, client_address
from hidream_ui.bench.abuse_client import (
    CallResult,
    new_session,
    queue_call,
    run_fn,
)
from hidream_ui.bench.abuse_kit import (
    ProbeContext,
    ProbeOutcome,
    start_honest_when,
    tally_answers,
)

# The issue's finding 4: 55,000 entries of {"params": {}} (~859 KB) per History refresh, four clients, 15 s.
HISTORY_ENTRIES = 55_000
HISTORY_CLIENTS = 4
# What one such refresh may cost the server in CPU seconds: a tenth of the 2.8 CPU-s the issue measured.
HISTORY_CPU_TARGET_S = 0.25
# The same attack adapted to a server that counts a request's objects: as many bytes, few objects.
ADAPTED_ENTRIES, ADAPTED_TEXT = 2_000, 400
HISTORY_STORAGE_KEY = "hidream-ui-history"


# ---------------------------------------------------------------------------------------------
# 1. A flood of fresh sessions calling the History refresh
# ---------------------------------------------------------------------------------------------


def history_refresh(app: AbuseApp) -> tuple[int, dict]:
    """The History refresh's (fn_index, dependency) as a raw client finds it in /config: the event
    the page load triggers whose first input is the browser's stored History."""
    components = {}
    with app.http(timeout=30) as http:
        for component in http.get("/config").json().get("components", []):
            components[component.get("id")] = component
    for index, dep in enumerate(app.dependencies()):
        inputs = [components.get(i, {}) for i in dep.get("inputs", [])]
        keys = [(c.get("props") or {}).get("storage_key") for c in inputs]
        triggers = [t[1] for t in dep.get("targets", []) if len(t) > 1]
        if keys and keys[0] == HISTORY_STORAGE_KEY and "load" in triggers and dep.get("backend_fn", True):
            return int(dep.get("id", index)), dep
    raise KeyError("the app has no History refresh on page load")


def history_data(dep: dict, entries: list) -> list:
    """The refresh's inputs: the stored History, then "" for the rest (the browser's secret)."""
    return [entries, *([""] * (len(dep.get("inputs", [])) - 1))]


def edit_result_picture(result: CallResult) -> bool:
    """ "Edit the result" put a picture in the source slot (not a bare update: the session had no result)."""
    if not result.ran or not isinstance(result.data, list) or not result.data:
        return False
    value = result.data[0]
    if isinstance(value, dict) and value.get("__type__") == "update":
        value = value.get("value")
    return isinstance(value, dict) and bool(value.get("path") or value.get("url"))


def session_flood_check(figures: dict) -> bool:
    """Held when "Edit the result" worked in the honest session before the flood (the control) and
    after it, and the flood was either evicted (with the table capped, at least a table's worth of
    flood sessions that ran after the honest session's last job: Gradio's plain LRU would have
    dropped it) or refused (uncapped: the rate limit refused some)."""
    capacity = figures.get("session_capacity")
    if capacity:
        reached = (figures.get("flood_sessions_after_honest_job") or 0) >= capacity
    else:
        reached = (figures.get("flood_refused_429") or 0) > 0
    return bool(
        figures.get("edit_result_before") == "picture" and figures.get("edit_result_after") == "picture" and reached
    )


def _edit_result(app: AbuseApp, honest, fn_index: int) -> str:
    with app.http(timeout=30, address=honest.address) as http:
        result = run_fn(http, fn_index, [None], honest.session, timeout=30)
    return "picture" if edit_result_picture(result) else f"no picture ({result.short()[:120]})"


def _edit_result_index(app: AbuseApp) -> int:
    try:
        return app.dependency("edit_result")[0]
    except KeyError:
        pass
    with app.http(timeout=30) as http:
        components = {c.get("id"): c for c in http.get("/config").json().get("components", [])}
    for index, dep in enumerate(app.dependencies()):
        for target in dep.get("targets", []):
            if (components.get(target[0], {}).get("props") or {}).get("elem_id") == "hui-edit-result" and dep.get(
                "backend_fn"
            ):
                return int(dep.get("id", index))
    raise KeyError('the app has no "Edit the result" event')


def session_flood(ctx: ProbeContext) -> ProbeOutcome:
    import httpx

    app = ctx.app
    capacity = app.session_capacity
    fn_index, dep = history_refresh(app)
    result_index = _edit_result_index(app)
    queued = dep.get("queue") is not False
    # One address sends more than its minute allows (--max-new-sessions 120); the others stay under it.
    one_address, others, per_other = (150, 2, 60) if ctx.quick else (200, 8, 100)
    plan = [("127.0.0.1", i) for i in range(one_address)]
    plan += [(f"127.0.3.{k + 1}", i) for k in range(others) for i in range(per_other)]
    plan.sort(key=lambda task: task[1])  # round robin over the addresses
    data = history_data(dep, [])
    before = _edit_result(app, ctx.honest, result_index)
    records: list[dict] = []
    lock = threading.Lock()
    tasks = iter(enumerate(plan))

    def worker(_: int) -> None:
        while ctx.left() > 1.0:
            with lock:
                task = next(tasks, None)
            if task is None:
                return
            index, (address, _) = task
            session = new_session("flood")
            # Half by the route the app declares, half by the other one (a raw client tries both).
            by_queue = queued if index % 2 == 0 else not queued
            try:
                with app.http(timeout=30, address=client_address(address)) as http:
                    if by_queue:
                        result = queue_call(app, http, fn_index, data, session, timeout=30)
                    else:
                        result = run_fn(http, fn_index, data, session, timeout=30)
            except httpx.HTTPError as exc:
                result = CallResult(False, None, f"{type(exc).__name__}: {exc}")
            with lock:
                records.append(
                    {
                        "address": address,
                        "route": "queue" if by_queue else "run",
                        "ran": result.ran,
                        "status": result.status,
                        "answer": result.short()[:100],
                        "ended": result.ended_at,
                    }
                )

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(8)]
    for thread in threads:
        thread.start()
    start_honest_when(ctx, lambda: len(records) >= 20, 10.0)
    for thread in threads:
        thread.join(timeout=max(0.0, ctx.left()))
    ctx.honest.finish(ctx.deadline)
    honest_job_end = ctx.honest.result.ended_at if ctx.honest.result else None
    after = _edit_result(app, ctx.honest, result_index)
    log = app.session_log()
    # Sessions the flood got state for: its refreshes that ran (a 404 or 429 leaves the table alone).
    stateful = [r for r in records if r["ran"]]
    by_route: dict[str, dict] = {}
    for route in ("queue", "run"):
        by_route[route] = _tally([r for r in records if r["route"] == route])
    figures = {
        "session_capacity": capacity,
        "flood_sent": len(records),
        "flood_planned": len(plan),
        "addresses": 1 + others,
        "one_address_sent": sum(1 for r in records if r["address"] == "127.0.0.1"),
        "one_address_refused_429": sum(1 for r in records if r["address"] == "127.0.0.1" and r["status"] == 429),
        "flood_refused_429": sum(1 for r in records if r["status"] == 429),
        "flood_sessions_ran": len(stateful),
        "flood_sessions_after_honest_job": (
            sum(1 for r in stateful if r["ended"] > honest_job_end) if honest_job_end is not None else None
        ),
        "history_refresh_fn_index": fn_index,
        "history_refresh_queued": queued,
        "answers_by_route": by_route,
        "table_peak": max((row.get("sessions", 0) for row in log), default=None),
        "table_end": log[-1].get("sessions") if log else None,
        "worked_sessions_end": log[-1].get("worked") if log else None,
        "edit_result_before": before,
        "edit_result_after": after,
    }
    if capacity and not log:
        ctx.notes.append("the session table's size was never logged: the cap may not have been applied")
    check = session_flood_check(figures)
    text = (
        f"'Edit the result' in the honest session: before {before[:40]}, after {after[:60]}; flood "
        f"{figures['flood_sessions_ran']} sessions ran the refresh "
        f"({figures['flood_sessions_after_honest_job']} after the honest job), "
        f"{figures['flood_refused_429']} refused 429; table peak {figures['table_peak']} of {capacity}"
    )
    sent = (
        f"{len(plan)} fresh sessions calling the History refresh by fn_index {fn_index} (half queued, half "
        f"/run/predict), 8 at a time: {one_address} from 127.0.0.1, {per_other} from each of {others} 127.0.3.x; "
        f"gradio's session table capped at {capacity} by the harness (the app has no flag for it)"
    )
    return ProbeOutcome(sent, check, text, figures)


def _tally(records: list[dict]) -> dict:
    answers: dict[str, int] = {}
    for record in records:
        key = re.sub(r"\d+ s\b", "N s", record["answer"])  # "try again in 7 s" and "in 6 s" are one answer
        answers[key] = answers.get(key, 0) + 1
    return {
        "sent": len(records),
        "ran": sum(1 for r in records if r["ran"]),
        "refused_429": sum(1 for r in records if r["status"] == 429),
        "answers": answers,
    }


# ---------------------------------------------------------------------------------------------
# 2. History refreshes of 55,000 entries
# ---------------------------------------------------------------------------------------------


def history_cpu_check(figures: dict) -> bool:
    """Held when a lone refresh of the large History and the refreshes of the four-client flood
    each cost the server less than HISTORY_CPU_TARGET_S CPU seconds and the flood got answers;
    the same for the `adapted` History (fewer entries with long texts) when it was sent."""

    def cheap(phase: dict) -> bool:
        single, flood = phase.get("single_request_cpu_s"), phase.get("flood_cpu_s_per_request")
        return bool(
            single is not None
            and single < HISTORY_CPU_TARGET_S
            and flood is not None
            and flood < HISTORY_CPU_TARGET_S
            and phase.get("flood_answered")
        )

    adapted = figures.get("adapted")
    return cheap(figures) and (adapted is None or cheap(adapted))


def adapted_history(entries: int = ADAPTED_ENTRIES, text: int = ADAPTED_TEXT) -> list[dict]:
    """A History as large on the wire as the issue's but with few objects: `entries` entries whose
    instruction is `text` characters (what an attacker sends when the object count is refused)."""
    return [{"params": {"instruction": "x" * text, "seed": index}} for index in range(entries)]


def history_cpu(ctx: ProbeContext) -> ProbeOutcome:
    import httpx

    app = ctx.app
    duration = 8.0 if ctx.quick else 15.0
    fn_index, dep = history_refresh(app)
    queued = dep.get("queue") is not False

    def phase(entries: list, tag: str, start_honest: bool) -> dict:
        """3 refreshes alone, one after another (each one's CPU), then HISTORY_CLIENTS clients (one
        address each) repeating them for `duration` s (CPU per answered request, /status)."""
        encoded = json.dumps(history_data(dep, entries)).encode()

        def refresh(http, session: str, timeout: float) -> CallResult:
            try:
                if queued:
                    return queue_call(app, http, fn_index, None, session, timeout=timeout, encoded_data=encoded)
                return run_fn(http, fn_index, None, session, timeout=timeout, encoded_data=encoded)
            except httpx.HTTPError as exc:
                return CallResult(False, None, f"{type(exc).__name__}: {exc}")

        singles: list[tuple[float, CallResult]] = []
        with app.http(timeout=60) as http:
            for _ in range(3):
                cpu = app.cpu_seconds()
                result = refresh(http, new_session(tag), 60.0)
                singles.append((app.cpu_seconds() - cpu, result))
        single_costs = sorted(cost for cost, _ in singles)
        results: list[CallResult] = []
        lock = threading.Lock()
        flood_start = time.monotonic()
        stop_at = flood_start + min(duration, max(0.0, ctx.left() - 5.0))

        def client(number: int) -> None:
            session = new_session(f"{tag}{number}")
            with app.http(timeout=60, address=client_address(f"127.0.4.{number + 1}")) as http:
                while time.monotonic() < stop_at:
                    result = refresh(http, session, max(1.0, min(60.0, ctx.left())))
                    with lock:
                        results.append(result)

        cpu_before = app.cpu_seconds()
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(HISTORY_CLIENTS)]
        for thread in threads:
            thread.start()
        if start_honest:  # the honest edit beside the flood, not beside the lone requests (its CPU would count)
            start_honest_when(ctx, lambda: len(results) >= 1, 3.0)
        for thread in threads:
            thread.join(timeout=max(0.0, ctx.left()))
        flood_seconds = time.monotonic() - flood_start
        flood_cpu = app.cpu_seconds() - cpu_before
        answered = [r for r in results if r.status is not None]
        return {
            "entries": len(entries),
            "body_kb": round(len(encoded) / 1024, 1),
            "single_request_cpu_s": round(single_costs[len(single_costs) // 2], 3),
            "single_requests": [
                {"cpu_s": round(cost, 3), "answer": r.short()[:100], "seconds": round(r.seconds, 3)}
                for cost, r in singles
            ],
            "flood_seconds": round(flood_seconds, 1),
            "flood_sent": len(results),
            "flood_answered": len(answered),
            "flood_answers": tally_answers(results)["answers"],
            "flood_cpu_s": round(flood_cpu, 2),
            "flood_cpu_s_per_request": round(flood_cpu / len(answered), 3) if answered else None,
            "server_cpu_share_during_flood": round(flood_cpu / flood_seconds, 2) if flood_seconds else None,
            "status_max_s_during_flood": ctx.statuses.max_seconds(flood_start),
        }

    issue = phase([{"params": {}}] * HISTORY_ENTRIES, "history", start_honest=True)
    adapted = phase(adapted_history(), "adapted", start_honest=False) if ctx.left() > duration else None
    if adapted is None:
        ctx.notes.append("no time left for the adapted History (fewer entries, long texts)")
    figures = {
        **issue,
        "route": "queue" if queued else "run",
        "fn_index": fn_index,
        "flood_clients": HISTORY_CLIENTS,
        "adapted": adapted,
        "target_cpu_s_per_request": HISTORY_CPU_TARGET_S,
    }
    check = history_cpu_check(figures)

    def line(name: str, f: dict) -> str:
        return (
            f"{name} ({f['entries']} entries, {f['body_kb']} KB): {f['single_request_cpu_s']} CPU-s alone, "
            f"{f['flood_answered']} answered in {f['flood_seconds']} s at {f['flood_cpu_s_per_request']} CPU-s "
            f"each, /status {f['status_max_s_during_flood']} s at most"
        )

    text = (
        "; ".join([line("the issue's History", issue)] + ([line("adapted", adapted)] if adapted else []))
        + f" (target < {HISTORY_CPU_TARGET_S} CPU-s per request)"
    )
    sent = (
        f"History refreshes (fn_index {fn_index}, {figures['route']}) carrying {HISTORY_ENTRIES} "
        f'{{"params": {{}}}} entries ({issue["body_kb"]} KB): 3 alone, then {HISTORY_CLIENTS} clients '
        f"(one address each) repeating them for {duration:.0f} s; then the same with {ADAPTED_ENTRIES} entries "
        f"whose instruction is {ADAPTED_TEXT} characters (as large, few objects)"
    )
    return ProbeOutcome(sent, check, text, figures)


__all__ = [
    "session_flood",
    "history_cpu",
    "session_flood_check",
    "history_cpu_check",
    "history_refresh",
    "history_data",
    "edit_result_picture",
    "adapted_history",
    "HISTORY_CPU_TARGET_S",
    "HISTORY_ENTRIES",
]
