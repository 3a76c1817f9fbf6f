"""Helpers every tab shares: error conversion (`guarded`), widget values <-> params, hints, how a
run button starts a device job (`device_run`, `RunTabHandles`)."""

from __future__ import annotations

import functools
import html
import inspect
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import gradio as gr

from hidream_ui.archive import ArchiveError
from hidream_ui.edits import (
    FIELD_SPECS,
    NO_FILE,
    NO_INSTRUCTION,
    SHARED_FORM,
    TARGET_MARKER,
    EditParams,
    RequestError,
    params_from_form,
    seed_from_form,
    settings_from_form,
)
from hidream_ui.edits import form_values as form_values  # re-exported: the History tab's round trip
from hidream_ui.engine.errors import EditCancelled, EngineError
from hidream_ui.engine.jobs import JobProgress
from hidream_ui.imaging import ImageError, UnreadableImage
from hidream_ui.outputs import MetadataError
from hidream_ui.rewrite.prompt import RewriteError
from hidream_ui.server.files import EXPIRED, PictureExpired
from hidream_ui.server.lanes import (  # noqa: F401  the lanes' one home; re-exported for the tabs
    CONTROL_GROUP,
    DEVICE_GROUP,
    REWRITER_CONCURRENCY,
    REWRITER_GROUP,
    SETTINGS_FILE_CONCURRENCY,
    SETTINGS_FILE_GROUP,
)
from hidream_ui.ui.services import redact_paths

logger = logging.getLogger(__name__)


# Errors whose message is written for users: shown exactly as raised.
USER_ERRORS = (EngineError, RequestError, ImageError, MetadataError, ArchiveError, RewriteError)

# Working resolutions offered before the model's geometry is known; `page_load` replaces them with
# the ones the configured model can take (`Engine.working_resolution_choices`).
WORKING_RESOLUTIONS = ("auto", "draft")

E11_HINT = (
    "**E1.1** takes a plain instruction, e.g. *Turn the sky into a sunset*. Describe the change, not the whole picture."
)
E1_FULL_HINT = (
    "**E1-Full** expects two parts: `Editing Instruction: <the change>. "
    f"{TARGET_MARKER} <the whole edited image>`. The description after "
    f"`{TARGET_MARKER}` drives the refine stage; without it the instruction is used for both."
)


def variant_hint(variant: str) -> str:
    return E1_FULL_HINT if variant == "e1-full" else E11_HINT


def instruction_placeholder(variant: str) -> str:
    if variant == "e1-full":
        return (
            "Editing Instruction: Convert the image into a Ghibli style. "
            f"{TARGET_MARKER} A Ghibli-style cottage on a green hill under a blue sky."
        )
    return "Turn the scene into a snowy winter evening"


def example_instruction(instruction: str, variant: str, target: str | None = None) -> str:
    """Examples are written as E1.1 instructions plus a target description; E1-Full gets both in
    its two-part format (without a description the instruction stands in for it)."""
    if variant != "e1-full" or TARGET_MARKER in instruction:
        return instruction
    return f"Editing Instruction: {instruction.rstrip('.')}. {TARGET_MARKER} {target or instruction}"


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def gr_error(message: str, title: str = "Error") -> gr.Error:
    """What a user sees of a failure. gr.Error renders its message as HTML in the browser (file
    names in messages are user input), and the server's absolute paths (a model folder named in an
    error) are cut to their last component: the server log keeps the whole message."""
    return gr.Error(html.escape(redact_paths(message), quote=False), title=title, print_exception=False)


# What to do, not what the check found (the API's RequestError text stays in the server log).
ADD_IMAGE = "Add an image: drop a PNG, JPEG, WebP, BMP, GIF or TIFF on “Source image”."
WRITE_INSTRUCTION = "Write an instruction: say what should change, e.g. “Turn the sky into a sunset”."
ADD_BOTH = "Add an image and write an instruction (what should change), then press Edit."


def write_instruction(example: str | None = None) -> str:
    """WRITE_INSTRUCTION, with `example` (an instruction the running model knows) as its example."""
    if not example:
        return WRITE_INSTRUCTION
    return f"Write an instruction: say what should change, e.g. “{example}”."


def instruction_example(owner: Any) -> str | None:
    """An instruction the running model knows, for a handler object (`TabHandlers`: its services'
    config): the trained offline model's world has its own (it cannot turn a sky into a sunset);
    None for the real model, or for anything that is no handler."""
    config = getattr(getattr(owner, "services", None), "config", None)
    if config is None or not getattr(config, "uses_trained_tiny_model", False):
        return None
    from hidream_ui.ui.world_examples import world_placeholder

    return world_placeholder(config)


def people_message(exc: Exception, example: str | None = None) -> str:
    """A user error in words that say what to do: a missing image or instruction, a file that is not
    an image; other errors keep their own message (it names the value and what is allowed).
    `example`: an instruction the running model knows (`instruction_example`), for the missing one."""
    if isinstance(exc, RequestError):  # only the generic refusals: a specific one keeps its hint
        if exc.field == "image" and exc.expected == NO_FILE:
            return ADD_IMAGE
        if exc.field == "instruction" and exc.expected == NO_INSTRUCTION:
            return write_instruction(example)
    if isinstance(exc, UnreadableImage):  # a readable image over a limit keeps its own message
        return f"This file is not an image we can read. {exc}"
    return str(exc)


