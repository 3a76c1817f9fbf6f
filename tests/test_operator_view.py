"""An operator who knows they are signed in (issue 56): the start-up line names /operator, the
login page is the app's (styled, self-contained, errors and the throttle's wait in place), a good
login opens the app (303 to /), and the operator's page shows the badge ("Operator · <name>"),
Log out and the engine controls in view at 1440x900; visitors see none of it.

The page, the start-up line and the middleware are checked directly (fast); the app's own routes,
the guard and the browser against launched apps (slow). Needs Debian's /usr/bin/chromium.
"""

from __future__ import annotations

import asyncio
import re
import types
from pathlib import Path

import gradio as gr
import httpx
import pytest

from hidream_ui.config import AppConfig
from hidream_ui.server.operator import CSP, OperatorLogin, login_page, startup_line
from hidream_ui.ui.operator_badge import BADGE_ID, badge_html, badge_update, build_operator_badge

OPERATOR = ("booth-operator", "op-s3cret-pass")
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
DESKTOP, PHONE = {"width": 1440, "height": 900}, {"width": 390, "height": 844}


# ---------------------------------------------------------------------------------------------
# The start-up line, the page and the badge's HTML
# ---------------------------------------------------------------------------------------------


def test_the_start_up_line_names_the_operators_page():
    kiosk = AppConfig(kiosk=True, operator=OPERATOR, host="0.0.0.0", port=7901)
    line = startup_line(kiosk)
    assert "http://0.0.0.0:7901/operator" in line and "attention, speed, load model" in line
    assert OPERATOR[1] not in line and OPERATOR[0] not in line  # no secret, not even the name
    # With --auth the operator logs in on gradio's login page: no /operator to send anyone to.
    with_auth = startup_line(AppConfig(kiosk=True, operator=OPERATOR, auth=("visitor", "v-pass"), port=7902))
    assert "/operator" not in with_auth and "login page (http://127.0.0.1:7902/)" in with_auth
    assert "v-pass" not in with_auth
    assert "nobody can change them" in startup_line(AppConfig(kiosk=True))
    assert startup_line(AppConfig()) is None  # no kiosk, no operator: nothing to say


def test_the_login_page_is_the_apps_styled_and_self_contained():
    page = login_page()
    assert re.search(r'<form id="op-form" method="post" action="/operator/login">', page)
    assert 'name="username"' in page and 'type="password"' in page and ">Sign in</button>" in page
    assert 'name="viewport" content="width=device-width' in page  # a phone's width
    # The app's Soft theme: its indigo and its font (served by the app itself).
    assert "#6366f1" in page and "'Montserrat'" in page and "url('/static/fonts/Montserrat/" in page
    # Nothing from elsewhere: no absolute or protocol-relative URL, no <link>, no external script.
    assert not re.search(r"(?:https?:)?//[\w.-]", page), re.findall(r"(?:https?:)?//[\w.-]+", page)
    assert "<link" not in page and "<script src" not in page and "@import" not in page
    assert 'id="op-message" class="message error" role="alert" hidden' in page  # no error yet
    # An error shows, escaped, in the box the script also writes to.
    refused = login_page(error="Incorrect <name> or password.")
    assert 'role="alert">Incorrect &lt;name&gt; or password.</p>' in refused
    # Under a root path every link, the form and the font go under it.
    rooted = login_page("/booth/")
    assert 'action="/booth/operator/login"' in rooted and 'href="/booth/"' in rooted
    assert "url('/booth/static/fonts/" in rooted
    # A browser already signed in gets the way to the app and out, not the form.
    signed_in = login_page(signed_in="op")
    assert "<form" not in signed_in and 'href="/logout"' in signed_in and "Signed in as the operator (op)" in signed_in


def test_the_badge_names_the_operator_and_links_to_log_out():
    html = badge_html("op <b>")
    assert "Operator · op &lt;b&gt;" in html and "<b>" not in html
    assert 'href="logout"' in html  # gradio's /logout, relative to the app's page (a root path too)
    assert 'href="#hui-engine-controls"' in html


