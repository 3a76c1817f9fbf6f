"""The core shared by the service routes (issue 57): API keys, the gate that turns a request into a
caller, the loopback's session slots and its reading of gradio's answers, the service router."""

from __future__ import annotations

import asyncio
import types

import pytest

from hidream_ui.server.api_keys import MIN_KEY_LENGTH, ApiGate, ApiKeyFileError, ApiKeys, bearer
from hidream_ui.server.guard import LoginThrottle
from hidream_ui.server.loopback import Caller, CallRefused, Loopback, _outputs, _refusal
from hidream_ui.server.service_routes import Service, ServiceRoutes, lifespans

KEY_A = "a" * MIN_KEY_LENGTH + "-alpha"
KEY_B = "b" * MIN_KEY_LENGTH + "-bravo"


def scope(key: str | None = None, address: str = "10.1.2.3") -> dict:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key is not None else []
    return {"type": "http", "client": (address, 5555), "headers": headers}


def test_the_key_file_gives_labels_by_line_and_never_keeps_a_key(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"# the booth's scripts\n{KEY_A}\n\n{KEY_B}\n")
    keys = ApiKeys.load(path)
    assert keys.label(KEY_A) == "key2" and keys.label(KEY_B) == "key4"
    assert keys.label("a" * MIN_KEY_LENGTH) is None and keys.label("") is None
    assert KEY_A not in repr(keys) and KEY_A.encode() not in b"".join(d for d, _ in keys.digests)


@pytest.mark.parametrize(
    "text, says",
    [("", "holds no key"), ("# only a comment\n", "holds no key"), ("short\n", "line 1"), (f"{KEY_A} x\n", "line 1")],
)
def test_a_key_file_that_cannot_be_used_names_the_file_and_line_but_no_key(tmp_path, text, says):
    path = tmp_path / "keys.txt"
    path.write_text(text)
    with pytest.raises(ApiKeyFileError, match=says) as caught:
        ApiKeys.load(path)
    assert str(path) in str(caught.value) and KEY_A not in str(caught.value)
    with pytest.raises(ApiKeyFileError, match="cannot read"):
        ApiKeys.load(tmp_path / "missing.txt")


def test_bearer_reads_only_the_bearer_scheme():
    assert bearer(scope(KEY_A)) == KEY_A
    assert bearer({"headers": [(b"authorization", b"Basic dXNlcjpwdw==")]}) is None
    assert bearer({"headers": []}) is None


def test_without_keys_only_an_app_without_login_answers_charged_per_address():
    open_gate = ApiGate(None, public=True)
    assert open_gate.caller(scope(address="10.0.0.9")) == Caller("10.0.0.9", "address:10.0.0.9", None)
    with pytest.raises(CallRefused) as refused:
        ApiGate(None, public=False).caller(scope())
    assert refused.value.status == 403 and "--api-keys" in refused.value.message


def test_with_keys_every_call_needs_one_and_a_login_app_sees_a_user_of_the_key(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"{KEY_A}\n")
    keys = ApiKeys.load(path)
    assert ApiGate(keys, public=True).caller(scope(KEY_A)) == Caller("10.1.2.3", "key:key1", None)
    assert ApiGate(keys, public=False).caller(scope(KEY_A)).user == "api-key1"
    narrowed = ApiGate(keys, public=True).caller(scope(KEY_A), agent=lambda base: f"{base}/mcp:s1")
    assert narrowed.agent == "key:key1/mcp:s1"
    for presented, code in ((None, "missing_api_key"), (KEY_B, "invalid_api_key")):
        with pytest.raises(CallRefused) as refused:
            ApiGate(keys, public=True).caller(scope(presented))
        assert (refused.value.status, refused.value.code) == (401, code)


def test_no_login_of_the_app_may_be_named_like_a_keys_login():
    from hidream_ui.server.api_keys import check_login_names, login_of

    check_login_names(["booth", "api-keyring", "api-key", "API-KEY1", "my-api-key1"])  # other names are fine
    for name in (login_of("key1"), "api-key12"):  # the operator named so would be every key1 program
        with pytest.raises(ApiKeyFileError, match=f"'{name}'.*line {name[7:]}"):
            check_login_names(["booth", name])


