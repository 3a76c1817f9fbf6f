"""`python -m hidream_ui bench app [--json] [--runs N] [--timeout S] [--no-imports]`.

Cold start of the app: starts `python app.py --port <free port>` on the offline tiny model in a
fresh process and times it until the HTTP port answers `GET /` with 200 ("serving"). The model is
lazy, so this is gradio's import plus building the UI plus the server start; nothing here loads
weights. Optionally also times the imports that dominate it, cumulatively, in one more fresh
process (each import's figure excludes what earlier imports already paid for).

Reports numbers only; the target (15 s on a 2-core CPU box) is shown for reference, not enforced.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

from hidream_ui.bench import free_port

TARGET_SECONDS = 15.0
REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout (hidream_ui/bench/app.py -> .)
# Variables that would point the app at real weights: the benchmark is about the tiny model.
_MODEL_ENV = ("HIDREAM_MODEL_DIR", "HIDREAM_LLAMA", "HIDREAM_I1", "HIDREAM_E1", "HIDREAM_PORT", "HIDREAM_HOST")

_IMPORTS_CHILD = textwrap.dedent("""
    import json, time
    marks = {}
    t = time.perf_counter()
    for name in ("hidream_ui.cli.app", "gradio", "hidream_ui.ui.layout"):
        __import__(name)
        now = time.perf_counter()
        marks[name] = round(now - t, 3)
        t = now
    print(json.dumps(marks))
""")


def _env(output_dir: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _MODEL_ENV}
    env["HIDREAM_OUTPUT_DIR"] = output_dir
    env["GRADIO_ANALYTICS_ENABLED"] = "False"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _command(port: int) -> list[str]:
    app = REPO_ROOT / "app.py"
    base = [sys.executable, str(app)] if app.is_file() else [sys.executable, "-m", "hidream_ui", "app"]
    return base + ["--host", "127.0.0.1", "--port", str(port)]


def _serving(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def measure_cold_start(timeout: float = 60.0) -> dict:
    """One cold start: seconds from process start to `GET /` answering 200."""
    port = free_port()
    command = _command(port)
    url = f"http://127.0.0.1:{port}/"
    with tempfile.TemporaryDirectory(prefix="hidream_bench_app_") as tmp, open(Path(tmp) / "app.log", "w+b") as log:
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=str(REPO_ROOT), env=_env(tmp), stdout=log, stderr=subprocess.STDOUT)
        seconds = None
        try:
            while time.perf_counter() - started < timeout:
                if process.poll() is not None:
                    break
                if _serving(url):
                    seconds = time.perf_counter() - started
                    break
                time.sleep(0.1)
        finally:
            # Only the process this function started, by its handle.
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        result = {
            "seconds_to_serving": round(seconds, 3) if seconds is not None else None,
            "command": command,
            "exit_code": process.returncode,
        }
        if seconds is None:
            log.seek(0)
            result["log_tail"] = log.read().decode("utf-8", "replace")[-2000:]
            result["error"] = (
                "the app exited before serving"
                if process.returncode not in (None, -15) and time.perf_counter() - started < timeout
                else f"not serving after {timeout:.0f} s"
            )
        return result


def measure_imports() -> dict[str, float] | None:
    """Cumulative import seconds of what the app imports at start, in one fresh process."""
    completed = subprocess.run(
        [sys.executable, "-c", _IMPORTS_CHILD],
        cwd=str(REPO_ROOT),
        env=_env(tempfile.gettempdir()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if completed.returncode != 0:
        return None
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hidream_ui bench app", description="Cold start of `python app.py` (tiny model) to serving."
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--runs", type=int, default=1, help="cold starts to measure (default 1)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for serving (default 60)")
    parser.add_argument("--no-imports", action="store_true", help="skip the import-time breakdown")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1 (got {args.runs})")

    runs = [measure_cold_start(args.timeout) for _ in range(args.runs)]
    served = [r["seconds_to_serving"] for r in runs if r["seconds_to_serving"] is not None]
    report = {
        "benchmark": "app_cold_start",
        "model": "tiny (lazy: not loaded at start)",
        "runs": runs,
        "seconds_to_serving": min(served) if served else None,
        "target_seconds": TARGET_SECONDS,
        "within_target": bool(served) and min(served) <= TARGET_SECONDS,
        "cpu_count": os.cpu_count(),
    }
    if not args.no_imports:
        report["import_seconds"] = measure_imports()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        if served:
            verdict = "within" if report["within_target"] else "OVER"
            print(
                f"cold start to serving: {report['seconds_to_serving']:.2f} s "
                f"(best of {len(runs)}; {verdict} the {TARGET_SECONDS:.0f} s target)"
            )
        for run in runs:
            if run["seconds_to_serving"] is None:
                print(f"failed: {run['error']}\n{run.get('log_tail', '')}", file=sys.stderr)
        if report.get("import_seconds"):
            parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in report["import_seconds"].items())
            print(f"imports (cumulative, fresh process): {parts}")
    return 0 if len(served) == len(runs) else 1


__all__ = ["main", "measure_cold_start", "measure_imports", "TARGET_SECONDS"]
