"""The client side of `bench abuse`: the app under test (a child process), raw HTTP calls the way
curl would send them, the /status and RSS samplers, the honest client, and what a probe gets
(`ProbeContext`) and returns (`ProbeOutcome`). The probes (abuse_probes.py) and the runner (abuse.py)
both build on it; it imports neither."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hidream_ui.bench import free_port

TARGET_STATUS_S = 1.0
TARGET_RSS_GROWTH_MB = 200.0
_MB = 1024 * 1024
REPO_ROOT = Path(__file__).resolve().parents[2]
EDIT_INSTRUCTION = "make it blue"
HONEST_INSTRUCTION = "honest client: make it green"
APP_START_TIMEOUT = 90.0
STATUS_EVERY = 0.2
STATUS_TIMEOUT = 10.0
# The honest client's own address: another client in the server's eyes (its storage, its quotas and its
# new-session limit are keyed on the address), so that "another client's files" means what it says.
# Linux answers on all of 127.0.0.0/8; where only 127.0.0.1 does, every client shares it (`client_address`).
HONEST_ADDRESS = "127.0.0.2"
# Gradio's session table is capped at this many sessions by the child launcher (abuse_child.py).
SESSION_CAPACITY_ENV = "BENCH_ABUSE_SESSION_CAPACITY"
SESSION_LOG_ENV = "BENCH_ABUSE_SESSION_LOG"
CACHE_EVERY = 0.1


@functools.lru_cache(maxsize=1)
def loopback_aliases() -> bool:
    """True when this machine lets a client connect from 127.0.0.x other than 127.0.0.1."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((HONEST_ADDRESS, 0))
        return True
    except OSError:
        return False


def client_address(address: str) -> str | None:
    """`address` when the machine can connect from it, else None (the default, 127.0.0.1)."""
    return address if loopback_aliases() else None


def _apple() -> Path:
    from hidream_ui.ui.layout import ASSETS_DIR  # lazy: gradio (the bench harness itself never needs it)

    return ASSETS_DIR / "apple.png"


def edit_data(
    image: Any, instruction: str = EDIT_INSTRUCTION, steps: int = 2, seed: int = 1, resolution: str = "draft"
) -> list:
    """The 13 inputs of `/edit` in order (image, instruction, negative, guidance, image guidance,
    steps, refine strength, CLIP norm, resolution, seed, randomize, collapse padding, rewrite)."""
    return [image, instruction, "", 3.0, 1.5, steps, 0.3, True, resolution, seed, False, True, False]


def file_data(path: str, orig_name: str | None = None) -> dict:
    value = {"path": path, "meta": {"_type": "gradio.FileData"}}
    if orig_name is not None:
        value["orig_name"] = orig_name
    return value


# ---------------------------------------------------------------------------------------------
# The app under test: a child process, killed at the end
# ---------------------------------------------------------------------------------------------


class AppRefused(RuntimeError):
    """The app exited before serving (e.g. it does not know a flag); the log's tail says why."""


