"""The operator's badge: "Operator · <name>", a link to the engine controls and gradio's log out.

With ``--kiosk --operator`` the operator shares the booth's page with visitors, so the page says
whose it is: the badge sits under the title, on the operator's page only. It is built hidden and
empty (the page config every browser reads names nobody); the page-load event fills and shows it
for the operator's browser (`is_operator`: gradio's `gr.Request.username`, whether the operator
signed in at ``/operator`` or on gradio's login page with ``--auth``). Visitors get nothing: no
badge, no link, no name. Without ``--kiosk`` or ``--operator`` there is no operator and no badge.

The engine controls themselves are the system panel's (ui/system_panel.py puts them at its top
with ``--kiosk``, so they are in view on a desktop without scrolling); the badge links to them,
which helps on a phone, where the panel comes after the tabs.
"""

from __future__ import annotations

import html
from typing import Any

import gradio as gr

from hidream_ui.config import AppConfig
from hidream_ui.server.operator import LOGOUT_PATH, is_operator

BADGE_ID = "hui-operator-badge"
CONTROLS_ID = "hui-engine-controls"  # ui/system_panel.py's column of the engine controls

# Scoped to the badge (gr.HTML's css_template): the Soft theme's indigo, a pill that wraps on a phone.
BADGE_CSS = """
.hui-operator { display: flex; flex-wrap: wrap; align-items: center; gap: 0.35em 1em;
                padding: 0.35em 0.8em; border-radius: 8px; font-size: 0.9em;
                border: 1px solid var(--primary-300, #a5b4fc); background: var(--primary-50, #eef2ff);
                color: var(--primary-700, #4338ca); }
.hui-operator .hui-operator-name { font-weight: 700; white-space: nowrap; }
/* A green dot: signed in (drawn, not an emoji: a booth's browser may have no emoji font). */
.hui-operator .hui-operator-name::before { content: ""; display: inline-block; width: 0.55em; height: 0.55em;
                                            margin-right: 0.45em; border-radius: 50%; background: #22c55e; }
.hui-operator a { color: inherit; font-weight: 600; white-space: nowrap; }
.hui-operator .hui-operator-links { display: flex; gap: 1em; margin-left: auto; }
@media (max-width: 640px) { .hui-operator .hui-operator-note { display: none; } }
"""


def badge_html(name: str) -> str:
    """The badge for the operator `name`: who is signed in, and the way to the controls and out.
    The log-out link is relative to the app's page (``/logout`` at the top, under a root path too)."""
    return (
        '<div class="hui-operator" role="status">'
        f'<span class="hui-operator-name">Operator · {html.escape(name)}</span>'
        '<span class="hui-operator-note">signed in: the engine controls change every visitor\'s edits</span>'
        '<span class="hui-operator-links">'
        f'<a href="#{CONTROLS_ID}">Engine controls</a>'
        f'<a href="{LOGOUT_PATH.lstrip("/")}" class="hui-operator-logout">Log out</a>'
        "</span></div>"
    )


def badge_update(config: AppConfig, request: Any) -> dict:
    """The badge's update for the browser of `request`: filled and shown for the operator only."""
    if not is_operator(config, request):
        return gr.update(value="", visible=False)
    return gr.update(value=badge_html(request.username), visible=True)


def build_operator_badge(config: AppConfig, demo: gr.Blocks) -> gr.HTML | None:
    """Adds the (hidden) badge where it is called and fills it on page load for the operator's
    browser. None, and nothing added, when the app has no operator (no --kiosk, or no --operator)."""
    if not config.kiosk or config.operator is None:
        return None
    badge = gr.HTML(value="", visible=False, css_template=BADGE_CSS, js_on_load=None, elem_id=BADGE_ID)

    def operator_badge(request: gr.Request = None) -> Any:
        return badge_update(config, request)

    demo.load(operator_badge, None, badge, queue=False, show_progress="hidden", api_visibility="private")
    return badge


__all__ = ["build_operator_badge", "badge_html", "badge_update", "BADGE_ID", "BADGE_CSS"]
