"""How `bench abuse` talks to the app under test: raw HTTP calls the way curl would send them
(upload, the direct /run route, unqueued events by index, the queue and its event stream) and the
honest client, whose edit beside every attack is a figure of its own. The app itself is
abuse_app.py; the samplers are abuse_samplers.py."""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hidream_ui.bench.abuse_app import AbuseApp

EDIT_INSTRUCTION = "make it blue"
HONEST_INSTRUCTION = "honest client: make it green"


def apple_path() -> Path:
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


def _post(http, path: str, timeout: float, **request) -> CallResult:
    """One unqueued POST and what it answered: it ran when the answer is a 200 with "data" and no
    "error" (the direct /run route and /run/predict answer alike)."""
    import httpx

    started = time.monotonic()
    try:
        answer = http.post(path, timeout=timeout, **request)
    except httpx.TimeoutException:
        return CallResult(False, None, f"no answer in {timeout:.0f} s", seconds=time.monotonic() - started)
    seconds = time.monotonic() - started
    try:
        body = answer.json()
    except ValueError:
        body = {"error": answer.text}
    if not isinstance(body, dict):
        return CallResult(False, answer.status_code, str(body), seconds=seconds)
    if answer.status_code == 200 and "data" in body and not body.get("error"):
        return CallResult(True, 200, data=body["data"], seconds=seconds)
    error = str(body.get("error") or body.get("detail"))
    return CallResult(False, answer.status_code, error, body.get("data"), seconds)


def run_direct(http, api_name: str, data: list, session: str, timeout: float = 120.0) -> CallResult:
    """`POST /gradio_api/run/<api_name>`: the direct REST route, no queue."""
    return _post(http, f"/gradio_api/run/{api_name}", timeout, json={"data": data, "session_hash": session})


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
    request = _body({"fn_index": fn_index, "session_hash": session}, data, encoded_data)
    return _post(http, "/gradio_api/run/predict", timeout, **request)


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

    def ended(ran: bool, status: int | None, error: str | None = None, data: Any = None) -> CallResult:
        return CallResult(ran, status, error, data, time.monotonic() - started, event_id=event_id, messages=messages)

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
                        return ended(False, 200, "ended with no output (cancelled)")
                    if message.get("success"):
                        return ended(True, 200, data=output.get("data"))
                    return ended(False, 200, str(output.get("error") or output.get("title") or output))
                if kind in ("close_stream", "unexpected_error"):
                    return ended(False, 200, str(message.get("message") or kind))
    except httpx.HTTPError as exc:
        return ended(False, None, f"{type(exc).__name__}: {exc}")
    return ended(False, None, f"not finished after {timeout:.0f} s")


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
            code, paths = upload(http, [("apple.png", apple_path().read_bytes())])
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