class AbuseApp:
    """`python -m hidream_ui app` in a child process on a free 127.0.0.1 port; use as a context
    manager (the process is killed on exit, the temporary folder removed)."""

    def __init__(self, args: list[str], *, auth: tuple[str, str] | None = None, session_capacity: int | None = None):
        self.args = list(args)
        self.auth = auth
        # Gradio's session table capped here (the app has no flag: abuse_child.py sets it), None: gradio's.
        self.session_capacity = session_capacity
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.root = Path(tempfile.mkdtemp(prefix="hidream-bench-abuse-"))
        self.output_dir = self.root / "outputs"
        self.gradio_tmp = self.root / "gradio"
        self.gradio_tmp.mkdir()
        self.process: subprocess.Popen | None = None
        self._log = None
        self._dependencies: list[dict] | None = None
        self._cookies = None
        self._cookie_lock = threading.Lock()
        self.exempt_files: set[str] = set()  # in the cache once the app serves: the examples' copies

    # ---- lifecycle
    def command(self) -> list[str]:
        launcher = (
            ["-m", "hidream_ui.bench.abuse_child"] if self.session_capacity is not None else ["-m", "hidream_ui", "app"]
        )
        return [
            sys.executable,
            *launcher,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--output-dir",
            str(self.output_dir),
            *self.args,
        ]

    @property
    def session_log_path(self) -> Path:
        return self.root / "sessions.jsonl"

    def _env(self) -> dict[str, str]:
        # Every HIDREAM_* setting of the caller is dropped (model paths, --auth, limits): the probe
        # names its flags; only the cache of the tiny checkpoint is kept.
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("HIDREAM_", "GRADIO_")) or k == "HIDREAM_UI_CACHE"
        }
        env.update(
            GRADIO_TEMP_DIR=str(self.gradio_tmp),
            GRADIO_ANALYTICS_ENABLED="False",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        )
        env.pop(SESSION_CAPACITY_ENV, None)
        env.pop(SESSION_LOG_ENV, None)
        if self.session_capacity is not None:
            env[SESSION_CAPACITY_ENV] = str(self.session_capacity)
            env[SESSION_LOG_ENV] = str(self.session_log_path)
        return env

    def __enter__(self) -> "AbuseApp":
        return self

    def start(self, timeout: float = APP_START_TIMEOUT) -> None:
        import httpx

        self._log = open(self.root / "app.log", "w+b")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            self.command(), cwd=str(REPO_ROOT), env=self._env(), stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AppRefused(f"the app exited with {self.process.returncode} before serving: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/", timeout=1.0).status_code == 200:
                    # What the app cached before any client (the examples' copies): its limits leave them out.
                    self.exempt_files = {str(p) for p in _files(self.gradio_tmp)}
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AppRefused(f"the app was not serving after {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, chars: int = 1500) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")[-chars:].strip()

    def close(self) -> None:
        # Only the process this object started, by its handle; killed outright if it does not stop.
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self._log is not None:
            self._log.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- figures of the server
    def rss_mb(self) -> float:
        import psutil

        return psutil.Process(self.process.pid).memory_info().rss / _MB

    def cpu_seconds(self) -> float:
        import psutil

        times = psutil.Process(self.process.pid).cpu_times()
        return times.user + times.system

    def temp_bytes(self) -> int:
        return sum(_size(f) for f in _files(self.gradio_tmp))

    def cache_folder(self) -> Path | None:
        return next(iter(sorted(self.gradio_tmp.glob("hidream-ui-gradio-*"))), None)

    def cache_counts(self) -> tuple[int, int]:
        """(files, bytes) in the app's GRADIO_TEMP_DIR that count against --cache-max-files and
        --cache-max-mb: everything but what was there when it started serving (the examples' copies)."""
        files = [f for f in _files(self.gradio_tmp) if str(f) not in self.exempt_files]
        return len(files), sum(_size(f) for f in files)

    def session_log(self) -> list[dict]:
        """The session table's size as abuse_child.py wrote it ({"t", "sessions", "worked", "capacity"}
        per line); empty without a session cap or before the app served."""
        out = []
        with contextlib.suppress(OSError):
            for line in self.session_log_path.read_text(encoding="utf-8").splitlines():
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out

    # ---- HTTP
    @contextlib.contextmanager
    def http(self, timeout: float = 60.0, address: str | None = None, **kwargs):
        """`with app.http() as http`: an httpx client on the app, logged in when the app has --auth;
        `address`: the local address it connects from (another client in the server's eyes)."""
        import httpx

        if address is not None and address != "127.0.0.1":
            kwargs.setdefault("transport", httpx.HTTPTransport(local_address=address))
        with httpx.Client(base_url=self.url, timeout=timeout, **kwargs) as client:
            if self.auth is not None:
                client.cookies = self._login_cookies()
            yield client

    def _login_cookies(self):
        """One login for every client of the harness: a good login forgives the user's failed ones,
        so logging in again and again would undo the lock the login probe sets."""
        import httpx

        with self._cookie_lock:
            if self._cookies is None:
                with httpx.Client(base_url=self.url, timeout=30) as client:
                    answer = client.post("/login", data={"username": self.auth[0], "password": self.auth[1]})
                    if answer.status_code != 200:
                        raise RuntimeError(
                            f"cannot log in to the app under test: {answer.status_code} {answer.text[:200]}"
                        )
                    self._cookies = httpx.Cookies(client.cookies)
            return self._cookies

    def dependencies(self) -> list[dict]:
        if self._dependencies is None:
            with self.http(timeout=30) as http:
                self._dependencies = http.get("/config").json()["dependencies"]
        return self._dependencies

    def dependency(self, api_name: str) -> tuple[int, dict]:
        for index, dep in enumerate(self.dependencies()):
            if dep.get("api_name") == api_name:
                return int(dep.get("id", index)), dep
        raise KeyError(f"the app has no event {api_name!r}")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # removed meanwhile (the app's janitor runs on its own)
        return 0


