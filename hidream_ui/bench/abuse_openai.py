"""The probes of `bench abuse` for issue 57's OpenAI-compatible route (``POST /v1/images/edits``): the
limits a browser meets hold for it too.

* ``openai-flood``: one address sends many edits at once (the per-client limit: 429), then clients
  of many addresses fill the queue (``--max-queue``: 503 with Retry-After), then clients send slow
  edits and hang up (each must be stopped, nothing saved);
* ``openai-bodies``: bodies over the route's cap (declared and streamed), an image over
  ``--max-upload-mb``, a form of thousands of fields, a PNG header claiming a billion pixels;
* ``openai-keys``: with ``--api-keys``, a flood of wrong keys from one address (throttled to 429
  after ``--max-login-failures``), while a good key from another address still edits.

Each gets a `ProbeContext` like those of abuse_probes.py and returns a `ProbeOutcome`; its check is a
pure function of its figures (`*_check`), so the verdict can be tested without an app. Every answer
that is not a result must be OpenAI's error shape (``{"error": {"message", "type", "param",
"code"}}``): an SDK client must be able to read it.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import secrets
import struct
import tempfile
import time
import zlib
from typing import Any, Iterator

from hidream_ui.bench.abuse_app import AbuseApp, client_address
from hidream_ui.bench.abuse_client import CallResult
from hidream_ui.bench.abuse_kit import (
    BASE_ARGS,
    ProbeContext,
    ProbeOutcome,
    ProbeSpec,
    attacker_apple,
    in_threads,
    saved_with,
    wait_until,
)

EDITS_PATH = "/v1/images/edits"
FLOOD_INSTRUCTION = "openai flood"
ABANDON_INSTRUCTION = "openai abandoned"
QUEUE_CAP = 4  # --max-queue of the flood probe: small, so that a few clients fill it
UPLOAD_MB = 1  # --max-upload-mb of the bodies probe: oversized bodies stay cheap to send
WRONG_KEY_FAILURES = 5  # --max-login-failures of the keys probe
ERROR_KEYS = {"message", "type", "param", "code"}


# ---------------------------------------------------------------------------------------------
# Calls
# ---------------------------------------------------------------------------------------------


def openai_edit(
    app: AbuseApp,
    image: bytes,
    prompt: str,
    *,
    steps: int = 2,
    key: str | None = None,
    address: str | None = None,
    timeout: float = 120.0,
    extra: dict[str, str] | None = None,
) -> CallResult:
    """One ``POST /v1/images/edits`` as OpenAI's SDK sends it (multipart). `ran`: a result came back;
    else `status` and `error` ("<code>: <message>", or what was wrong with the answer's shape)."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    fields = {"prompt": prompt, "num_inference_steps": str(steps), **(extra or {})}
    started = time.monotonic()
    try:
        with app.http(timeout=timeout, address=address) as http:
            answer = http.post(
                EDITS_PATH, files={"image": ("apple.png", image, "image/png")}, data=fields, headers=headers
            )
    except httpx.HTTPError as exc:
        return CallResult(False, None, f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - started)
    return _result(answer, time.monotonic() - started)


def _result(answer, seconds: float) -> CallResult:
    """A CallResult of an answer of the route; `data`: {"retry_after", "shape_ok"} beside the body."""
    try:
        body = answer.json()
    except ValueError:
        body = None
    retry = answer.headers.get("retry-after")
    if answer.status_code == 200 and isinstance(body, dict) and body.get("data"):
        return CallResult(True, 200, data={"retry_after": retry, "shape_ok": True}, seconds=seconds)
    error = body.get("error") if isinstance(body, dict) else None
    shape_ok = isinstance(error, dict) and set(error) == ERROR_KEYS
    text = f"{error.get('code')}: {error.get('message')}" if shape_ok else f"not OpenAI's shape: {answer.text[:120]}"
    return CallResult(
        False, answer.status_code, text, data={"retry_after": retry, "shape_ok": shape_ok}, seconds=seconds
    )


def answers(results: list[CallResult]) -> dict[str, Any]:
    """Counts by status, whether every refusal had OpenAI's shape, and the Retry-After headers seen."""
    by_status: dict[str, int] = {}
    for result in results:
        key = str(result.status) if result.status is not None else "no answer"
        by_status[key] = by_status.get(key, 0) + 1
    refusals = [r for r in results if r.status not in (None, 200)]
    return {
        "by_status": by_status,
        "ran": sum(r.ran for r in results),
        "refusals_in_openai_shape": sum(bool((r.data or {}).get("shape_ok")) for r in refusals),
        "refusals": len(refusals),
        "retry_after": sorted({(r.data or {}).get("retry_after") for r in results if r.status in (429, 503)} - {None}),
        "examples": sorted({(r.error or "")[:100] for r in refusals})[:4],
    }


def _engine_idle(app: AbuseApp) -> bool:
    import httpx

    try:
        with app.http(timeout=10) as http:
            answer = http.post("/gradio_api/run/status", json={"data": []})
        status = answer.json()["data"][0]
        return status.get("state") == "idle" and not (status.get("queue") or {}).get("running")
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return False


def _addresses(count: int, third: int) -> list[str | None]:
    """`count` client addresses 127.<third>.0.x (None where this machine has only 127.0.0.1)."""
    return [client_address(f"127.{third}.0.{index + 1}") for index in range(count)]


# ---------------------------------------------------------------------------------------------
# openai-flood: the per-client limit, the queue's cap, clients that hang up
# ---------------------------------------------------------------------------------------------


def flood(ctx: ProbeContext) -> ProbeOutcome:
    app = ctx.app
    parallel = 8 if ctx.quick else 16
    steps = 4 if ctx.quick else 8
    image = attacker_apple()
    before = saved_with(app, FLOOD_INSTRUCTION)

    # 1. One address, many edits at once: at most --max-jobs-per-client (2) run, the rest are a 429.
    def one_client(index: int) -> CallResult:
        return openai_edit(app, image, f"{FLOOD_INSTRUCTION} {index}", steps=steps, timeout=ctx.left())

    ctx.honest.start()  # beside the flood: the per-client limit leaves room in the queue for it
    per_client = in_threads(parallel, one_client, ctx.left())
    # 2. Many addresses, two edits each: the queue holds at most QUEUE_CAP waiting, the rest are a 503.
    addresses = _addresses(parallel // 2, 61)
    spread = not any(address is None for address in addresses)

    def many_clients(index: int) -> CallResult:
        return openai_edit(
            app, image, f"{FLOOD_INSTRUCTION} q{index}", steps=steps, address=addresses[index // 2], timeout=ctx.left()
        )

    queue = in_threads(parallel, many_clients, ctx.left())
    # 3. Slow edits whose clients hang up after a second: each is stopped, nothing is saved.
    abandoned_before = saved_with(app, ABANDON_INSTRUCTION)
    hang_ups = _addresses(3, 62)

    def hang_up(index: int) -> CallResult:
        return openai_edit(
            app, image, f"{ABANDON_INSTRUCTION} {index}", steps=200, address=hang_ups[index], timeout=1.0
        )

    abandoned = in_threads(len(hang_ups), hang_up, min(30.0, ctx.left()))
    # Seen busy (the edits arrived: a hang-up before the queue also counts), then idle again: stopped.
    wait_until(lambda: not _engine_idle(app), min(5.0, ctx.left()), every=0.1)
    stopped = wait_until(lambda: _engine_idle(app), min(60.0, ctx.left()), every=0.25)
    figures = {
        "per_client": answers(per_client),
        "queue": answers(queue),
        "queue_clients_spread": spread,
        "hang_ups": answers(abandoned),
        "hang_ups_stopped": stopped,
        "hang_ups_saved": saved_with(app, ABANDON_INSTRUCTION) - abandoned_before,
        "flood_saved": saved_with(app, FLOOD_INSTRUCTION) - before,
        "max_jobs_per_client": 2,
        "max_queue": QUEUE_CAP,
    }
    per, q = figures["per_client"], figures["queue"]
    text = (
        f"one address x{parallel}: {per['ran']} ran, {per['by_status'].get('429', 0)} got 429; "
        f"{len(addresses)} addresses x2: {q['ran']} ran, {q['by_status'].get('503', 0)} got 503 "
        f"(Retry-After {q['retry_after']}); {len(hang_ups)} hung up: stopped {stopped}, "
        f"saved {figures['hang_ups_saved']}"
    )
    sent = (
        f"{parallel} parallel POST {EDITS_PATH} ({steps} steps) from one address; {parallel} from "
        f"{len(addresses)} addresses (--max-queue {QUEUE_CAP}); {len(hang_ups)} 200-step edits given up after 1 s"
    )
    return ProbeOutcome(sent, flood_check(figures), text, figures)


def flood_check(figures: dict) -> bool:
    """Held when the one address got no more than its 2 jobs at once (the rest 429), a full queue
    answered 503 with Retry-After (where clients could be told apart), every refusal was OpenAI's
    shape, and the hung-up edits stopped without saving anything."""
    per, queue = figures["per_client"], figures["queue"]
    shapes = all(part["refusals_in_openai_shape"] == part["refusals"] for part in (per, queue))
    per_client = per["by_status"].get("429", 0) > 0 and set(per["by_status"]) <= {"200", "429"}
    full = not figures["queue_clients_spread"] or (queue["by_status"].get("503", 0) > 0 and bool(queue["retry_after"]))
    return bool(shapes and per_client and full and figures["hang_ups_stopped"] and figures["hang_ups_saved"] == 0)


# ---------------------------------------------------------------------------------------------
# openai-bodies: bodies over the cap, an image over --max-upload-mb, a field flood, a pixel bomb
# ---------------------------------------------------------------------------------------------


def _multipart(fields: list[tuple[str, str]], files: list[tuple[str, str, bytes]]) -> tuple[bytes, str]:
    """A multipart body and its Content-Type, built by hand (a form httpx would refuse to send)."""
    boundary = secrets.token_hex(12)
    out = io.BytesIO()
    for name, value in fields:
        out.write(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    for name, filename, data in files:
        out.write(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
            "Content-Type: image/png\r\n\r\n".encode()
        )
        out.write(data + b"\r\n")
    out.write(f"--{boundary}--\r\n".encode())
    return out.getvalue(), f"multipart/form-data; boundary={boundary}"


def _streamed(body: bytes, chunk: int = 256 * 1024) -> Iterator[bytes]:
    for start in range(0, len(body), chunk):
        yield body[start : start + chunk]


def pixel_bomb(side: int = 40_000) -> bytes:
    """A small PNG whose header claims side x side pixels (its data is a few bytes of zeros)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 1024))
        + chunk(b"IEND", b"")
    )


def bodies(ctx: ProbeContext) -> ProbeOutcome:
    import httpx

    app = ctx.app
    rounds = 3 if ctx.quick else 10
    cap = 2 * UPLOAD_MB * 1024 * 1024 + 256 * 1024  # openai_api.max_body_bytes at --max-upload-mb UPLOAD_MB
    over = os.urandom(cap + 512 * 1024)
    image_over = os.urandom(UPLOAD_MB * 1024 * 1024 + 1024)
    before = saved_with(app, "openai body")
    cases: dict[str, tuple[bytes, str, bool]] = {}
    body, kind = _multipart([("prompt", "openai body declared")], [("image", "big.png", over)])
    cases["declared_over_cap"] = (body, kind, False)
    cases["streamed_over_cap"] = (body, kind, True)  # chunked: no Content-Length to refuse it by
    cases["image_over_upload_mb"] = (
        *_multipart([("prompt", "openai body image")], [("image", "i.png", image_over)]),
        False,
    )
    fields = [(f"f{index}", "x") for index in range(5000)]
    cases["field_flood"] = (
        *_multipart([("prompt", "openai body fields"), *fields], [("image", "a.png", attacker_apple())]),
        False,
    )
    cases["pixel_bomb"] = (*_multipart([("prompt", "openai body bomb")], [("image", "bomb.png", pixel_bomb())]), False)
    ctx.honest.start()
    results: dict[str, list[CallResult]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (payload, content_type, streamed) in cases.items():
            if ctx.left() <= 0:
                break
            started = time.monotonic()
            try:
                with app.http(timeout=min(60.0, ctx.left() + 1)) as http:
                    content = _streamed(payload) if streamed else payload
                    answer = http.post(EDITS_PATH, content=content, headers={"Content-Type": content_type})
                results[name].append(_result(answer, time.monotonic() - started))
            except httpx.HTTPError as exc:  # the server may close a streamed body it refused
                results[name].append(CallResult(False, None, f"{type(exc).__name__}: {exc}"))
    figures = {name: answers(found) for name, found in results.items()}
    figures["saved"] = saved_with(app, "openai body") - before
    figures["cap_bytes"] = cap
    text = "; ".join(f"{name}: {part['by_status']}" for name, part in figures.items() if isinstance(part, dict))
    sent = (
        f"{rounds} rounds of: a {len(over) / 2**20:.1f} MB body declared and streamed (cap {cap / 2**20:.2f} MB), "
        f"an image of {len(image_over) / 2**20:.1f} MB (--max-upload-mb {UPLOAD_MB}), a form of {len(fields)} "
        "fields, a PNG header of 40000x40000 px"
    )
    return ProbeOutcome(sent, bodies_check(figures), text + f"; saved {figures['saved']}", figures)


# What each body must get: the status (a streamed body over the cap may also see its connection closed).
BODY_STATUS = {
    "declared_over_cap": {"413"},
    "streamed_over_cap": {"413", "no answer"},
    "image_over_upload_mb": {"413"},
    "field_flood": {"400"},
    "pixel_bomb": {"400"},
}


def bodies_check(figures: dict) -> bool:
    """Held when every body got its refusal (BODY_STATUS), each in OpenAI's shape, and nothing ran."""
    for name, wanted in BODY_STATUS.items():
        part = figures.get(name)
        if not part or not part["by_status"] or not set(part["by_status"]) <= wanted:
            return False
        if part["ran"] or part["refusals_in_openai_shape"] != part["refusals"]:
            return False
    return figures.get("saved") == 0


# ---------------------------------------------------------------------------------------------
# openai-keys: wrong keys are throttled per address; a good key elsewhere still edits
# ---------------------------------------------------------------------------------------------

_KEY_FILES: list[str] = []


def _remove_key_files() -> None:
    for path in _KEY_FILES:
        with contextlib.suppress(OSError):
            os.remove(path)


def _keys_args(quick: bool) -> tuple[list[str], None]:
    """The app's flags with a key file of one fresh key (written once per run, removed at exit)."""
    if not _KEY_FILES:
        handle, path = tempfile.mkstemp(prefix="hidream-bench-abuse-keys-", suffix=".txt")
        with os.fdopen(handle, "w") as out:
            out.write(secrets.token_urlsafe(32) + "\n")
        _KEY_FILES.append(path)
        atexit.register(_remove_key_files)
    return [*BASE_ARGS, "--api-keys", _KEY_FILES[0], "--max-login-failures", str(WRONG_KEY_FAILURES)], None


def _good_key() -> str:
    with open(_KEY_FILES[0], encoding="utf-8") as keys:
        return keys.read().strip()


def keys(ctx: ProbeContext) -> ProbeOutcome:
    app = ctx.app
    guesses = 40 if ctx.quick else 200
    good = _good_key()
    image = attacker_apple()

    def wrong(index: int) -> CallResult:
        return openai_edit(app, image, "openai key guess", key=secrets.token_urlsafe(32), timeout=ctx.left())

    ctx.honest.start()
    guessed = in_threads(guesses, wrong, ctx.left())
    # The right key from the guessing address is locked out with it (the throttle is per address) ...
    locked = openai_edit(app, image, "openai key locked", key=good, timeout=min(60.0, ctx.left()))
    # ... and from another address it edits.
    elsewhere = client_address("127.0.63.1")
    keyed = openai_edit(app, image, "openai key good", key=good, address=elsewhere, timeout=ctx.left())
    leaked = sum(good in (r.error or "") for r in [*guessed, locked, keyed])
    figures = {
        "wrong_keys": answers(guessed),
        "good_key_same_address": locked.short(),
        "good_key_other_address": keyed.short(),
        "other_address_distinct": elsewhere is not None,
        "max_login_failures": WRONG_KEY_FAILURES,
        "answers_naming_the_key": leaked,
    }
    text = (
        f"{guesses} wrong keys from one address: {figures['wrong_keys']['by_status']}; the good key there: "
        f"{locked.short()[:60]}; from another address: {keyed.short()[:60]}"
    )
    sent = f"{guesses} parallel POST {EDITS_PATH} with random Bearer keys from one address, then the good key"
    return ProbeOutcome(sent, keys_check(figures), text, figures)


def keys_check(figures: dict) -> bool:
    """Held when at most --max-login-failures wrong keys were answered 401 (the rest 429 with
    Retry-After), every refusal was OpenAI's shape, no answer named a key, and the good key edited
    from another address (where this machine can tell addresses apart)."""
    wrong = figures["wrong_keys"]
    throttled = (
        wrong["by_status"].get("401", 0) <= figures["max_login_failures"]
        and set(wrong["by_status"]) <= {"401", "429"}
        and bool(wrong["retry_after"])
    )
    good = not figures["other_address_distinct"] or figures["good_key_other_address"] == "ran"
    return bool(
        throttled
        and wrong["refusals_in_openai_shape"] == wrong["refusals"]
        and good
        and figures["answers_naming_the_key"] == 0
    )


PROBES: dict[str, ProbeSpec] = {
    "openai-flood": ProbeSpec(
        flood,
        lambda quick: (["--max-queue", str(QUEUE_CAP), "--max-jobs-per-client", "2"], None),
    ),
    "openai-bodies": ProbeSpec(bodies, lambda quick: ([*BASE_ARGS, "--max-upload-mb", str(UPLOAD_MB)], None)),
    "openai-keys": ProbeSpec(keys, _keys_args),
}

__all__ = ["PROBES", "bodies_check", "flood_check", "keys_check", "openai_edit", "pixel_bomb"]
