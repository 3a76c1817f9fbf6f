"""Issue 19, findings 4 and 5: per-client storage and capped client names.

Over raw HTTP against the launched app (conftest.launch_app), as an attacker would: two clients are
two source addresses on the loopback (127.0.0.1 and 127.0.0.2, ...: the app charges an upload to the
address that sent it). The janitor's round is run directly (`services.janitor.run_once()`, the very
call its timer makes every few seconds) so that no test waits on a clock.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import types
from pathlib import Path

import httpx
import pytest
from helpers import raw_edit, run_info, wait_for
from PIL import Image, PngImagePlugin

from hidream_ui.ui.layout import ASSETS_DIR

EXAMPLE = ASSETS_DIR / "apple.png"
FILE_META = {"_type": "gradio.FileData"}


@pytest.fixture(scope="module")
def app(launch_app):
    # Small limits: a client keeps at most 8 files / 2 MB; the cache at most 40 files.
    return launch_app(
        "storage",
        max_queue=8,
        max_jobs_per_client=2,
        max_upload_mb=1,
        cache_max_files=40,
        cache_max_mb=50,
        client_quota_files=8,
        client_quota_mb=2,
    )


def client(app, address: str = "127.0.0.1", timeout: float = 60) -> httpx.Client:
    """A raw HTTP client whose connections come from `address` (any 127.x.y.z reaches the app)."""
    return httpx.Client(base_url=app["url"], timeout=timeout, transport=httpx.HTTPTransport(local_address=address))


def cache_folder(app) -> Path:
    return app["demo"].hidream_services.cache_folder


def spool_files(app) -> list[Path]:
    """Gradio's multipart spool files: `tmp*` at the top of the cache folder while an upload arrives."""
    return [p for p in cache_folder(app).iterdir() if p.is_file() and p.name.startswith("tmp")]


def all_files(app) -> set[Path]:
    return {p for p in cache_folder(app).rglob("*") if p.is_file()}


def edit_call(http: httpx.Client, path: str, name: str, session: str, seed: int = 1) -> dict:
    """A raw queued edit (`/gradio_api/call/edit`); returns {"event", "data"} of its last SSE event."""
    return raw_edit(http, path, name, session, seed=seed)


def result_urls(data: list) -> list[str]:
    """The file URLs an edit's answer hands its client (the slider's two images, the download)."""
    urls: list[str] = []

    def walk(value):
        if isinstance(value, dict):
            if isinstance(value.get("url"), str):
                urls.append(value["url"])
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(data[:2])
    return urls


def upload_one(http: httpx.Client, name: str, content: bytes) -> tuple[int, str]:
    """(status, text) of a one-file upload; a connection the server dropped counts as a 500."""
    try:
        answer = http.post("/gradio_api/upload", files={"files": (name, content, "image/png")})
    except httpx.RemoteProtocolError as exc:
        return 500, str(exc)
    return answer.status_code, answer.text


def fetch(http: httpx.Client, url: str) -> int:
    path = url.split("/gradio_api/", 1)[1]
    return http.get(f"/gradio_api/{path}").status_code


# ---------------------------------------------------------------------------------------------
# Finding 4: one client evicts nobody
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_client_past_its_quota_ages_out_its_own_files_and_evicts_nobody(app):
    janitor = app["demo"].hidream_services.janitor
    storage = janitor.storage
    with client(app, "127.0.0.1") as victim, client(app, "127.0.0.2") as attacker:
        upload = victim.post("/gradio_api/upload", files={"files": ("apple.png", EXAMPLE.read_bytes(), "image/png")})
        assert upload.status_code == 200, upload.text
        victim_upload = upload.json()[0]
        first = edit_call(victim, victim_upload, "apple.png", session="victim")
        assert first["event"] == "complete", first
        urls = result_urls(first["data"])
        assert urls and all(fetch(victim, url) == 200 for url in urls)

        # One request of 300 tiny files: more than a client may keep at all (8), refused whole. Then
        # file by file, past the quota: every one is taken, the attacker's own oldest age out.
        flood = [("files", (f"f{i}.png", b"\x89PNG%d" % i, "image/png")) for i in range(300)]
        refused = attacker.post("/gradio_api/upload", files=flood)
        answers = [upload_one(attacker, f"g{i}.png", b"\x89PNG-%d" % i) for i in range(12)]

        assert [code for code, _ in answers] == [200] * 12, answers
        janitor.run_once()  # the janitor's round, as its timer runs it
        assert storage.usage("address:127.0.0.2")[0] <= 8
        assert Path(json.loads(answers[-1][1])[0]).is_file()  # the newest stays
        assert not Path(json.loads(answers[0][1])[0]).exists()  # the oldest aged out
        assert Path(victim_upload).is_file()
        assert all(fetch(victim, url) == 200 for url in urls), [fetch(victim, url) for url in urls]
        again = edit_call(victim, victim_upload, "apple.png", session="victim", seed=2)
        assert again["event"] == "complete", again  # not "upload it again"

    assert refused.status_code == 413, refused.status_code
    assert "at most 8" in refused.json()["detail"] and "per client" in refused.json()["detail"]


