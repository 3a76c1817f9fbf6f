"""The editing experience in headless Chromium at a desktop (1440x900) and a phone (390x844) size
(issue 21): progress in view, a neutral Stop, the edit loop, History that survives a reload and
stays in its browser, random seeds, batch bars that move with steps.

Every wait waits for a state only the action can produce (a progress bar, "Stopped after", the
result's own file in the source slot, a History card after a reload, a new seed, a percentage
above 0 while no item is done). The tiny offline model keeps edits to a second or two; the long
edits are stopped as soon as they showed what the test needs. Needs Debian's /usr/bin/chromium.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from helpers import wait_for
from playwright import sync_api
from test_browser import CHROMIUM, CHROMIUM_ARGS, open_app, set_number

from hidream_ui.pipeline.edit_pipeline import HiDreamEditPipeline
from hidream_ui.ui.history_tab import STORAGE_KEY

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
VIEWPORTS = {"desktop": {"width": 1440, "height": 900}, "phone": {"width": 390, "height": 844}}
EXAMPLE = "Make the mug blue with white polka dots"  # assets/examples.json, last entry


@pytest.fixture(scope="module")
def app(launch_app):
    return launch_app("browser_experience")


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
    page.set_default_timeout(60_000)
    page.size_name = request.param
    try:
        yield page
    finally:
        context.close()


def pick_example(page, steps: int) -> None:
    """The example's image and instruction in the form, and `steps` steps."""
    page.get_by_text(EXAMPLE).first.click()
    sync_api.expect(page.locator("#hui-instruction textarea")).to_have_value(EXAMPLE)
    sync_api.expect(page.locator("#hui-source img")).to_be_visible()
    page.locator("#hui-advanced").get_by_text("Advanced settings").click()
    set_number(page, page.get_by_label("number input for Steps"), steps)


def finished_summary(page, previous: str = "") -> str:
    """Waits for the summary of a finished edit that differs from `previous`; returns it."""
    summary = page.locator("#hui-summary")
    # The edit's progress is drawn on the summary: while it runs, the summary holds the progress text
    # beside the previous result's line, so "differs and names a seed" alone is not the end.
    progress = page.locator("#hui-summary .progress-text")
    sync_api.expect(summary).to_contain_text("Seed", timeout=120_000)
    if previous:
        sync_api.expect(summary).not_to_have_text(previous, timeout=120_000)
    sync_api.expect(progress).to_have_count(0, timeout=120_000)
    if previous:
        sync_api.expect(summary).not_to_have_text(previous, timeout=120_000)
    sync_api.expect(summary).to_contain_text("Seed", timeout=120_000)
    return summary.inner_text()


def no_error_toast(page) -> None:
    errors = page.locator(".toast-title.error, .toast-body.error")
    assert errors.count() == 0, [t for t in page.locator("[data-testid=toast-body]").all_inner_texts()]


def test_progress_is_in_view_within_3_s_of_edit(app, page):
    open_app(page, app["url"])
    pick_example(page, 60)
    page.mouse.wheel(0, 5000)  # down at the examples, where the visitor was
    page.wait_for_timeout(300)
    page.locator("#hui-edit").click()
    # Gradio's progress element on the summary under the result: it exists only while the edit runs.
    sync_api.expect(page.locator("#hui-summary .progress-text")).to_be_in_viewport(timeout=3_000)
    sync_api.expect(page.locator("#hui-result")).to_be_in_viewport()
    sync_api.expect(page.locator("#hui-edit")).to_be_disabled()  # Edit is unavailable while it runs
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"edit_running_{page.size_name}.png"))
    page.locator("#hui-stop").click()
    sync_api.expect(page.locator("#hui-edit")).to_be_enabled(timeout=60_000)  # and back when it ended


