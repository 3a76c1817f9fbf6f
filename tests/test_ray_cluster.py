"""Ray as docs/cluster.md says to run it (issue 57): a head from `ray start` in its own process, the app
and the CLI in others, on 127.0.0.1 only; token authentication (Ray 2.60 turns it on for a head
started where a token exists) and each way a head refuses, in one line.

The heads run in their own sessions (`start_new_session`), with their own `--temp-dir`, HOME (so the
user's ~/.ray is never read or written) and ports; they are stopped by killing the processes of that
session and those naming that temp dir, never with `ray stop` (which stops every cluster of the user).
Nothing here imports `ray` into the test process (test_ray.py's cluster must be the first to). The
mapping of refusals to their lines is also tested without Ray, against a stand-in gRPC head.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from concurrent import futures
from pathlib import Path

import pytest
from helpers import wait_for, write_picture

from hidream_ui.bench import free_port
from hidream_ui.engine import ray_env
from hidream_ui.engine.ray_env import RayUnavailable, check_cluster, connect_error, refusal

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
STEPS_LONG = 200  # the most an edit may have: long enough to be stopped in the middle


# ---------------------------------------------------------------------------------------------- processes


def _environment(home: Path, cache: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a child, without anything of Ray's that would change what is tested."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "HIDREAM_RAY"))}
    return {**env, "HOME": str(home), "HIDREAM_MODEL_CACHE": str(cache), "PYTHONPATH": str(ROOT), **extra}


def _session_pids(sid: int) -> set[int]:
    import psutil

    pids = set()
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == sid:
                pids.add(process.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return pids


class RayHead:
    """`ray start --head` on 127.0.0.1 in a session of its own; `stop()` ends that session's processes."""

    def __init__(self, home: Path, cache: Path, token: str | None):
        self.home, self.token = home, token
        if token is not None:  # where `ray start` finds it (and then turns token authentication on)
            (home / ".ray").mkdir(parents=True)
            (home / ".ray" / "auth_token").write_text(token)
        self.temp_dir = tempfile.mkdtemp(prefix="hray", dir="/tmp")  # short: Ray's socket paths must fit
        self.port = free_port()
        ports = {
            name: free_port() for name in ("ray-client-server", "dashboard", "dashboard-agent-listen", "metrics-export")
        }
        command = [
            RAY,
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={self.port}",
            # Logical CPUs: the app's two replicas hold one each while it runs, and a manifest's Ray Data
            # actors need their own (with two, a manifest run beside the app would wait for ever).
            "--num-cpus=4",
            "--disable-usage-stats",
            "--include-dashboard=false",
            f"--temp-dir={self.temp_dir}",
            *(f"--{name}-port={port}" for name, port in ports.items()),
        ]
        # As docs/cluster.md's one-machine quick start: Ray binds the head to 127.0.0.1 only with this.
        env = _environment(home, cache, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        process = subprocess.Popen(
            command, env=env, cwd=home, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self.sid = process.pid  # the session `ray start` leads; its daemons stay in it after it exits
        output, _ = process.communicate(timeout=180)
        self.log = output.decode(errors="replace")
        if process.returncode != 0:
            self.stop()
            raise AssertionError(f"ray start failed:\n{self.log}")
        self.address = f"127.0.0.1:{self.port}"

    def pids(self) -> set[int]:
        return _session_pids(self.sid)

    def stop(self) -> None:
        import psutil

        ours = os.getsid(0)
        victims = [psutil.Process(pid) for pid in self.pids() if pid != os.getpid()]
        for process in psutil.process_iter(["cmdline"]):
            try:
                named = self.temp_dir in " ".join(process.info["cmdline"] or ())
                if named and process.pid != os.getpid() and os.getsid(process.pid) != ours:
                    victims.append(process)
            except (ProcessLookupError, PermissionError):
                continue
        for process in victims:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(victims, timeout=30)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class App:
    """`python app.py --ray ADDRESS ...` in a process (and session) of its own."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.port = free_port()
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "app.py", *args, "--port", str(self.port)],
            cwd=ROOT,
            env=env,
            start_new_session=True,
            stdout=open(log, "wb"),  # noqa: SIM115 - the child holds it
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}/"

    def wait_ready(self, timeout: float = 240) -> None:
        def up() -> bool:
            assert self.process.poll() is None, self.log.read_text()
            try:
                return urllib.request.urlopen(self.url, timeout=5).status == 200
            except OSError:
                return False

        wait_for(up, "the app to serve", timeout=timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # the app deletes its replicas on the way out
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        for pid in _session_pids(self.process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue


def _refused(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """An app that should refuse at start: its exit code and its output."""
    done = subprocess.run(
        [sys.executable, "app.py", *args, "--port", str(free_port())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return done.returncode, done.stdout + done.stderr


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def token_head(tiny_cache, tmp_path_factory):
    head = RayHead(tmp_path_factory.mktemp("head_home"), tiny_cache, token=secrets.token_hex(32))
    try:
        assert "Token authentication is enabled" in head.log, head.log
        yield head
    finally:
        head.stop()


@pytest.fixture(scope="module")
def client_home(tmp_path_factory) -> Path:
    """The app's HOME: no ~/.ray, so a token can come only from what the test gives."""
    return tmp_path_factory.mktemp("client_home")


@pytest.fixture(scope="module")
def token_file(token_head, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("token") / "ray_token"
    path.write_text(token_head.token + "\n")
    return path


@pytest.fixture(scope="module")
def app(token_head, token_file, client_home, tiny_cache, tmp_path_factory):
    folder = tmp_path_factory.mktemp("app")
    env = _environment(client_home, tiny_cache)
    args = ["--ray", token_head.address, "--devices", "cpu,cpu", "--ray-token-file", str(token_file)]
    running = App([*args, "--output-dir", str(folder / "out")], env, folder / "app.log")
    try:
        running.wait_ready()
        running.out = folder / "out"
        yield running
    finally:
        running.stop()


def _edit_args(steps: int, seed: int = 5) -> dict:
    from gradio_client import handle_file

    from hidream_ui.ui.layout import ASSETS_DIR

    return {
        "image": handle_file(str(ASSETS_DIR / "apple.png")),
        "instruction": "make it red",
        "num_inference_steps": steps,
        "working_resolution": "draft" if steps < 10 else "auto",
        "seed": seed,
        "randomize_seed": False,
        "api_name": "/edit",
    }


# ---------------------------------------------------------------------------------------------- the head


@pytest.mark.slow
def test_the_app_edits_through_a_token_head_with_the_token_file(app, token_head):
    from gradio_client import Client

    from hidream_ui.outputs import read_metadata

    client = Client(app.url, verbose=False)
    _, saved, seed, _ = client.predict(**_edit_args(2))
    metadata = read_metadata(saved)
    assert seed == 5 and metadata["engine"].startswith("ray:")
    status = wait_for(
        lambda: (lambda s: s if len(s["devices"]) == 2 else None)(client.predict(api_name="/status")),
        "one /status row per replica",
        timeout=120,
    )
    assert status["cluster"]["address"] == token_head.address and status["cluster"]["replicas"] == 2
    for text in (json.dumps(status), json.dumps(metadata), app.log.read_text()):
        assert token_head.token not in text  # never printed, logged, reported or saved


@pytest.mark.slow
def test_a_cancel_stops_the_replica_after_its_step_and_saves_nothing(app):
    from gradio_client import Client

    client = Client(app.url, verbose=False)

    def calls() -> int:
        return client.predict(api_name="/status")["counters"].get("transformer_calls", 0)

    def idle():
        rows = client.predict(api_name="/status")["devices"]
        return len(rows) == 2 and all(row["state"] == "idle" for row in rows)

    before = calls()
    client.predict(**_edit_args(2, seed=6))
    per_step = (calls() - before) / 2  # transformer calls of one step (the guidance branches)
    saved = set(app.out.rglob("*"))
    start = calls()
    job = client.submit(**_edit_args(STEPS_LONG, seed=7))

    def stepping():
        assert not job.done(), job.outputs()  # the job ended without a cancel: nothing to test
        rows = client.predict(api_name="/status")["devices"]
        return [row for row in rows if row["state"] == "editing" and (row["progress"]["step"] or 0) >= 3]

    wait_for(stepping, "a replica to run three steps of the job", timeout=120)
    job.cancel()
    wait_for(idle, "the replicas to be idle again", timeout=60)
    steps_run = (calls() - start) / per_step
    # Stopped far short of its end (the cancel's trip takes wall time, not steps: see test_ray.py).
    assert 3 <= steps_run < STEPS_LONG // 2, steps_run
    assert set(app.out.rglob("*")) == saved  # nothing saved


@pytest.mark.slow
def test_every_process_of_the_head_and_the_app_listens_on_loopback_only(app, token_head):
    pids = token_head.pids() | _session_pids(app.process.pid)
    listening = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True, timeout=30, check=True).stdout
    ours = []
    for line in listening.splitlines():
        if {int(pid) for pid in re.findall(r"pid=(\d+)", line)} & pids:
            ours.append(line)
    assert len(ours) >= 4, listening  # GCS, raylet, the app's port, the app's Ray worker at least
    assert [line for line in ours if not _is_loopback(line.split()[3].rsplit(":", 1)[0].strip("[]"))] == []


def _is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # "*": every interface
        return False
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # [::ffff:127.0.0.1] too


@pytest.mark.slow
def test_a_manifest_runs_through_the_token_head_with_the_token_file_variable(
    token_head, token_file, client_home, tiny_cache, tmp_path
):
    lines = []
    for seed in range(2):
        write_picture(tmp_path / f"p{seed}.png", seed=seed)
        lines.append({"image": f"p{seed}.png", "instruction": "make it red", "seed": seed, "num_inference_steps": 2})
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    env = _environment(client_home, tiny_cache, HIDREAM_RAY_TOKEN_FILE=str(token_file))
    done = subprocess.run(
        [sys.executable, "-m", "hidream_ui", "batch", "--manifest", str(tmp_path / "m.jsonl")]
        + ["--out", str(tmp_path / "out"), "--ray", token_head.address, "--device", "cpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = json.loads(done.stdout[done.stdout.index("{") :])
    assert done.returncode == 0 and summary["done"] == 2, done.stdout + done.stderr
    rows = [json.loads(row) for row in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert all(row["engine"].startswith("ray-data:") for row in rows), rows
    assert token_head.token not in done.stdout + done.stderr


@pytest.mark.slow
def test_a_head_that_refuses_says_why_in_one_line_at_start(token_head, client_home, tiny_cache, tmp_path):
    env = _environment(client_home, tiny_cache)
    base = ["--ray", token_head.address, "--devices", "cpu,cpu"]
    code, output = _refused(base, env)  # no token anywhere
    assert code == 2 and output.strip().splitlines() == ["error: " + refusal(token_head.address, "no-token").message], (
        output
    )
    wrong = tmp_path / "wrong"
    wrong.write_text(secrets.token_hex(32))
    code, output = _refused([*base, "--ray-token-file", str(wrong)], env)
    assert code == 2 and output.strip().splitlines() == [
        "error: " + refusal(token_head.address, "wrong-token", token=ray_env.Token("", str(wrong))).message
    ], output
    assert wrong.read_text() not in output and token_head.token not in output
    code, output = _refused(base, {**env, "RAY_AUTH_TOKEN": token_head.token[::-1]})  # Ray's own variable
    assert code == 2 and "refused the token in RAY_AUTH_TOKEN" in output and token_head.token[::-1] not in output


@pytest.fixture(scope="module")
def open_head(tiny_cache, tmp_path_factory):
    """A head started where no token exists: Ray leaves authentication off."""
    head = RayHead(tmp_path_factory.mktemp("open_home"), tiny_cache, token=None)
    try:
        assert "Token authentication is disabled" in head.log, head.log
        yield head
    finally:
        head.stop()


@pytest.mark.slow
def test_a_head_without_authentication_serves_a_manifest(open_head, client_home, tiny_cache, tmp_path):
    write_picture(tmp_path / "p.png", seed=1)
    line = {"image": "p.png", "instruction": "make it red", "seed": 1, "num_inference_steps": 2}
    (tmp_path / "m.jsonl").write_text(json.dumps(line) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "hidream_ui", "batch", "--manifest", str(tmp_path / "m.jsonl")]
        + ["--out", str(tmp_path / "out"), "--ray", open_head.address, "--device", "cpu"],
        cwd=ROOT,
        env=_environment(client_home, tiny_cache),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and json.loads(done.stdout[done.stdout.index("{") :])["done"] == 1, done.stderr


_SET_VERSION = """
import json, sys
from ray._raylet import GcsClient
gcs = GcsClient(address=sys.argv[1])
record = json.loads(gcs.internal_kv_get(b"CLUSTER_METADATA", namespace=b"cluster"))
print(json.dumps(record))
record.update(json.loads(sys.argv[2]))
gcs.internal_kv_put(b"CLUSTER_METADATA", json.dumps(record).encode(), True, namespace=b"cluster")
"""


@pytest.mark.slow
def test_a_head_of_another_ray_version_is_refused_in_one_line(open_head, client_home, tiny_cache):
    """The head's version record, as a head of Ray 2.59 would have written it (the record `ray.init`
    itself checks): the app refuses at start with Ray's two versions in one line."""
    env = _environment(client_home, tiny_cache)

    def set_version(values: dict) -> dict:
        done = subprocess.run(
            [sys.executable, "-c", _SET_VERSION, open_head.address, json.dumps(values)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    original = set_version({"ray_version": "2.59.0"})
    try:
        code, output = _refused(["--ray", open_head.address, "--devices", "cpu"], env)
    finally:
        set_version({"ray_version": original["ray_version"]})
    python = original["python_version"]
    assert code == 2 and output.strip().splitlines() == [
        f"error: --ray {open_head.address}: version mismatch: the cluster runs Ray 2.59.0 on Python {python}, "
        f"this process Ray {original['ray_version']} on Python {python}: run the app with the cluster's Ray and "
        f"Python (requirements-ray.txt pins ray=={ray_env.RAY_VERSION})"
    ], output


# ---------------------------------------------------------------------------------------------- without Ray


class _StandInHead:
    """A gRPC server answering the GCS's first call as a head with token authentication does."""

    def __init__(self, token: str | None):
        import grpc

        def answer(request, context):
            sent = dict(context.invocation_metadata()).get("authorization")
            if token is not None and sent != f"Bearer {token}":
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken: missing or incorrect")
            return b"cluster-id"

        handler = grpc.method_handlers_generic_handler(
            "ray.rpc.NodeInfoGcsService", {"GetClusterId": grpc.unary_unary_rpc_method_handler(answer)}
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


@pytest.fixture
def stand_in():
    started = []

    def start(token: str | None) -> _StandInHead:
        started.append(_StandInHead(token))
        return started[-1]

    yield start
    for head in started:
        head.server.stop(None)


def test_the_mode_and_the_token_follow_what_the_head_wants(stand_in, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    secret = secrets.token_hex(16)
    head = stand_in(secret)
    environ: dict[str, str] = {}
    with pytest.raises(RayUnavailable) as refused:
        check_cluster(head.address, environ=environ)
    assert str(refused.value) == refusal(head.address, "no-token").message
    assert "--ray-token-file PATH" in str(refused.value) and "RAY_AUTH_TOKEN" in str(refused.value)
    with pytest.raises(RayUnavailable, match="refused the token in RAY_AUTH_TOKEN") as refused:
        check_cluster(head.address, environ={"RAY_AUTH_TOKEN": "not-it"})
    assert "not-it" not in str(refused.value)
    token_file = tmp_path / "token"
    token_file.write_text(secret + "\n")
    environ = {"RAY_AUTH_TOKEN": "not-it"}  # the flag is explicit: it wins over Ray's variable
    assert check_cluster(head.address, token_file, environ) == "token"
    assert environ == {"RAY_AUTH_TOKEN_PATH": str(token_file.resolve()), "RAY_AUTH_MODE": "token"}
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(secret)  # Ray's own file, as `ray start` reads it
    environ = {}
    assert check_cluster(head.address, environ=environ) == "token" and environ == {"RAY_AUTH_MODE": "token"}
    open_one = stand_in(None)
    environ = {}
    assert check_cluster(open_one.address, environ=environ) == "open" and environ == {}  # mode left to Ray


def test_each_refusal_is_one_line_naming_its_cause(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(RayUnavailable) as refused:
        check_cluster(address, environ={})
    assert str(refused.value) == refusal(address, "nothing-listening").message
    assert "nothing is listening" in str(refused.value) and f"--port={address.rsplit(':', 1)[1]}" in str(refused.value)
    for kind in ray_env.REFUSALS:
        message = refusal("10.0.0.5:6379", kind, "detail", ray_env.Token("s3cret", "/etc/ray/token")).message
        assert message.startswith("--ray 10.0.0.5:6379: ") and "\n" not in message and "s3cret" not in message
    mismatch = RuntimeError(
        "Version mismatch: The cluster was started with:\n    Ray: 2.59.0\n    Python: 3.11.7\n"
        "This process on node 127.0.0.1 was started with:\n    Ray: 2.60.0\n    Python: 3.12.1\n"
    )
    assert "the cluster runs Ray 2.59.0 on Python 3.11.7, this process Ray 2.60.0 on Python 3.12.1" in (
        connect_error("h:1", mismatch)
    )
    assert connect_error("h:1", ConnectionError("Failed to connect to Ray cluster at h:1\nmore")) == (
        "--ray h:1: cannot connect to the Ray cluster: Failed to connect to Ray cluster at h:1"
    )
    assert "no token" in connect_error("h:1", type("AuthenticationError", (Exception,), {})("x"))
    unreadable = tmp_path / "missing"
    with pytest.raises(RayUnavailable, match=f"--ray-token-file {unreadable}: cannot read the token file"):
        check_cluster("auto", unreadable, environ={})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(RayUnavailable, match="the token file is empty"):
        ray_env.use_token_file(tmp_path / "empty", {})


def test_the_token_never_shows_in_a_repr_and_the_flag_keeps_only_its_path(tmp_path):
    from hidream_ui.config import from_args

    assert "s3cret" not in repr(ray_env.Token("s3cret", "RAY_AUTH_TOKEN"))
    config = from_args(["--ray", "127.0.0.1:6391", "--ray-token-file", str(tmp_path / "t")], {})
    assert config.ray_token_file == tmp_path / "t"
    from_env = from_args([], {"HIDREAM_RAY_TOKEN_FILE": "~/t"})
    assert from_env.ray_token_file == Path("~/t").expanduser()
    assert [ray_env.gcs_endpoint(a) for a in ("127.0.0.1:6391", "auto", "local", "ray://h:10001", "[::1]:7")] == [
        ("127.0.0.1", 6391),
        None,
        None,
        None,
        ("::1", 7),
    ]


def test_the_app_and_batch_take_the_token_flag():
    from hidream_ui.cli import batch as batch_cli
    from hidream_ui.cli.app import build_parser

    assert build_parser().parse_args(["--ray-token-file", "t"]).ray_token_file == "t"
    parsed = batch_cli._parser().parse_args(["--manifest", "m", "--out", "o", "--ray-token-file", "t"])
    assert parsed.ray_token_file == "t"


@pytest.mark.slow
def test_bench_cluster_takes_the_token_flag_and_refuses_in_one_line(tmp_path, client_home, tiny_cache):
    (tmp_path / "token").write_text("s3cret")
    address = f"127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "hidream_ui", "bench", "cluster", "--json", "--ray", address]
        + ["--ray-token-file", str(tmp_path / "token")],
        cwd=ROOT,
        env=_environment(client_home, tiny_cache),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 1 and done.stdout.strip().splitlines() == [
        "error: " + refusal(address, "nothing-listening").message
    ], done.stdout + done.stderr