def test_an_upload_cut_at_413_leaves_no_file(app):
    before = all_files(app)

    def body():  # chunked: no Content-Length, so the limit is found while it streams (8 MB in all)
        boundary = b"--xx\r\n"
        for i in range(10):
            yield boundary + f'Content-Disposition: form-data; name="files"; filename="p{i}.png"\r\n'.encode()
            yield b"Content-Type: image/png\r\n\r\n" + b"\x89PNG" + bytes(900_000) + b"\r\n"
        yield b"--xx--\r\n"

    with client(app, "127.0.0.4") as http:
        answer = http.post(
            "/gradio_api/upload", content=body(), headers={"content-type": "multipart/form-data; boundary=xx"}
        )
    assert answer.status_code == 413, answer.text  # over the 2 MB quota (and the 8 MB request limit)
    assert spool_files(app) == []
    assert all_files(app) - before == set()


def test_an_upload_broken_off_midway_leaves_no_file(app):
    host, port = httpx.URL(app["url"]).host, httpx.URL(app["url"]).port
    part = (
        b'--xx\r\nContent-Disposition: form-data; name="files"; filename="half.png"\r\n'
        b"Content-Type: image/png\r\n\r\n\x89PNG" + bytes(200_000)
    )
    head = (
        f"POST /gradio_api/upload HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Content-Type: multipart/form-data; boundary=xx\r\nContent-Length: 900000\r\n\r\n"
    ).encode()
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(head + part)
        wait_for(lambda: spool_files(app), what="the upload's spool file")  # the route is receiving it
    # The connection is closed with the body incomplete.
    wait_for(lambda: not spool_files(app), what="the broken-off upload's spool file to go", timeout=30)


def test_a_file_still_arriving_is_not_pruned(app):
    """45 files in one slow request (more than --cache-max-files 40): none of the spool files is pruned
    while the rest arrives, and the upload ends with an answer, not a server error."""
    janitor = app["demo"].hidream_services.janitor
    release = threading.Event()

    def body():
        for i in range(45):
            yield (
                b'--xx\r\nContent-Disposition: form-data; name="files"; filename="a%d.png"\r\n'
                b"Content-Type: image/png\r\n\r\n\x89PNG-arriving-%d\r\n" % (i, i)
            )
            if i == 43:
                release.wait(60)  # the last file is still to come
        yield b"--xx--\r\n"

    answer = {}

    def send():
        with client(app, "127.0.0.5") as http:
            answer["response"] = http.post(
                "/gradio_api/upload", content=body(), headers={"content-type": "multipart/form-data; boundary=xx"}
            )

    sender = threading.Thread(target=send)
    sender.start()
    try:
        arrived = wait_for(lambda: len(spool_files(app)) >= 44 and spool_files(app), what="44 files received")
        janitor.run_once()
        assert all(path.is_file() for path in arrived)
    finally:
        release.set()
        sender.join(60)
    assert answer["response"].status_code != 500, answer["response"].text