# Records every image the before/after slider shows (a MutationObserver: an edit on the tiny model can
# stream its previews faster than a test could poll them).
WATCH_SLIDER_JS = """() => {
  window.huiShown = [];
  const note = () => {
    const srcs = [...document.querySelectorAll('#hui-result img')].map(e => e.src).join(' ');
    if (srcs && window.huiShown[window.huiShown.length - 1] !== srcs) window.huiShown.push(srcs);
  };
  new MutationObserver(note).observe(document.querySelector('#hui-result'),
                                     {subtree: true, childList: true, attributes: true, attributeFilter: ['src']});
}"""


def test_the_live_preview_changes_during_a_40_step_edit(app, page):
    open_app(page, app["url"])
    pick_example(page, 40)
    page.evaluate(WATCH_SLIDER_JS)
    page.locator("#hui-edit").click()
    summary = finished_summary(page)
    shown = page.evaluate("window.huiShown")
    # Before the result: at least three different pictures, i.e. the preview changed at least twice.
    assert len(shown) >= 4, f"the slider showed {len(shown)} pictures in a 40-step edit ({summary!r})"


def test_stop_leaves_stopped_and_no_error(app, page, monkeypatch):
    jobs = app["demo"].hidream_services.jobs
    # At least 0.1 s a step (the app runs in this process): on a fast machine the tiny model's 200 steps
    # took 14 s, and the edit could end between the state line's step 3 and the Stop click landing.
    predict = HiDreamEditPipeline.predict

    def slow_predict(self, *args, **kwargs):
        time.sleep(0.1)
        return predict(self, *args, **kwargs)

    monkeypatch.setattr(HiDreamEditPipeline, "predict", slow_predict)
    open_app(page, app["url"])
    pick_example(page, 200)
    page.locator("#hui-edit").click()
    # The panel's state line shows the steps the bar shows, from the same source (any step from 3 on:
    # on a fast machine the line may jump from 2 to 28 to 137 between two looks).
    sync_api.expect(page.locator("#hui-status-state")).to_contain_text(
        re.compile(r"step ([3-9]|[1-9]\d+)/200"), timeout=120_000
    )
    page.locator("#hui-stop").click()
    stopped = re.compile(r"Stopped (after \d+ of 200 steps|before)")
    sync_api.expect(page.locator("#hui-summary")).to_contain_text(stopped)
    sync_api.expect(page.locator("#hui-edit")).to_be_enabled(timeout=60_000)
    # The job itself ends after its current step (the browser's cancel may have landed first).
    wait_for(lambda: not [job for job in jobs.running() if job.kind == "edit"], "the edit job to end")
    page.wait_for_timeout(500)  # an error toast, were there one, would be up by now
    no_error_toast(page)
    # Nothing of the stopped edit is left on the panel once it ended.
    sync_api.expect(page.locator("#hui-status-state")).not_to_contain_text("/200", timeout=10_000)


def test_edit_the_result_moves_it_into_the_source(app, page):
    open_app(page, app["url"])
    pick_example(page, 2)
    page.locator("#hui-edit").click()
    summary = finished_summary(page)
    saved = re.search(r"saved (\S+\.png)", summary).group(1)
    page.locator("#hui-edit-result").click()
    # The source slot now shows the saved result (gradio serves its own copy, same file name).
    sync_api.expect(page.locator("#hui-source img")).to_have_attribute("src", re.compile(re.escape(saved) + "$"))
    sync_api.expect(page.locator("#hui-instruction textarea")).to_have_value(EXAMPLE)  # kept for the next step
    sync_api.expect(page.locator("#hui-source")).to_be_in_viewport()


