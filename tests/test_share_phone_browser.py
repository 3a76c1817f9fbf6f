"""In headless Chromium: "Send to my phone" shows a QR code whose link opens the result's PNG in a
second browser context (no cookies of the visitor's), and with --wall only the results a visitor
ticked "Show on the wall" for reach /wall. Screenshots go to tests/artifacts/ (share_*.png)."""

from __future__ import annotations

import pytest
from playwright import sync_api
from test_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, EXAMPLE_INSTRUCTION, open_app, set_number


@pytest.fixture(scope="module")
def app(launch_app):
    return launch_app("share_phone", wall=True)


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


def edit(page, url: str) -> None:
    open_app(page, url)
    page.get_by_text(EXAMPLE_INSTRUCTION).first.click()
    sync_api.expect(page.locator("#hui-instruction textarea")).to_have_value(EXAMPLE_INSTRUCTION)
    page.locator("#hui-advanced").get_by_text("Advanced settings").click()
    set_number(page, page.get_by_label("number input for Steps"), 2)
    page.locator("#hui-edit").click()
    sync_api.expect(page.locator("#hui-result img").first).to_be_visible(timeout=120_000)
    sync_api.expect(page.locator("#hui-phone-button")).to_be_visible(timeout=30_000)


@pytest.mark.slow
def test_send_to_my_phone_and_the_wall(app, browser):
    ARTIFACTS.mkdir(exist_ok=True)
    visitor = browser.new_context(viewport={"width": 1440, "height": 900})
    page = visitor.new_page()
    page.set_default_timeout(30_000)
    edit(page, app["url"])
    (saved,) = list(app["config"].output_dir.rglob("*.png"))

    # The wall is empty until the visitor ticks the box.
    wall_list = app["url"].rstrip("/") + "/wall/list.json"
    assert page.request.get(wall_list).json() == {"results": []}

    page.locator("#hui-phone-button").click()
    qr = page.locator("#hui-phone img[data-link]")
    sync_api.expect(qr).to_be_visible()
    link = qr.get_attribute("data-link")
    assert link.startswith(app["url"].rstrip("/") + "/share/")  # the address the visitor used
    assert str(saved.parent) not in page.locator("#hui-phone").inner_text()
    sync_api.expect(page.locator("#hui-phone")).to_contain_text("60 minutes")
    page.mouse.move(0, 0)
    page.locator("#hui-phone").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "share_phone_1440.png"))

    # A phone: another browser context, none of the visitor's cookies.
    phone = browser.new_context(viewport={"width": 390, "height": 844})
    answer = phone.request.get(link)
    assert answer.status == 200 and answer.headers["content-type"] == "image/png"
    assert answer.body() == saved.read_bytes()
    assert phone.request.get(link + "x").status == 404

    # The wall: the ticked result only.
    page.locator("#hui-wall-checkbox input").check()
    wall = browser.new_context(viewport={"width": 1440, "height": 900})
    wall_page = wall.new_page()
    for _ in range(50):
        results = wall_page.request.get(wall_list).json()["results"]
        if results:
            break
        wall_page.wait_for_timeout(200)
    assert len(results) == 1 and results[0].startswith("/share/")
    assert wall_page.request.get(app["url"].rstrip("/") + results[0]).body() == saved.read_bytes()
    wall_page.goto(app["url"].rstrip("/") + "/wall")
    sync_api.expect(wall_page.locator("#wall")).to_have_attribute("data-index", "0")
    assert wall_page.locator("button, input, select, textarea").count() == 0  # no controls on the wall
    wall_page.screenshot(path=str(ARTIFACTS / "share_wall_1440.png"))

    # Ticked off again: the wall forgets it.
    page.locator("#hui-wall-checkbox input").uncheck()
    for _ in range(50):
        if not wall_page.request.get(wall_list).json()["results"]:
            break
        wall_page.wait_for_timeout(200)
    assert wall_page.request.get(wall_list).json() == {"results": []}

    # A phone-sized page shows the same QR under the result.
    small = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    small_page = small.new_page()
    small_page.set_default_timeout(30_000)
    edit(small_page, app["url"])
    small_page.locator("#hui-phone-button").click()
    sync_api.expect(small_page.locator("#hui-phone img[data-link]")).to_be_visible()
    small_page.locator("#hui-phone").scroll_into_view_if_needed()
    small_page.screenshot(path=str(ARTIFACTS / "share_phone_390.png"))
    for context in (visitor, phone, wall, small):
        context.close()
