"""`python -m hidream_ui bench abuse [--json] [--quick] [--probe NAME ...] [--timeout S]`.

The findings of issue 19 run as bounded loops against a local app, as an attacker on 127.0.0.1
would send them over raw HTTP. Every probe launches its own app (`python -m hidream_ui app`, tiny
model, CPU, a free 127.0.0.1 port, its own --output-dir and GRADIO_TEMP_DIR in a temporary folder),
so the server's figures are its own: RSS is read with psutil on the child's pid, the cache is the
child's GRADIO_TEMP_DIR (Gradio's `hidream-ui-gradio-*` folder and its upload spools). The app is
killed at the end of every probe, whatever happened.

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
measured; nothing is tuned to pass. Exit status 0 when every probe held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from hidream_ui.bench import abuse_probes
from hidream_ui.bench.abuse_client import (
    _MB,
    STATUS_EVERY,
    TARGET_RSS_GROWTH_MB,
    TARGET_STATUS_S,
    AbuseApp,
    AppRefused,
    HonestClient,
    ProbeContext,
    RssSampler,
    StatusSampler,
)


def held(record: dict) -> bool:
    """The verdict from recorded observations: the probe's own check (when it has one), the honest
    edit completed, `/status` under 1 s, RSS growth under 200 MB, no file of another client removed."""
    status = record.get("status_max_s")
    rss = record.get("rss_growth_mb")
    return (record.get("error") is None
            and record.get("check") is not False
            and record.get("honest_edit_completed") is True
            and status is not None and status < TARGET_STATUS_S
            and rss is not None and rss < TARGET_RSS_GROWTH_MB
            and record.get("other_client_files_removed") == 0)


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


RECORD_KEYS = ("probe", "sent", "held", "honest_edit_completed", "status_max_s", "rss_growth_mb", "cache_growth_mb",
               "other_client_files_removed", "notes", "check", "check_text", "figures", "app_args", "seconds", "error")


def run_probe(name: str, *, quick: bool, budget: float) -> dict:
    """One probe against its own app; always returns a record (a harness failure is its `error`)."""
    spec = abuse_probes.PROBES[name]
    started = time.monotonic()
    record: dict[str, Any] = {key: None for key in RECORD_KEYS}
    record.update(probe=name, notes=[], figures={}, held=False)
    args, auth = spec.app_args(quick)
    record["app_args"] = args
    apps = [AbuseApp(args, auth=auth)]
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
            record["notes"].append(f"not applicable: app refused {missing} "
                                   f"({str(exc).splitlines()[-1][:200]}); measured without it")
            args = fallback
            record["app_args"] = args
            apps.append(AbuseApp(args, auth=auth))
            apps[-1].start()
        app = apps[-1]
        honest_timeout = 60.0 if quick else 120.0
        honest = HonestClient(app, timeout=honest_timeout)
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
        context = ProbeContext(app=app, honest=honest, quick=quick, statuses=statuses,
                               deadline=probe_start + budget)
        outcome = spec.run(context)
        if not honest.started:  # a probe that forgot: the edit still has to run beside the app's state
            context.notes.append("honest edit started after the attack")
            honest.start()
        record["honest_edit_completed"] = honest.finish(time.monotonic() + honest_timeout)
        if not record["honest_edit_completed"]:
            record["notes"].append("honest edit: " + (honest.result.short() if honest.result else
                                                      f"no answer in {honest_timeout:.0f} s"))
        removed, removal_notes = honest.files_removed()
        record["other_client_files_removed"] = removed
        record["notes"] += removal_notes + context.notes
        statuses.wait_for_sample(probe_start)
        record["status_max_s"] = statuses.max_seconds(probe_start)
        rss.stop()
        record["rss_growth_mb"] = round(rss.peak - rss.baseline, 1)
        record["figures"] = {"rss_before_mb": round(rss.baseline, 1), "rss_peak_mb": round(rss.peak, 1),
                             "rss_end_mb": round(app.rss_mb(), 1), **outcome.figures}
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


def run(probes: list[str] | None = None, *, quick: bool = False, timeout: float = 600.0,
        probe_budget: float | None = None) -> dict:
    """Runs the probes one after another (each against its own app) within `timeout` seconds in all;
    returns the report. Probes that no longer fit are reported as skipped."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    names = list(probes or abuse_probes.PROBES)
    unknown = [n for n in names if n not in abuse_probes.PROBES]
    if unknown:
        raise ValueError(f"unknown probe(s) {', '.join(unknown)}; choose from {', '.join(abuse_probes.PROBES)}")
    budget = probe_budget if probe_budget is not None else (25.0 if quick else 90.0)
    started = time.monotonic()
    records = []
    for name in names:
        # A probe needs its budget plus an app start, the warm-up edit and the honest edit's wait.
        if time.monotonic() - started + budget + 30 > timeout:
            records.append({**{key: None for key in RECORD_KEYS}, "probe": name, "held": False, "notes": [],
                            "figures": {}, "error": f"skipped: the overall bound of {timeout:.0f} s was reached"})
            continue
        records.append(run_probe(name, quick=quick, budget=budget))
    return {
        "benchmark": "abuse",
        "quick": quick,
        "model": "tiny",
        "device": "cpu",
        "cpu_count": os.cpu_count(),
        "targets": {"honest_edit_completed": True, "status_max_s_under": TARGET_STATUS_S,
                    "rss_growth_mb_under": TARGET_RSS_GROWTH_MB, "other_client_files_removed": 0,
                    "check": "the probe's own check (see check_text)"},
        "probe_budget_s": budget,
        "probes": records,
        "summary": {"held": sum(1 for r in records if r["held"]), "probes": len(records),
                    "not_held": [r["probe"] for r in records if not r["held"]]},
        "seconds_total": round(time.monotonic() - started, 1),
    }


