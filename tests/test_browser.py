"""End-to-end checks in headless Chromium (Playwright, sync API) on the offline tiny model:
pick an example, edit with 2 steps, wait for the before/after slider, read the system panel; run
a batch; stop a long edit.

Every wait waits for a state only the action can produce (the result image, the seed in the
summary, the panel's plain "idle" that only a loaded model shows, a "Done" report): a wait for
text the page may already show passes at once on one machine and reads a stale page on the next.

Screenshots of the Edit tab before and after the edit go to tests/artifacts/ (gitignored) for a
human to look at. Needs Debian's /usr/bin/chromium; Playwright's own browser download is not used.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import wait_for
from playwright import sync_api

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
EXAMPLE_INSTRUCTION = "Turn the scene into a snowy winter evening"  # assets/examples.json, first entry


@pytest.fixture(scope="module")
def app(launch_app):
    return launch_app("browser")


@pytest.fixture(scope="module")
def page(app):
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        page.set_default_timeout(30_000)
        try:
            yield page
        finally:
            context.close()
            browser.close()


def open_app(page, url: str) -> None:
    """Opens the app and waits until its page-load event has answered. Only that event labels the
    attention dropdown ("auto → sdpa (best available here)", "sdpa — torch ..."; before it, the bare
    name), and its updates re-render form widgets: a value typed in before they arrive can be reset."""
    page.goto(url)
    sync_api.expect(page.locator("#hui-attention input")).to_have_value(re.compile("[→—]"), timeout=60_000)


def set_number(page, box, value: int) -> None:
    """Types `value` into a slider's number box until it stays there. A box in an accordion that
    has just opened can be re-initialised right after a first fill (seen on loaded machines), which
    silently ran an edit with the default 28 steps; the value is checked after it settled."""
    for _ in range(10):
        box.fill(str(value))
        box.press("Tab")  # commits the number (change on blur) like a user leaving the box
        page.wait_for_timeout(300)
        if box.input_value() == str(value):
            return
    raise AssertionError(f"the number box kept {box.input_value()!r} instead of {value}")


def test_edit_in_the_browser(app, page):
    ARTIFACTS.mkdir(exist_ok=True)
    open_app(page, app["url"])
    panel = page.locator("#hui-status-panel")
    device_name = app["engine"].status().device_name
    sync_api.expect(panel).to_contain_text(device_name)

    page.get_by_text(EXAMPLE_INSTRUCTION).first.click()
    sync_api.expect(page.locator("#hui-source img")).to_be_visible()
    sync_api.expect(page.locator("#hui-instruction textarea")).to_have_value(EXAMPLE_INSTRUCTION)

    page.get_by_text("Advanced settings").click()
    set_number(page, page.get_by_label("number input for Steps"), 2)
    page.locator("#hui-edit").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "edit_tab_before.png"), full_page=True)

    sync_api.expect(page.get_by_label("number input for Steps")).to_have_value("2")  # still, after the screenshot
    page.locator("#hui-edit").click()
    result = page.locator("#hui-result img")
    sync_api.expect(result.first).to_be_visible(timeout=120_000)
    summary = page.locator("#hui-summary")
    sync_api.expect(summary).to_contain_text("Seed", timeout=30_000)
    assert "2 steps" in summary.inner_text()
    seed_text = re.search(r"Seed (\d+)", summary.inner_text())
    assert seed_text is not None

    # The panel shows the device, dtype, model source, attention and memory, and is idle again.
    # Before the edit it read "idle · model not loaded yet ...": only the loaded model shows plain "idle".
    sync_api.expect(panel.locator(".hui-state")).to_have_text("idle", timeout=10_000)
    status = app["engine"].status()
    text = panel.inner_text()
    for expected in (status.device_name, status.dtype, "tiny", status.attention, "host RAM", "process RSS"):
        assert expected in text, (expected, text)
    page.mouse.move(0, 0)  # no hover highlight in the screenshot
    page.screenshot(path=str(ARTIFACTS / "edit_tab_after.png"), full_page=True)

    # The result also landed in this browser's history, with its settings in words.
    page.get_by_role("tab", name="History").click()
    card = page.locator("#hui-history .hui-h-card")
    sync_api.expect(card).to_have_count(1)
    sync_api.expect(card).to_contain_text(EXAMPLE_INSTRUCTION)
    sync_api.expect(card).to_contain_text(f"steps 2 · refine 0.3 · resolution auto · seed {seed_text.group(1)}")


def test_batch_in_the_browser(app, page, tmp_path):
    """Two images x two instructions in the Batch tab: the gallery fills with four results."""
    from PIL import Image

    ARTIFACTS.mkdir(exist_ok=True)
    uploads = []
    for i, colour in enumerate(((200, 40, 40), (40, 90, 200))):
        path = tmp_path / f"batch{i}.png"
        Image.new("RGB", (96, 64), colour).save(path)
        uploads.append(str(path))
    open_app(page, app["url"])
    page.get_by_role("tab", name="Batch").click()
    page.locator("#hui-batch-files input[type=file]").set_input_files(uploads)
    page.locator("#hui-batch-instructions textarea").fill("make it brighter\nadd a red border")
    page.get_by_text("Settings (shared by every item)").click()
    set_number(page, page.get_by_label("number input for Steps").locator("visible=true"), 2)
    page.locator("#hui-batch-run").click()
    sync_api.expect(page.locator("#hui-batch-gallery img")).to_have_count(4, timeout=180_000)
    report = page.locator("#hui-batch-report")
    sync_api.expect(report).to_contain_text("Done: 4/4", timeout=30_000)  # the final report only
    wait_for(lambda: app["engine"].status().state == "idle", "the engine to go idle")
    page.mouse.move(0, 0)
    page.screenshot(path=str(ARTIFACTS / "batch_tab_after.png"), full_page=True)
    assert app["engine"].counters["edits"] >= 4


def test_stop_in_the_browser_stops_within_one_step_and_saves_nothing(app, page):
    jobs = app["demo"].hidream_services.jobs
    output_dir = Path(app["config"].output_dir)
    before = sorted(output_dir.glob("*.png"))
    open_app(page, app["url"])
    page.get_by_text(EXAMPLE_INSTRUCTION).first.click()
    sync_api.expect(page.locator("#hui-instruction textarea")).to_have_value(EXAMPLE_INSTRUCTION)
    page.get_by_text("Advanced settings").click()
    set_number(page, page.get_by_label("number input for Steps"), 200)
    page.locator("#hui-edit").click()
    job = wait_for(lambda: next((j for j in jobs.running() if j.kind == "edit"), None), "the edit to start")
    wait_for(lambda: job.token.step >= 3, "three steps")
    page.locator("#hui-stop").click()
    wait_for(lambda: job not in jobs.running(), "the edit to stop")
    # Stop does both: its own handler and the browser's cancel of the edit event; either may land first.
    assert job.token.reason in ("stopped by its user", "cancelled by the client")
    assert job.token.step - job.token.cancelled_at_step <= 1, (job.token.cancelled_at_step, job.token.step)
    assert sorted(output_dir.glob("*.png")) == before  # a stopped edit saves nothing