def test_a_running_jobs_upload_is_in_use_and_its_outputs_are_charged_to_its_client(app):
    """Pins the two gradio readings the policy rests on: the files a queued or running event names
    (`gradio_internals.referenced_paths`), and the output copies of a call, charged to its caller
    (`gradio_internals.watch_calls`)."""
    from hidream_ui.server import gradio_internals

    services, storage = app["demo"].hidream_services, app["demo"].hidream_services.janitor.storage
    with client(app, "127.0.0.7") as http:
        upload = http.post("/gradio_api/upload", files={"files": ("apple.png", EXAMPLE.read_bytes(), "image/png")})
        path = upload.json()[0]
        data = [
            {"path": path, "meta": FILE_META, "orig_name": "apple.png"},
            "slowly",
            "",
            3.0,
            1.5,
            200,
            0.3,
            True,
            "draft",
            1,
            False,
            True,
            False,
        ]
        assert http.post("/gradio_api/call/edit", json={"data": data, "session_hash": "busy"}).status_code == 200
        job = wait_for(lambda: services.jobs.running(), what="the edit to run")[0]
        try:
            assert path in gradio_internals.referenced_paths(app["demo"])
        finally:
            job.token.cancel("test over")
        wait_for(lambda: app["engine"].status().state == "idle", what="the engine to go idle")
        done = edit_call(http, path, "apple.png", session="busy-2")
    assert done["event"] == "complete", done
    copies = [value["path"] for value in done["data"][:2] if isinstance(value, dict)]
    assert copies and all(storage.owners(copy) == {"address:127.0.0.7"} for copy in copies)


# ---------------------------------------------------------------------------------------------
# Finding 5: a client's name is capped, retention recognises its own files
# ---------------------------------------------------------------------------------------------


def test_a_megabyte_file_name_is_capped_before_it_reaches_the_metadata(app):
    name = "n" * 1_100_000 + ".png"
    with client(app, "127.0.0.6") as http:
        upload = http.post("/gradio_api/upload", files={"files": ("apple.png", EXAMPLE.read_bytes(), "image/png")})
        outcome = edit_call(http, upload.json()[0], name, session="long-name")
    if outcome["event"] == "refused":  # a body cap of the app refused the request first: nothing saved
        assert outcome["status"] == 413, outcome
        return
    assert outcome["event"] == "complete", outcome
    download = outcome["data"][1]  # the Download button: gradio's copy of the saved PNG, same file name
    png = Path(app["config"].output_dir) / Path(download["path"]).name
    stored = json.loads(png.with_suffix(".json").read_text())["source_name"]
    assert len(stored) <= 255 and stored.endswith(".png")
    assert png.stat().st_size < 200_000
    with Image.open(png) as image:
        assert "hidream_ui" in image.info  # our own reader finds it again


def test_the_gate_and_the_metadata_cap_client_names(tmp_path):
    from hidream_ui.edits import MAX_NAME_CHARS, EditParams, EditResult, Timings
    from hidream_ui.server.upload_gate import UploadGate

    picture = tmp_path / "p.png"
    Image.new("RGB", (8, 8)).save(picture)
    gate = UploadGate(lambda path: True)
    _, name = gate.path({"path": str(picture), "orig_name": "x" * 2_000_000 + ".png"})
    assert len(name) == MAX_NAME_CHARS and name.endswith(".png")
    result = EditResult(
        image=Image.new("RGB", (8, 8)),
        source_image=Image.new("RGB", (8, 8)),
        params=EditParams(instruction="a").validated(),
        working_size=(8, 8),
        source_size=(8, 8),
        timings=Timings(),
        peak_memory_bytes=None,
        info=run_info(),
        source_name="y" * 1_000_000,
    )
    assert len(result.metadata()["source_name"]) == MAX_NAME_CHARS


def test_retention_prunes_its_own_pngs_whose_metadata_pillow_refuses(tmp_path, monkeypatch):
    """A result saved before the cap, with a text chunk Pillow will not read: the name pattern and
    our sidecar say it is ours, so retention counts it and deletes it. Pillow refuses text over
    MAX_TEXT_MEMORY (64 MB: the finding's 68 MB name); lowered to 1 MB here so the test writes 2 MB."""
    from hidream_ui.outputs import prune

    monkeypatch.setattr(PngImagePlugin, "MAX_TEXT_MEMORY", 1024 * 1024)
    info = PngImagePlugin.PngInfo()
    info.add_text("hidream_ui", json.dumps({"format": "hidream_ui/1", "source_name": "z" * 2_000_000}))
    huge = tmp_path / "20240101-000000-000000-s1-0123abcd.png"
    Image.new("RGB", (8, 8)).save(huge, pnginfo=info)
    huge.with_suffix(".json").write_text(
        json.dumps({"format": "hidream_ui/1", "source_name": "z" * 2_000_000}, indent=2)
    )
    with pytest.raises(ValueError):
        Image.open(huge).load()  # Pillow refuses the chunk: this is the file the old retention kept forever
    newer = []
    for second in (1, 2):
        path = tmp_path / f"20240101-00000{second}-000000-s1-0123abcd.png"
        Image.new("RGB", (8, 8)).save(path, pnginfo=_small_info())
        path.with_suffix(".json").write_text(json.dumps({"format": "hidream_ui/1"}, indent=2))
        newer.append(path)
    foreign = tmp_path / "20230101-000000-000000-s1-0123abcd.png"  # our pattern, not ours
    Image.new("RGB", (8, 8)).save(foreign)
    deleted = prune(tmp_path, 2)
    assert deleted == [huge]
    assert not huge.with_suffix(".json").exists() and foreign.exists() and all(p.exists() for p in newer)


