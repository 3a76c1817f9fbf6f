"""One truth for status (issue 56, item 5): the progress bar, the panel's state line, the status
panel and its Devices rows read the same job record (`Job.progress`), a stopped job's last step line
does not stay on the panel, the summary's model load agrees with the load's own figure, and the
"write an instruction" refusal gives an example the running model knows."""

from __future__ import annotations

import re
from types import SimpleNamespace

from hidream_ui.config import AppConfig
from hidream_ui.engine.jobs import JobProgress
from hidream_ui.engine.status import DeviceRow, EngineStatus, Progress, PromptCacheStats
from hidream_ui.ui.common import WRITE_INSTRUCTION, instruction_example, summarise_result, write_instruction
from hidream_ui.ui.status_panel import render_status
from hidream_ui.ui.system_handlers import SystemHandlers


def row(engine: str, state: str = "editing", step: int | None = 0, total: int | None = 28, busy: bool = True):
    return DeviceRow(
        engine=engine,
        device="cpu",
        device_name="CPU",
        state=state,
        progress=Progress(step=step, total=total, stage="edit" if total else None),
        loaded=True,
        busy=busy,
        jobs=1,
        memory=None,
        telemetry=None,
    )


def engine_status(*rows: DeviceRow, step: int | None = 0, total: int | None = 28) -> EngineStatus:
    return EngineStatus(
        state="editing",
        progress=Progress(step=step, total=total, stage="edit"),
        loaded=True,
        variant="e1.1",
        model_source="tiny",
        attention="sdpa",
        attention_note=None,
        refiner="none",
        text_encoders="full",
        prompt_cache=PromptCacheStats(entries=0, hits=0, misses=0),
        devices=list(rows),
    )


class FakeEngine:
    """An engine whose own figures lag the job (a worker's cached row: "editing 0/28")."""

    def __init__(self, status: EngineStatus):
        self._status = status
        self.loaded = True

    def status(self) -> EngineStatus:
        return self._status


def steps_shown(html_text: str) -> set[str]:
    return set(re.findall(r"\d+/\d+", html_text))


def test_the_state_line_the_panel_and_devices_read_the_jobs_record():
    panel = SystemHandlers(engine=FakeEngine(engine_status(row("cpu"))))
    with panel.services.jobs.start("edit", "alice") as job:
        job.progress = JobProgress(fraction=0.5, text="edit step 14/28 · ETA 1 s", step=14, total=28)
        state, body = panel.status_state(), panel.status_panel()
        status = panel.status()
    assert "edit step 14/28" in state
    assert steps_shown(state) == {"14/28"}
    assert steps_shown(body) == {"14/28"}, body  # Devices says "editing 14/28", never 0/28
    assert status["progress"]["step"] == 14 and status["devices"][0]["progress"]["step"] == 14


def test_a_pool_gives_each_busy_engine_its_own_job_oldest_first():
    status = engine_status(row("cpu#1"), row("cpu#2", state="idle", step=None, total=None, busy=False), row("cpu#3"))
    first = JobProgress(fraction=0.1, text="edit step 3/28", step=3, total=28)
    second = JobProgress(fraction=0.2, text="refine step 5/10", step=5, total=10)
    followed = status.following([first, second])
    assert followed.progress == Progress(step=3, total=28, stage="edit")
    assert [(r.state, r.progress.step, r.progress.total) for r in followed.devices] == [
        ("editing", 3, 28),
        ("idle", None, None),
        ("editing", 5, 10),
    ]
    assert followed.devices[2].progress.stage == "refine"
    # No job with steps (loading, rewriting): the engine's own figures stand.
    assert status.following([JobProgress(fraction=0.0, text="Loading the model")]) is status
    assert status.following([]) is status


