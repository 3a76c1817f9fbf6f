"""Operator mode (`--kiosk`, `--operator USER:PASS`): who may change the engine for everyone.

In kiosk mode visitors edit, batch and compare; the engine-wide controls (attention strategy,
Speed setting, Load model) are hidden from them and their APIs refuse (`may_change_engine`,
`refusal`), unless the caller is logged in as the operator. With `--kiosk` and no `--operator`
nobody changes them while the app runs (the flags chose them at start).

How the operator logs in: gradio's login is all-or-nothing (with `auth=` every visitor must log
in), so

* with `--auth` / `--auth-file`, the operator is one more user of gradio's login page
  (`cli.app._auth`), under a name of its own;
* without it, visitors need no login and the operator signs in at ``/operator`` (this module's
  `OperatorLogin` middleware): a page in the app's colours whose form posts to
  ``/operator/login``, which checks the operator's name and password and, when they match, issues
  gradio's own session cookie (`gradio_internals.sign_in`) and sends the browser to the app (303
  to ``/``). Gradio then names the operator in every request of that browser
  (`gr.Request.username`), exactly as after its own login, and the operator's page shows the
  badge, the log-out link and the engine controls (ui/operator_badge.py, ui/system_panel.py).
  The guard throttles these attempts like gradio's logins (a path ending in ``/login``); the
  page's script shows the guard's refusal and its wait. ``/logout`` (gradio's) signs out.

`startup_line(config)` is what the start-up log says about it, so the operator knows where to go.
"""

from __future__ import annotations

import hmac
import html
import logging
from typing import Any
from urllib.parse import parse_qs

from hidream_ui.config import AppConfig
from hidream_ui.server import gradio_internals
from hidream_ui.server.gradio_seam import override

logger = logging.getLogger(__name__)

OPERATOR_PATH = "/operator"
LOGIN_PATH = OPERATOR_PATH + "/login"
LOGOUT_PATH = "/logout"  # gradio's own: drops the session's cookies and tokens, back to the app
MAX_LOGIN_BODY = 4096  # a name and a password; a larger body is not a login
CONTROLS = "attention, speed, load model"  # the engine-wide controls, as the page and the log name them

# The page is its own: nothing is fetched from elsewhere (a booth may be offline, and a login page
# must not load anything a third party could change). The app's font comes from the app itself
# (gradio serves it for its theme); the colours are gradio's Soft theme, which ui/layout.py uses.
# `default-src 'none'` holds the page to that; `frame-ancestors 'none'`: no other site frames it.
CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; font-src 'self'; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)

_STYLE = """
@font-face { font-family: 'Montserrat'; font-weight: 400;
             src: url('{root}/static/fonts/Montserrat/Montserrat-Regular.woff2') format('woff2'); }
@font-face { font-family: 'Montserrat'; font-weight: 700;
             src: url('{root}/static/fonts/Montserrat/Montserrat-Bold.woff2') format('woff2'); }
:root { --primary: #6366f1; --primary-hover: #818cf8; --primary-soft: #eef2ff; --primary-text: #4338ca;
        --page: #f9fafb; --card: #ffffff; --text: #1f2937; --subdued: #6b7280; --border: #e5e7eb;
        --error: #b91c1c; --error-fill: #fef2f2; color-scheme: light dark; }
@media (prefers-color-scheme: dark) {
  :root { --page: #0b0f19; --card: #1f2937; --text: #f3f4f6; --subdued: #9ca3af; --border: #374151;
          --primary-soft: #312e81; --primary-text: #c7d2fe; --error: #fca5a5; --error-fill: #450a0a; } }
* { box-sizing: border-box; }
body { margin: 0; min-height: 100vh; display: flex; align-items: flex-start; justify-content: center;
       background: var(--page); color: var(--text); font: 14px/1.5 'Montserrat', ui-sans-serif, system-ui, sans-serif; }
main { width: 100%; max-width: 26rem; margin: 12vh 1rem 2rem; padding: 1.75rem 1.75rem 1.25rem;
       background: var(--card); border: 1px solid var(--border); border-radius: 12px;
       box-shadow: 0 2px 5px 0 rgb(0 0 0 / 0.1); }
.app { margin: 0; font-size: 12px; font-weight: 700; letter-spacing: .04em; text-transform: uppercase;
       color: var(--primary); }
h1 { margin: .2rem 0 .4rem; font-size: 22px; }
.lead { margin: 0 0 1.1rem; color: var(--subdued); }
.message { margin: 0 0 1rem; padding: .6rem .8rem; border-radius: 6px; border: 1px solid; }
.message.error { color: var(--error); background: var(--error-fill); border-color: var(--error); }
.message.ok { color: var(--primary-text); background: var(--primary-soft); border-color: var(--primary); }
.message[hidden] { display: none; }
label { display: block; margin: 0 0 .9rem; font-weight: 700; }
input { display: block; width: 100%; margin-top: .3rem; padding: .65rem .75rem; font: inherit; font-weight: 400;
        color: var(--text); background: var(--card); border: 1px solid var(--border); border-radius: 6px; }
input:focus { outline: 2px solid var(--primary); outline-offset: 1px; border-color: var(--primary); }
button { width: 100%; margin-top: .3rem; padding: .7rem; font: inherit; font-weight: 700; color: #fff;
         background: var(--primary); border: 0; border-radius: 6px; cursor: pointer; }
button:hover { background: var(--primary-hover); }
button:disabled { opacity: .55; cursor: not-allowed; }
.links { display: flex; flex-wrap: wrap; gap: .4rem 1.2rem; margin: 1.1rem 0 0; font-size: 13px; }
a { color: var(--primary); font-weight: 700; }
@media (max-width: 480px) { main { margin-top: 1.5rem; padding: 1.25rem 1.1rem 1rem; } }
"""