def _files(folder: Path) -> list[Path]:
    # os.walk, not Path.rglob: rglob raises when a folder goes mid-walk (the app's janitor prunes
    # while the samplers count); os.walk skips it.
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            path = Path(root, name)
            with contextlib.suppress(OSError):
                if path.is_file():
                    out.append(path)
    return out


# ---------------------------------------------------------------------------------------------
# Talking to it: raw HTTP, the way curl would
# ---------------------------------------------------------------------------------------------


@dataclass
class CallResult:
    """The end of one call: `ran` (a result came back), `refused` (an HTTP status or an error
    message said no), the status code, the error text, the output data, seconds."""

    ran: bool
    status: int | None = None
    error: str | None = None
    data: Any = None
    seconds: float = 0.0
    event_id: str | None = None
    messages: list[str] = field(default_factory=list)
    ended_at: float = field(default_factory=time.monotonic)

    @property
    def refused(self) -> bool:
        return not self.ran

    def short(self) -> str:
        if self.ran:
            return "ran"
        if self.status is None:  # no HTTP answer: a timeout or a dropped connection
            return f"no answer ({(self.error or '')[:160]})"
        return f"refused ({self.status}: {(self.error or '')[:160]})"


def upload(http, files: list[tuple[str, bytes]], timeout: float = 120.0) -> tuple[int, Any]:
    answer = http.post(
        "/gradio_api/upload",
        files=[("files", (name, data, "application/octet-stream")) for name, data in files],
        timeout=timeout,
    )
    try:
        return answer.status_code, answer.json()
    except ValueError:
        return answer.status_code, answer.text


def run_direct(http, api_name: str, data: list, session: str, timeout: float = 120.0) -> CallResult:
    """`POST /gradio_api/run/<api_name>`: the direct REST route, no queue."""
    import httpx

    started = time.monotonic()
    try:
        answer = http.post(f"/gradio_api/run/{api_name}", json={"data": data, "session_hash": session}, timeout=timeout)
    except httpx.TimeoutException:
        return CallResult(False, None, f"no answer in {timeout:.0f} s", seconds=time.monotonic() - started)
    seconds = time.monotonic() - started
    try:
        body = answer.json()
    except ValueError:
        body = {"error": answer.text}
    if answer.status_code == 200 and isinstance(body, dict) and "data" in body and not body.get("error"):
        return CallResult(True, 200, data=body["data"], seconds=seconds)
    error = body.get("error") or body.get("detail") if isinstance(body, dict) else str(body)
    return CallResult(False, answer.status_code, str(error), seconds=seconds)


def _body(payload: dict, data: list | None, encoded_data: bytes | None) -> dict:
    """The JSON request: `payload` with "data" (`encoded_data`: data already JSON-encoded, sent as is)."""
    if encoded_data is None:
        return {"json": {**payload, "data": data}}
    head = json.dumps(payload)[:-1]  # '{"fn_index": ..., "session_hash": ...' without its closing brace
    return {
        "content": head.encode() + b', "data": ' + encoded_data + b"}",
        "headers": {"content-type": "application/json"},
    }


def run_fn(
    http, fn_index: int, data: list | None, session: str, timeout: float = 120.0, encoded_data: bytes | None = None
) -> CallResult:
    """An unqueued event by its index (`/gradio_api/run/predict` with `fn_index`), as the browser's
    private events are called."""
    import httpx

    started = time.monotonic()
    try:
        answer = http.post(
            "/gradio_api/run/predict",
            timeout=timeout,
            **_body({"fn_index": fn_index, "session_hash": session}, data, encoded_data),
        )
    except httpx.TimeoutException:
        return CallResult(False, None, f"no answer in {timeout:.0f} s", seconds=time.monotonic() - started)
    try:
        body = answer.json()
    except ValueError:
        body = {"error": answer.text}
    ok = answer.status_code == 200 and isinstance(body, dict) and "data" in body and not body.get("error")
    error = None if ok else str(body.get("error") or body.get("detail") if isinstance(body, dict) else body)
    return CallResult(
        ok, answer.status_code, error, body.get("data") if isinstance(body, dict) else None, time.monotonic() - started
    )


