"""The Gradio layout: widgets and their wiring, nothing else (the work is in each tab's handlers).

API names are part of the app's contract (README, tests, MCP):

* ``/edit``           image, instruction and every advanced setting -> before/after, saved PNG,
                      seed used, summary
* ``/status``         engine status as JSON (state, device, dtype, attention, memory, queue, ...);
                      never queued, so it answers while the queue is full
* ``/cancel``         stops the caller's own running edit / batch / comparison; never queued
* ``/set_attention``  strategy name [, engine label or "all"] -> the active strategy (refusals are
                      errors with the reason)
* ``/load_model``     loads the model now (otherwise the first edit does)
* ``/set_speed``      exact | fast | faster | a ``--cache`` spec -> the step cache of the next edits
* ``/rewrite``        image, instruction -> the prompt the rewriter makes of it, and its answer
                      (``--rewriter``; an error with the reason when it fails or none is configured)
* ``/edit_rewritten`` like ``/edit``, with the (edited) rewritten prompt and the ``/rewrite`` answer,
                      which the result's metadata records beside the prompt used

Tabs, one module each: Edit (`edit_tab`, its handlers in `edit_handlers`), Batch (`batch_tab`),
Compare (`compare_tab`), History (`history_tab`). The system panel (`system_panel`, its handlers in
`system_handlers` and `speed_setting`) sits outside the tabs so it is visible on all of them. Each
module builds its widgets and returns typed handles; `build_demo` only places and connects them.

The page shows only what the running executor can do (`Engine.capabilities`): a tab it cannot serve
(Compare, Batch) is not built, nor are its API names, and the system panel says why.

Everything that touches the device (edit, load, attention switch) shares the concurrency group
``"device"``, as many at once as there are engines (one per ``--devices`` entry, else 1): an engine
is not re-entrant and users see their queue position.
The status timer, ``/status``, ``/cancel`` and the Stop buttons never wait behind it. Every event
that does work on a client's input is queued (the app serves with ``api_open=False``: the queue
is the only way in); events left unqueued only read server-side state or the status.

With ``--kiosk`` the engine-wide controls (attention, speed, load model) sit in one column that
only the operator's page shows (server/operator.py, ui/system_panel.py).

Imported lazily by the app (it imports gradio at the top).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Sequence

import gradio as gr

from hidream_ui.config import AppConfig
from hidream_ui.engine.protocol import Capabilities, Engine
from hidream_ui.ui.common import resolution_choices
from hidream_ui.ui.edit_handlers import EditHandlers
from hidream_ui.ui.edit_tab import build_edit_tab, load_examples, wire_edit_tab
from hidream_ui.ui.history_tab import HistoryHandlers, add_to_history, build_history_tab, wire_history_tab
from hidream_ui.ui.services import ASSETS_DIR, AppServices
from hidream_ui.ui.system_handlers import SystemHandlers
from hidream_ui.ui.system_panel import build_system_panel

logger = logging.getLogger(__name__)


TINY_BANNER = (
    "⚠️ **Offline tiny model with random weights: every result is noise.** "
    '<span class="hui-banner-more">It exists to try the '
    "app, the queue and the device plumbing without the 17B checkpoints. To edit for real, start "
    "`python app.py --model-dir /path/to/models` (a folder holding `Llama-3.1-8B-Instruct/`, "
    "`HiDream-I1-Full/` and `HiDream-E1-1/` or `HiDream-E1-Full/`), or set `HIDREAM_MODEL_DIR`.</span>"
)


def trained_banner() -> str:
    """The banner of the trained offline model: what it is and the instructions it knows (from its world). The
    first sentence, all a phone shows (APP_CSS), names the three instruction forms; the rest their words."""
    from hidream_ui.model.tiny import world

    # HTML, not Markdown: emphasis nested in bold did not render. The background slot spelled out: 3 words.
    forms = [
        "<i>" + form.replace("{background}", "{" + " / ".join(world.BACKGROUNDS) + "}") + "</i>"
        for form in world.INSTRUCTION_FORMS
    ]
    return (
        f"<b>Offline demo model of coloured shapes: it knows {', '.join(forms[:-1])} and {forms[-1]}.</b> "
        '<span class="hui-banner-more">A tiny HiDream-E1 trained here on 128x128 scenes: shapes '
        f"{' / '.join(world.SHAPES)}, colours {' / '.join(world.COLOURS)}, backgrounds "
        f"{' / '.join(world.BACKGROUNDS)}. {_held_out_line()}"
        "Photos and other words give guesses (the summary names the words it does not know). To edit photos, start "
        "`python app.py --model-dir /path/to/models` or set `HIDREAM_MODEL_DIR`.</span>"
    )


def _held_out_line() -> str:
    """What the shipped weights' recorded held-out test measured (trained.json), in words."""
    from hidream_ui.model.tiny import trained
    from hidream_ui.model.tiny.profiles import PROFILES

    measured = trained.held_out_success(trained.asset_dir(PROFILES["trained"].weights_asset))
    if measured is None:
        return ""
    success, cases = measured
    return (
        f"{round(100 * success)} % of {cases} held-out edits come out as asked; the rest are near misses or "
        "blurred guesses. "
    )


