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
  `OperatorLogin` middleware): a small form whose POST ``/operator/login`` checks the operator's
  name and password and, when they match, issues gradio's own session cookie
  (`gradio_internals.sign_in`). Gradio then names the operator in every request of that browser
  (`gr.Request.username`), exactly as after its own login. The guard throttles these attempts
  like gradio's logins (a path ending in ``/login``). ``/logout`` (gradio's) signs out.
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
MAX_LOGIN_BODY = 4096  # a name and a password; a larger body is not a login

_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>Operator login</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font-family:sans-serif;max-width:24em;margin:4em auto}}input{{display:block;width:100%;margin:.3em 0 1em}}
</style></head><body><h2>Operator login</h2><p>{message}</p>{body}</body></html>"""
_FORM = """<form method="post" action="{action}">
<label>Name<input name="username" autocomplete="username" required></label>
<label>Password<input name="password" type="password" autocomplete="current-password" required></label>
<button type="submit">Log in</button></form>"""


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
    """ASGI middleware: GET /operator (the form) and POST /operator/login (the check)."""

    def __init__(self, app, *, operator: tuple[str, str]):
        self.app = app
        self.user, self.password = operator

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http":
            path = str(scope.get("path", "")).rstrip("/")
            method = scope.get("method")
            if path == OPERATOR_PATH and method in ("GET", "HEAD"):
                return await _page(
                    send,
                    200,
                    "Sign in to change the engine-wide settings (attention, speed, load model).",
                    _form(scope),
                )
            if path == LOGIN_PATH and method == "POST":
                return await self._login(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _login(self, scope, receive, send):
        # The first Content-Type, as starlette (and so the guard's throttle) reads it; the guard
        # refuses requests that carry several.
        content_type = (
            next((value for key, value in scope.get("headers", ()) if key == b"content-type"), b"")
            .split(b";")[0]
            .strip()
            .lower()
        )
        if content_type != b"application/x-www-form-urlencoded":
            return await _page(send, 415, "Send the form (application/x-www-form-urlencoded).", "")
        body, more = b"", True
        while more:
            message = await receive()
            if message.get("type") == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > MAX_LOGIN_BODY:
                return await _page(send, 413, "That is not a login form.", "")
        fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
        users, passwords = fields.get("username", []), fields.get("password", [])
        if len(users) != 1 or len(passwords) != 1:  # one of each: no guessing which one is read
            return await _page(send, 400, "Give one name and one password.", _form(scope))
        # Both compared in full, whatever the first says: the time taken tells nothing.
        good_user = hmac.compare_digest(users[0].strip().encode(), self.user.encode())
        good_password = hmac.compare_digest(passwords[0].encode(), self.password.encode())
        if not (good_user and good_password):
            logger.warning("operator login refused for %r", users[0][:64])
            return await _page(send, 401, "Incorrect name or password.", _form(scope))
        cookies = gradio_internals.sign_in(scope, self.user)
        if cookies is None:
            return await _page(send, 503, "This gradio version's login cannot be used; see the server log.", "")
        logger.info("operator signed in")
        return await _page(
            send,
            200,
            'Signed in as the operator. <a href="../">Open the app</a>; <a href="../logout">log out</a> when done.',
            "",
            cookies,
        )


def _form(scope) -> str:
    """The login form, posting to an absolute path: the form is also served from /operator/ and from
    /operator/login (after a wrong password), where a relative action would point elsewhere."""
    root = str(scope.get("root_path", "") or "").rstrip("/")
    return _FORM.format(action=html.escape(root + LOGIN_PATH))


async def _page(send, status: int, message: str, body: str, headers: list | None = None) -> None:
    text = _PAGE.format(message=message if status == 200 else html.escape(message), body=body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/html; charset=utf-8"),
                (b"cache-control", b"no-store"),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": text})


__all__ = ["OperatorLogin", "OPERATOR_PATH", "is_operator", "may_change_engine", "refusal"]