def test_the_badge_is_filled_for_the_operator_only():
    config = AppConfig(kiosk=True, operator=OPERATOR)
    visitor = badge_update(config, types.SimpleNamespace(username=None))
    assert visitor["visible"] is False and visitor["value"] == ""
    assert badge_update(config, types.SimpleNamespace(username="someone"))["visible"] is False  # --auth's users
    assert badge_update(config, None)["visible"] is False
    operator = badge_update(config, types.SimpleNamespace(username=OPERATOR[0]))
    assert operator["visible"] is True and f"Operator · {OPERATOR[0]}" in operator["value"]
    # No operator, no badge: not even a hidden component.
    for config in (AppConfig(), AppConfig(kiosk=True)):
        assert build_operator_badge(config, demo=None) is None


@pytest.mark.slow
def test_the_badge_is_built_hidden_and_empty_and_filled_on_page_load():
    with gr.Blocks() as demo:
        badge = build_operator_badge(AppConfig(kiosk=True, operator=OPERATOR), demo)
    assert badge.visible is False and badge.value == ""  # the page config names nobody
    fill = next(fn.fn for fn in demo.fns.values() if fn.fn.__name__ == "operator_badge")
    assert fill(types.SimpleNamespace(username=OPERATOR[0]))["visible"] is True
    assert fill(types.SimpleNamespace(username=None))["visible"] is False


# ---------------------------------------------------------------------------------------------
# The middleware, driven as ASGI (no server)
# ---------------------------------------------------------------------------------------------


def asgi(method: str, path: str, body: bytes = b"", *, root_path: str = "", app=None, cookie: str = "") -> dict:
    """One request through OperatorLogin (whatever it passes on answers 404); the answer's parts."""
    sent, passed = [], []
    gradio_app = app or types.SimpleNamespace(tokens={}, cookie_id="c1")

    async def inner(scope, receive, send):
        passed.append(scope["path"])
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    headers = [(b"content-type", b"application/x-www-form-urlencoded")]
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    scope = {"type": "http", "method": method, "path": path, "root_path": root_path, "headers": headers}
    scope["app"] = gradio_app
    asyncio.run(OperatorLogin(inner, operator=OPERATOR)(scope, receive, send))
    start = sent[0]
    return {
        "status": start["status"],
        "headers": [(k.decode(), v.decode()) for k, v in start["headers"]],
        "body": b"".join(m.get("body", b"") for m in sent[1:]).decode(),
        "passed": passed,
        "tokens": gradio_app.tokens,
    }


def header(answer: dict, name: str) -> list[str]:
    return [value for key, value in answer["headers"] if key == name]


def test_a_good_login_is_a_303_to_the_app_with_gradios_cookie():
    good = f"username={OPERATOR[0]}&password={OPERATOR[1]}".encode()
    answer = asgi("POST", "/operator/login", good)
    assert answer["status"] == 303 and header(answer, "location") == ["/"]
    assert len(header(answer, "set-cookie")) == 2 and list(answer["tokens"].values()) == [OPERATOR[0]]
    assert answer["body"] == ""
    rooted = asgi("POST", "/operator/login", good, root_path="/booth")
    assert header(rooted, "location") == ["/booth/"]


def test_a_wrong_password_comes_back_as_the_page_with_its_error():
    answer = asgi("POST", "/operator/login", f"username={OPERATOR[0]}&password=guess".encode())
    assert answer["status"] == 401 and not answer["tokens"] and not header(answer, "set-cookie")
    assert re.search(r'id="op-message" class="message error" role="alert">Incorrect name or password', answer["body"])
    assert 'action="/operator/login"' in answer["body"]  # the form again, for the next try
    assert header(answer, "content-security-policy") == [CSP]


def test_the_page_is_served_at_operator_and_knows_a_signed_in_operator():
    answer = asgi("GET", "/operator")
    assert answer["status"] == 200 and "<form" in answer["body"] and not answer["passed"]
    assert "default-src 'none'" in header(answer, "content-security-policy")[0]
    app = types.SimpleNamespace(tokens={"t0k": OPERATOR[0], "v1s": "visitor"}, cookie_id="c1")
    signed_in = asgi("GET", "/operator/", app=app, cookie="access-token-c1=t0k")
    assert "<form" not in signed_in["body"] and "Log out" in signed_in["body"]
    someone_else = asgi("GET", "/operator", app=app, cookie="access-token-c1=v1s")
    assert "<form" in someone_else["body"]
    assert asgi("GET", "/")["passed"] == ["/"]  # the rest is gradio's


# ---------------------------------------------------------------------------------------------
# Against the launched app: the guard, gradio's cookie, the page-load event
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app(launch_app):
    return launch_app("operator_view", kiosk=True, operator=OPERATOR, max_login_failures=3)


