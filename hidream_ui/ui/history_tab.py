"""The History tab: this browser's results, their settings, and the way back into the Edit form.

The entries live in the browser (`gr.BrowserState`): they survive a reload and belong to that
browser only (another visitor never sees them). Beside them the browser keeps its own random
secret (a second BrowserState, made by the server on the first visit): each entry names its result
by an opaque id signed together with that secret (history_entries says what the signature binds).
What comes back from the browser is checked by `history_entries.check_entries` (its first 30
entries only, settings validated, a result only with this server's signature for this browser and
while it still serves it); the checked list stays server-side in a gr.State and "Load settings" /
"Edit again" act on it. The refresh (page load, tab opened) runs queued on a small lane of its own
(server/lanes.py HISTORY_GROUP), with the admission limits of every lane.

`build_history_tab()` adds the tab and returns its `HistoryTabHandles`; `wire_history_tab(...)`
connects it to the Edit tab (a finished edit is added; "Load settings" and a PNG's settings fill
the Edit form, whose widgets are hidream_ui.edits.EDIT_FORM; "Edit again" puts the result in the
source slot). Its handlers are `HistoryHandlers`, below. Imports gradio at the top: only the UI imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from hidream_ui.outputs import load_settings
from hidream_ui.server.lanes import HISTORY_CONCURRENCY, HISTORY_GROUP
from hidream_ui.ui.common import SETTINGS_FILE_CONCURRENCY, SETTINGS_FILE_GROUP, form_values, guarded
from hidream_ui.ui.edit_tab import EditTabHandles
from hidream_ui.ui.history_entries import (
    HISTORY_CSS,
    added,
    browser_secret,
    check_entries,
    new_browser_secret,
    picker_choices,
    render_entries,
    signed,
)
from hidream_ui.ui.services import TabHandlers

STORAGE_KEY = "hidream-ui-history"  # the browser's localStorage key
SECRET_KEY = "hidream-ui-history-secret"  # the browser's secret (history_entries.new_browser_secret)


@dataclass(frozen=True)
class HistoryTabHandles:
    tab: gr.Tab
    stored: gr.BrowserState  # this browser's entries (JSON), newest first
    secret: gr.BrowserState  # this browser's secret, which its entries are signed for ("" until made)
    checked: gr.State  # the same, checked by the server (history_entries.CheckedEntry)
    cards: gr.HTML
    picker: gr.Dropdown
    apply_button: gr.Button
    edit_again_button: gr.Button
    clear_button: gr.Button
    settings_file: gr.File


def build_history_tab() -> HistoryTabHandles:
    """Adds the History tab (call inside `gr.Tabs()`)."""
    with gr.Tab("History", id="history", elem_id="hui-history-tab") as tab:
        gr.Markdown(
            "Your results in this browser, newest first: they stay after a reload, and nobody else "
            "sees them. Pick one to load its settings or to edit it again."
        )
        with gr.Row(equal_height=True, elem_id="hui-history-actions"):
            picker = gr.Dropdown(
                label="Result",
                choices=[],
                value=None,
                interactive=True,
                scale=3,
                min_width=220,
                elem_id="hui-history-picker",
            )
            apply_button = gr.Button("Load settings", scale=1, min_width=120, elem_id="hui-history-load")
            edit_again_button = gr.Button(
                "Edit again", variant="primary", scale=1, min_width=120, elem_id="hui-history-edit"
            )
        cards = gr.HTML(render_entries([]), css_template=HISTORY_CSS, elem_id="hui-history")
        with gr.Row():
            settings_file = gr.File(
                label="…or read the settings of a PNG saved by this app",
                file_types=[".png"],
                type="filepath",
                height=120,
                elem_id="hui-settings-file",
            )
            clear_button = gr.Button(
                "Forget this browser's history", size="sm", variant="secondary", elem_id="hui-history-clear"
            )
        # Rendered by build_demo outside the tabs: a tab's content mounts only once it is opened,
        # and the storage must be written even if the History tab never was.
        stored = gr.BrowserState([], storage_key=STORAGE_KEY, render=False)
        secret = gr.BrowserState("", storage_key=SECRET_KEY, render=False)
        checked = gr.State([])
    return HistoryTabHandles(
        tab=tab,
        stored=stored,
        secret=secret,
        checked=checked,
        cards=cards,
        picker=picker,
        apply_button=apply_button,
        edit_again_button=edit_again_button,
        clear_button=clear_button,
        settings_file=settings_file,
    )


class HistoryHandlers(TabHandlers):
    """The History tab's handlers. What comes back from the browser is checked
    (history_entries.check_entries); the checked list is kept server-side for the session (a
    gr.State) and the buttons act on it."""

    def _history_view(self, stored: Any, secret: str):
        results = self.services.results
        checked = check_entries(stored, lambda result, ticket: results.stored(result, ticket, secret))
        choices = picker_choices(checked)
        picker = gr.update(choices=choices, value=choices[0][1] if choices else None)
        return checked, render_entries(checked), picker

    def add_history(self, stored: Any, secret: Any, entry: dict | None):
        """A finished edit: its entry, signed for this browser, goes first in its History. Returns
        (the browser's list, the checked list, the cards, the picker, the result's buttons row, the
        browser's secret: made here if the page load did not make it)."""
        secret = browser_secret(secret)
        made = (entry or {}).get("history")
        results = self.services.results
        history = added(stored, signed(made, lambda result: results.ticket(result, secret)) if made else None)
        # The result's buttons and seed show with a result (a stopped edit has none).
        return (history, *self._history_view(history, secret), gr.Row(visible=True) if entry else gr.update(), secret)

    def refresh_history(self, stored: Any, secret: Any):
        """The History as this browser stored it (page load, tab opened): checked, then drawn.
        Returns (the checked list, the cards, the picker, the browser's secret: made on its first visit)."""
        secret = browser_secret(secret)
        return (*self._history_view(stored, secret), secret)

    def clear_history(self):
        """Forgets this browser's History (the result files stay on the server until retention) and
        gives it a new secret: a copy of the old entries opens nothing here any more."""
        secret = new_browser_secret()
        return [], *self._history_view([], secret), secret

    @staticmethod
    def _picked(checked: list | None, index: Any):
        try:
            position = int(index)
        except (TypeError, ValueError):
            position = -1
        if not checked or not 0 <= position < len(checked):
            raise gr.Error("Pick a result first.", print_exception=False)
        return checked[position], position

    @guarded("loading the settings")
    def apply_history(self, checked: list | None, index: Any):
        """ "Load settings": the picked result's settings fill the Edit form."""
        entry, position = self._picked(checked, index)
        params = entry.params
        gr.Info(f"Loaded the settings of result {position + 1} (seed {params.seed}).")
        return (*form_values(params), gr.Tabs(selected="edit"))

    @guarded("opening the result")
    def edit_again(self, checked: list | None, index: Any):
        """ "Edit again": the picked result becomes the source of the Edit tab, its instruction
        fills the box. Only a result this server stored for this browser and still serves."""
        entry, _ = self._picked(checked, index)
        if not entry.available:
            raise gr.Error(
                "That result is no longer on this server; “Load settings” still works.", print_exception=False
            )
        return entry.png, entry.params.instruction, gr.Tabs(selected="edit")

    @guarded("reading the PNG")
    def settings_from_file(self, file):
        if not file:
            raise gr.Error("Upload a PNG saved by this app.", print_exception=False)
        # The event runs with preprocess=False: gr.File's preprocessing leaves an empty temp file in
        # gradio's cache on every call. The gate opens only what this app stored (or its examples).
        path, name = self.services.gate.path(file, "file")
        params = load_settings(path)
        gr.Info(f"Loaded the settings from {name or 'the PNG'} (seed {params.seed}).")
        return (*form_values(params), gr.Tabs(selected="edit"))


def wire_history_tab(
    history: HistoryTabHandles, edit: EditTabHandles, tabs: gr.Tabs, handlers: HistoryHandlers, demo: gr.Blocks
) -> None:
    private = {"queue": False, "show_progress": "hidden", "api_visibility": "private"}
    view = [history.checked, history.cards, history.picker]
    # On page load (the browser's storage arrives with it) and whenever the tab opens (retention
    # may have deleted a result since). The browser sends its whole stored list, which it can
    # rewrite to any length under --max-body-kb: queued on a small lane of its own, with the
    # admission limits of every lane (cli/app.py), never beside the queue; it looks at 30 entries.
    lane = {
        "concurrency_id": HISTORY_GROUP,
        "concurrency_limit": HISTORY_CONCURRENCY,
        "show_progress": "hidden",
        "api_visibility": "private",
    }
    refresh = ([history.stored, history.secret], [*view, history.secret])
    demo.load(handlers.refresh_history, *refresh, **lane)
    history.tab.select(handlers.refresh_history, *refresh, **lane)
    # The form round trip: the settings fill the Edit form's widgets in EDIT_FORM order.
    history.apply_button.click(
        handlers.apply_history,
        [history.checked, history.picker],
        [*edit.inputs, tabs],
        queue=False,
        api_visibility="private",
    )
    history.edit_again_button.click(
        handlers.edit_again,
        [history.checked, history.picker],
        [edit.image, edit.form["instruction"], tabs],
        queue=False,
        api_visibility="private",
    )
    history.clear_button.click(handlers.clear_history, None, [history.stored, *view, history.secret], **private)
    # It decodes a client's file: queued on a small lane of its own, with the device lane's admission
    # limits (cli/app.py `admission`), never a way around the queue.
    history.settings_file.upload(
        handlers.settings_from_file,
        [history.settings_file],
        [*edit.inputs, tabs],
        concurrency_id=SETTINGS_FILE_GROUP,
        concurrency_limit=SETTINGS_FILE_CONCURRENCY,
        show_progress="minimal",
        api_visibility="private",
        preprocess=False,
    )


def add_to_history(history: HistoryTabHandles, edit: EditTabHandles, handlers: HistoryHandlers):
    """What a finished edit does to the History tab: `event.success(...)` for an Edit tab event."""

    def chain(event):
        return event.success(
            handlers.add_history,
            [history.stored, history.secret, edit.last_entry],
            [history.stored, history.checked, history.cards, history.picker, edit.result_details, history.secret],
            queue=False,
            show_progress="hidden",
            api_visibility="private",
        )

    return chain


__all__ = [
    "HistoryHandlers",
    "HistoryTabHandles",
    "SECRET_KEY",
    "STORAGE_KEY",
    "build_history_tab",
    "wire_history_tab",
    "add_to_history",
]
