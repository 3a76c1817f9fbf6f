"""The History tab: this session's results, their settings, and the way back into the Edit form.

`build_history_tab()` adds the tab and returns its `HistoryTabHandles`; `wire_history_tab(...)`
connects it to the Edit tab (a finished edit is added; "Load these settings" and a PNG's settings
fill the Edit form, whose widgets are hidream_ui.edits.EDIT_FORM). The handlers are
`handlers.Handlers`. Imports gradio at the top: only the UI imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from hidream_ui.ui.common import SETTINGS_FILE_CONCURRENCY, SETTINGS_FILE_GROUP
from hidream_ui.ui.edit_tab import EditTabHandles
from hidream_ui.ui.handlers import Handlers


@dataclass(frozen=True)
class HistoryTabHandles:
    tab: gr.Tab
    history: gr.State  # this session's entries, newest first
    selected_index: gr.State
    gallery: gr.Gallery
    selected_params: gr.JSON
    apply_button: gr.Button
    settings_file: gr.File


def build_history_tab() -> HistoryTabHandles:
    """Adds the History tab (call inside `gr.Tabs()`)."""
    with gr.Tab("History", id="history") as tab:
        gr.Markdown("Results of this session, newest first. Select one to see its settings.")
        gallery = gr.Gallery(label="Results", columns=5, height=300, object_fit="contain", allow_preview=False,
                             fit_columns=False, interactive=False, elem_id="hui-gallery")
        with gr.Row():
            with gr.Column(scale=2):
                selected_params = gr.JSON(label="Settings of the selected result", elem_id="hui-selected-params")
            with gr.Column(scale=1):
                apply_button = gr.Button("Load these settings into the form", interactive=False)
                settings_file = gr.File(label="…or read the settings of a PNG saved by this app",
                                        file_types=[".png"], type="filepath", elem_id="hui-settings-file")
        history = gr.State([])
        selected_index = gr.State(None)
    return HistoryTabHandles(tab=tab, history=history, selected_index=selected_index, gallery=gallery,
                             selected_params=selected_params, apply_button=apply_button, settings_file=settings_file)


def wire_history_tab(history: HistoryTabHandles, edit: EditTabHandles, tabs: gr.Tabs, handlers: Handlers) -> None:
    private = {"queue": False, "show_progress": "hidden", "api_visibility": "private"}
    history.tab.select(handlers.refresh_history, [history.history], [history.gallery], **private)
    history.gallery.select(handlers.select_history, [history.history],
                           [history.selected_params, history.selected_index, history.apply_button], **private)
    # The form round trip: the settings fill the Edit form's widgets in EDIT_FORM order.
    history.apply_button.click(handlers.apply_history, [history.history, history.selected_index],
                               [*edit.inputs, tabs], queue=False, api_visibility="private")
    # It decodes a client's file: queued on a small lane of its own, with the device lane's admission
    # limits (cli/app.py `admission`), never a way around the queue.
    history.settings_file.upload(handlers.settings_from_file, [history.settings_file], [*edit.inputs, tabs],
                                 concurrency_id=SETTINGS_FILE_GROUP, concurrency_limit=SETTINGS_FILE_CONCURRENCY,
                                 show_progress="minimal", api_visibility="private", preprocess=False)


def add_to_history(history: HistoryTabHandles, edit: EditTabHandles, handlers: Handlers):
    """What a finished edit does to the History tab: `event.success(...)` for an Edit tab event."""

    def chain(event):
        return event.success(handlers.add_history, [history.history, edit.last_entry],
                             [history.history, history.gallery, edit.result_details],
                             queue=False, show_progress="hidden", api_visibility="private")

    return chain


__all__ = ["HistoryTabHandles", "build_history_tab", "wire_history_tab", "add_to_history"]