def offline_banner(config: AppConfig) -> str | None:
    """The banner over the app: None with real weights; what the offline model can do otherwise."""
    if not config.uses_tiny_model:
        return None
    return trained_banner() if config.uses_trained_tiny_model else TINY_BANNER


APP_CSS = """
/* The edit's progress shows on the summary (the slider stays free for the live previews): room for it. */
#hui-summary { min-height: 64px; }
#hui-tiny-banner { border: 1px solid #f59e0b; background: rgba(245, 158, 11, 0.12);
                   border-radius: 8px; padding: 0.4em 0.9em; }
#hui-system { position: sticky; top: 0.5em; }
#hui-attention-note { font-size: 0.85em; min-height: 1.2em; }
/* The attention choice in the narrow system column: a smaller font so "auto → sdpa (best available here)"
   fits whole, and an ellipsis where a longer label still cannot (the open list shows every label whole). */
#hui-attention input { font-size: 0.85em; text-overflow: ellipsis; }
#hui-attention ul.options li { white-space: normal; }
/* "Seed used": the label on one line, the number whole. */
#hui-seed-used label span, #hui-seed-used [data-testid="block-info"] { white-space: nowrap; }
#hui-attention-unavailable { font-size: 0.8em; opacity: 0.85; }
.hui-hint { font-size: 0.85em; opacity: 0.85; }
#hui-visitor-card .hui-card { border: 1px solid rgba(127, 127, 127, 0.3); border-radius: 8px; padding: 0.5em; }
/* A refused edit ("Add an image") says what to do in its toast; the summary, where the progress
   runs, keeps what it showed instead of gradio's bare red "Error" box over it. */
#hui-summary [data-testid="status-tracker"]:has(> .error) { display: none; }
/* Image toolbars (download, full screen) in a row of their own above the picture, not over it:
   they hid the grid's last column header. */
#hui-compare-grid .icon-button-wrapper, #hui-compare-slider .icon-button-wrapper {
  position: static; justify-content: flex-end; }
/* Gallery captions: one line over the picture, whole (wrapped) while the pointer is on it, and
   whole in the large view a click opens. */
#hui-batch-gallery .gallery-item:hover .caption-label, #hui-compare-cells .gallery-item:hover .caption-label {
  white-space: normal; overflow: visible; text-overflow: clip; max-width: 100%; opacity: 0.95; }
/* Phones: the banner keeps its one warning line (the how-to is on a wide screen and in README),
   the title shrinks, so the source image and Edit are on the first screen. */
/* The System accordion's label reads as the heading it replaced. */
#hui-system-box > button.label-wrap > span:first-child { font-size: 1.2em; font-weight: 600; }
@media (max-width: 640px) {
  #hui-title h2 { font-size: 1.15em; margin: 0; }
  #hui-tiny-banner { font-size: 0.8em; padding: 0.2em 0.6em; }
  #hui-tiny-banner .hui-banner-more { display: none; }
  /* The examples on the first screen, under Edit (issue 56): a smaller source, short example rows. */
  #hui-source { height: 250px !important; }
  #hui-source .image-container { max-height: 200px; }
  #hui-examples td { padding: 2px 6px; }
  #hui-examples td img, #hui-examples td .container, #hui-examples td .image-container {
    max-height: 44px; max-width: 44px; }
}
"""