def _small_info():
    info = PngImagePlugin.PngInfo()
    info.add_text("hidream_ui", json.dumps({"format": "hidream_ui/1"}))
    return info


# ---------------------------------------------------------------------------------------------
# The policy itself (files.ClientStorage.plan), without a server
# ---------------------------------------------------------------------------------------------


def _storage(**limits):
    from hidream_ui.server.client_storage import ClientStorage
    from hidream_ui.server.storage_limits import StorageLimits

    values = dict(client_bytes=10_000, client_files=3, cache_bytes=100_000, cache_files=5, max_age=100.0, grace=5.0)
    return ClientStorage(StorageLimits(**{**values, **limits}), clock=lambda: 1000.0)


def _entry(path, changed, size=10, spool=False):
    from hidream_ui.server.storage_limits import CacheEntry

    return CacheEntry(path, size, changed, changed, spool)


def test_the_cache_cap_takes_files_charged_to_nobody_then_the_heaviest_clients_oldest():
    storage = _storage(client_files=100)
    a = [f"/c/a{i}" for i in range(4)]  # a: 4 files, its oldest older than anything else
    b = [f"/c/b{i}" for i in range(2)]  # b: 2 files, the newest
    entries = (
        [_entry(p, 900.0 + i) for i, p in enumerate(a)]
        + [_entry("/c/n0", 950.0)]
        + [_entry(p, 960.0 + i) for i, p in enumerate(b)]
    )
    storage.record_upload("address:a", a)
    storage.record_upload("address:b", b)
    # 7 files, cap 5: the file nobody holds goes first, then a's oldest (a is the heaviest), never b's.
    assert storage.plan(entries, now=1000.0) == ["/c/n0", "/c/a0"]
    entries = [e for e in entries if e.path not in ("/c/n0", "/c/a0")]
    storage.forget(["/c/n0", "/c/a0"])
    # Cap 3 now: a (3) and b (2) are both over a fair share; a goes first while it is the heavier.
    assert storage.plan(entries, now=1000.0, max_files=3) == ["/c/a1", "/c/a2"]


def test_a_client_over_its_quota_ages_out_its_own_least_recently_used_files():
    """Issue 58 (HIGH): a client at its quota is not refused, it loses its own oldest files, uploads and
    results alike; a file another client holds too is only taken off its account; a queued job's file
    and the files of its latest job stay."""
    storage = _storage(cache_files=100)
    outputs = [f"/c/b{i}" for i in range(5)]
    entries = [_entry(path, 900.0 + i) for i, path in enumerate(["/c/up0", "/c/shared", *outputs, "/c/queued"])]
    storage.record_upload("address:b", ["/c/up0", "/c/queued"])
    storage.record_call(None, "address:b", 1, "e0", inputs=[], outputs=["/c/shared", *outputs[:4]])
    storage.record_call(None, "address:a", 1, "e1", inputs=[], outputs=["/c/shared"])
    storage.record_call("s-b", "address:b", 1, "e2", inputs=[], outputs=["/c/b4"])  # b's latest job
    # b holds 8 files, quota 3: up0 (its oldest, an upload), then b0..b2 go; the shared file is
    # released to a; b3 (newest unpinned), b4 (latest job) and queued (a running job's) stay.
    victims = storage.plan(entries, referenced=["/c/queued"], now=1000.0)
    assert victims == ["/c/up0", "/c/b0", "/c/b1", "/c/b2"]
    assert storage.owners("/c/shared") == {"address:a"}
    storage.forget(victims)
    assert storage.usage("address:b")[0] == 3 and storage.expired("/c/up0") and not storage.expired("/c/b4")
    assert storage.refusal("address:b") is None and storage.refusal("address:a") is None