# Without a script the form posts as usual (the 303 opens the app, a wrong password comes back as
# this page with its error). With it, the page stays put and says what went wrong in place,
# including the guard's refusal, which is JSON (`{"detail": ...}`) with a Retry-After: a locked
# form counts down and comes back by itself.
_SCRIPT = """
(() => {
  const form = document.getElementById('op-form'), box = document.getElementById('op-message');
  if (!form || !window.fetch) return;
  const button = form.querySelector('button');
  let timer = null;
  const say = (text, kind) => { box.textContent = text; box.className = 'message ' + kind; box.hidden = !text; };
  const wait = (seconds, text) => {
    clearInterval(timer);
    let left = seconds;
    button.disabled = true;
    const tick = () => {
      if (left <= 0) { clearInterval(timer); button.disabled = false; say('You can try again now.', 'ok'); return; }
      say(text.replace(/\\d+ s\\b/, left + ' s'), 'error');
      left -= 1;
    };
    tick();
    timer = setInterval(tick, 1000);
  };
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    button.disabled = true;
    let answer;
    try {
      answer = await fetch(form.action, { method: 'POST', body: new URLSearchParams(new FormData(form)),
                                          credentials: 'same-origin', redirect: 'follow' });
    } catch (error) {
      button.disabled = false;
      say('The app did not answer: is it still running?', 'error');
      return;
    }
    if (answer.redirected) { window.location.assign(answer.url); return; }
    let text = 'Login refused (HTTP ' + answer.status + ').';
    const type = answer.headers.get('content-type') || '';
    if (type.includes('json')) {
      const data = await answer.json().catch(() => ({}));
      if (typeof data.detail === 'string') text = data.detail;
    } else {
      const page = new DOMParser().parseFromString(await answer.text(), 'text/html');
      const message = page.getElementById('op-message');
      if (message && message.textContent.trim()) text = message.textContent.trim();
    }
    const retry = parseInt(answer.headers.get('retry-after') || '', 10);
    form.elements.password.value = '';
    if (answer.status === 429 && retry > 0) { wait(retry, text); return; }
    button.disabled = false;
    say(text, 'error');
    form.elements.password.focus();
  });
})();
"""

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Operator sign-in · HiDream-E1</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><meta name="robots" content="noindex">
<style>{style}</style></head>
<body><main>
<p class="app">HiDream-E1 image editing</p>
<h1>Operator sign-in</h1>
<p class="lead">{lead}</p>
<p id="op-message" class="message {kind}" role="alert"{hidden}>{message}</p>
{body}
<p class="links">{links}</p>
</main>{script}</body></html>"""

_FORM = """<form id="op-form" method="post" action="{action}">
<label>Name<input name="username" autocomplete="username" autocapitalize="none" spellcheck="false"
 required autofocus></label>
<label>Password<input name="password" type="password" autocomplete="current-password" required></label>
<button type="submit">Sign in</button></form>"""

LEAD = (
    f"For the booth's operator: sign in to change the engine-wide settings ({CONTROLS}). "
    "Visitors do not need to sign in."
)


def startup_line(config: AppConfig) -> str | None:
    """What the start-up log says about the operator (None without --kiosk): where the operator
    signs in, or that nobody can. Names neither the operator nor the password."""
    if not config.kiosk:
        return None
    base = f"http://{config.host}:{config.port}"
    if config.operator is None:
        return (
            "Kiosk mode without --operator: attention and speed stay as the flags set them; "
            "nobody can change them while the app runs."
        )
    if config.auth is not None or config.auth_file is not None:
        where = f"logs in on the app's login page ({base}/) with the --operator name and password"
    else:
        where = f"signs in at {base}{OPERATOR_PATH} with the --operator name and password"
    return (
        f"Kiosk mode: visitors edit, the operator {where}; the engine controls ({CONTROLS}) "
        "show on the operator's page only."
    )


def login_page(root: str = "", *, error: str = "", signed_in: str | None = None) -> str:
    """The /operator page (HTML, self-contained): the form, `error` (plain text) above it, or, for
    a browser already signed in as the operator (`signed_in`: the name), the way back to the app
    and the log-out link instead of the form. `root`: the app's root path ("" at the top)."""
    root = root.rstrip("/")
    app, logout = html.escape(root + "/"), html.escape(root + LOGOUT_PATH)
    if signed_in is not None:
        message, kind = f"Signed in as the operator ({signed_in}).", "ok"
        body, script = "", ""
        links = f'<a href="{app}">Open the app</a><a href="{logout}">Log out</a>'
    else:
        message, kind = error, "error"
        body, script = _FORM.format(action=html.escape(root + LOGIN_PATH)), f"<script>{_SCRIPT}</script>"
        links = f'<a href="{app}">Back to the app</a>'
    return _PAGE.format(
        style=_STYLE.replace("{root}", html.escape(root)),
        lead=html.escape(LEAD),
        kind=kind,
        hidden="" if message else " hidden",
        message=html.escape(message),
        body=body,
        links=links,
        script=script,
    )


