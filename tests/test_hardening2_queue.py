"""Hardening II (issue 19): the queue is the only way in, engine-wide settings are the operator's
(--kiosk, --operator), and the small leaks: a cancel during the save, load messages in /status,
a compare range that overflows.

Every finding is reproduced over raw HTTP (httpx) against the launched app (conftest.launch_app),
as an attacker would send it; gradio_client checks that honest clients still work.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from helpers import edit_params, random_picture, wait_for

from hidream_ui.config import AppConfig, ConfigError, from_args
from hidream_ui.edits import EditRequest, RequestError
from hidream_ui.engine.errors import EditCancelled
from hidream_ui.pipeline.speed.settings import SPEED_PRESETS
from hidream_ui.server import gradio_internals
from hidream_ui.ui.layout import ASSETS_DIR
from hidream_ui.ui.services import AppServices

EXAMPLE = ASSETS_DIR / "apple.png"
OPERATOR = ("booth-operator", "op-s3cret-pass")


def edit_data(file, steps: int = 2, seed: int = 1) -> list:
    """/edit's inputs in order: image, instruction, negative, guidance, image guidance, steps, refine,
    CLIP-CFG norm, working resolution, seed, random seed, collapse padding, rewrite."""
    return [file, "make it blue", "", 3.0, 1.5, steps, 0.3, True, "draft", seed, False, True, False]


# What each queued event takes (a plausible call: on the old code each of these ran).
def direct_calls(file) -> dict[str, list]:
    return {
        "edit": edit_data(file),
        "edit_rewritten": [file, "make it blue", None, "", 3.0, 1.5, 2, 0.3, True, "draft", 1, False, True],
        "batch_edit": [[file], "make it blue", "matrix", "", 3.0, 1.5, 2, 0.3, True, "draft", 1, "fixed", 0, False],
        "compare": [file, "make it blue", "seed", "1", "none", "", "", 3.0, 1.5, 2, 0.3, True, "draft", 1],
        "rewrite": [file, "make it blue"],
        "set_attention": ["math", "all"],
        "set_speed": ["faster"],
        "load_model": [],
    }


def upload(http: httpx.Client, path: Path = EXAMPLE) -> dict:
    answer = http.post("/gradio_api/upload", files={"files": (path.name, path.read_bytes(), "image/png")})
    assert answer.status_code == 200, answer.text
    return {"path": answer.json()[0], "meta": {"_type": "gradio.FileData"}, "orig_name": path.name}


def sse_result(text: str) -> dict:
    events = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("event:")]
    payloads = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("data:")]
    data = payloads[-1] if payloads else ""
    return {
        "event": events[-1] if events else None,
        "data": json.loads(data) if data not in ("", "null") else None,
        "text": text,
    }


def raw_call(http: httpx.Client, api: str, data: list, session: str = "raw-client") -> dict:
    """A raw REST call through the queue (`/gradio_api/call/<api>`, as curl makes it); the last SSE event."""
    posted = http.post(f"/gradio_api/call/{api}", json={"data": data, "session_hash": session})
    assert posted.status_code == 200, posted.text
    return sse_result(http.get(f"/gradio_api/call/{api}/{posted.json()['event_id']}").text)


def fn_index(http: httpx.Client, api_name: str) -> int:
    dependencies = http.get("/config").json()["dependencies"]
    return next(i for i, dep in enumerate(dependencies) if dep.get("api_name") == api_name)


def results(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("*.png"))


@pytest.fixture(scope="module")
def app(launch_app):
    return launch_app("queue2", max_queue=12, max_jobs_per_client=2)


@pytest.fixture(autouse=True)
def idle(request):
    """Every test that used `app` ends with nothing of it running."""
    yield
    if "app" in request.fixturenames:
        launched = request.getfixturevalue("app")
        for job in launched["demo"].hidream_services.jobs.running():
            job.token.cancel("test teardown")
        wait_for(lambda: launched["engine"].status().state == "idle", what="the engine to go idle")


# ---------------------------------------------------------------------------------------------
# One way in: queued events answer only through the queue
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("route", ["/gradio_api/run/{api}", "/gradio_api/api/{api}"])
def test_a_direct_post_of_a_queued_event_is_refused_and_runs_nothing(app, route):
    engine = app["engine"]
    speed, attention = engine.status().speed["cache_default"], engine.status().attention
    edits, saved = engine.counters["edits"], results(app["config"].output_dir)
    with httpx.Client(base_url=app["url"], timeout=60) as http:
        file = upload(http)
        for api, data in direct_calls(file).items():
            answer = http.post(route.format(api=api), json={"data": data, "session_hash": "direct"})
            assert answer.status_code == 404 and "join the queue" in answer.text, (
                api,
                answer.status_code,
                answer.text[:300],
            )
    assert engine.status().speed["cache_default"] == speed and engine.status().attention == attention
    assert engine.counters["edits"] == edits and results(app["config"].output_dir) == saved
    assert not engine.loaded


def test_private_queued_events_are_refused_by_index_too(app):
    """The browser's own events (the attention dropdown, the Speed dropdown, the settings reader)
    have no public name, but `/run/predict` with their index reached them unqueued."""
    with httpx.Client(base_url=app["url"], timeout=60) as http:
        for name, data in (
            ("change_attention", ["auto", "all"]),
            ("change_speed", [SPEED_PRESETS["faster"]]),
            ("settings_from_file", [upload(http)]),
        ):
            answer = http.post(
                "/gradio_api/run/predict",
                json={"fn_index": fn_index(http, name), "data": data, "session_hash": "direct"},
            )
            assert answer.status_code == 404 and "join the queue" in answer.text, (name, answer.text[:300])
    assert app["engine"].status().speed["cache_default"] == "none"


def test_status_and_cancel_stay_unqueued_and_answer_at_once(app):
    with httpx.Client(base_url=app["url"], timeout=30) as http:
        http.post("/gradio_api/run/status", json={"data": []})  # the first one imports torch's device layer
        for _ in range(3):
            started = time.perf_counter()
            status = http.post("/gradio_api/run/status", json={"data": []})
            cancel = http.post("/gradio_api/run/cancel", json={"data": [], "session_hash": "nobody"})
            assert time.perf_counter() - started < 1.0
            assert status.status_code == 200 and status.json()["data"][0]["state"] == "idle"
            assert cancel.status_code == 200 and cancel.json()["data"] == ["nothing of yours is running"]


@pytest.mark.slow
def test_the_queue_routes_still_work_for_raw_callers_and_gradio_client(app):
    with httpx.Client(base_url=app["url"], timeout=120) as http:
        answer = raw_call(http, "edit", edit_data(upload(http)))
        assert answer["event"] == "complete", answer["text"][:500]
        assert raw_call(http, "set_speed", ["exact"])["data"] == ["none"]
    client = Client(app["url"], verbose=False)
    _, png, seed, _ = client.predict(
        image=handle_file(str(EXAMPLE)),
        instruction="make it green",
        seed=3,
        randomize_seed=False,  # on by default (issue 21)
        num_inference_steps=2,
        working_resolution="draft",
        api_name="/edit",
    )
    assert seed == 3 and Path(png).is_file()


@pytest.mark.slow
def test_the_settings_reader_runs_queued_on_its_own_small_lane(app):
    fn = next(f for f in app["demo"].fns.values() if f.api_name == "settings_from_file")
    assert fn.queue and fn.concurrency_id == "settings-file" and fn.concurrency_limit == 2
    client = Client(app["url"], verbose=False)
    png = client.predict(
        image=handle_file(str(EXAMPLE)),
        instruction="make it red",
        seed=11,
        randomize_seed=False,
        num_inference_steps=2,
        working_resolution="draft",
        api_name="/edit",
    )[1]
    with httpx.Client(base_url=app["url"], timeout=60) as http:
        answer = raw_call(http, "settings_from_file", [upload(http, Path(png))])
    assert answer["event"] == "complete", answer["text"][:500]
    assert 11 in answer["data"] and "make it red" in answer["data"]


def test_the_per_client_limit_holds_for_raw_callers(app):
    """Eight parallel raw calls with one session: through the queue two are admitted (the rest get
    the per-client refusal), and the direct route admits none (on the old code all eight ran)."""
    session = "greedy-raw-client"
    codes: dict[str, list] = {"call": [], "run": []}
    with httpx.Client(base_url=app["url"], timeout=60) as http:
        file = upload(http)
    slow = edit_data(file, steps=200)

    def send(kind: str) -> None:
        with httpx.Client(base_url=app["url"], timeout=60) as http:
            path = "/gradio_api/call/edit" if kind == "call" else "/gradio_api/run/edit"
            answer = http.post(path, json={"data": slow, "session_hash": session})
            codes[kind].append((answer.status_code, answer.text))

    threads = [threading.Thread(target=send, args=(kind,)) for kind in ("call", "run") for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    try:
        assert sorted(code for code, _ in codes["call"]) == [200, 200, 422, 422], codes["call"]
        assert all("already have 2 job" in text for code, text in codes["call"] if code == 422)
        assert [code for code, _ in codes["run"]] == [404] * 4, codes["run"]
        assert gradio_internals.session_jobs(app["demo"], session, "device") == 2
    finally:
        with httpx.Client(base_url=app["url"], timeout=30) as http:
            for code, text in codes["call"]:
                if code == 200:
                    http.post(
                        "/gradio_api/cancel",
                        json={"session_hash": session, "fn_index": 0, "event_id": json.loads(text)["event_id"]},
                    )
        wait_for(
            lambda: gradio_internals.session_jobs(app["demo"], session, "device") == 0,
            what="the greedy client's jobs to go",
        )


# ---------------------------------------------------------------------------------------------
# Operator mode: --kiosk hides and refuses the engine-wide controls; --operator may use them
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kiosk(launch_app):
    return launch_app("kiosk", kiosk=True, operator=OPERATOR)


@contextlib.contextmanager
def operator_http(url: str) -> Iterator[httpx.Client]:
    """An HTTP client signed in as the operator at /operator/login (no --auth: visitors need no login)."""
    with httpx.Client(base_url=url, timeout=120) as http:
        answer = http.post("/operator/login", data={"username": OPERATOR[0], "password": OPERATOR[1]})
        assert answer.status_code == 303 and answer.headers["location"] == "/", answer.text  # to the app
        yield http


def controls_visible(http: httpx.Client) -> bool:
    """What `page_load` tells this browser about the engine-wide controls (the column's visibility)."""
    config = http.get("/config").json()
    column = next(c["id"] for c in config["components"] if c["props"].get("elem_id") == "hui-engine-controls")
    dependency = fn_index(http, "page_load")
    outputs = config["dependencies"][dependency]["outputs"]
    answer = http.post(
        "/gradio_api/run/predict",
        json={"fn_index": dependency, "data": [], "session_hash": f"page-{time.monotonic_ns()}"},
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["data"][outputs.index(column)]["visible"]


@pytest.mark.slow
def test_the_kiosk_page_hides_the_engine_controls_from_visitors(kiosk):
    with httpx.Client(base_url=kiosk["url"], timeout=60) as http:
        config = http.get("/config").json()
        by_elem = {c["props"].get("elem_id"): c for c in config["components"]}
        column = by_elem["hui-engine-controls"]
        assert column["props"]["visible"] is False

        def ids_under(node: dict, inside: bool = False) -> set:
            found = {node["id"]} if inside else set()
            for child in node.get("children", []):
                found |= ids_under(child, inside or node["id"] == column["id"])
            return found

        hidden = ids_under(config["layout"])
        for elem in ("hui-attention", "hui-speed", "hui-load-model"):
            assert by_elem[elem]["id"] in hidden, elem
        assert controls_visible(http) is False
    with operator_http(kiosk["url"]) as http:
        assert controls_visible(http) is True


@pytest.mark.slow
def test_kiosk_visitors_are_refused_over_gradio_client_and_the_raw_queue(kiosk):
    engine = kiosk["engine"]
    speed, attention = engine.status().speed["cache_default"], engine.status().attention
    client = Client(kiosk["url"], verbose=False)
    for api, args in (("/set_attention", ("math",)), ("/set_speed", ("faster",)), ("/load_model", ())):
        with pytest.raises(AppError, match="only the operator controls"):
            client.predict(*args, api_name=api)
    with httpx.Client(base_url=kiosk["url"], timeout=60) as http:
        for api, data in (
            ("set_attention", ["math", "all"]),
            ("set_speed", ["faster"]),
            ("load_model", []),
            # The dropdowns' own events take only their choices (gradio checks that first).
            ("change_attention", ["auto", "all"]),
            ("change_speed", [SPEED_PRESETS["faster"]]),
        ):
            answer = raw_call(http, api, data, session="visitor")
            assert answer["event"] == "error" and "only the operator controls" in answer["text"], (api, answer)
    assert engine.status().speed["cache_default"] == speed and engine.status().attention == attention
    assert not engine.loaded
    # Visitors still edit: the model loads on the first edit, as without --kiosk.
    _, png, _, _ = client.predict(
        image=handle_file(str(EXAMPLE)),
        instruction="make it blue",
        seed=2,
        num_inference_steps=2,
        working_resolution="draft",
        api_name="/edit",
    )
    assert Path(png).is_file() and engine.loaded


def test_the_operator_changes_the_engine_in_kiosk_mode(kiosk):
    engine = kiosk["engine"]
    with operator_http(kiosk["url"]) as http:
        assert raw_call(http, "set_speed", ["faster"], session="operator")["data"] == [SPEED_PRESETS["faster"]]
        assert engine.status().speed["cache_default"] == SPEED_PRESETS["faster"]
        assert raw_call(http, "set_attention", ["math", "all"], session="operator")["data"] == ["math"]
        assert engine.status().attention == "math"
        answer = raw_call(http, "change_attention", ["auto", "all"], session="operator")
        assert answer["event"] == "complete" and engine.status().attention != "math", answer["text"][:300]
        assert raw_call(http, "load_model", [], session="operator")["event"] == "complete"
        raw_call(http, "set_speed", ["exact"], session="operator")
    assert engine.status().speed["cache_default"] == "none"


@pytest.mark.slow
def test_a_wrong_operator_password_signs_nobody_in_and_guessing_is_throttled(launch_app):
    # An app of its own: the operator stays locked out of it for a minute afterwards.
    guessed = launch_app("kiosk_guessed", kiosk=True, operator=OPERATOR, max_login_failures=3)
    codes = []
    with httpx.Client(base_url=guessed["url"], timeout=30) as http:
        for i in range(5):
            answer = http.post("/operator/login", data={"username": OPERATOR[0], "password": f"guess{i}"})
            codes.append(answer.status_code)
        assert not http.cookies
        assert raw_call(http, "set_speed", ["faster"], session="guesser")["event"] == "error"
        # Two name fields (one right, one wrong): refused, whichever a reader would pick.
        doubled = http.post(
            "/operator/login",
            content=f"username={OPERATOR[0]}&username=x&password={OPERATOR[1]}",
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert doubled.status_code in (400, 429) and not http.cookies
    assert codes[:3] == [401] * 3 and codes[3:] == [429] * 2, codes


@pytest.mark.slow
def test_two_content_types_do_not_escape_the_operators_lock(launch_app):
    """The guard (starlette) reads the first Content-Type, a dict the last: a body declared both
    text/plain and form would count only against its (spoofable) address. Refused outright."""
    locked = launch_app("kiosk_two_types", kiosk=True, operator=OPERATOR, max_login_failures=2)
    body = f"username={OPERATOR[0]}&password=wrong"
    codes = []
    for i in range(4):
        headers = [
            ("X-Forwarded-For", f"10.9.0.{i}"),
            ("content-type", "text/plain"),
            ("content-type", "application/x-www-form-urlencoded"),
        ]
        with httpx.Client(base_url=locked["url"], timeout=30) as http:
            codes.append(http.post("/operator/login", content=body, headers=httpx.Headers(headers)).status_code)
    assert codes == [400] * 4, codes
    with httpx.Client(base_url=locked["url"], timeout=30) as http:
        for i in range(2):  # lock the operator's name, each try from an address of its own
            http.post(
                "/operator/login",
                data={"username": OPERATOR[0], "password": f"x{i}"},
                headers={"X-Forwarded-For": f"10.9.1.{i}"},
            )
        right = http.post(
            "/operator/login",
            data={"username": OPERATOR[0], "password": OPERATOR[1]},
            headers={"X-Forwarded-For": "10.9.2.1"},
        )
        assert right.status_code == 429 and not http.cookies, right.status_code


def test_the_operator_form_posts_to_the_login_route_from_every_page(kiosk):
    """After a wrong password the form is served from /operator/login: its action must still be
    /operator/login (a relative one posted to /operator/operator/login, a 404 that counted as a try)."""
    with httpx.Client(base_url=kiosk["url"], timeout=30) as http:
        pages = [
            http.get("/operator").text,
            http.get("/operator/").text,
            http.post(
                "/operator/login", data={"username": "nobody", "password": "x"}, headers={"X-Forwarded-For": "10.9.3.1"}
            ).text,
        ]
    for page in pages:
        assert re.search(r'action="/operator/login"', page), page[:400]


@pytest.fixture(scope="module")
def kiosk_with_auth(launch_app):
    return launch_app("kiosk_auth", kiosk=True, operator=OPERATOR, auth=("visitor", "visitor-pass"))


@pytest.mark.slow
def test_with_auth_the_operator_logs_in_on_gradios_login_page(kiosk_with_auth):
    url, engine = kiosk_with_auth["url"], kiosk_with_auth["engine"]
    visitor = Client(url, auth=("visitor", "visitor-pass"), verbose=False)
    with pytest.raises(AppError, match="only the operator controls"):
        visitor.predict("faster", api_name="/set_speed")
    operator = Client(url, auth=OPERATOR, verbose=False)
    assert operator.predict("fast", api_name="/set_speed") == SPEED_PRESETS["fast"]
    assert engine.status().speed["cache_default"] == SPEED_PRESETS["fast"]


def test_kiosk_without_an_operator_lets_nobody_change_the_engine():
    from hidream_ui.engine.pool import EnginePool
    from hidream_ui.ui.system_handlers import SystemHandlers

    class Visitor:
        username = None

    handlers = SystemHandlers(EnginePool.for_config(AppConfig(device="cpu", kiosk=True)))
    with pytest.raises(Exception, match="without an operator") as refused:
        handlers.set_attention("math", request=Visitor())
    assert "only the operator controls" in str(refused.value)
    # Without --kiosk, today's behaviour: anyone may.
    anyone = SystemHandlers(EnginePool.for_config(AppConfig(device="cpu")))
    assert anyone.set_attention("math", request=Visitor()) == "math"


def test_the_operator_sign_in_degrades_to_nothing_on_an_unknown_app():
    import types

    assert gradio_internals.sign_in({"app": types.SimpleNamespace()}, "op") is None
    assert gradio_internals.sign_in({}, "op") is None


def test_operator_flags_and_their_environment_twins(tmp_path):
    config = from_args(["--kiosk", "--operator", "op:pw"])
    assert config.kiosk and config.operator == ("op", "pw") and "pw" not in repr(config)
    config = from_args([], environ={"HIDREAM_KIOSK": "1", "HIDREAM_OPERATOR": "op:pw"})
    assert config.kiosk and config.operator == ("op", "pw")
    assert not from_args([], environ={"HIDREAM_KIOSK": "no"}).kiosk
    with pytest.raises(ConfigError, match="HIDREAM_KIOSK"):
        from_args([], environ={"HIDREAM_KIOSK": "maybe"})
    with pytest.raises(ConfigError, match="--operator needs --kiosk"):
        from_args(["--operator", "op:pw"])
    with pytest.raises(ConfigError, match="user:password"):
        from_args(["--kiosk", "--operator", "op"])
    with pytest.raises(ConfigError, match="a name of its own"):
        from_args(["--kiosk", "--operator", "op:pw", "--auth", "op:other"])
    from hidream_ui.cli.app import main

    users = tmp_path / "users.txt"
    users.write_text("op:other\n", encoding="utf-8")
    assert main(["--kiosk", "--operator", "op:pw", "--auth-file", str(users)]) == 2


# ---------------------------------------------------------------------------------------------
# The LOW findings
# ---------------------------------------------------------------------------------------------


def test_a_cancel_that_arrives_while_the_result_is_saved_saves_nothing(app, monkeypatch):
    """Over the app: the edit's PNG encoding waits until the client's /cancel has arrived."""
    import hidream_ui.outputs as outputs

    saving, cancelled = threading.Event(), threading.Event()
    encode = outputs.encode_png

    def slow_encode(*args, **kwargs):
        saving.set()
        cancelled.wait(30)
        return encode(*args, **kwargs)

    monkeypatch.setattr(outputs, "encode_png", slow_encode)
    folder = Path(app["config"].output_dir)
    before = sorted(folder.iterdir())
    client = Client(app["url"], verbose=False)
    job = client.submit(
        image=handle_file(str(EXAMPLE)),
        instruction="make it blue",
        seed=4,
        num_inference_steps=2,
        working_resolution="draft",
        api_name="/edit",
    )
    assert saving.wait(60), "the edit never reached its save"
    with httpx.Client(base_url=app["url"], timeout=30) as http:
        answer = http.post("/gradio_api/run/cancel", json={"data": [], "session_hash": client.session_hash})
    assert answer.json()["data"] == ["stopped 1 job(s)"]
    cancelled.set()
    with pytest.raises(AppError, match="cancelled"):
        job.result(timeout=60)
    assert sorted(folder.iterdir()) == before  # neither the PNG nor its JSON


def test_a_cancel_during_the_save_leaves_no_file_in_process(tiny_dir, tmp_path, monkeypatch):
    """The engine alone: the token set while the PNG is written (the window the old code missed)."""
    import hidream_ui.outputs as outputs
    from hidream_ui.engine.engine import EditEngine
    from hidream_ui.engine.jobs import CancelToken

    engine = EditEngine(AppConfig(device="cpu", output_dir=tmp_path / "out"))
    token = CancelToken()
    encode = outputs.encode_png

    def cancelling_encode(*args, **kwargs):
        token.cancel("stopped by its user")  # the Stop arrives while the file is being written
        return encode(*args, **kwargs)

    monkeypatch.setattr(outputs, "encode_png", cancelling_encode)
    request = EditRequest(image=random_picture(1), params=edit_params(steps=2))
    with pytest.raises(EditCancelled):
        engine.edit(request, cancel=token)
    assert not list((tmp_path / "out").glob("*"))


@pytest.mark.slow
def test_status_redacts_the_model_path_of_a_load_in_progress(launch_app, tiny_dir):
    """During a load `progress.message` says "loading ... from <folder>": without --auth, the folder's
    name only, like every other status field."""
    loading = launch_app("progress_message")
    engine = loading["engine"]
    reached, release = threading.Event(), threading.Event()

    def hold(fraction: float, message: str) -> None:
        if os.sep in message and not reached.is_set():
            reached.set()
            release.wait(60)

    loader = threading.Thread(target=engine.load, kwargs={"on_progress": hold}, daemon=True)
    loader.start()
    try:
        assert reached.wait(120), "the load never named a folder"
        with httpx.Client(base_url=loading["url"], timeout=30) as http:
            status = http.post("/gradio_api/run/status", json={"data": []}).json()["data"][0]
        assert status["state"] == "loading" and status["progress"]["message"]
        text = json.dumps(status)
        assert str(Path(tiny_dir).parent) not in text and os.environ["HIDREAM_MODEL_CACHE"] not in text, status[
            "progress"
        ]
        assert status["devices"][0]["progress"]["message"] == status["progress"]["message"]
    finally:
        release.set()
        loader.join(120)


def test_the_load_progress_an_edit_streams_names_no_absolute_path(tiny_dir):
    """The edit's own progress bar shows the load's messages: without --auth, folder names only."""
    from hidream_ui.ui.edit_handlers import EditHandlers

    folder = str(Path(tiny_dir) / "transformer")

    class Loading:
        config = AppConfig()
        loaded = False

        def load(self, on_progress=None):
            on_progress(0.5, f"loading the transformer from {folder}")

    shown: list[str] = []
    EditHandlers(Loading()).load_with_progress(lambda fraction, desc: shown.append(desc))
    assert shown and "transformer" in shown[0] and folder not in shown[0], shown
    private = EditHandlers(Loading(), services=AppServices.for_config(AppConfig(auth=("a", "b"))))
    private.load_with_progress(lambda fraction, desc: shown.append(desc))
    assert folder in shown[1]  # logged-in users see the path, as in /status


def test_a_compare_range_with_a_tiny_step_gets_a_message(app):
    with httpx.Client(base_url=app["url"], timeout=60) as http:
        file = upload(http)
        for values in ("1:2:1e-320", "-1e308:1e308:1e308", "1:2:5e-324"):
            answer = raw_call(
                http,
                "compare",
                [file, "make it blue", "guidance", values, "none", "", "", 3.0, 1.5, 2, 0.3, True, "draft", 1],
            )
            assert answer["event"] == "error", answer["text"][:300]
            assert "at most 256 values" in answer["text"] and "Overflow" not in answer["text"], answer["text"][:300]


def test_no_number_parse_overflows():
    from hidream_ui.edits import EditSettings
    from hidream_ui.engine.compare import parse_axis_values

    with pytest.raises(RequestError, match="guidance_scale"):
        EditSettings(guidance_scale=10**400).validated()
    with pytest.raises(RequestError, match="guidance values"):
        parse_axis_values("guidance", [10**400])
    from hidream_ui.ui.batch_tab import _batch_size

    with pytest.raises(RequestError, match="batch_size"):
        _batch_size(10**400)
    # A range whose values underflow towards 0 while going the wrong way: refused, not an empty axis.
    with pytest.raises(RequestError, match="goes from start towards stop"):
        parse_axis_values("guidance", "2e-320:1e-320:1e-320")
    assert parse_axis_values("guidance", "1.5:4.5:1") == (1.5, 2.5, 3.5, 4.5)


# ---------------------------------------------------------------------------------------------
# In the browser: the moved events still work, and the kiosk page shows the controls to the operator only
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    from playwright import sync_api
    from test_browser import CHROMIUM, CHROMIUM_ARGS

    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@contextlib.contextmanager
def new_page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(30_000)
    try:
        yield page
    finally:
        context.close()


@pytest.mark.slow
def test_the_settings_reader_fills_the_form_in_the_browser_through_the_queue(app, browser):
    from playwright import sync_api
    from test_browser import open_app

    client = Client(app["url"], verbose=False)
    png = client.predict(
        image=handle_file(str(EXAMPLE)),
        instruction="make it violet",
        seed=23,
        num_inference_steps=2,
        working_resolution="draft",
        api_name="/edit",
    )[1]
    with new_page(browser) as page:
        open_app(page, app["url"])
        page.get_by_role("tab", name="History").click()
        page.locator("#hui-settings-file input[type=file]").set_input_files(png)
        # Only the reader's answer puts this instruction into the Edit tab's form (and selects the tab).
        sync_api.expect(page.locator("#hui-instruction textarea")).to_have_value("make it violet", timeout=60_000)


@pytest.mark.slow
def test_the_kiosk_page_shows_the_engine_controls_to_the_operator_only(kiosk, browser):
    from playwright import sync_api

    with new_page(browser) as page:
        page.goto(kiosk["url"])
        # The panel leaves "connecting…" only when the page-load event (which decides the controls) answered.
        sync_api.expect(page.locator("#hui-status-panel .hui-state")).to_be_visible(timeout=60_000)
        for elem in ("#hui-attention", "#hui-speed", "#hui-load-model", "#hui-status-details"):
            sync_api.expect(page.locator(elem)).to_be_hidden()
        # A visitor's card: the device, the queue and their place in it.
        card = page.locator("#hui-visitor-card")
        sync_api.expect(card).to_contain_text(kiosk["engine"].status().device_name)
        sync_api.expect(card).to_contain_text("waiting")
        sync_api.expect(card).to_contain_text("You")
    with new_page(browser) as page:
        page.goto(kiosk["url"] + "operator")
        page.get_by_label("Name").fill(OPERATOR[0])
        page.get_by_label("Password").fill(OPERATOR[1])
        page.get_by_role("button", name="Sign in").click()  # and the app opens (303 to it)
        # The operator's page load labels the attention dropdown ("auto → ..."): shown, and filled.
        sync_api.expect(page.locator("#hui-attention input")).to_have_value(re.compile("[→—]"), timeout=60_000)
        sync_api.expect(page.locator("#hui-speed")).to_be_visible()
        # "Load model" shows while there is a model to load (an earlier test may have loaded it).
        load = page.locator("#hui-load-model")
        sync_api.expect(load).to_be_hidden() if kiosk["engine"].loaded else sync_api.expect(load).to_be_visible()
        # The operator gets the whole panel, visitors the small card.
        sync_api.expect(page.locator("#hui-status-details")).to_be_visible()
        sync_api.expect(page.locator("#hui-visitor-card")).to_be_hidden()