def disable_js(elem_id: str) -> str:
    """Browser-side: the run's button is unavailable the moment it is clicked (the server's own
    `interactive=False`, `SystemHandlers.run_started`, can take a while to arrive on a busy machine, and a
    second click would queue a second run). Register it before the run's event: a click's
    listeners start in order."""
    return f"() => {{ const b = document.querySelector('#{elem_id}'); if (b) b.disabled = true; }}"


def enable_js(elem_id: str) -> str:
    """Browser-side: the run's button is back (after `disable_js`; the server's update alone would
    not undo a change it never made)."""
    return f"() => {{ const b = document.querySelector('#{elem_id}'); if (b) b.disabled = false; }}"


# ---------------------------------------------------------------------------------------------
# A tab's run: Edit, Batch and Compare start their device jobs the same way
# ---------------------------------------------------------------------------------------------

# The browser-only or control events: they never wait in the queue and are not part of the API.
PRIVATE = {"queue": False, "show_progress": "hidden", "api_visibility": "private"}


def disable_on_click(button: gr.Button) -> None:
    """The run's button is unavailable the moment it is clicked (in the browser, `disable_js`). Call it
    before the run's own `click`: a click's listeners start in order."""
    button.click(None, None, None, js=disable_js(button.elem_id), **PRIVATE)


def device_run(
    button: gr.Button,
    handler: Callable,
    inputs: Sequence[Any],
    outputs: Sequence[Any],
    *,
    api_name: str,
    lane: int,
    progress_on: Any,
):
    """`button` runs `handler` as the API's `api_name` on the device lane (`lane` jobs at once: one
    per engine), its progress shown on `progress_on`. preprocess=False: the handler opens the uploads
    itself and can say what is wrong with a damaged file (gradio's decode error is a developer
    message). Returns the event, to chain on."""
    return button.click(
        handler,
        inputs=list(inputs),
        outputs=list(outputs),
        api_name=api_name,
        concurrency_id=DEVICE_GROUP,
        concurrency_limit=lane,
        preprocess=False,
        show_progress_on=[progress_on],
    )


def stop_on_click(button: gr.Button, stop: Callable) -> None:
    """The Stop button never queues (it must get through while the run holds the device lane) and
    does not cancel the event: the run ends by itself after the current step and keeps what it made."""
    button.click(stop, None, None, **PRIVATE)


@dataclass(frozen=True, kw_only=True)
class RunTabHandles:
    """What a tab with a Run and a Stop button hands the layout (Batch, Compare): its handlers, its API
    inputs and the widgets the page watches. Each tab's handles add its outputs."""

    handlers: Any  # the tab's handler object (BatchTab, CompareTab)
    inputs: tuple[Any, ...]  # the run's API inputs, in order (its handler's parameters)
    settings: Mapping[str, Any]  # the shared-settings widgets by field name (hidream_ui.edits.SHARED_FORM)
    run_button: gr.Button
    stop_button: gr.Button
    runs: tuple = ()  # (button, event) the page watches (system_panel.watch_run)

    @property
    def resolution_dropdown(self):
        """Gets the model's working resolutions on page load."""
        return self.settings["working_resolution"]


def stopped_message(step: int | None, total: int | None, what: str = "steps") -> str:
    """What Stop shows: a neutral fact, not an error ("Stopped after 3 of 28 steps")."""
    if not step:
        return "Stopped before the first step. Nothing was saved."
    return f"Stopped after {step} of {total} {what}. Nothing was saved." if total else f"Stopped after {step} {what}."


def move_bar(progress, job, fraction: float, text: str, *, step: int | None = None, total: int | None = None) -> None:
    """Moves a run's progress bar and tells the system panel the same (`Job.progress`): one source,
    so the panel never lags the bar nor outlives it. `fraction` counts the steps within the current
    item, so a batch bar moves before its first item ends."""
    fraction = max(0.0, min(1.0, float(fraction)))
    if job is not None:
        job.progress = JobProgress(fraction=fraction, text=text, step=step, total=total)
    if progress is not None:
        progress(fraction, desc=text)


