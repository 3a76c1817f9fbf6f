"""`python -m hidream_ui bench abuse [--json] [--quick] [--probe NAME ...] [--timeout S]`.

The findings of issue 19 (abuse_probes.py: run-bypass ... low) and issue 58 (abuse_booth.py:
results-flood, kiosk-lockout, session-flood, history-cpu) and issue 57 (abuse_openai.py: openai-flood,
openai-bodies, openai-keys: the same limits on /v1/images/edits) run as bounded loops against a local app,
as an attacker on 127.0.0.1 would send them over raw HTTP. Every probe launches its own app
(`python -m hidream_ui app`, tiny model, CPU, a free 127.0.0.1 port, its own --output-dir and
GRADIO_TEMP_DIR in a temporary folder), so the server's figures are its own: RSS is read with psutil
on the child's pid, the cache is the child's GRADIO_TEMP_DIR (Gradio's `hidream-ui-gradio-*` folder
and its upload spools). The app is killed at the end of every probe, whatever happened.

Clients are told apart by the address they connect from, as the server keys its storage and its
limits on it: the attacker uses 127.0.0.1, the honest client 127.0.0.2, newcomers and floods other
127.x.y.z addresses (Linux answers on all of 127.0.0.0/8; where a machine does not, every client
shares 127.0.0.1 and the record says so). `session-flood` launches the app through abuse_child.py,
which caps Gradio's session table (10,000 by default, no app flag) so that a flood reaches it.

Around every probe an honest client (its own session) uploads the bundled apple and edits it once
(2 steps, draft) before the attack (the warm-up: the model loads then, so its memory is not counted
as the probe's); baselines are taken after it. During the attack the same client edits again; a
sampler asks `/status` every 0.2 s. Per probe the report says what was sent and:

* `honest_edit_completed`: the honest client's edit during the attack finished with a result;
* `status_max_s`: the longest `/status` answer during the probe (an unanswered one counts as its
  timeout);
* `rss_growth_mb`: the server's peak RSS during the probe over its RSS just before it;
* `cache_growth_mb`: bytes in the app's GRADIO_TEMP_DIR at the end over those before;
* `other_client_files_removed`: the honest client's upload gone from disk, or its result URL no
  longer answering 200 (0, 1 or 2);
* `check`: what the finding itself needs to count as fixed (e.g. no `/run/` call of a queued event
  ran); a request the server refuses as intended counts as held.

A probe is `held` when its check holds, the honest edit completed, `/status` stayed under 1 s, RSS
grew by less than 200 MB and no file of another client was removed. Figures are reported as
measured; nothing is tuned to pass. Exit status 0 when every probe held, 1 otherwise. Each probe's
attack has a budget (90 s, 25 s with --quick, unless the probe names its own: kiosk-lockout 600 s);
docs/benchmarks.md ("bench abuse") lists every probe's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from hidream_ui.bench import abuse_booth, abuse_openai, abuse_probes
from hidream_ui.bench.abuse_app import _MB, HONEST_ADDRESS, AbuseApp, AppRefused, client_address
from hidream_ui.bench.abuse_client import HonestClient
from hidream_ui.bench.abuse_kit import ProbeContext
from hidream_ui.bench.abuse_samplers import STATUS_EVERY, RssSampler, StatusSampler

# The common targets every probe is held to (docs/benchmarks.md, "bench abuse").
TARGET_STATUS_S = 1.0
TARGET_RSS_GROWTH_MB = 200.0

# Issue 19's probes, then issue 58's (booth storage and sessions), then issue 57's (the OpenAI route).
PROBES = {**abuse_probes.PROBES, **abuse_booth.PROBES, **abuse_openai.PROBES}
DEFAULT_BUDGET, QUICK_BUDGET = 90.0, 25.0
DEFAULT_TIMEOUT = 1800.0


def probe_name(name: str) -> str:
    """A probe's name as PROBES spells it (`kiosk_lockout` is `kiosk-lockout`)."""
    return name.replace("_", "-")


def held(record: dict) -> bool:
    """The verdict from recorded observations: the probe's own check (when it has one), the honest
    edit completed, `/status` under 1 s, RSS growth under 200 MB, no file of another client removed."""
    status = record.get("status_max_s")
    rss = record.get("rss_growth_mb")
    return (
        record.get("error") is None
        and record.get("check") is not False
        and record.get("honest_edit_completed") is True
        and status is not None
        and status < TARGET_STATUS_S
        and rss is not None
        and rss < TARGET_RSS_GROWTH_MB
        and record.get("other_client_files_removed") == 0
    )


def failed_targets(record: dict) -> list[str]:
    """Which targets a record misses, in words (for the table and the notes)."""
    out = []
    if record.get("error") is not None:
        out.append("harness error")
    if record.get("check") is False:
        out.append("check")
    if record.get("honest_edit_completed") is not True:
        out.append("honest edit")
    status = record.get("status_max_s")
    if status is None or status >= TARGET_STATUS_S:
        out.append("/status")
    rss = record.get("rss_growth_mb")
    if rss is None or rss >= TARGET_RSS_GROWTH_MB:
        out.append("RSS")
    if record.get("other_client_files_removed") != 0:
        out.append("files removed")
    return out


