"""The Gradio UI: one module per tab (`edit_tab`, `batch_tab`, `compare_tab`, `history_tab`) and the
`system_panel`, each building its widgets and returning typed handles; `layout.build_demo(engine)`
places and connects them. Each tab owns its handlers (`edit_handlers.EditHandlers`,
`history_tab.HistoryHandlers`, `batch_tab.BatchTab`, `compare_tab.CompareTab`) and so does the
panel (`system_handlers.SystemHandlers`); `layout` builds one of each per app.

Importing this package is free; `build_demo` imports gradio on first use, so the CLI and the
tests of the core never pay for it.
"""

from __future__ import annotations

__all__ = ["build_demo"]


def __getattr__(name: str):
    if name == "build_demo":
        from hidream_ui.ui.layout import build_demo

        return build_demo
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
