"""The Gradio UI: `layout.build_demo(engine)` (widgets and wiring) and `handlers` (what they do).

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
