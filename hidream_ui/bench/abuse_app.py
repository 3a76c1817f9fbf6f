"""The app under test of `bench abuse`: `python -m hidream_ui app` (or abuse_child.py) in a child
process on a free 127.0.0.1 port, its temporary folders, and the figures the probes read from it
(RSS, CPU, cache files). It talks to no probe; abuse_client.py is how the probes talk to it."""

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
from pathlib import Path

from hidream_ui.bench import free_port

_MB = 1024 * 1024
REPO_ROOT = Path(__file__).resolve().parents[2]
APP_START_TIMEOUT = 90.0
# The honest client's own address: another client in the server's eyes (its storage, its quotas and its
# new-session limit are keyed on the address), so that "another client's files" means what it says.
# Linux answers on all of 127.0.0.0/8; where only 127.0.0.1 does, every client shares it (`client_address`).
HONEST_ADDRESS = "127.0.0.2"
# Gradio's session table is capped at this many sessions by the child launcher (abuse_child.py).
SESSION_CAPACITY_ENV = "BENCH_ABUSE_SESSION_CAPACITY"
SESSION_LOG_ENV = "BENCH_ABUSE_SESSION_LOG"


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
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("HIDREAM_", "GRADIO_")) or k in ("HIDREAM_MODEL_CACHE", "HIDREAM_UI_CACHE")
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