def test_history_survives_a_reload_and_stays_in_its_browser(app, page, browser):
    open_app(page, app["url"])
    pick_example(page, 2)
    page.locator("#hui-edit").click()
    summary = finished_summary(page)
    seed = re.search(r"Seed (\d+)", summary).group(1)
    # The entry reaches the browser's storage by its own request after the summary shows (add_history):
    # opening the tab before it lands refreshes the cards from the storage as it was (seen once in a fresh-clone
    # CI run with a training job beside it: no card within 5 s). Wait for the storage to hold an entry (it is
    # encrypted: an empty history is far shorter than 1000 characters, one entry far longer), then open the tab.
    page.wait_for_function(f"() => (localStorage.getItem({STORAGE_KEY!r}) || '').length > 1000")
    page.get_by_role("tab", name="History").click()
    sync_api.expect(page.locator("#hui-history .hui-h-card").first).to_contain_text(f"seed {seed}")
    page.reload()
    open_app(page, app["url"])
    page.get_by_role("tab", name="History").click()
    card = page.locator("#hui-history .hui-h-card").first
    sync_api.expect(card).to_contain_text(EXAMPLE)
    sync_api.expect(card).to_contain_text(f"seed {seed}")
    sync_api.expect(card.locator("img")).to_have_count(2)  # before and after
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"history_{page.size_name}.png"))
    # "Edit again" puts that result back into the Edit tab.
    page.locator("#hui-history-edit").click()
    sync_api.expect(page.locator("#hui-source img")).to_have_attribute("src", re.compile(r"-s" + seed + r"-\w+\.png$"))
    # Another browser (a fresh context: its own storage) sees none of it.
    other = browser.new_context(viewport={"width": 390, "height": 844})
    try:
        stranger = other.new_page()
        open_app(stranger, app["url"])
        stranger.get_by_role("tab", name="History").click()
        sync_api.expect(stranger.locator("#hui-history")).to_contain_text("No results yet in this browser")
        assert stranger.locator("#hui-history .hui-h-card").count() == 0
    finally:
        other.close()


def test_two_edits_in_a_row_get_different_seeds(app, page):
    """Random seed is switched on here explicitly; it becomes the default with the pipeline's part
    of issue 21, and the test holds either way."""
    open_app(page, app["url"])
    pick_example(page, 2)
    page.get_by_label("Random seed").check()
    page.locator("#hui-edit").click()
    first = finished_summary(page)
    sync_api.expect(page.locator("#hui-edit")).to_be_enabled()
    page.locator("#hui-edit").click()
    second = finished_summary(page, previous=first)
    seeds = [re.search(r"Seed (\d+)", text).group(1) for text in (first, second)]
    assert seeds[0] != seeds[1], seeds


def test_a_batch_bar_passes_0_percent_before_the_first_item_ends(app, page, tmp_path):
    from PIL import Image

    # Two items of different shapes (never one shared transformer call): while the second runs, Stop
    # still lands on a loaded machine where one 120-step item can end before the click does.
    paths = [tmp_path / "wide.png", tmp_path / "tall.png"]
    Image.new("RGB", (96, 64), (200, 40, 40)).save(paths[0])
    Image.new("RGB", (64, 96), (40, 40, 200)).save(paths[1])
    open_app(page, app["url"])
    page.get_by_role("tab", name="Batch").click()
    page.locator("#hui-batch-files input[type=file]").set_input_files([str(p) for p in paths])
    page.locator("#hui-batch-instructions textarea").fill("make it brighter")
    page.get_by_text("Settings (shared by every item)").click()
    set_number(page, page.get_by_label("number input for Steps").locator("visible=true"), 120)
    page.locator("#hui-batch-run").click()
    bar = page.locator("#hui-batch-gallery .progress-level-inner")  # the bar's text
    # "0/2 items done · item 1: edit step 7/120 · whole batch - 2.9%": the first item has not ended, the
    # bar has moved, and the text says whose percent it is (issue 56: "0/6 items · edit step 10/28 - 6.0 %"
    # read as the item's).
    sync_api.expect(bar).to_contain_text(
        re.compile(r"0/2 items done · item 1: edit step \d+/\d+ · whole batch .*(0\.[1-9]|[1-9]\d*(\.\d)?)%"),
        timeout=120_000,
    )
    assert page.locator("#hui-batch-gallery img").count() == 0
    page.locator("#hui-batch-stop").click()
    sync_api.expect(page.locator("#hui-batch-report")).to_contain_text("Stopped", timeout=60_000)
    sync_api.expect(page.locator("#hui-batch-run")).to_be_enabled()