def test_files_still_arriving_do_not_make_a_client_pay_for_them():
    """A stranger's 300-file upload being stored (nobody charged yet) is not cache pressure on the
    clients already there: their files stay (seen: a refused flood took a visitor's results)."""
    storage = _storage(client_files=100)
    storage.record_upload("address:a", ["/c/a0", "/c/a1"])
    entries = [_entry("/c/a0", 900.0), _entry("/c/a1", 901.0)] + [_entry(f"/c/x{i}", 999.0) for i in range(300)]
    assert storage.plan(entries, now=1000.0) == []


def test_a_latest_job_is_held_only_for_a_while_and_one_per_client():
    """In use is bounded per client: its latest job only (new sessions do not add pins), for `hold` s."""
    storage = _storage(cache_files=100, client_files=1, hold=60.0)
    for i in range(3):  # three jobs, each from a new session
        storage.record_call(f"s{i}", "address:a", 1, f"e{i}", inputs=[], outputs=[f"/c/r{i}"])
    entries = [_entry(f"/c/r{i}", 900.0 + i) for i in range(3)]
    assert storage.plan(entries, now=1000.0) == ["/c/r0", "/c/r1"]  # r2: the latest job's, held
    assert storage.in_use(now=1000.0) == {"/c/r2"} and storage.in_use(now=1061.0) == set()


def test_an_upload_alone_over_the_quota_is_refused_before_and_after_its_body():
    storage = _storage(client_bytes=1_000, client_files=2)
    refusal = storage.refusal("address:a", declared=5_000)
    assert refusal is not None and refusal.status == 413 and "at most" in refusal.message
    assert storage.record_upload("address:a", ["/c/1", "/c/2"])[1] is False  # at the quota: fine
    assert storage.record_upload("address:a", ["/c/3", "/c/4", "/c/5"])[1] is True  # 3 files in one request


def test_arriving_and_queued_files_are_never_pruned():
    storage = _storage(cache_files=1)
    upload = storage.begin_upload("address:c")
    entries = [
        _entry("/c/tmpabc", 900.0, spool=True),
        _entry("/c/fresh", 998.0),
        _entry("/c/queued", 800.0),
        _entry("/c/old", 800.0),
    ]
    assert storage.plan(entries, referenced=["/c/queued"], now=1000.0) == ["/c/old"]
    storage.end_upload(upload)  # no upload in flight: an old spool file is an orphan now
    assert set(storage.plan(entries, referenced=["/c/queued"], now=1000.0)) == {"/c/tmpabc", "/c/old"}


def test_an_upload_charged_during_the_janitors_walk_keeps_counting():
    """The walk that lists the cache begins before `plan` runs: an upload that completes in between is
    missing from it, yet there. It stays charged (else its client drops out of its own count and passes
    its quota: seen on a loaded machine); a file charged before the walk and missing from it is gone."""
    import time

    storage = _storage()
    storage.record_upload("address:a", ["/c/before"])
    walked_from = time.monotonic()
    storage.record_upload("address:a", ["/c/during"])
    assert storage.usage("address:a")[0] == 2
    storage.plan([], now=1000.0, walked_from=walked_from)
    assert storage.owners("/c/during") == {"address:a"} and storage.owners("/c/before") == set()
    assert storage.usage("address:a")[0] == 1
    storage.plan([], now=1000.0, walked_from=time.monotonic())  # the next round: gone for good
    assert storage.usage("address:a") == (0, 0)