RECORD_KEYS = (
    "probe",
    "sent",
    "held",
    "honest_edit_completed",
    "status_max_s",
    "rss_growth_mb",
    "cache_growth_mb",
    "other_client_files_removed",
    "notes",
    "check",
    "check_text",
    "figures",
    "app_args",
    "budget_s",
    "seconds",
    "error",
)


def budget_for(name: str, quick: bool, override: float | None = None) -> float:
    """Seconds a probe's attack may take: `override` (--probe-budget), else the probe's own, else
    DEFAULT_BUDGET (QUICK_BUDGET with --quick)."""
    if override is not None:
        return override
    spec = PROBES[name]
    if spec.budget is not None:
        return spec.budget(quick)
    return QUICK_BUDGET if quick else DEFAULT_BUDGET


def run_probe(name: str, *, quick: bool, budget: float) -> dict:
    """One probe against its own app; always returns a record (a harness failure is its `error`)."""
    spec = PROBES[name]
    started = time.monotonic()
    record: dict[str, Any] = {key: None for key in RECORD_KEYS}
    record.update(probe=name, notes=[], figures={}, held=False, budget_s=budget)
    args, auth = spec.app_args(quick)
    record["app_args"] = args
    capacity = spec.session_capacity(quick) if spec.session_capacity is not None else None
    apps = [AbuseApp(args, auth=auth, session_capacity=capacity)]
    statuses = rss = None
    try:
        try:
            apps[0].start()
        except AppRefused as exc:
            if spec.fallback_args is None:
                raise
            # A flag the app does not know yet (e.g. --kiosk before it exists): say so, and
            # measure what the app does without it.
            fallback, auth = spec.fallback_args(quick)
            missing = " ".join(a for a in args if a not in fallback)
            record["notes"].append(
                f"not applicable: app refused {missing} ({str(exc).splitlines()[-1][:200]}); measured without it"
            )
            args = fallback
            record["app_args"] = args
            apps.append(AbuseApp(args, auth=auth, session_capacity=capacity))
            apps[-1].start()
        app = apps[-1]
        honest_timeout = 60.0 if quick else 120.0
        honest = HonestClient(app, timeout=honest_timeout, address=client_address(HONEST_ADDRESS))
        if honest.address is None:
            record["notes"].append(
                f"this machine connects from 127.0.0.1 only: the honest client shares the "
                f"attacker's address (wanted {HONEST_ADDRESS})"
            )
        # Fast during the warm-up (the model load's progress messages last milliseconds), then
        # every STATUS_EVERY s during the probe.
        statuses = StatusSampler(app, every=0.01)
        warm = honest.warm_up()
        statuses.every = STATUS_EVERY
        if not warm.ran:
            raise RuntimeError(f"the honest client's warm-up edit failed: {warm.short()}")
        rss = RssSampler(app)
        temp_before = app.temp_bytes()
        probe_start = time.monotonic()
        context = ProbeContext(app=app, honest=honest, quick=quick, statuses=statuses, deadline=probe_start + budget)
        outcome = spec.run(context)
        if not honest.started:  # a probe that forgot: the edit still has to run beside the app's state
            context.notes.append("honest edit started after the attack")
            honest.start()
        record["honest_edit_completed"] = honest.finish(time.monotonic() + honest_timeout)
        if not record["honest_edit_completed"]:
            record["notes"].append(
                "honest edit: " + (honest.result.short() if honest.result else f"no answer in {honest_timeout:.0f} s")
            )
        removed, removal_notes = honest.files_removed()
        record["other_client_files_removed"] = removed
        record["notes"] += removal_notes + context.notes
        statuses.wait_for_sample(probe_start)
        record["status_max_s"] = statuses.max_seconds(probe_start)
        rss.stop()
        record["rss_growth_mb"] = round(rss.peak - rss.baseline, 1)
        record["figures"] = {
            "rss_before_mb": round(rss.baseline, 1),
            "rss_peak_mb": round(rss.peak, 1),
            "rss_end_mb": round(app.rss_mb(), 1),
            **outcome.figures,
        }
        record["cache_growth_mb"] = round((app.temp_bytes() - temp_before) / _MB, 2)
        record.update(sent=outcome.sent, check=outcome.check, check_text=outcome.check_text)
    except Exception as exc:  # noqa: BLE001 - one probe's failure is reported, the others still run
        record["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if statuses is not None:
            statuses.stop()
        if rss is not None:
            rss.stop()
        for app in apps:
            app.close()
    record["held"] = held(record)
    record["seconds"] = round(time.monotonic() - started, 1)
    return record


def run(
    probes: list[str] | None = None,
    *,
    quick: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    probe_budget: float | None = None,
) -> dict:
    """Runs the probes one after another (each against its own app) within `timeout` seconds in all;
    returns the report. Probes that no longer fit are reported as skipped."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    names = [probe_name(n) for n in (probes or PROBES)]
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        raise ValueError(f"unknown probe(s) {', '.join(unknown)}; choose from {', '.join(PROBES)}")
    started = time.monotonic()
    records = []
    for name in names:
        budget = budget_for(name, quick, probe_budget)
        # A probe needs its budget plus an app start, the warm-up edit and the honest edit's wait.
        if time.monotonic() - started + budget + 30 > timeout:
            records.append(
                {
                    **{key: None for key in RECORD_KEYS},
                    "probe": name,
                    "held": False,
                    "notes": [],
                    "figures": {},
                    "error": f"skipped: the overall bound of {timeout:.0f} s was reached",
                }
            )
            continue
        records.append(run_probe(name, quick=quick, budget=budget))
    return {
        "benchmark": "abuse",
        "quick": quick,
        "model": "tiny",
        "device": "cpu",
        "cpu_count": os.cpu_count(),
        "targets": {
            "honest_edit_completed": True,
            "status_max_s_under": TARGET_STATUS_S,
            "rss_growth_mb_under": TARGET_RSS_GROWTH_MB,
            "other_client_files_removed": 0,
            "check": "the probe's own check (see check_text)",
        },
        "probe_budget_s": probe_budget if probe_budget is not None else (QUICK_BUDGET if quick else DEFAULT_BUDGET),
        "probes": records,
        "summary": {
            "held": sum(1 for r in records if r["held"]),
            "probes": len(records),
            "not_held": [r["probe"] for r in records if not r["held"]],
        },
        "seconds_total": round(time.monotonic() - started, 1),
    }


def table(report: dict) -> str:
    rows = [
        f"{'probe':16s} {'held':5s} {'honest':7s} {'status s':>8s} {'RSS MB':>8s} {'cache MB':>9s} "
        f"{'removed':>7s}  check / misses"
    ]

    def fmt(value, spec):
        return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"

    for r in report["probes"]:
        misses = failed_targets(r)
        rows.append(
            f"{r['probe']:16s} {'yes' if r['held'] else 'NO':5s} "
            f"{str(r.get('honest_edit_completed')):7s} {fmt(r.get('status_max_s'), '8.2f')} "
            f"{fmt(r.get('rss_growth_mb'), '8.1f')} {fmt(r.get('cache_growth_mb'), '9.2f')} "
            f"{fmt(r.get('other_client_files_removed'), '7d')}  "
            f"{r.get('check_text') or r.get('error') or ''}" + (f"  [misses: {', '.join(misses)}]" if misses else "")
        )
        if r.get("sent"):
            rows.append(f"{'':16s} sent: {r['sent']}")
        for note in r.get("notes") or []:
            rows.append(f"{'':16s} note: {note}")
    s = report["summary"]
    rows.append(
        f"{s['held']} of {s['probes']} probes held "
        f"(targets: honest edit completed, /status < {TARGET_STATUS_S:.0f} s, RSS growth < "
        f"{TARGET_RSS_GROWTH_MB:.0f} MB, no file of another client removed, the probe's check); "
        f"{report['seconds_total']:.0f} s"
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hidream_ui bench abuse",
        description="The findings of issues 19 and 58 as bounded loops against a local app (tiny model): per "
        "probe what was sent, server RSS and cache growth, the slowest /status, whether an honest "
        "client's edit completed and kept its files.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quick", action="store_true", help="smaller attacks and budgets (a smoke run, ~minutes)")
    parser.add_argument(
        "--probe",
        action="append",
        type=probe_name,
        choices=list(PROBES),
        metavar="NAME",
        help=f"run only this probe (repeatable): {', '.join(PROBES)}",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"overall bound in seconds; probes that no longer fit are skipped (default {DEFAULT_TIMEOUT:.0f})",
    )
    parser.add_argument(
        "--probe-budget",
        type=float,
        default=None,
        help="seconds each probe's attack may take (default: the probe's own; 90, 25 with --quick, "
        "for issue 19's; kiosk-lockout 600, 120 with --quick)",
    )
    args = parser.parse_args(argv)
    if args.timeout <= 0 or (args.probe_budget is not None and args.probe_budget <= 0):
        parser.error("--timeout and --probe-budget must be positive")
    report = run(args.probe, quick=args.quick, timeout=args.timeout, probe_budget=args.probe_budget)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(table(report))
    return 0 if report["summary"]["held"] == report["summary"]["probes"] else 1


__all__ = [
    "main",
    "run",
    "run_probe",
    "held",
    "failed_targets",
    "table",
    "AbuseApp",
    "AppRefused",
    "PROBES",
    "budget_for",
    "probe_name",
    "TARGET_STATUS_S",
    "TARGET_RSS_GROWTH_MB",
]