def test_wrong_keys_are_throttled_per_address_and_a_good_key_is_not_counted(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"{KEY_A}\n")
    now = [0.0]
    gate = ApiGate(ApiKeys.load(path), public=True, throttle=LoginThrottle(3, window=60, clock=lambda: now[0]))
    for _ in range(5):
        gate.caller(scope(KEY_A))  # good keys never fill the budget
    for _ in range(3):
        with pytest.raises(CallRefused, match="Incorrect"):
            gate.caller(scope(KEY_B))
    with pytest.raises(CallRefused) as refused:
        gate.caller(scope(KEY_A))  # the address is over its budget: even a good key waits
    assert refused.value.status == 429 and refused.value.retry_after == pytest.approx(60)
    assert gate.caller(scope(KEY_A, address="10.9.9.9")).agent == "key:key1"  # another address is not
    now[0] = 61
    assert gate.caller(scope(KEY_A)).agent == "key:key1"


def loopback(slots: int = 2) -> Loopback:
    return Loopback(lambda: None, slots=slots, fn_index=lambda name: 7, per_client_message=lambda n: f"at most {n}")


def test_session_ids_are_stable_per_agent_and_slot_unguessable_and_distinct():
    one, other = loopback(), loopback()
    assert one.session("key:key1", 0) == one.session("key:key1", 0)
    ids = {one.session(agent, slot) for agent in ("key:key1", "key:key2") for slot in (0, 1)}
    assert len(ids) == 4 and all(len(i) == 32 and "key" not in i for i in ids)
    assert one.session("key:key1", 0) != other.session("key:key1", 0)  # a secret of each process


def test_an_agent_with_every_slot_busy_is_refused_with_the_per_client_message_before_any_request():
    box = loopback(slots=2)
    held = [box._slots.take("key:key1"), box._slots.take("key:key1")]
    assert held == [0, 1] and box._slots.take("key:key2") == 0  # another agent has its own
    with pytest.raises(CallRefused) as refused:
        asyncio.run(box.call(Caller("10.0.0.1", "key:key1"), "edit", []))  # app_of() is None: never reached
    assert (refused.value.status, refused.value.code, refused.value.message) == (429, "per_client_limit", "at most 2")
    box._slots.give("key:key1", 0)
    assert box._slots.take("key:key1") == 0
    box._slots.give("key:key1", 0), box._slots.give("key:key1", 1), box._slots.give("key:key2", 0)
    assert box._slots.busy == {}  # agents with nothing in flight are forgotten


def answer(status: int, text: str):
    return types.SimpleNamespace(status_code=status, text=text)


def test_gradio_answers_become_outputs_or_refusals_that_name_the_reason():
    done = 'event: generating\ndata: [1]\n\nevent: complete\ndata: ["a", 2]\n\n'
    assert _outputs(answer(200, done), "edit") == ["a", 2]
    with pytest.raises(CallRefused) as refused:
        _outputs(answer(200, 'event: error\ndata: {"error": "steps: got -5"}\n\n'), "edit")
    assert (refused.value.status, refused.value.code, refused.value.message) == (400, "edit_failed", "steps: got -5")
    with pytest.raises(CallRefused) as refused:
        _outputs(answer(200, "event: error\ndata: null\n\n"), "edit")
    assert refused.value.status == 500
    with pytest.raises(CallRefused) as refused:
        _outputs(answer(200, "event: complete\ndata: {}\n\n"), "edit")  # a cancel completes with no outputs
    assert refused.value.code == "cancelled"
    full = _refusal(503, '{"detail": "Queue is full. Max size is 1 and size is 1."}', "edit")
    assert (full.status, full.code) == (503, "queue_full") and full.message.startswith("Queue is full")
    mine = _refusal(422, '{"detail": [{"is_valid": false, "message": "You already have 2 job(s)"}]}', "edit")
    assert (mine.status, mine.code, mine.message) == (429, "per_client_limit", "You already have 2 job(s)")
    wait = _refusal(429, '{"detail": "Too many new sessions from your address: try again in 12 s."}', "edit")
    assert wait.retry_after == 12
    assert _refusal(413, '{"detail": "too big"}', "upload").code == "too_large"


def test_the_router_sends_a_service_its_prefix_and_everything_else_to_gradio():
    seen = []

    def app(name):
        async def asgi(scope, receive, send):
            seen.append((name, scope["path"]))

        return asgi

    router = ServiceRoutes(app("gradio"), services=[Service("openai", "/v1", app("openai"), 10)])
    for path in ("/v1", "/v1/images/edits", "/v10/x", "/gradio_api/upload", "/"):
        asyncio.run(router({"type": "http", "path": path}, None, None))
    assert seen == [("openai", "/v1"), ("openai", "/v1/images/edits"), ("gradio", "/v10/x")] + [
        ("gradio", "/gradio_api/upload"),
        ("gradio", "/"),
    ]