def test_an_upload_that_is_not_an_image_is_refused_on_arrival(app, page, tmp_path):
    fake = tmp_path / "notes.png"
    fake.write_text("shopping list: eggs, milk\n", encoding="utf-8")
    open_app(page, app["url"])
    page.locator("#hui-source input[type=file]").set_input_files(str(fake))
    # Refused at upload (a warning, the slot emptied), not later at Edit.
    sync_api.expect(page.locator("[data-testid=toast-body]")).to_contain_text("This file is not an image we can read")
    sync_api.expect(page.locator("#hui-summary")).to_contain_text("not an image we can read")
    sync_api.expect(page.locator("#hui-source img")).to_have_count(0)
    no_error_toast(page)


def test_a_stale_error_goes_when_the_form_changes(app, page):
    open_app(page, app["url"])
    page.get_by_text(EXAMPLE).first.click()
    sync_api.expect(page.locator("#hui-source img")).to_be_visible()
    page.locator("#hui-instruction textarea").fill("")
    page.locator("#hui-edit").click()
    error = page.locator("[data-testid=toast-body]").filter(has_text="Write an instruction")
    sync_api.expect(error).to_have_count(1)
    page.locator("#hui-instruction textarea").fill("Make the mug red")  # the form changed: the error is stale
    sync_api.expect(error).to_have_count(0)
    sync_api.expect(page.locator("#hui-edit")).to_be_enabled()


def open_region(page) -> None:
    """Opens the Region box and waits for the editor to show the source it paints on."""
    page.locator("#hui-region-box").get_by_text("Region (optional)").click()
    canvas = page.locator("#hui-mask canvas").first
    sync_api.expect(canvas).to_be_visible()
    canvas.scroll_into_view_if_needed()


def paint_left_half(page) -> None:
    """Brush strokes over the left half of the source, which the editor shows centred in its canvas
    (the picture fits the canvas's height: strokes within a fifth of that height left of the centre)."""
    box = page.locator("#hui-mask canvas").first.bounding_box()
    cx, cy, side = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2, box["height"]
    page.mouse.move(cx - 0.2 * side, cy - 0.3 * side)
    page.mouse.down()
    for row in range(1, 13):
        page.mouse.move(cx - (0.2 if row % 2 == 0 else 0.03) * side, cy - 0.3 * side + row * 0.05 * side, steps=8)
    page.mouse.up()


def test_a_painted_stroke_limits_the_edit_to_its_region(app, page):
    from PIL import Image

    from hidream_ui.outputs import read_metadata

    open_app(page, app["url"])
    pick_example(page, 2)
    open_region(page)
    page.wait_for_timeout(500)  # the background (the source) is drawn into the canvas
    paint_left_half(page)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"region_painted_{page.size_name}.png"))
    page.locator("#hui-edit").click()
    summary = finished_summary(page)
    assert "region edit" in summary
    saved = Path(app["config"].output_dir) / re.search(r"saved (\S+\.png)", summary).group(1)
    mask = read_metadata(saved)["mask"]
    assert mask["name"] == "painted region" and (saved.parent / mask["file"]).is_file()
    with Image.open(saved.parent / mask["file"]) as stored:
        left, top, right, bottom = stored.getbbox()
        assert right <= stored.width * 0.6  # painted on the left: the right side is kept
    no_error_toast(page)


def test_edit_before_the_image_arrived_shows_no_bare_error(app, page):
    open_app(page, app["url"])
    page.locator("#hui-instruction textarea").fill(EXAMPLE)  # an example's text, its image not there yet
    page.locator("#hui-edit").click()
    sync_api.expect(page.locator("[data-testid=toast-body]").filter(has_text="Add an image")).to_have_count(1)
    page.wait_for_timeout(500)  # the refused event's status reaches the summary with the toast
    sync_api.expect(page.locator("#hui-summary .error")).to_be_hidden()
    assert "Error" not in page.locator("#hui-summary").inner_text()
    sync_api.expect(page.locator("#hui-edit")).to_be_enabled()