def test_a_stopped_job_finishing_its_step_shows_no_step_line():
    panel = SystemHandlers(engine=FakeEngine(engine_status(row("cpu"), step=3)))
    with panel.services.jobs.start("edit", "alice") as job:
        job.progress = JobProgress(fraction=0.1, text="edit step 3/28 · ETA 39 s", step=3, total=28)
        job.token.step = 3
        panel.services.jobs.cancel("alice", reason="stopped")
        state, body = panel.status_state(), panel.status_panel()
        # The page's fast timer keeps following while the job finishes its step (then it is idle).
        _, timer = panel.follow_run(SimpleNamespace(session_hash="alice"))
    assert "stopping" in state and "ETA" not in state and "3/28" not in state
    assert timer.active is True
    assert "ETA" not in body
    _, timer = panel.follow_run(SimpleNamespace(session_hash="alice"))
    assert timer.active is False  # the job is gone: the timer stops


def test_the_summary_gives_the_loads_own_figure_and_the_wait_apart():
    result = SimpleNamespace(
        params=SimpleNamespace(seed=3, num_inference_steps=2, mask=None),
        timings=SimpleNamespace(total=1.0, denoise=0.5, per_step=0.25),
        working_size=(64, 64),
        saved_png=None,
    )
    line = summarise_result(result, 14.1, model_seconds=0.7)
    assert "model load 0.7 s (waited 14.1 s with start-up)" in line
    assert "model load 14.1 s" not in line
    assert "model load 2.0 s ·" in summarise_result(result, 2.0, model_seconds=2.0)
    assert "model load" not in summarise_result(result, 0.0, model_seconds=0.7)


def test_the_write_an_instruction_refusal_uses_an_instruction_the_model_knows():
    from hidream_ui.model.tiny import world

    trained = SimpleNamespace(services=SimpleNamespace(config=SimpleNamespace(uses_trained_tiny_model=True)))
    example = instruction_example(trained)
    assert example in world.example_instructions()
    assert example in write_instruction(example) and "sunset" not in write_instruction(example)
    real = SimpleNamespace(services=SimpleNamespace(config=AppConfig(model_dir="/models/hidream")))
    assert instruction_example(real) is None and write_instruction(None) == WRITE_INSTRUCTION
    assert instruction_example(object()) is None


def test_render_status_without_jobs_keeps_the_engines_figures():
    body = render_status(engine_status(row("cpu", step=7), step=7), with_state=False)
    assert steps_shown(body) == {"7/28"}


def test_stop_clears_what_it_stopped():
    from hidream_ui.ui.edit_handlers import EARLIER_RESULTS, STOP_OUTPUTS, EditHandlers

    edit = EditHandlers(engine=None)
    nothing = edit.stop(SimpleNamespace(session_hash="alice"))  # nothing running: everything unchanged
    assert len(nothing) == len(STOP_OUTPUTS) and all(update == {"__type__": "update"} for update in nothing)
    with edit.services.jobs.start("edit", "alice") as job:
        job.progress = JobProgress(fraction=0.1, text="edit step 3/28 · ETA 39 s", step=3, total=28)
        job.token.step = 3
        slider, png, seed, summary, entry, row = edit.stop(SimpleNamespace(session_hash="alice"))
    assert job.token.cancelled
    # No result, file, seed or "Edit the result" of the stopped edit (nor of the one before) stays current.
    assert (slider, png, seed, entry) == (None, None, None, None)
    assert row == {"__type__": "update", "visible": False}
    assert summary.startswith("Stopped after 3 of 28 steps.") and EARLIER_RESULTS in summary
    assert "ETA" not in summary


def test_a_handlers_missing_instruction_refusal_names_its_models_example():
    import gradio as gr
    import pytest

    from hidream_ui.edits import EditParams
    from hidream_ui.model.tiny import world
    from hidream_ui.ui.common import guarded
    from hidream_ui.ui.services import AppServices, TabHandlers

    class Handlers(TabHandlers):
        @guarded("the edit")
        def edit(self):
            EditParams(instruction="").validated()

    trained = Handlers(engine=None, services=AppServices.for_config(AppConfig(tiny_profile="trained")))
    with pytest.raises(gr.Error) as refused:
        trained.edit()
    assert f"“{world.example_instructions()[0]}”" in refused.value.message and "sunset" not in refused.value.message
    real = Handlers(engine=None, services=AppServices.for_config(AppConfig(model_dir="/models/hidream")))
    with pytest.raises(gr.Error) as refused:
        real.edit()
    assert refused.value.message == WRITE_INSTRUCTION
