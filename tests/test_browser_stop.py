"""Stop and the region brush in headless Chromium at a desktop (1440x900) and a phone (390x844) size
(issue 56, items 3 and 4): Stop leaves no result marked as current and no step line; a stroke that
starts in the grey margin around the picture paints where it enters it; a region sent with nothing
painted is named in the summary, not silently the whole picture.

Every wait waits for a state only the action can produce ("Stopped after", the job gone, a summary
naming a region edit). Needs Debian's /usr/bin/chromium.
"""

from __future__ import annotations

import re
import time

import pytest
from helpers import wait_for
from playwright import sync_api
from test_browser import CHROMIUM, CHROMIUM_ARGS, open_app, set_number

from hidream_ui.pipeline.edit_pipeline import HiDreamEditPipeline
from hidream_ui.ui.edit_handlers import UNPAINTED_REGION

VIEWPORTS = {"desktop": {"width": 1440, "height": 900}, "phone": {"width": 390, "height": 844}}
EXAMPLE = "Make the mug blue with white polka dots"  # assets/examples.json, last entry

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def app(launch_app):
    return launch_app("browser_stop")


@pytest.fixture(scope="module")
def browser(app):
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(params=list(VIEWPORTS))
def page(request, browser):
    context = browser.new_context(viewport=VIEWPORTS[request.param])
    page = context.new_page()
    page.set_default_timeout(120_000)
    try:
        yield page
    finally:
        context.close()


def start(page, url: str, steps: int):
    open_app(page, url)
    page.get_by_text(EXAMPLE).first.click()
    sync_api.expect(page.locator("#hui-source img")).to_be_visible()
    page.locator("#hui-advanced").get_by_text("Advanced settings").click()
    box = page.get_by_label("number input for Steps")
    set_number(page, box, steps)
    return box


def finished(page, previous: str = "") -> str:
    summary = page.locator("#hui-summary")
    if previous:
        sync_api.expect(summary).not_to_have_text(previous, timeout=180_000)
    sync_api.expect(page.locator("#hui-summary .progress-text")).to_have_count(0, timeout=180_000)
    sync_api.expect(summary).to_contain_text("Seed", timeout=180_000)
    return summary.inner_text()


def test_stop_leaves_no_result_marked_as_current_and_no_step_line(app, page, monkeypatch):
    jobs = app["demo"].hidream_services.jobs
    box = start(page, app["url"], 2)
    page.locator("#hui-edit").click()
    finished(page)
    sync_api.expect(page.locator("#hui-edit-result")).to_be_visible()  # a finished result is current

    predict = HiDreamEditPipeline.predict

    def slow_predict(self, *args, **kwargs):  # at least 0.1 s a step: the Stop lands mid-edit
        time.sleep(0.1)
        return predict(self, *args, **kwargs)

    monkeypatch.setattr(HiDreamEditPipeline, "predict", slow_predict)
    set_number(page, box, 60)
    page.locator("#hui-edit").click()
    sync_api.expect(page.locator("#hui-status-state")).to_contain_text(re.compile(r"step [1-9]\d*/60"), timeout=180_000)
    page.locator("#hui-stop").click()
    sync_api.expect(page.locator("#hui-summary")).to_contain_text(re.compile(r"Stopped (after \d+ of 60 steps|before)"))
    # What it stopped is cleared: no picture in the result area, no "Edit the result", no seed used.
    sync_api.expect(page.locator("#hui-result img")).to_have_count(0)
    sync_api.expect(page.locator("#hui-edit-result")).to_be_hidden()
    sync_api.expect(page.locator("#hui-seed-used")).to_be_hidden()
    wait_for(lambda: not [job for job in jobs.running() if job.kind == "edit"], "the edit job to end")
    # No step line of the stopped edit anywhere: the summary, the state line, the status panel.
    sync_api.expect(page.locator("#hui-status-state")).not_to_contain_text("/60", timeout=30_000)
    sync_api.expect(page.locator("#hui-summary")).not_to_contain_text("ETA")
    sync_api.expect(page.locator("body")).not_to_contain_text(re.compile(r"step \d+/60"))


def margin_stroke(page) -> None:
    """A stroke from the canvas's left margin to the picture's middle (the mouse, like a finger)."""
    page.locator("#hui-region-box").get_by_text("Region (optional)").click()
    canvas = page.locator("#hui-mask canvas").first
    sync_api.expect(canvas).to_be_visible()
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    x, y = box["x"] + 3, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    for i in range(1, 21):
        page.mouse.move(x + (box["width"] / 2 - 3) * i / 20, y)
    page.mouse.up()


def test_an_empty_region_is_named_and_a_margin_started_stroke_paints(app, page):
    start(page, app["url"], 2)
    page.locator("#hui-edit").click()
    first = finished(page)
    assert UNPAINTED_REGION in first and "region edit" not in first  # nothing painted: said, not silent
    margin_stroke(page)
    page.locator("#hui-edit").click()
    second = finished(page, first)
    assert "region edit" in second, second  # the stroke painted: the edit was limited to it
    assert UNPAINTED_REGION not in second
