"""The Edit page on a phone (390x844) beside a desktop (1440x900), issue 56: the examples on the first
screen, the progress of an edit in view within 3 s of Edit, no label over another control, the System
panel folded on a phone and open on a desktop.

Every wait waits for a state only the action can produce (the progress element exists only while an
edit runs; the System accordion starts open and only the page's script folds it). Screenshots go to
tests/artifacts/ (gitignored). Needs Debian's /usr/bin/chromium.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright import sync_api
from test_browser import CHROMIUM, CHROMIUM_ARGS, open_app, set_number

pytestmark = pytest.mark.slow

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
PHONE = {"width": 390, "height": 844}
VIEWPORTS = {"desktop": {"width": 1440, "height": 900}, "phone": PHONE}

# Boxes of the labels and of the controls in `root` (visible, not empty), each with its text and the
# index of every box it contains or sits in (a label holds its text, a dropdown its input).
BOXES_JS = """(root) => {
  const els = [...root.querySelectorAll('[data-testid="block-info"], input, textarea, button, select')]
    .filter((e) => { const r = e.getBoundingClientRect(); return r.width > 0 && r.height > 0
                     && getComputedStyle(e).visibility !== 'hidden'; });
  return els.map((e, i) => { const r = e.getBoundingClientRect();
    return {text: (e.innerText || e.value || e.tagName).trim().slice(0, 40), tag: e.tagName,
            label: e.dataset.testid === 'block-info', x: r.left, y: r.top, w: r.width, h: r.height,
            related: els.map((o, j) => (o.contains(e) || e.contains(o)) ? j : -1).filter((j) => j >= 0)}; });
}"""


@pytest.fixture(scope="module")
def app(launch_app):
    return launch_app("browser_phone")


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


def new_page(browser, size: str):
    page = browser.new_context(viewport=VIEWPORTS[size]).new_page()
    page.set_default_timeout(60_000)
    return page


def overlaps(boxes: list[dict]) -> list[tuple[str, str]]:
    """Pairs (label, other) whose boxes intersect by more than a pixel each way, ancestors aside."""
    found = []
    for i, a in enumerate(boxes):
        if not a["label"]:
            continue
        for j, b in enumerate(boxes):
            if j == i or j in a["related"]:
                continue
            dx = min(a["x"] + a["w"], b["x"] + b["w"]) - max(a["x"], b["x"])
            dy = min(a["y"] + a["h"], b["y"] + b["h"]) - max(a["y"], b["y"])
            if dx > 1 and dy > 1:
                found.append((a["text"], b["text"]))
    return found


def test_examples_are_on_the_first_screen_of_a_phone(app, browser):
    page = new_page(browser, "phone")
    open_app(page, app["url"])
    first = page.locator("#hui-examples tbody tr, #hui-examples .gallery-item").first
    sync_api.expect(first).to_be_visible()
    box = first.bounding_box()
    assert page.evaluate("window.scrollY") == 0
    assert box["y"] + box["height"] <= PHONE["height"], f"the first example ends at {box}, below the screen"
    page.context.close()


def test_progress_is_in_view_within_3_s_of_edit_on_a_phone(app, browser):
    page = new_page(browser, "phone")
    open_app(page, app["url"])
    page.locator("#hui-examples tbody tr, #hui-examples .gallery-item").first.click()
    sync_api.expect(page.locator("#hui-source img")).to_be_visible()
    page.locator("#hui-advanced").get_by_text("Advanced settings").click()
    set_number(page, page.get_by_label("number input for Steps"), 200)
    page.locator("#hui-edit").scroll_into_view_if_needed()  # the phone's visitor at the Edit button
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "phone_before_edit.png"))
    page.locator("#hui-edit").click()
    # Gradio's progress element on the summary exists only while the edit runs.
    sync_api.expect(page.locator("#hui-summary .progress-text")).to_be_in_viewport(timeout=3_000)
    sync_api.expect(page.locator("#hui-result")).to_be_in_viewport()
    sync_api.expect(page.locator("#hui-summary")).to_contain_text(re.compile(r"step \d+/200"), timeout=60_000)
    sync_api.expect(page.locator("#hui-summary .progress-text")).to_be_in_viewport()
    page.screenshot(path=str(ARTIFACTS / "phone_during_edit.png"))
    page.locator("#hui-stop").click()
    sync_api.expect(page.locator("#hui-edit")).to_be_enabled(timeout=60_000)
    page.context.close()


@pytest.mark.parametrize("size", list(VIEWPORTS))
def test_no_label_overlaps_a_control(app, browser, size):
    page = new_page(browser, size)
    open_app(page, app["url"])
    page.locator("#hui-advanced").get_by_text("Advanced settings").click()
    sync_api.expect(page.get_by_label("number input for Steps")).to_be_visible()
    found = overlaps(page.locator("#hui-advanced").evaluate(BOXES_JS))
    page.get_by_role("tab", name="History").click()
    sync_api.expect(page.locator("#hui-history-picker")).to_be_visible()
    found += overlaps(page.locator("#hui-history-tab").evaluate(BOXES_JS))
    assert not found, f"labels over other controls at {size}: {found}"
    page.context.close()


def test_the_system_panel_is_folded_on_a_phone_and_open_on_a_desktop(app, browser):
    phone = new_page(browser, "phone")
    open_app(phone, app["url"])
    label = phone.locator("#hui-system-box > button.label-wrap")
    sync_api.expect(label).not_to_have_class(re.compile(r"\bopen\b"))  # folded by the page's script
    sync_api.expect(phone.locator("#hui-status-state")).to_be_hidden()
    label.click()  # and it opens, live
    sync_api.expect(phone.locator("#hui-status-state")).to_be_visible()
    phone.context.close()
    desktop = new_page(browser, "desktop")
    open_app(desktop, app["url"])
    sync_api.expect(desktop.locator("#hui-system-box > button.label-wrap")).to_have_class(re.compile(r"\bopen\b"))
    sync_api.expect(desktop.locator("#hui-status-state")).to_be_in_viewport()
    desktop.context.close()
