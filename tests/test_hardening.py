"""The app in front of strangers: file access, limits, queue share, cancellation, disk, login.

Every test drives the real app (conftest.launch_app) over HTTP, through gradio_client or raw
httpx as an attacker would, on the offline tiny model. Long edits (200 steps) are the "busy
server"; they are always cancelled, so the module stays fast.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from helpers import wait_for, write_picture
from PIL import Image

from hidream_ui.server import gradio_internals
from hidream_ui.server.upload_gate import NOT_UPLOADED
from hidream_ui.ui.layout import ASSETS_DIR

EXAMPLE = ASSETS_DIR / "apple.png"
FAST = {"num_inference_steps": 2, "working_resolution": "draft"}
SLOW = {"num_inference_steps": 200, "working_resolution": "draft"}


def results(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.png"))


@pytest.fixture(scope="module")
def app(launch_app):
    return launch_app(
        "hardening", max_queue=12, max_jobs_per_client=2, cache_max_files=16, max_upload_mb=1, max_pixels=2_000_000
    )


@pytest.fixture(scope="module")
def client(app):
    return Client(app["url"], verbose=False)


@pytest.fixture(autouse=True)
def idle_engine(app):
    """Every test starts and ends with nothing running (a failed test must not block the next)."""
    yield
    for job in app["demo"].hidream_services.jobs.running():
        job.token.cancel("test teardown")
    wait_for(lambda: app["engine"].status().state == "idle", what="the engine to go idle")


def raw_call(url: str, api: str, data: list, session: str = "raw-client") -> dict:
    """A raw REST call (`/gradio_api/call/<api>`), as curl would make it; returns the last SSE event."""
    with httpx.Client(base_url=url, timeout=60) as http:
        posted = http.post(f"/gradio_api/call/{api}", json={"data": data, "session_hash": session})
        assert posted.status_code == 200, posted.text
        event_id = posted.json()["event_id"]
        text = http.get(f"/gradio_api/call/{api}/{event_id}").text
    events = [line for line in text.splitlines() if line.startswith(("event:", "data:"))]
    kind = [line.split(":", 1)[1].strip() for line in events if line.startswith("event:")][-1]
    payload = [line.split(":", 1)[1].strip() for line in events if line.startswith("data:")][-1]
    return {"event": kind, "data": json.loads(payload) if payload not in ("", "null") else None, "text": text}


# ---------------------------------------------------------------------------------------------
# Files: a client reads only what it uploaded; only results are served
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "api, data",
    [
        ("edit", lambda f: [f, "make it blue", "", 3.0, 1.5, 2, 0.3, True, "draft", 1, False, True, False]),
        ("compare", lambda f: [f, "make it blue", "seed", "1", "none", "", "", 3.0, 1.5, 2, 0.3, True, "draft", 1]),
        (
            "batch_edit",
            lambda f: [[f], "make it blue", "matrix", "", 3.0, 1.5, 2, 0.3, True, "draft", 1, "fixed", 0, False],
        ),
    ],
)
@pytest.mark.slow
@pytest.mark.parametrize("meta", [None, {"_type": "gradio.FileData"}], ids=["no-meta", "file-meta"])
def test_a_server_path_from_a_raw_client_is_refused_without_saying_whether_it_exists(app, tmp_path, api, data, meta):
    secret = write_picture(tmp_path / "secret.png", 7)  # a real image the server can read
    edits = app["engine"].counters["edits"]
    messages = []
    for path in (str(secret), str(tmp_path / "missing.png"), "/etc/passwd", str(EXAMPLE.parent / ".." / "README.md")):
        value = {"path": path, **({"meta": meta} if meta else {})}
        answer = raw_call(app["url"], api, data(value))
        assert answer["event"] == "error", answer["text"]
        # The path the client sent may be echoed back; nothing else may differ between them.
        messages.append(json.dumps(answer["data"]).replace(path, "<path>"))
    assert len(set(messages)) == 1, messages
    for leak in ("not an existing file", "recognised image", "damaged", "too large", "no such file"):
        assert leak not in messages[0]
    if meta is None and api != "batch_edit":  # the rest gradio itself refuses before our handler
        assert NOT_UPLOADED.split(" (")[0] in messages[0]
    assert app["engine"].counters["edits"] == edits


def test_a_file_in_the_apps_own_cache_that_nobody_uploaded_is_refused(app):
    """Gradio accepts (and records) any path inside its cache folder that a client names, with the
    FileData marker or without: only uploads through this app and the examples may be opened."""
    planted = app["demo"].hidream_services.cache_folder / "planted" / "secret.png"
    planted.parent.mkdir(parents=True, exist_ok=True)
    write_picture(planted, 9)
    edits = app["engine"].counters["edits"]
    for value in ({"path": str(planted)}, {"path": str(planted), "meta": {"_type": "gradio.FileData"}}):
        answer = raw_call(
            app["url"], "edit", [value, "make it blue", "", 3.0, 1.5, 2, 0.3, True, "draft", 1, False, True, False]
        )
        assert answer["event"] == "error" and NOT_UPLOADED.split(" (")[0] in json.dumps(answer["data"])
    assert app["engine"].counters["edits"] == edits


@pytest.mark.slow
def test_no_event_serves_a_server_file_a_client_names(app, tmp_path):
    """Every event of the app, private ones included (the Compare tab's slider pickers, History),
    sent a raw server path in every input, as a file and as a gallery entry: none may hand the
    file back. The secret sits where gradio would copy from (the temp folder)."""
    import uuid

    marker = f"secret-{uuid.uuid4().hex}".encode()
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"\x89PNG\r\n\x1a\n" + marker)
    forged = ({"path": str(secret)}, [{"image": {"path": str(secret)}, "caption": "x"}])
    with httpx.Client(base_url=app["url"], timeout=30) as http:
        dependencies = http.get("/config").json()["dependencies"]
        for index, dependency in enumerate(dependencies):
            if dependency.get("api_name") in ("edit", "compare", "batch_edit", "edit_rewritten"):
                continue  # queued device work: covered by the raw-path tests above
            for value in forged:
                answer = http.post(
                    "/gradio_api/run/predict",
                    json={
                        "fn_index": index,
                        "data": [value] * len(dependency.get("inputs", [])),
                        "session_hash": "probe",
                    },
                )
                for url in set(re.findall(r'"url":\s*"([^"]+)"', answer.text)):
                    fetched = http.get(url if url.startswith("http") else url)
                    assert marker not in fetched.content, (index, url)


@pytest.mark.slow
def test_uploads_and_bundled_examples_still_work(client, app):
    # handle_file uploads the file first (gradio stores it for this app): accepted.
    (before, after), saved, seed, _ = client.predict(
        image=handle_file(str(EXAMPLE)), instruction="make it blue", **FAST, api_name="/edit"
    )
    assert Path(saved).is_file() and seed >= 0
    # An app without login names model folders in the results it hands out, never their paths.
    from hidream_ui.outputs import read_metadata

    for value in read_metadata(saved)["model_paths"].values():
        assert not (isinstance(value, str) and os.path.isabs(value)), value
    # The bundled examples are trusted by path (the browser sends them without an upload).
    assert app["demo"].hidream_services.gate.allows(EXAMPLE)


def test_only_results_the_app_wrote_are_served_from_the_output_folder(client, app):
    output_dir = Path(app["config"].output_dir).resolve()
    _, saved, _, _ = client.predict(
        image=handle_file(str(EXAMPLE)), instruction="make it red", **FAST, api_name="/edit"
    )
    result = sorted(output_dir.glob("*.png"))[-1]
    private = output_dir / "operator-notes.txt"
    private.write_text("not for visitors")
    foreign = write_picture(output_dir / "someone-elses.png", 3)
    sidecar = result.with_suffix(".json")
    with httpx.Client(base_url=app["url"], timeout=30) as http:
        assert http.get(f"/gradio_api/file={result}").status_code == 200
        for path in (private, foreign, sidecar, output_dir):
            assert http.get(f"/gradio_api/file={path}").status_code in (403, 404), path


def test_an_upload_over_the_size_limit_is_refused_before_it_is_stored(app, tmp_path):
    big = tmp_path / "big.png"
    big.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(int(1.5 * 1024 * 1024)))  # 1.5 MB > --max-upload-mb 1
    with httpx.Client(base_url=app["url"], timeout=30) as http:
        with big.open("rb") as fp:
            answer = http.post("/gradio_api/upload", files={"files": ("big.png", fp, "image/png")})
    assert answer.status_code == 413, answer.text
    assert "maximum allowed size" in answer.text


def test_an_upload_request_over_its_total_size_is_refused(app):
    # Each file is under --max-upload-mb (1 MB), the request is over 8 of them in all.
    files = [("files", (f"part{i}.png", b"\x89PNG" + os.urandom(900_000), "image/png")) for i in range(10)]
    with httpx.Client(base_url=app["url"], timeout=60) as http:
        answer = http.post("/gradio_api/upload", files=files)
    assert answer.status_code == 413 and "in all" in answer.json()["detail"]


def test_an_image_over_the_pixel_limit_is_refused_from_its_header(client, app, tmp_path):
    # 2000 x 1200 = 2.4 MP > --max-pixels 2 MP; a flat 1-bit PNG of a few KB.
    huge = tmp_path / "huge.png"
    Image.new("1", (2000, 1200)).save(huge)
    assert huge.stat().st_size < 50_000
    edits = app["engine"].counters["edits"]
    with pytest.raises(AppError) as info:
        client.predict(image=handle_file(str(huge)), instruction="make it blue", **FAST, api_name="/edit")
    assert "too large" in str(info.value) and "2,000,000" in str(info.value)
    assert app["engine"].counters["edits"] == edits


# ---------------------------------------------------------------------------------------------
# Queue: status always answers, one client holds at most its share
# ---------------------------------------------------------------------------------------------


def submit_slow(client: Client, seed: int = 1):
    return client.submit(
        image=handle_file(str(EXAMPLE)), instruction=f"slow edit {seed}", seed=seed, **SLOW, api_name="/edit"
    )


@pytest.mark.slow
def test_status_answers_within_a_second_while_the_queue_is_full(app):
    limit = app["config"].max_queue
    clients = [Client(app["url"], verbose=False) for _ in range(limit // 2 + 1)]
    jobs = [submit_slow(c, i) for c in clients for i in range(2)]  # one running + a full queue
    try:
        wait_for(lambda: app["engine"].status().state == "editing", what="the first slow edit to start")
        wait_for(
            lambda: (gradio_internals.queue_figures(app["demo"], "device") or {}).get("waiting", 0) == limit,
            what="the queue to fill",
        )
        extra = Client(app["url"], verbose=False)
        with pytest.raises(Exception, match="(?i)queue is full"):
            submit_slow(extra).result(timeout=30)
        for _ in range(5):
            started = time.perf_counter()
            status = extra.predict(api_name="/status")
            assert time.perf_counter() - started < 1.0
            assert status["state"] == "editing" and status["queue"]["waiting"] == limit
    finally:
        for job in jobs:
            job.cancel()


@pytest.mark.slow
def test_one_client_cannot_hold_more_than_its_share_of_the_queue(app):
    clients = [Client(app["url"], verbose=False) for _ in range(3)]
    jobs = {}
    try:
        for index, c in enumerate(clients):
            jobs[index] = [submit_slow(c, seed) for seed in range(2)]
            wait_for(
                lambda c=c: gradio_internals.session_jobs(app["demo"], c.session_hash, "device") == 2,
                what="both jobs queued",
            )
            with pytest.raises(Exception, match="already have 2 job"):
                submit_slow(c, 9).result(timeout=30)
        # Everyone got exactly two places: nobody was starved by the first client.
        assert [gradio_internals.session_jobs(app["demo"], c.session_hash, "device") for c in clients] == [2, 2, 2]
    finally:
        for pair in jobs.values():
            for job in pair:
                job.cancel()


# ---------------------------------------------------------------------------------------------
# Cancellation: one token, set by Job.cancel(), /cancel, Stop and a disconnect
# ---------------------------------------------------------------------------------------------


def running_job(app, kind: str):
    return wait_for(
        lambda: next((j for j in app["demo"].hidream_services.jobs.running() if j.kind == kind), None),
        what=f"a running {kind} job",
    )


@pytest.mark.slow
def test_job_cancel_stops_a_200_step_edit_within_one_step_and_saves_nothing(app):
    c = Client(app["url"], verbose=False)
    before = results(Path(app["config"].output_dir))
    job = submit_slow(c, 5)
    running = running_job(app, "edit")
    wait_for(lambda: running.token.step >= 3, what="three steps")
    started = time.perf_counter()
    job.cancel()
    cancel_seconds = time.perf_counter() - started
    wait_for(lambda: running not in app["demo"].hidream_services.jobs.running(), what="the edit to end")
    token = running.token
    assert token.reason == "cancelled by the client"
    assert token.step - token.cancelled_at_step <= 1, (token.cancelled_at_step, token.step)
    assert token.step < 200
    assert cancel_seconds < 5  # the client's cancel call no longer waits for the whole edit
    assert results(Path(app["config"].output_dir)) == before


@pytest.mark.slow
def test_the_public_cancel_api_stops_only_the_callers_job(app):
    mine, theirs = Client(app["url"], verbose=False), Client(app["url"], verbose=False)
    job = submit_slow(mine, 6)
    running = running_job(app, "edit")
    assert theirs.predict(api_name="/cancel") == "nothing of yours is running"
    # A raw cancel that knows the session but not the event stops nothing either.
    with httpx.Client(base_url=app["url"], timeout=30) as http:
        http.post("/gradio_api/cancel", json={"session_hash": mine.session_hash, "fn_index": 0})
    assert not running.token.cancelled
    assert mine.predict(api_name="/cancel") == "stopped 1 job(s)"
    assert running.token.cancelled and running.token.reason == "cancelled through /cancel"
    with pytest.raises(Exception):  # noqa: B017 - whatever gradio_client raises for a cancelled job
        job.result(timeout=60)  # the edit ends as cancelled, with no result


@pytest.mark.slow
def test_a_cancelled_batch_keeps_its_finished_items(app, tmp_path):
    c = Client(app["url"], verbose=False)
    output_dir = Path(app["config"].output_dir)
    before = set(results(output_dir))
    sources = [handle_file(str(write_picture(tmp_path / f"b{i}.png", i))) for i in range(3)]
    job = c.submit(
        files=sources,
        instructions="make it teal",
        mode="matrix",
        seed=1,
        seed_policy="increment",
        batch_size=1,
        num_inference_steps=30,
        working_resolution="draft",
        api_name="/batch_edit",
    )
    running = running_job(app, "batch")
    wait_for(lambda: len(set(results(output_dir)) - before) >= 1, what="the first item")
    job.cancel()
    wait_for(lambda: running not in app["demo"].hidream_services.jobs.running(), what="the batch to end")
    finished = set(results(output_dir)) - before
    assert 1 <= len(finished) < 3  # the finished item stays, the rest never ran
    assert running.token.reason == "cancelled by the client"


def test_a_client_that_goes_away_stops_its_edit(app):
    """Raw queue protocol: join, read a few progress messages, drop the event stream."""
    session = "leaving-client"
    with httpx.Client(base_url=app["url"], timeout=60) as http:
        upload = http.post("/gradio_api/upload", files={"files": ("apple.png", EXAMPLE.read_bytes(), "image/png")})
        path = upload.json()[0]
        fn_index = next(
            i for i, dep in enumerate(http.get("/config").json()["dependencies"]) if dep.get("api_name") == "edit"
        )
        data = [
            {"path": path, "meta": {"_type": "gradio.FileData"}, "orig_name": "apple.png"},
            "leave me",
            "",
            3.0,
            1.5,
            200,
            0.3,
            True,
            "draft",
            4,
            False,
            True,
            False,
        ]
        joined = http.post("/gradio_api/queue/join", json={"data": data, "fn_index": fn_index, "session_hash": session})
        assert joined.status_code == 200, joined.text
        with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as stream:
            lines = stream.iter_lines()
            running = running_job(app, "edit")
            wait_for(lambda: running.token.step >= 2, what="two steps")
            next(lines)
        # The stream is closed: gradio marks the event dead; the token sees it at the next step.
    wait_for(lambda: running.token.cancelled, "the edit to notice", timeout=30)
    assert running.token.reason == "the client went away"
    wait_for(lambda: app["engine"].status().state == "idle", what="idle")
    assert running.token.step < 200


# ---------------------------------------------------------------------------------------------
# Disk: gradio's cache stays bounded
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gradios_cache_stays_within_the_file_limit_after_30_edits(client, app):
    services = app["demo"].hidream_services
    for seed in range(30):
        client.predict(image=handle_file(str(EXAMPLE)), instruction="make it blue", seed=seed, **FAST, api_name="/edit")
    services.janitor.run_once()  # the janitor runs every few seconds; this is the same call
    cached = gradio_internals.app_cache_files(app["demo"], services.cache_folder)
    assert len(cached) <= app["config"].cache_max_files
    assert all(os.path.isfile(f) for f in cached)
    assert services.cache_folder.name.startswith("hidream-ui-gradio-")  # not the shared /tmp/gradio


def test_status_without_login_shows_no_absolute_paths(client, app):
    status = client.predict(api_name="/status")
    text = json.dumps(status)
    assert str(Path(app["config"].output_dir).resolve()) not in text
    for value in (status.get("model_paths") or {}).values():
        assert not (isinstance(value, str) and os.path.isabs(value)), value


# ---------------------------------------------------------------------------------------------
# Login: with --auth everything needs it, and guessing is throttled
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def private_app(launch_app):
    return launch_app("hardening_auth", auth=("booth", "s3cret-pass"), max_login_failures=3)


@pytest.mark.slow
def test_after_login_status_answers(private_app):
    logged = Client(private_app["url"], auth=("booth", "s3cret-pass"), verbose=False)
    status = logged.predict(api_name="/status")
    assert status["model_source"] == "tiny"


@pytest.mark.slow
def test_with_auth_status_needs_login_and_parallel_guessing_is_throttled(private_app):
    with httpx.Client(base_url=private_app["url"], timeout=30) as http:
        anonymous = http.post("/gradio_api/run/status", json={"data": []})
        assert anonymous.status_code in (401, 403)
    codes = []

    def guess(i: int) -> None:
        with httpx.Client(base_url=private_app["url"], timeout=30) as http:
            codes.append(http.post("/login", data={"username": "booth", "password": f"guess{i}"}).status_code)

    threads = [threading.Thread(target=guess, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Every attempt counts from the moment it arrives: parallel guesses get no more tries.
    assert sorted(codes) == [400] * 3 + [429] * 9, codes
    with httpx.Client(base_url=private_app["url"], timeout=30) as http:
        throttled = http.post("/login", data={"username": "booth", "password": "s3cret-pass"})
    assert throttled.status_code == 429 and "try again" in throttled.json()["detail"]