def queue_call(
    app: AbuseApp,
    http,
    fn_index: int,
    data: list | None,
    session: str,
    timeout: float = 120.0,
    on_event: Callable[[dict], None] | None = None,
    encoded_data: bytes | None = None,
) -> CallResult:
    """Joins the queue and reads the event stream until this event completes (or `timeout`);
    `encoded_data`: the data already JSON-encoded (a large payload sent many times)."""
    import httpx

    started = time.monotonic()
    try:
        joined = http.post(
            "/gradio_api/queue/join",
            timeout=60,
            **_body(
                {"fn_index": fn_index, "session_hash": session, "event_data": None, "trigger_id": None},
                data,
                encoded_data,
            ),
        )
    except httpx.HTTPError as exc:
        return CallResult(False, None, f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - started)
    if joined.status_code != 200:
        return CallResult(False, joined.status_code, joined.text[:500], seconds=time.monotonic() - started)
    event_id = joined.json().get("event_id")
    if on_event is not None:
        on_event({"msg": "joined", "event_id": event_id})
    messages: list[str] = []
    deadline = started + timeout
    try:
        with http.stream(
            "GET",
            "/gradio_api/queue/data",
            params={"session_hash": session},
            timeout=httpx.Timeout(30.0, read=min(30.0, max(1.0, timeout))),
        ) as stream:
            for line in stream.iter_lines():
                if time.monotonic() > deadline:
                    break
                if not line.startswith("data:"):
                    continue
                try:
                    message = json.loads(line[5:])
                except ValueError:
                    continue
                if message.get("event_id") not in (None, event_id):
                    continue
                if on_event is not None:
                    on_event(message)
                kind = message.get("msg")
                if kind == "progress":
                    messages.extend(str(p.get("desc")) for p in message.get("progress_data") or [] if p.get("desc"))
                if kind == "process_completed":
                    output = message.get("output") or {}
                    if message.get("success") and "data" not in output:
                        # What Gradio sends for an event its /cancel ended: "success", no output.
                        return CallResult(
                            False,
                            200,
                            "ended with no output (cancelled)",
                            seconds=time.monotonic() - started,
                            event_id=event_id,
                            messages=messages,
                        )
                    if message.get("success"):
                        return CallResult(
                            True,
                            200,
                            data=output.get("data"),
                            seconds=time.monotonic() - started,
                            event_id=event_id,
                            messages=messages,
                        )
                    return CallResult(
                        False,
                        200,
                        str(output.get("error") or output.get("title") or output),
                        seconds=time.monotonic() - started,
                        event_id=event_id,
                        messages=messages,
                    )
                if kind in ("close_stream", "unexpected_error"):
                    return CallResult(
                        False,
                        200,
                        str(message.get("message") or kind),
                        seconds=time.monotonic() - started,
                        event_id=event_id,
                        messages=messages,
                    )
    except httpx.HTTPError as exc:
        return CallResult(
            False,
            None,
            f"{type(exc).__name__}: {exc}",
            seconds=time.monotonic() - started,
            event_id=event_id,
            messages=messages,
        )
    return CallResult(
        False,
        None,
        f"not finished after {timeout:.0f} s",
        seconds=time.monotonic() - started,
        event_id=event_id,
        messages=messages,
    )


def call_api(
    app: AbuseApp,
    http,
    api_name: str,
    data: list,
    session: str,
    timeout: float = 120.0,
    on_event: Callable[[dict], None] | None = None,
) -> CallResult:
    """An event the way a well-behaved client calls it: through the queue when the app queues it,
    else the direct route (so the probes follow the app when a fix changes which is which)."""
    fn_index, dep = app.dependency(api_name)
    if dep.get("queue") is False:
        return run_fn(http, fn_index, data, session, timeout=timeout)
    return queue_call(app, http, fn_index, data, session, timeout=timeout, on_event=on_event)