# Runs once when the page loads. An error toast belongs to the form it refused: any change the user
# makes in the Edit tab (typing, a slider, a new upload) dismisses the error toasts still shown, so
# a stale "Error (2)" never sits beside a form that has changed since.
APP_JS = """
() => {
  const clear = () => document.querySelectorAll('button[data-testid="toast-close"].error')
    .forEach((button) => button.click());
  // A phone folds the System panel (it ended every tab, issue 56); a wide screen keeps it open. Once, at
  // load: the accordion is drawn a moment after this script runs, hence the retries.
  if (window.matchMedia("(max-width: 640px)").matches) {
    let tries = 0;
    const fold = () => {
      const label = document.querySelector("#hui-system-box > button.label-wrap.open");
      if (label) label.click();
      else if (++tries < 100 && !document.querySelector("#hui-system-box > button.label-wrap")) setTimeout(fold, 100);
    };
    fold();
  }
  // A link to the engine controls (the operator's badge) opens the folded System panel first.
  document.addEventListener("click", (event) => {
    const link = event.target.closest && event.target.closest('a[href="#hui-engine-controls"]');
    const label = document.querySelector("#hui-system-box > button.label-wrap");
    if (!link || !label || label.classList.contains("open")) return;
    event.preventDefault();
    label.click();
    setTimeout(() => document.getElementById("hui-engine-controls")?.scrollIntoView(), 100);
  }, true);
  for (const type of ["input", "change"]) {
    document.addEventListener(type, (event) => {
      if (event.isTrusted && event.target.closest && event.target.closest("#hui-edit-tab")) clear();
    }, true);
  }
}
"""


def launch_options() -> dict[str, Any]:
    """Theme, CSS and the page's script: Gradio 6 takes them in `launch()`, not in `gr.Blocks()`."""
    return {"theme": gr.themes.Soft(), "css": APP_CSS, "js": APP_JS}


def new_blocks(config: AppConfig) -> gr.Blocks:
    """The (empty) Blocks the UI is built into: made before the services, which read it."""
    # Gradio's own cache clean-up: files older than the limit go (checked every minute or sooner),
    # and all of this app's files at shutdown. The file-count limit is the janitor's.
    delete_cache = (max(1, min(60, config.cache_max_age)), config.cache_max_age)
    return gr.Blocks(title="HiDream-E1 image editing", delete_cache=delete_cache)


# Tabs built by their own modules: (module, builder, the capability the executor needs for it). Each
# builder is called as `builder(engine, config, services)` inside the `gr.Tabs()` context, adds one
# `gr.Tab` and returns its handles (whose `resolution_dropdown` gets the model's working
# resolutions on load).
EXTRA_TABS = (
    ("hidream_ui.ui.batch_tab", "build_batch_tab", "batch"),
    ("hidream_ui.ui.compare_tab", "build_compare_tab", "compare"),
)
TabBuilder = Callable[[Engine, Any, AppServices], Any]


def default_extra_tabs(capabilities: Capabilities | None = None) -> list[TabBuilder]:
    """The Batch and Compare tab builders, those the executor can serve (`capabilities`; None: all).
    A tab module that is absent (a trimmed install) is skipped with a log line; one that fails to
    import for any other reason is a bug and raises."""
    builders = []
    for module_name, attribute, capability in EXTRA_TABS:
        if capabilities is not None and not capabilities.has(capability):
            logger.info("the %s tab is left out: %s", capability, capabilities.missing[capability])
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            logger.info("tab module %s not present; its tab is left out", module_name)
            continue
        builders.append(getattr(module, attribute))
    return builders