def is_operator(config: AppConfig, request: Any) -> bool:
    """True when the request's login (gradio's `gr.Request.username`) is the operator's."""
    if config.operator is None:
        return False
    username = getattr(request, "username", None)
    return isinstance(username, str) and hmac.compare_digest(username.encode(), config.operator[0].encode())


def may_change_engine(config: AppConfig, request: Any) -> bool:
    """Whether this request may change engine-wide settings: anyone without --kiosk, the operator with it."""
    return not config.kiosk or is_operator(config, request)


def refusal(config: AppConfig, what: str) -> str:
    """The message a refused visitor reads (`what`: "the attention strategy", ...)."""
    if config.operator is None:
        return (
            f"In kiosk mode only the operator controls {what}, and this app was started without an "
            "operator (--kiosk without --operator): it stays as set at start."
        )
    return (
        f"In kiosk mode only the operator controls {what}: log in as the operator (at {OPERATOR_PATH}, "
        "or on the login page) to change it."
    )


@override("http_routes")  # gradio's routes, by path and body (gradio_seam)
class OperatorLogin:
    """ASGI middleware: GET /operator (the page) and POST /operator/login (the check; 303 to the app)."""

    def __init__(self, app, *, operator: tuple[str, str]):
        self.app = app
        self.user, self.password = operator

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http":
            path = str(scope.get("path", "")).rstrip("/")
            method = scope.get("method")
            if path == OPERATOR_PATH and method in ("GET", "HEAD"):
                signed_in = gradio_internals.logged_in_user(scope)
                if not (isinstance(signed_in, str) and hmac.compare_digest(signed_in.encode(), self.user.encode())):
                    signed_in = None
                return await _send_page(send, 200, login_page(_root(scope), signed_in=signed_in))
            if path == LOGIN_PATH and method == "POST":
                return await self._login(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _login(self, scope, receive, send):
        root = _root(scope)
        # The first Content-Type, as starlette (and so the guard's throttle) reads it; the guard
        # refuses requests that carry several.
        content_type = (
            next((value for key, value in scope.get("headers", ()) if key == b"content-type"), b"")
            .split(b";")[0]
            .strip()
            .lower()
        )
        if content_type != b"application/x-www-form-urlencoded":
            return await _send_page(
                send, 415, login_page(root, error="Send the form (application/x-www-form-urlencoded).")
            )
        body, more = b"", True
        while more:
            message = await receive()
            if message.get("type") == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > MAX_LOGIN_BODY:
                return await _send_page(send, 413, login_page(root, error="That is not a login form."))
        fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
        users, passwords = fields.get("username", []), fields.get("password", [])
        if len(users) != 1 or len(passwords) != 1:  # one of each: no guessing which one is read
            return await _send_page(send, 400, login_page(root, error="Give one name and one password."))
        # Both compared in full, whatever the first says: the time taken tells nothing.
        good_user = hmac.compare_digest(users[0].strip().encode(), self.user.encode())
        good_password = hmac.compare_digest(passwords[0].encode(), self.password.encode())
        if not (good_user and good_password):
            logger.warning("operator login refused for %r", users[0][:64])
            return await _send_page(
                send,
                401,
                login_page(root, error="Incorrect name or password. Repeated failures lock the form for a minute."),
            )
        cookies = gradio_internals.sign_in(scope, self.user)
        if cookies is None:
            return await _send_page(
                send, 503, login_page(root, error="This gradio version's login cannot be used; see the server log.")
            )
        logger.info("operator signed in")
        # 303: the browser GETs the app with its new cookie (the guard forgives the failures
        # counted against this name and address on it, as on gradio's own login's 200).
        await send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [
                    (b"location", (root + "/").encode()),
                    (b"cache-control", b"no-store"),
                    (b"content-length", b"0"),
                    *cookies,
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})


def _root(scope) -> str:
    """The app's root path: the page's links and the form post under it (the form is also served
    from /operator/ and /operator/login, where a relative action would point elsewhere)."""
    return str(scope.get("root_path", "") or "").rstrip("/")


async def _send_page(send, status: int, page: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/html; charset=utf-8"),
                (b"cache-control", b"no-store"),
                (b"content-security-policy", CSP.encode()),
                (b"x-content-type-options", b"nosniff"),
                (b"referrer-policy", b"no-referrer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": page.encode()})


__all__ = [
    "OperatorLogin",
    "OPERATOR_PATH",
    "LOGIN_PATH",
    "LOGOUT_PATH",
    "is_operator",
    "login_page",
    "may_change_engine",
    "refusal",
    "startup_line",
]
