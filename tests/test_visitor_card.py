"""With --kiosk a visitor sees a small card (issue 21): the device, the queue, and their own place
in it, read from gradio's queue for that visitor's session only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from gradio_client import Client, handle_file
from helpers import wait_for

from hidream_ui.server import gradio_internals
from hidream_ui.ui.layout import ASSETS_DIR
from hidream_ui.ui.system_handlers import SystemHandlers

SLOW = {"num_inference_steps": 200, "working_resolution": "draft"}


@pytest.mark.slow
def test_a_waiting_visitor_sees_their_place_and_others_see_theirs(launch_app):
    app = launch_app("visitor_card", kiosk=True)
    demo = app["demo"]
    handlers = SystemHandlers(app["engine"], services=demo.hidream_services)
    first, second = Client(app["url"], verbose=False), Client(app["url"], verbose=False)

    def submit(client):
        return client.submit(
            image=handle_file(str(ASSETS_DIR / "apple.png")), instruction="slow", seed=1, **SLOW, api_name="/edit"
        )

    jobs = [submit(first)]
    try:
        # The first one runs before the second is sent: which of two at once runs first is the queue's choice.
        wait_for(lambda: any(job.kind == "edit" for job in demo.hidream_services.jobs.running()), "the first edit")
        jobs.append(submit(second))
        wait_for(
            lambda: (gradio_internals.queue_figures(demo, "device") or {}).get("waiting") == 1,
            "the second edit to wait",
        )
        waiting = handlers.visitor_card(SimpleNamespace(session_hash=second.session_hash))
        running = handlers.visitor_card(SimpleNamespace(session_hash=first.session_hash))
        stranger = handlers.visitor_card(SimpleNamespace(session_hash="someone-else"))
        assert "you are number 1 of 1 waiting" in waiting and "1 waiting · 1 running" in waiting
        assert "nothing of yours is waiting" in running and "nothing of yours is waiting" in stranger
        assert app["engine"].status().device_name in waiting
    finally:
        for job in jobs:
            job.cancel()