def guarded(what: str) -> Callable[[Callable], Callable]:
    """Turns every failure of the wrapped handler into a `gr.Error` with a readable message.

    Works for plain and generator handlers (streaming tabs): for a generator, errors raised while
    iterating are converted too. `functools.wraps` keeps the signature, which gradio reads to
    inject `gr.Request` and `gr.Progress` and to name the API parameters.
    """

    def convert(exc: Exception, args: tuple = ()) -> gr.Error:
        if isinstance(exc, EditCancelled):
            return gr_error(str(exc), title="Stopped")
        if isinstance(exc, PictureExpired):  # not the visitor's mistake: the picture aged out on the server
            return gr_error(EXPIRED, title="Picture expired")
        if isinstance(exc, USER_ERRORS):  # args[0]: the handler object, whose model gives the example
            return gr_error(people_message(exc, instruction_example(args[0] if args else None)))
        logger.error("%s failed", what, exc_info=exc)
        return gr_error(f"{what} failed unexpectedly ({type(exc).__name__}: {exc}). The server log has the details.")

    def decorate(fn: Callable) -> Callable:
        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def stream(*args, **kwargs):
                try:
                    yield from fn(*args, **kwargs)
                except gr.Error:
                    raise
                except Exception as exc:  # noqa: BLE001 - the one place that turns bugs into messages
                    raise convert(exc, args) from None

            return stream

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except gr.Error:
                raise
            except Exception as exc:  # noqa: BLE001 - the one place that turns bugs into messages
                raise convert(exc, args) from None

        return wrapper

    return decorate


# ---------------------------------------------------------------------------------------------
# Widget values <-> params
# ---------------------------------------------------------------------------------------------


# The conversions are the schema's (hidream_ui.edits, derived from FIELDS); these names are the UI's.
seed_from_widgets = seed_from_form
settings_from_widgets = settings_from_form
params_from_widgets = params_from_form


def resolution_choices(engine: Any):
    """A dropdown update offering only the working resolutions the configured model can take (each
    tab's dropdown gets it on page load; until then WORKING_RESOLUTIONS)."""
    try:
        choices = engine.working_resolution_choices()
    except Exception as exc:  # noqa: BLE001 - the page must still open; the edit validates anyway
        logger.warning("working resolutions unknown: %s", exc, exc_info=True)
        choices = list(WORKING_RESOLUTIONS)
    return gr.update(choices=choices)


def widget(name: str, value: Any, *, hints: bool = True, **options: Any):
    """The widget of field `name` of hidream_ui.edits.FIELDS: its kind, range, step, label and hint
    come from the spec; `options` (elem_id, lines, placeholder, ...) are the tab's own."""
    spec = FIELD_SPECS[name]
    options = {"label": spec.label, "value": value, **({"info": spec.info} if hints and spec.info else {}), **options}
    if spec.kind in ("float", "int"):
        return gr.Slider(spec.lo, spec.hi, step=spec.step, **options)
    if spec.kind == "bool":
        return gr.Checkbox(**options)
    if spec.kind == "text":
        return gr.Textbox(**options)
    if spec.kind == "resolution":
        return gr.Dropdown(choices=list(WORKING_RESOLUTIONS), allow_custom_value=True, **options)
    if spec.kind == "seed":
        return gr.Number(precision=0, minimum=spec.lo, **options)
    raise ValueError(f"field {name!r} ({spec.kind}) has no widget")


def summarise_result(result, load_seconds: float = 0.0, model_seconds: float | None = None) -> str:
    """One Markdown line for a finished edit; `load_seconds` is the model load this request waited
    for (the first edit after start-up), shown apart from the edit's own time. `model_seconds`: the
    load's own time as the engine recorded it (`EngineStatus.load_seconds`, the figure the load's
    "model ready in" line and the panel give); the wait beyond it (imports, start-up) is named apart
    so the two figures never read as a contradiction."""
    params = result.params
    timings = result.timings
    width, height = result.working_size
    name = result.saved_png.name if result.saved_png else "not saved"
    load = f" · model load {load_seconds:.1f} s" if load_seconds >= 0.05 else ""
    if load and model_seconds is not None and load_seconds - model_seconds >= 0.05:
        load = f" · model load {model_seconds:.1f} s (waited {load_seconds:.1f} s with start-up)"
    rewrite = getattr(result, "rewrite", None)
    rewritten = f" · instruction rewritten by {rewrite.backend} ({rewrite.seconds:.1f} s)" if rewrite else ""
    region = " · region edit: outside it the source is kept" if getattr(params, "mask", None) is not None else ""
    return (
        f"Seed **{params.seed}** · working size {width}×{height} · {params.num_inference_steps} steps · "
        f"{timings.total:.1f} s (denoise {timings.denoise:.1f} s, "
        f"{timings.per_step:.2f} s/step){load}{rewritten}{region} · saved `{name}` (settings in its metadata)"
    )


# ---------------------------------------------------------------------------------------------
# Shared by the Batch and Compare tabs
# ---------------------------------------------------------------------------------------------


def settings_widgets(defaults: EditParams) -> dict[str, Any]:
    """The shared-settings widgets of the Batch and Compare tabs, {field: widget} in SHARED_FORM
    order (their APIs' input order), without the Edit form's hints."""
    return {name: widget(name, getattr(defaults, name), hints=False) for name in SHARED_FORM}


# Only what can turn text into markup mid-line (emphasis, links, code, HTML, tables); the
# report puts user text after "- " or inside a line, never at a line start.
_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|~])")


def md(text: Any) -> str:
    """User text (file names, instructions, messages) made inert inside Markdown."""
    return _MD_SPECIAL.sub(r"\\\1", " ".join(str(text).split()))


def format_seconds(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"