def badge_for(http: httpx.Client) -> dict:
    """What the page-load event tells this browser's badge ({"visible": ..., "value": ...})."""
    config = http.get("/config").json()
    badge = next(c["id"] for c in config["components"] if c["props"].get("elem_id") == BADGE_ID)
    index = next(i for i, dep in enumerate(config["dependencies"]) if badge in dep["outputs"])
    answer = http.post("/gradio_api/run/predict", json={"fn_index": index, "data": [], "session_hash": "badge-check"})
    assert answer.status_code == 200, answer.text
    return answer.json()["data"][config["dependencies"][index]["outputs"].index(badge)]


@pytest.mark.slow
def test_signing_in_opens_the_app_and_forgives_the_failures_before_it(app):
    with httpx.Client(base_url=app["url"], timeout=60) as http:
        config_text = http.get("/config").text
        assert OPERATOR[0] not in config_text  # the page config every visitor reads names nobody
        assert badge_for(http)["visible"] is False
        for _ in range(2):
            assert http.post("/operator/login", data={"username": OPERATOR[0], "password": "guess"}).status_code == 401
        signed_in = http.post("/operator/login", data={"username": OPERATOR[0], "password": OPERATOR[1]})
        assert signed_in.status_code == 303 and signed_in.headers["location"] == "/"
        assert http.get("/").status_code == 200
        badge = badge_for(http)
        assert badge["visible"] is True and f"Operator · {OPERATOR[0]}" in badge["value"]
        # The 303 counted as the success it is (as gradio's 200 does): the two failures before it
        # and the attempt itself are forgiven, so this third failure in the minute is not locked out.
        wrong = http.post("/operator/login", data={"username": OPERATOR[0], "password": "guess"})
        assert wrong.status_code == 401, wrong.status_code
        http.get("/logout")
        assert badge_for(http)["visible"] is False


@pytest.fixture(scope="module")
def app_with_auth(launch_app):
    return launch_app("operator_view_auth", kiosk=True, operator=OPERATOR, auth=("visitor", "visitor-pass"))


@pytest.mark.slow
def test_with_auth_the_badge_shows_after_gradios_own_login(app_with_auth):
    for (user, password), shown in ((("visitor", "visitor-pass"), False), (OPERATOR, True)):
        with httpx.Client(base_url=app_with_auth["url"], timeout=60) as http:
            assert http.post("/login", data={"username": user, "password": password}).status_code == 200
            badge = badge_for(http)
            assert badge["visible"] is shown, user
            assert (f"Operator · {OPERATOR[0]}" in badge["value"]) is shown
            assert ('href="logout"' in badge["value"]) is shown


# ---------------------------------------------------------------------------------------------
# In the browser
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


def new_page(browser, viewport: dict):
    page = browser.new_context(viewport=viewport).new_page()
    page.set_default_timeout(60_000)
    return page


def sign_in(page, url: str, password: str) -> None:
    page.goto(url + "operator")
    page.get_by_label("Name").fill(OPERATOR[0])
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Sign in").click()


def wait_for_page_load(page) -> None:
    """The panel leaves "connecting…" when the page-load events (badge, controls) have answered."""
    from playwright import sync_api

    # Its text, not its visibility: a phone folds the System panel at load (issue 56).
    state = page.locator("#hui-status-panel .hui-state")
    sync_api.expect(state).to_have_count(1, timeout=60_000)
    sync_api.expect(state).not_to_have_text(re.compile(r"^\s*connecting"), timeout=60_000)


def in_viewport(page, selector: str) -> bool:
    box = page.locator(selector).bounding_box()
    viewport = page.viewport_size
    return (
        box is not None
        and box["x"] >= 0
        and box["y"] >= 0
        and box["x"] + box["width"] <= viewport["width"]
        and box["y"] + box["height"] <= viewport["height"]
    )


