"""Beside the Edit tab's result: "Send to my phone" (a QR code of an expiring link to the result's PNG,
server/share_links.py) and, with ``--wall``, "Show on the wall" (the booth's big screen, /wall).

Both act only on the tab's own result (the "Download PNG" file the edit produced): a visitor names no
path, so the wall can show nothing but results whose visitors ticked the box. The link and the wall
read the PNG through the app's own file route as the visitor (server/share_routes.py).
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass

import gradio as gr

from hidream_ui.server import share_links
from hidream_ui.server.loopback import Caller

QR_SCALE = 6  # pixels per QR module: ~250 px for an hour link on a laptop's host name


@dataclass
class SharePhoneHandles:
    box: gr.Column  # hidden until there is a result
    phone_button: gr.Button
    phone: gr.HTML  # the QR code, the link and when it expires
    wall: gr.Checkbox  # shown only with --wall


def _caller(request: gr.Request | None) -> Caller:
    client = getattr(request, "client", None)
    address = str(getattr(client, "host", None) or "unknown")
    user = getattr(request, "username", None)
    return Caller(address=address, agent=f"share:{address}", user=user)


def base_url(request: gr.Request | None) -> str:
    """The address the visitor reached the app by (its Host header, with the connection's scheme)."""
    headers = getattr(request, "headers", None) or {}
    host = headers.get("host")
    if not host:
        raise gr.Error("This request names no host: the link cannot be made.")
    url = getattr(request, "url", None)
    scheme = getattr(url, "scheme", None) or "http"
    return f"{scheme}://{host}"


def qr_data_uri(url: str) -> str:
    """A PNG QR code of `url` as a data: URI (segno: pure Python, no other dependency)."""
    import segno

    return segno.make(url, error="m").png_data_uri(scale=QR_SCALE, border=2)


def phone_html(link: share_links.PhoneLink, now: float | None = None) -> str:
    minutes = max(0, round((link.expires_at - (time.time() if now is None else now)) / 60))
    at = time.strftime("%H:%M UTC", time.gmtime(link.expires_at))
    url = html.escape(link.url, quote=True)
    return (
        f'<div class="hui-phone" data-link="{url}">'
        f'<img src="{qr_data_uri(link.url)}" alt="QR code of the link to this result" data-link="{url}" '
        'style="width:180px;height:180px;image-rendering:pixelated">'
        "<p>Scan it with your phone, or open "
        f'<a href="{url}" target="_blank" rel="noopener" style="word-break:break-all">{url}</a>.'
        f" The link works for {minutes} minutes (until {at}).</p></div>"
    )


def build_share_phone(config, result, saved_png) -> SharePhoneHandles:
    """Builds the controls under the result (call inside the result column) and wires them:
    `result` (the before/after slider) changes with each new result, `saved_png` holds its file."""
    table = share_links.of(gr.context.Context.root_block)
    with gr.Column(visible=False, elem_id="hui-share-box") as box:
        with gr.Row(equal_height=True):
            phone_button = gr.Button("Send to my phone", size="sm", variant="secondary", elem_id="hui-phone-button")
            wall = gr.Checkbox(
                value=False, label="Show on the wall", visible=bool(config.wall), elem_id="hui-wall-checkbox"
            )
        phone = gr.HTML(visible=False, elem_id="hui-phone")

    def new_result(path):
        # Each result starts unshared: no QR of the previous one, not on the wall.
        return gr.update(visible=bool(path)), gr.update(value="", visible=False), False

    def send(path, request: gr.Request = None):
        if not path:
            raise gr.Error("There is no result to send yet.")
        link = table.phone_link(_caller(request), str(path), base_url(request))
        return gr.update(value=phone_html(link), visible=True)

    def show_on_wall(show, path, request: gr.Request = None):
        if path:
            table.show_on_wall(_caller(request), str(path), bool(show))

    private = {"queue": False, "show_progress": "hidden", "api_visibility": "private"}
    result.change(new_result, [saved_png], [box, phone, wall], **private)
    phone_button.click(send, [saved_png], [phone], **private)
    wall.input(show_on_wall, [wall, saved_png], None, **private)
    return SharePhoneHandles(box=box, phone_button=phone_button, phone=phone, wall=wall)


__all__ = ["SharePhoneHandles", "base_url", "build_share_phone", "phone_html", "qr_data_uri"]