def table(report: dict) -> str:
    rows = [f"{'probe':16s} {'held':5s} {'honest':7s} {'status s':>8s} {'RSS MB':>8s} {'cache MB':>9s} "
            f"{'removed':>7s}  check / misses"]

    def fmt(value, spec):
        return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"

    for r in report["probes"]:
        misses = failed_targets(r)
        rows.append(f"{r['probe']:16s} {'yes' if r['held'] else 'NO':5s} "
                    f"{str(r.get('honest_edit_completed')):7s} {fmt(r.get('status_max_s'), '8.2f')} "
                    f"{fmt(r.get('rss_growth_mb'), '8.1f')} {fmt(r.get('cache_growth_mb'), '9.2f')} "
                    f"{fmt(r.get('other_client_files_removed'), '7d')}  "
                    f"{r.get('check_text') or r.get('error') or ''}"
                    + (f"  [misses: {', '.join(misses)}]" if misses else ""))
        if r.get("sent"):
            rows.append(f"{'':16s} sent: {r['sent']}")
        for note in r.get("notes") or []:
            rows.append(f"{'':16s} note: {note}")
    s = report["summary"]
    rows.append(f"{s['held']} of {s['probes']} probes held "
                f"(targets: honest edit completed, /status < {TARGET_STATUS_S:.0f} s, RSS growth < "
                f"{TARGET_RSS_GROWTH_MB:.0f} MB, no file of another client removed, the probe's check); "
                f"{report['seconds_total']:.0f} s")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hidream_ui bench abuse",
        description="The findings of issue 19 as bounded loops against a local app (tiny model): per probe "
                    "what was sent, server RSS and cache growth, the slowest /status, whether an honest "
                    "client's edit completed and kept its files.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quick", action="store_true", help="smaller attacks and budgets (a smoke run, ~minutes)")
    parser.add_argument("--probe", action="append", choices=list(abuse_probes.PROBES), metavar="NAME",
                        help=f"run only this probe (repeatable): {', '.join(abuse_probes.PROBES)}")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="overall bound in seconds; probes that no longer fit are skipped (default 900)")
    parser.add_argument("--probe-budget", type=float, default=None,
                        help="seconds each probe's attack may take (default 90, 25 with --quick)")
    args = parser.parse_args(argv)
    if args.timeout <= 0 or (args.probe_budget is not None and args.probe_budget <= 0):
        parser.error("--timeout and --probe-budget must be positive")
    report = run(args.probe, quick=args.quick, timeout=args.timeout, probe_budget=args.probe_budget)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(table(report))
    return 0 if report["summary"]["held"] == report["summary"]["probes"] else 1


__all__ = ["main", "run", "run_probe", "held", "failed_targets", "table", "AbuseApp", "AppRefused",
           "TARGET_STATUS_S", "TARGET_RSS_GROWTH_MB"]