@pytest.mark.slow
def test_the_operator_signs_in_and_lands_on_the_app_with_the_badge_and_the_controls_in_view(app, browser):
    from playwright import sync_api

    ARTIFACTS.mkdir(exist_ok=True)
    page = new_page(browser, DESKTOP)
    try:
        sign_in(page, app["url"], "not-the-password")
        # Said in place (the script), on the same page; the form stays for the next try.
        sync_api.expect(page.locator("#op-message")).to_have_text(re.compile("Incorrect name or password"))
        assert page.url == app["url"] + "operator"
        page.screenshot(path=str(ARTIFACTS / "operator_login_error_desktop.png"))
        page.get_by_label("Password").fill(OPERATOR[1])
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url(app["url"])  # the 303: the app itself, not a text page
        wait_for_page_load(page)
        badge = page.locator(f"#{BADGE_ID}")
        sync_api.expect(badge).to_contain_text(f"Operator · {OPERATOR[0]}")
        sync_api.expect(badge.get_by_role("link", name="Log out")).to_be_visible()
        sync_api.expect(page.locator("#hui-attention input")).to_have_value(re.compile("[→—]"))
        load_selector = "#hui-load-model" if not app["engine"].loaded else "#hui-speed"
        for selector in (f"#{BADGE_ID}", "#hui-attention", "#hui-speed", load_selector):
            assert in_viewport(page, selector), (selector, page.locator(selector).bounding_box())
        page.screenshot(path=str(ARTIFACTS / "operator_view_desktop.png"))

        visitor = new_page(browser, DESKTOP)
        try:
            visitor.goto(app["url"])
            wait_for_page_load(visitor)
            sync_api.expect(visitor.locator("#hui-visitor-card")).to_be_visible()
            for selector in (f"#{BADGE_ID}", "#hui-engine-controls", "#hui-attention", "#hui-load-model"):
                sync_api.expect(visitor.locator(selector)).to_be_hidden()
            assert OPERATOR[0] not in visitor.content() and "Log out" not in visitor.locator("body").inner_text()
        finally:
            visitor.context.close()

        badge.get_by_role("link", name="Log out").click()  # gradio's /logout: back to the app, a visitor
        wait_for_page_load(page)
        sync_api.expect(page.locator("#hui-visitor-card")).to_be_visible()
        sync_api.expect(badge).to_be_hidden()
    finally:
        page.context.close()


@pytest.mark.slow
def test_on_a_phone_the_badge_is_on_the_first_screen(app, browser):
    from playwright import sync_api

    page = new_page(browser, PHONE)
    try:
        page.goto(app["url"] + "operator")
        page.screenshot(path=str(ARTIFACTS / "operator_login_phone.png"))
        assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]  # nothing off the side
        sign_in(page, app["url"], OPERATOR[1])
        page.wait_for_url(app["url"])
        wait_for_page_load(page)
        sync_api.expect(page.locator(f"#{BADGE_ID}")).to_contain_text(f"Operator · {OPERATOR[0]}")
        assert in_viewport(page, f"#{BADGE_ID}")
        page.screenshot(path=str(ARTIFACTS / "operator_view_phone.png"))
        page.locator(f"#{BADGE_ID}").get_by_role("link", name="Engine controls").click()  # the panel is below the tabs
        sync_api.expect(page.locator("#hui-attention")).to_be_in_viewport()
    finally:
        page.context.close()


@pytest.mark.slow
def test_a_locked_form_shows_the_throttles_wait_and_counts_down(app, browser):
    """Last in the module: it locks the operator's name and this address for a minute."""
    from playwright import sync_api

    page = new_page(browser, DESKTOP)
    try:
        message = page.locator("#op-message")
        page.goto(app["url"] + "operator")
        page.get_by_label("Name").fill(OPERATOR[0])
        for attempt in range(6):  # until the guard refuses (3 failures a minute, some maybe spent before)
            message.evaluate("box => { box.textContent = ''; }")  # so the next answer is this try's
            page.get_by_label("Password").fill(f"guess-{attempt}")
            page.get_by_role("button", name="Sign in").click()
            sync_api.expect(message).to_have_text(re.compile(r"\S"))
            if "try again in" in message.inner_text():
                break
            sync_api.expect(message).to_have_text(re.compile("Incorrect name or password"))
        sync_api.expect(message).to_have_text(re.compile(r"Too many failed logins: try again in \d+ s"))
        sync_api.expect(page.get_by_role("button", name="Sign in")).to_be_disabled()
        first = int(re.search(r"in (\d+) s", message.inner_text()).group(1))
        sync_api.expect(message).not_to_have_text(re.compile(rf"in {first} s"), timeout=5_000)  # it counts down
        page.screenshot(path=str(ARTIFACTS / "operator_login_locked_desktop.png"))
    finally:
        page.context.close()
