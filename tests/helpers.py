"""Small helpers shared by test modules (import as `from helpers import ...`; pytest puts tests/ on
sys.path, as for `fakes`)."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], what: str = "condition", timeout: float = 60.0) -> T:
    """Polls `predicate` until it returns something truthy (returned), or fails naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def run_info(**overrides):
    """A `RunInfo` for results built by hand (tests of outputs, archives, grids)."""
    from hidream_ui.edits import RunInfo

    values = dict(
        variant="e1.1",
        model_source="tiny",
        model_paths=None,
        device="cpu",
        device_name="test CPU",
        dtype="fp32",
        attention="sdpa",
        refiner="e1",
        versions={"hidream_ui": "test"},
    )
    return RunInfo(**{**values, **overrides})


def random_picture(seed: int = 0, size: tuple[int, int] = (80, 60)):
    """A noise image of `size` (width, height): every seed a different, reproducible picture."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def edit_params(instruction: str = "make the sky purple", *, steps: int = 2, **overrides):
    """Validated E1.1 defaults, made fast: `steps` steps at the draft working size."""
    from hidream_ui.edits import EditParams

    values = {
        **EditParams.defaults_for("e1.1").to_dict(),
        "instruction": instruction,
        "num_inference_steps": steps,
        "working_resolution": "draft",
        **overrides,
    }
    return EditParams.from_dict(values)


def write_picture(path, seed: int = 0, size: tuple[int, int] = (80, 60)):
    """`random_picture(seed, size)` saved as a PNG at `path`; returns the path."""
    random_picture(seed, size).save(path)
    return path


def raw_edit(http, path: str, name: str, session: str, seed: int = 1, steps: int = 2) -> dict:
    """A raw queued edit (`/gradio_api/call/edit` over an httpx.Client, as a script would send it) of the
    uploaded `path`; returns {"event", "data"} of its last SSE event ({"event": "refused", "status"} when
    the call itself is refused)."""
    import json

    file = {"path": path, "meta": {"_type": "gradio.FileData"}, "orig_name": name}
    data = [file, "make it blue", "", 3.0, 1.5, steps, 0.3, True, "draft", seed, False, True, False]
    posted = http.post("/gradio_api/call/edit", json={"data": data, "session_hash": session})
    if posted.status_code != 200:
        return {"event": "refused", "status": posted.status_code, "data": posted.text}
    text = http.get(f"/gradio_api/call/edit/{posted.json()['event_id']}").text
    kinds = [line[6:].strip() for line in text.splitlines() if line.startswith("event:")]
    payloads = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    return {"event": kinds[-1], "data": json.loads(payloads[-1]) if payloads[-1] not in ("", "null") else None}
