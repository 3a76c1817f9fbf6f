"""The seam to Gradio's private internals (hidream_ui/server/gradio_seam.py): a Gradio upgrade is
noticed here, with the overrides to re-check named, before it breaks a booth.

* each registered override names the Gradio version it was checked against: a different installed
  Gradio fails, listing the overrides (names and targets) to re-check;
* every private attribute, parameter, route and source line an override relies on still exists on
  the installed Gradio (checked on real instances: most of them are set in ``__init__``);
* every override has a body, every body is registered, and gradio's private modules are imported
  only behind the seam.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
from pathlib import Path

import pytest

from hidream_ui.server import gradio_seam
from hidream_ui.server.gradio_seam import OVERRIDES

ROOT = Path(__file__).resolve().parent.parent / "hidream_ui"

# Gradio's modules that hold no public API: imported by the seam's bodies alone.
PRIVATE_MODULES = frozenset(
    {
        "gradio.queueing",
        "gradio.state_holder",
        "gradio.route_utils",
        "gradio.routes",
        "gradio.blocks",
        "gradio.block_function",
        "gradio.context",
        "gradio.processing_utils",
        "gradio.server_messages",
        "gradio.utils",
    }
)
SEAM_MODULES = (
    "server/gradio_queue.py",
    "server/gradio_sessions.py",
    "server/gradio_cache.py",
    "server/gradio_seam.py",
)
# Gradio's private state read by name outside the seam (attribute names no public API has).
PRIVATE_NAMES = (
    "state_holder",
    "session_data",
    "upload_file_set",
    "temp_file_sets",
    "event_queue_per_concurrency_id",
    "active_jobs",
    "keep_in_cache",
    "LocalContext",
    "SessionState",
    "StateHolder",
    '"_queue"',
)
# `demo._queue` (gradio's queue), not a method of the app's own named `_queue`.
PRIVATE_PATTERN = re.compile(r"\._queue\b(?!\s*\()")
# Files outside the seam allowed to name them, and why (each one a place to move behind the seam).
KNOWN_OUTSIDE = {
    "bench/abuse_child.py": "the abuse bench caps and logs gradio's session table (not part of the app)",
}


def test_every_override_was_checked_against_the_installed_gradio():
    installed = importlib.metadata.version("gradio")
    stale = gradio_seam.unchecked(installed)
    assert not stale, gradio_seam.recheck_message(stale, installed)


def test_a_different_gradio_names_the_overrides_to_recheck():
    stale = gradio_seam.unchecked("0.0.0-not-installed")
    assert stale == list(OVERRIDES)
    message = gradio_seam.recheck_message(stale, "0.0.0-not-installed")
    for entry in OVERRIDES:
        assert f"{entry.name}: {entry.target} (checked with {entry.checked_with})" in message


def _samples() -> dict[type, object]:
    """A real instance of every gradio class whose instance attributes an override touches."""
    import gradio as gr
    from gradio import block_function, blocks, data_classes, queueing, routes, state_holder

    with gr.Blocks() as demo:
        box = gr.Textbox()
        gr.State()
        button = gr.Button()
        button.click(lambda text: text, box, box, api_name="echo", concurrency_id="device")
    demo.queue()
    app = routes.App.create_app(demo)
    fn = next(iter(demo.fns.values()))
    return {
        blocks.Blocks: demo,
        blocks.Block: box,
        blocks.BlocksConfig: demo.default_config,
        block_function.BlockFunction: fn,
        queueing.Queue: demo._queue,
        queueing.EventQueue: queueing.EventQueue("device", 1),
        queueing.Event: queueing.Event(None, fn, None, None),
        routes.App: app,
        state_holder.StateHolder: demo.state_holder,
        state_holder.SessionState: state_holder.SessionState(demo),
        data_classes.PredictBodyInternal: data_classes.PredictBodyInternal(data=[], fn_index=0, session_hash="s"),
    }


def _route_paths(routes, prefix: str = "") -> set[str]:
    paths: set[str] = set()
    for route in routes:
        inner = getattr(route, "original_router", None) or route  # FastAPI's included routers
        if hasattr(inner, "routes") and not hasattr(route, "endpoint"):
            paths |= _route_paths(inner.routes, prefix + (getattr(route, "path", "") or ""))
        elif getattr(route, "path", None):
            paths.add(prefix + route.path)
    return paths


def test_everything_the_overrides_touch_exists_on_the_installed_gradio():
    samples = _samples()
    paths = _route_paths(samples[next(k for k in samples if k.__name__ == "App")].routes)
    problems = []
    for entry in OVERRIDES:
        problems += gradio_seam.missing_touches(entry, samples)
        problems += gradio_seam.missing_routes(entry, paths)
    assert not problems, "gradio no longer has what these overrides use:\n" + "\n".join(problems)


def test_every_override_has_a_body_and_every_body_is_registered():
    from hidream_ui.server import gradio_internals, guard, operator  # noqa: F401  (registers the bodies)

    assert not [name for name, bodies in gradio_seam.BODIES.items() if not bodies], gradio_seam.BODIES
    # The facade's functions: each one an override's body, except the plain helpers below.
    plain = {"cache_files", "private_cache_folder", "register_demo", "unchecked"}
    unregistered = [
        name
        for name in gradio_internals.__all__
        if callable(getattr(gradio_internals, name))
        and not isinstance(getattr(gradio_internals, name), type)
        and name not in plain
        and not hasattr(getattr(gradio_internals, name), "__gradio_override__")
    ]
    assert not unregistered, f"functions of gradio_internals with no registered override: {unregistered}"
    with pytest.raises(ValueError, match="not a registered Gradio override"):
        gradio_seam.override("no_such_override")


def _gradio_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name.startswith("gradio.")}


def test_gradio_private_modules_and_state_are_used_only_behind_the_seam():
    leaks = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative in SEAM_MODULES:
            continue
        private = sorted(_gradio_imports(path) & PRIVATE_MODULES)
        if private:
            leaks.append(f"{relative} imports {private}")
        if relative in KNOWN_OUTSIDE:
            continue
        text = path.read_text(encoding="utf-8")
        named = [name for name in PRIVATE_NAMES if name in text] + PRIVATE_PATTERN.findall(text)
        if named:
            leaks.append(f"{relative} names gradio's private state {named}")
    assert not leaks, "use hidream_ui.server.gradio_internals (the seam) instead:\n" + "\n".join(leaks)