def new_session(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


# ---------------------------------------------------------------------------------------------
# Samplers: /status latency (and what it says), server RSS
# ---------------------------------------------------------------------------------------------


class StatusSampler:
    """Asks `/status` every STATUS_EVERY s on its own connection; keeps (time, seconds, status)."""

    def __init__(self, app: AbuseApp, every: float = STATUS_EVERY):
        self.app = app
        self.every = every
        self.samples: list[tuple[float, float, dict | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="abuse-status")
        self._thread.start()

    def _loop(self) -> None:
        import httpx

        session = new_session("status")
        with contextlib.suppress(httpx.HTTPError, RuntimeError), self.app.http(timeout=STATUS_TIMEOUT) as http:
            while not self._stop.is_set():
                started = time.monotonic()
                status = None
                try:
                    answer = http.post("/gradio_api/run/status", json={"data": [], "session_hash": session})
                    data = answer.json().get("data") if answer.status_code == 200 else None
                    status = data[0] if data else None
                except (httpx.HTTPError, ValueError):
                    pass
                self.samples.append((started, time.monotonic() - started, status))
                self._stop.wait(self.every)

    def max_seconds(self, since: float) -> float | None:
        times = [seconds for at, seconds, _ in self.samples if at >= since]
        return round(max(times), 3) if times else None

    def wait_for_sample(self, since: float) -> None:
        """Waits (at most one request's timeout and one interval) until a request started at or after
        `since` has been answered: a probe shorter than one /status round trip on a busy machine
        would otherwise have no figure at all."""
        deadline = time.monotonic() + STATUS_TIMEOUT + self.every + 1.0
        while time.monotonic() < deadline and not self._stop.is_set():
            if any(at >= since for at, _, _ in list(self.samples)):
                return
            time.sleep(0.02)

    def statuses(self, since: float = 0.0) -> list[dict]:
        return [status for at, _, status in self.samples if at >= since and status]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=STATUS_TIMEOUT + 2)


class RssSampler:
    """The server's peak RSS since `reset()`, sampled every 0.1 s on a thread."""

    def __init__(self, app: AbuseApp):
        self.app = app
        self.baseline = self.peak = app.rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="abuse-rss")
        self._thread.start()

    def reset(self) -> None:
        self.baseline = self.peak = self.app.rss_mb()

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            with contextlib.suppress(psutil.Error):
                self.peak = max(self.peak, self.app.rss_mb())
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class CacheSampler:
    """The app's cache (`AbuseApp.cache_counts`: files and bytes that count against its limits),
    sampled every CACHE_EVERY s on a thread: the peaks, and how often and how long it was over
    `max_files` / `max_bytes`. Use as a context manager or call `stop()`."""

    def __init__(self, app: AbuseApp, max_files: int, max_bytes: int, every: float = CACHE_EVERY):
        self.app = app
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.every = every
        self.samples: list[tuple[float, int, int]] = []  # (monotonic time, files, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="abuse-cache")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            files, size = self.app.cache_counts()
            self.samples.append((time.monotonic(), files, size))
            self._stop.wait(self.every)

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(timeout=10)
            files, size = self.app.cache_counts()
            self.samples.append((time.monotonic(), files, size))

    def __enter__(self) -> "CacheSampler":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def figures(self) -> dict:
        return cache_figures(self.samples, self.max_files, self.max_bytes)