def build_demo(
    engine: Engine, extra_tabs: Sequence[TabBuilder] | None = None, services: AppServices | None = None
) -> gr.Blocks:
    """The whole UI for `engine`. Builds widgets only: no model load, no torch import.

    `extra_tabs` are tab builders placed between Edit and History (default: Batch and Compare, those
    the executor can serve: `engine.capabilities`; the system panel says why one is left out).
    `services` (jobs, upload gate, served results, rewriter) are shared by every tab; given, they
    hold the Blocks to build into (`new_blocks`). `demo.hidream_services` holds them afterwards.
    """
    config = engine.config
    capabilities = engine.capabilities
    extra_tabs = default_extra_tabs(capabilities) if extra_tabs is None else list(extra_tabs)
    services = services or AppServices.for_config(config, engine=engine, demo=new_blocks(config))
    if services.demo is None:
        raise ValueError(
            "build_demo: the services hold no Blocks; build them with "
            "AppServices.for_config(config, demo=new_blocks(config), ...)"
        )
    edit_handlers = EditHandlers(engine, services)
    history_handlers = HistoryHandlers(engine, services)
    system_handlers = SystemHandlers(engine, services)
    lane = engine.size  # device jobs at once: one per engine (--devices)

    with services.demo as demo:
        gr.Markdown(f"## HiDream-{config.variant.upper()} instruction-based image editing", elem_id="hui-title")
        banner = offline_banner(config)
        if banner:
            gr.Markdown(banner, elem_id="hui-tiny-banner")
        from hidream_ui.ui.operator_badge import build_operator_badge  # --kiosk --operator only

        build_operator_badge(config, demo)  # "Operator · <name>" and Log out, on the operator's page only
        with gr.Row(equal_height=False):
            with gr.Column(scale=4):
                with gr.Tabs(selected="edit") as tabs:
                    edit = build_edit_tab(config, services.rewriter)
                    extra = [build_tab(engine, config, services) for build_tab in extra_tabs]
                    history = build_history_tab()
            with gr.Column(scale=1, min_width=270, elem_id="hui-system"):
                # Open on a wide screen; a phone folds it at load (APP_JS): there it ends every tab.
                with gr.Accordion("System", open=True, elem_id="hui-system-box"):
                    panel = build_system_panel(engine, system_handlers, services, lane, capabilities)
        history.stored.render()  # outside the tabs (see build_history_tab)
        history.secret.render()

        runs = wire_edit_tab(edit, edit_handlers, lane, on_edit=add_to_history(history, edit, history_handlers))
        runs += [run for tab in extra for run in getattr(tab, "runs", ())]
        for button, event in runs:  # unavailable while it runs; the panel follows it
            panel.watch_run(button, event)
        wire_history_tab(history, edit, tabs, history_handlers, demo)
        private = {"queue": False, "show_progress": "hidden", "api_visibility": "private"}
        demo.load(
            system_handlers.page_load,
            None,
            [
                panel.attention,
                panel.status_state,
                panel.status_panel,
                panel.engine_controls,
                panel.attention_unavailable,
                panel.load_button,
                *panel.operator_view,
                panel.visitor_card,
            ],
            **private,
        )

        def working_resolutions():  # the resolutions the configured model can take (needs its config)
            return resolution_choices(engine)

        dropdowns = [edit.form["working_resolution"], *(getattr(tab, "resolution_dropdown", None) for tab in extra)]
        for dropdown in dropdowns:
            if dropdown is not None:
                demo.load(working_resolutions, None, dropdown, **private)

    demo.hidream_services = services
    return demo


__all__ = [
    "build_demo",
    "new_blocks",
    "default_extra_tabs",
    "launch_options",
    "load_examples",
    "TINY_BANNER",
    "offline_banner",
    "APP_CSS",
    "APP_JS",
    "ASSETS_DIR",
]