def test_service_lifespans_are_entered_in_order_and_left_in_reverse():
    import contextlib

    trail = []

    def lifespan(name):
        @contextlib.asynccontextmanager
        async def run():
            trail.append(f"+{name}")
            yield
            trail.append(f"-{name}")

        return run

    services = [
        Service("a", "/a", None, 1, lifespan("a")),
        Service("b", "/b", None, 1),
        Service("c", "/c", None, 1, lifespan("c")),
    ]

    async def main():
        async with lifespans(services):
            trail.append("serving")

    asyncio.run(main())
    assert trail == ["+a", "+c", "serving", "-c", "-a"]


def test_the_start_up_log_says_where_the_service_routes_are_and_who_may_call_them(tmp_path):
    from hidream_ui.cli.app import service_lines
    from hidream_ui.config import AppConfig

    keys = tmp_path / "keys.txt"
    assert service_lines(AppConfig(port=7861)) == (
        "OpenAI-compatible images API: http://127.0.0.1:7861/v1/images/edits, open to anyone who can open the "
        "page (no login; --api-keys FILE asks for keys)"
    )
    login = service_lines(AppConfig(auth=("booth", "pw"), mcp=True)).splitlines()
    assert "refused: the app has a login" in login[0] and login[1].startswith("MCP server (streamable HTTP): ")
    keyed = service_lines(AppConfig(auth=("booth", "pw"), api_keys_file=keys))
    assert f"with a key of {keys}" in keyed and "MCP" not in keyed  # no --mcp, no MCP line


def test_the_app_refuses_a_login_named_like_a_keys_login_at_start(tmp_path):
    from hidream_ui.cli.app import launch
    from hidream_ui.config import AppConfig, ConfigError

    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    for config in (
        AppConfig(auth=("api-key2", "pw"), api_keys_file=keys),
        AppConfig(auth=("booth", "pw"), kiosk=True, operator=("api-key1", "pw"), api_keys_file=keys),
        AppConfig(kiosk=True, operator=("api-key7", "pw"), api_keys_file=keys),  # a key added later, too
    ):
        with pytest.raises(ConfigError, match="is the name the API key on line"):
            launch(config, prevent_thread_lock=True, quiet=True)  # refused before any engine is built


def test_a_path_that_only_begins_like_a_service_prefix_keeps_the_guards_json_checks():
    from hidream_ui.server.guard import BoothGuard

    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard = BoothGuard(app, jobs=None, max_body_bytes=10, service_bodies={"/v1": (1000, lambda m: {"m": m})})
    sent = []

    async def send(message):
        sent.append(message)

    def post(path: str, size: int):
        body = b"{" + b" " * (size - 2) + b"}"
        headers = [(b"content-type", b"application/json"), (b"content-length", str(size).encode())]
        scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "client": ("1.2.3.4", 1)}
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive():
            return next(messages)

        sent.clear()
        asyncio.run(guard(scope, receive, send))
        return sent[0]["status"]

    assert post("/v1/images/edits", 500) == 200  # the service's own cap (1000)
    assert post("/v1x", 500) == 413 and post("/v1", 2000) == 413  # /v1x is gradio's: the 10-byte cap
    assert reached == ["/v1/images/edits"]


@pytest.mark.slow
def test_the_start_up_log_of_a_kiosk_names_the_operators_way_in_and_the_service_routes(tiny_cache, tmp_path, capsys):
    from hidream_ui.bench import free_port
    from hidream_ui.cli.app import launch
    from hidream_ui.config import AppConfig

    config = AppConfig(device="cpu", output_dir=tmp_path, port=free_port(), kiosk=True, operator=("booth-op", "pw"))
    demo, _ = launch(config, prevent_thread_lock=True, quiet=False)
    try:
        log = capsys.readouterr().err
    finally:
        demo.close()
    assert f"the operator signs in at http://127.0.0.1:{config.port}/operator" in log
    assert f"OpenAI-compatible images API: http://127.0.0.1:{config.port}/v1/images/edits" in log
    assert "booth-op" not in log and "pw" not in log.replace("pwd", "")  # neither name nor password