def cache_figures(samples: list[tuple[float, int, int]], max_files: int, max_bytes: int) -> dict:
    """What a run of cache samples says: first, peak and last file counts and MB, the caps, how many
    samples were over either cap, for how many seconds in all and at most in one stretch (a sample
    over a cap counts until the next sample)."""
    if not samples:
        return {
            "cache_samples": 0,
            "cache_files_first": None,
            "cache_files_max": None,
            "cache_files_end": None,
            "cache_mb_max": None,
            "cache_mb_end": None,
            "cache_max_files": max_files,
            "cache_max_mb": round(max_bytes / _MB, 1),
            "cache_samples_over_cap": None,
            "cache_seconds_over_cap": None,
            "cache_longest_over_cap_s": None,
        }
    over, seconds, longest, run_start = 0, 0.0, 0.0, None
    for index, (at, files, size) in enumerate(samples):
        ends = samples[index + 1][0] if index + 1 < len(samples) else at
        if files > max_files or size > max_bytes:
            over += 1
            seconds += ends - at
            run_start = at if run_start is None else run_start
            longest = max(longest, ends - run_start)
        else:
            run_start = None
    return {
        "cache_samples": len(samples),
        "cache_files_first": samples[0][1],
        "cache_files_max": max(s[1] for s in samples),
        "cache_files_end": samples[-1][1],
        "cache_mb_max": round(max(s[2] for s in samples) / _MB, 2),
        "cache_mb_end": round(samples[-1][2] / _MB, 2),
        "cache_max_files": max_files,
        "cache_max_mb": round(max_bytes / _MB, 1),
        "cache_samples_over_cap": over,
        "cache_seconds_over_cap": round(seconds, 2),
        "cache_longest_over_cap_s": round(longest, 2),
    }


# ---------------------------------------------------------------------------------------------
# The honest client
# ---------------------------------------------------------------------------------------------


class HonestClient:
    """Its own session; `warm_up()` uploads the apple and edits it (keeps the upload path and the
    result URL); `start()` edits again on a thread; `finish()` waits for that edit."""

    def __init__(self, app: AbuseApp, timeout: float, address: str | None = None):
        self.app = app
        self.timeout = timeout
        self.address = address  # the local address it connects from (None: 127.0.0.1)
        self.session = new_session("honest")
        self.upload_path: str | None = None
        self.result_url: str | None = None
        self.warm_up_messages: list[str] = []
        self.result: CallResult | None = None
        self._thread: threading.Thread | None = None

    def warm_up(self) -> CallResult:
        with self.app.http(address=self.address) as http:
            code, paths = upload(http, [("apple.png", _apple().read_bytes())])
            if code != 200:
                return CallResult(False, code, f"upload refused: {paths}")
            self.upload_path = paths[0]
            fn_index, _ = self.app.dependency("edit")
            result = queue_call(
                self.app,
                http,
                fn_index,
                edit_data(file_data(self.upload_path, "apple.png"), HONEST_INSTRUCTION),
                self.session,
                timeout=self.timeout + 60,
            )  # the first edit loads the model
        self.warm_up_messages = result.messages
        if result.ran:
            self.result_url = _result_url(result.data)
        return result

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._edit, daemon=True, name="abuse-honest")
            self._thread.start()

    def _edit(self) -> None:
        try:
            with self.app.http(address=self.address) as http:
                fn_index, _ = self.app.dependency("edit")
                data = edit_data(file_data(self.upload_path, "apple.png"), HONEST_INSTRUCTION, seed=2)
                self.result = queue_call(self.app, http, fn_index, data, self.session, timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - a failure of the honest edit is the figure
            self.result = CallResult(False, None, f"{type(exc).__name__}: {exc}")

    def finish(self, deadline: float) -> bool | None:
        if self._thread is None:
            return None
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return bool(self.result is not None and self.result.ran)

    def files_removed(self) -> tuple[int, list[str]]:
        """How many of this client's files are gone: its upload (on disk) and its result (URL)."""
        import httpx

        removed, notes = 0, []
        if self.upload_path and not Path(self.upload_path).is_file():
            removed += 1
            notes.append("the honest client's upload was removed")
        if self.result_url:
            try:
                with self.app.http(timeout=30, address=self.address) as http:
                    code = http.get(self.result_url).status_code
            except httpx.HTTPError as exc:
                code = f"{type(exc).__name__}"
            if code != 200:
                removed += 1
                notes.append(f"the honest client's result URL answered {code}")
        return removed, notes


def _result_url(data: Any) -> str | None:
    """The URL of the saved PNG in /edit's outputs (the download button's file)."""
    if isinstance(data, list) and len(data) > 1:
        saved = data[1]
        if isinstance(saved, dict):
            value = saved.get("value", saved)
            if isinstance(value, dict) and value.get("url"):
                return str(value["url"])
    return None


# ---------------------------------------------------------------------------------------------
# Probes: each returns what it sent, its check, figures and notes (abuse_probes.py)
# ---------------------------------------------------------------------------------------------


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