def test_a_folder_removed_mid_walk_does_not_lose_the_round(tmp_path, monkeypatch):
    """gradio_internals.cache_files: a hash folder deleted between listing its parent and entering it
    (a refused upload, a prune on another thread) is skipped; the other files are still listed."""
    import os

    from hidream_ui.server.gradio_internals import cache_files

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.png").write_bytes(b"x")
    real = os.scandir

    def vanishing(path="."):
        if os.fspath(path).endswith(os.sep + "b"):
            raise FileNotFoundError(2, "No such file or directory", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", vanishing)
    assert cache_files(tmp_path) == [tmp_path / "a" / "x.png"]


def test_emptied_and_abandoned_folders_are_removed(tmp_path):
    from hidream_ui.server import gradio_internals

    old = tmp_path / "hidream-ui-gradio-x1" / "deep"
    old.mkdir(parents=True)
    fresh = tmp_path / "hidream-ui-gradio-x2"
    fresh.mkdir()
    storage = _storage(grace=30.0)
    later = time.time() + 60
    demo = types.SimpleNamespace(temp_file_sets=[], blocks={})
    for folder in (old, old.parent):  # untouched for 90 s as the janitor sees it
        os.utime(folder, (later - 90, later - 90))
    os.utime(fresh, (later - 1, later - 1))
    gradio_internals.prune_cache(demo, tmp_path, 10, 3600, now=later, storage=storage)
    assert not old.parent.exists() and fresh.exists()


# ---------------------------------------------------------------------------------------------
# Review of the storage code: a refused upload deletes only its own files; uploads in flight count
# against the cache; a shared login does not share one quota; no empty accounts are left behind.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tight(launch_app):
    # A client keeps at most 2 files; the whole cache (examples excluded) at most 2 MB.
    return launch_app(
        "storage-tight",
        max_queue=8,
        max_upload_mb=1,
        cache_max_files=40,
        cache_max_mb=2,
        client_quota_files=2,
        client_quota_mb=2,
    )


@pytest.mark.slow
def test_a_refused_upload_does_not_delete_an_examples_cached_copy(tight):
    """Gradio stores an upload at cache/<hash of its bytes>/<name>: the bytes of the bundled apple.png
    named apple.png land on the example's own cached copy. Refusing that upload must not delete it."""
    from hidream_ui.server import gradio_internals

    copies = [p for p in gradio_internals.kept_files(tight["demo"]) if Path(p).name == "apple.png"]
    assert copies and all(Path(p).is_file() for p in copies)
    with client(tight, "127.0.1.1") as http:
        assert upload_one(http, "junk.png", b"\x89PNG-junk")[0] == 200
        answer = http.post(
            "/gradio_api/upload",
            files=[
                ("files", ("junk2.png", b"\x89PNG-junk2", "image/png")),
                ("files", ("junk3.png", b"\x89PNG-junk3", "image/png")),
                ("files", ("apple.png", EXAMPLE.read_bytes(), "image/png")),
            ],
        )
        assert answer.status_code == 413, answer.text  # 3 files in one request, quota 2: undone and refused
        assert all(Path(p).is_file() for p in copies), "the example's cached copy was deleted"
        # The example still works through the app (the gate allows its copy, the edit reads it).
        done = edit_call(http, copies[0], "apple.png", session="example-after-refusal")
    assert done["event"] == "complete", done


def test_uploads_in_flight_count_against_the_cache_cap(tight):
    """Two clients each stream 0.9 MB (chunked: no length to check up front) into a 2 MB cache and hold
    their uploads open; a third client's 0.9 MB then passes the cap with the others' bytes in flight
    and is cut off with 503 (it used to be stored: 2.7 MB in a 2 MB cache), while the first two complete."""
    release = threading.Event()
    chunk = bytes(900_000)

    def body(i, hold):
        yield (
            b'--xx\r\nContent-Disposition: form-data; name="files"; filename="big%d.png"\r\n'
            b"Content-Type: image/png\r\n\r\n\x89PNG" % i + chunk
        )
        if hold:
            release.wait(60)  # held open: its bytes are in flight, not yet a stored file
        yield b"\r\n--xx--\r\n"

    def send(i, hold=True):
        with client(tight, f"127.0.2.{i + 1}") as http:
            try:
                return http.post(
                    "/gradio_api/upload",
                    content=body(i, hold),
                    headers={"content-type": "multipart/form-data; boundary=xx"},
                ).status_code
            except httpx.HTTPError as exc:
                return repr(exc)

    def spooled():
        return sum(p.stat().st_size for p in spool_files(tight) if p.exists())

    answers: dict[int, object] = {}
    holders = [threading.Thread(target=lambda i=i: answers.__setitem__(i, send(i))) for i in range(2)]
    try:
        for i, holder in enumerate(holders):
            holder.start()
            wait_for(lambda i=i: spooled() >= (i + 1) * 880_000, what=f"upload {i} in flight")
        answers[2] = send(2, hold=False)
    finally:
        release.set()
        for holder in holders:
            holder.join(60)
    assert answers == {0: 200, 1: 200, 2: 503}, answers


def test_a_shared_login_does_not_share_one_quota():
    """`--auth booth:pw` with many visitors: each visitor (address) under the login has its own quota."""
    from hidream_ui.server.client_storage import ClientStorage

    first, second = ClientStorage.client_key("10.0.0.1", "booth"), ClientStorage.client_key("10.0.0.2", "booth")
    assert first != second and "booth" in first and "10.0.0.1" in first
    storage = _storage(client_files=1, cache_files=100)
    storage.record_upload(first, ["/c/one", "/c/two"])
    storage.record_upload(second, ["/c/three"])
    entries = [_entry("/c/one", 900.0), _entry("/c/three", 901.0), _entry("/c/two", 902.0)]
    assert storage.plan(entries, now=1000.0) == ["/c/one"]  # first's own oldest, never second's


def test_a_refused_upload_leaves_no_empty_account():
    storage = _storage(client_files=1)
    new, over = storage.record_upload("address:x", ["/c/x1", "/c/x2"])
    assert over
    assert storage.uncharge("address:x", new) == ["/c/x1", "/c/x2"]
    assert "address:x" not in storage._held and storage.usage("address:x") == (0, 0)


def test_a_declared_length_is_reserved_in_the_cache():
    """An upload with a Content-Length holds its room from the start: a second one that would not fit
    beside it is refused before its body is read."""
    storage = _storage(cache_bytes=1_000, client_bytes=1_000)
    first = storage.begin_upload("address:a", declared=800)
    refusal = storage.refusal("address:b", declared=300)
    assert refusal is not None and refusal.status == 503
    assert storage.refusal("address:b", declared=150) is None
    storage.end_upload(first)
    assert storage.refusal("address:b", declared=300) is None


def test_discarding_spares_what_gradio_held_before_and_the_examples(tmp_path):
    from hidream_ui.server import gradio_internals

    mine, earlier, example = (tmp_path / h / "a.png" for h in ("h1", "h2", "h3"))
    for path in (mine, earlier, example):
        path.parent.mkdir()
        path.write_bytes(b"x")
    block = types.SimpleNamespace(keep_in_cache={str(example)})
    demo = types.SimpleNamespace(upload_file_set={str(mine), str(earlier)}, blocks={1: block})
    app = types.SimpleNamespace(uploaded_file_dir=str(tmp_path), get_blocks=lambda: demo)
    scope = {"app": app}
    before = gradio_internals.stored_uploads(scope)  # as the guard notes it before the route runs
    assert before == {str(mine), str(earlier)}
    gradio_internals.discard_uploads(scope, [str(mine), str(earlier), str(example)], existed=before - {str(mine)})
    assert not mine.exists() and earlier.is_file() and example.is_file()
    assert demo.upload_file_set == {str(earlier)}


def test_cache_once_writes_a_file_once_where_gradio_would_and_anew_after_a_prune():
    """`cache_once` (the live preview's "before"): one write, by rename, in the folder gradio names
    these bytes by, so gradio's copy of it is the file itself; a pruned file comes back."""
    from gradio.processing_utils import hash_bytes, save_file_to_cache

    from hidream_ui.server import gradio_internals

    data = os.urandom(64)
    path = Path(gradio_internals.cache_once(data, "before.png"))
    assert path.read_bytes() == data and path.parent.name == hash_bytes(data)
    assert path.parent.parent == gradio_internals.private_cache_folder()
    stamp = path.stat().st_mtime_ns, path.stat().st_ino
    assert gradio_internals.cache_once(data, "before.png") == str(path)
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == stamp  # not rewritten
    assert save_file_to_cache(path, str(path.parent.parent)) == str(path)  # gradio's copy: this very file
    assert sorted(p.name for p in path.parent.iterdir()) == ["before.png"]  # no staging file left
    path.unlink()
    assert Path(gradio_internals.cache_once(data, "before.png")).read_bytes() == data
    path.unlink()  # the cache folder is every app's of this process: leave nothing for their limits
    path.parent.rmdir()
