"""The upload probes of `bench abuse` (issue 19's findings 2-5): a zip bomb cancelled mid-batch, an
ICO decoded inside Image.open, one client filling the shared cache, and a long file name that
escapes --retention. Each is bounded in count and time; abuse_probes.py lists them with the others."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from hidream_ui.bench import abuse_files
from hidream_ui.bench.abuse_app import AbuseApp
from hidream_ui.bench.abuse_client import (
    EDIT_INSTRUCTION,
    CallResult,
    call_api,
    edit_data,
    file_data,
    new_session,
    queue_call,
    upload,
)
from hidream_ui.bench.abuse_kit import (
    _MIB,
    ProbeContext,
    ProbeOutcome,
    attacker_png,
    in_threads,
    tally_answers,
    upload_one,
    wait_until,
)

# How soon after a cancel the server must stop working on a cancelled zip (issue 19: "bounded in time").
ZIP_QUIET_TARGET_S = 10.0


# ---------------------------------------------------------------------------------------------
# 2. A zip bomb with wrong CRCs, listed twice, then cancelled
# ---------------------------------------------------------------------------------------------


def zip_bomb(ctx: ProbeContext) -> ProbeOutcome:
    import psutil

    app = ctx.app
    # The zip (256 x 64 MiB); --quick: 48 members, still enough to keep today's app busy for
    # well over ZIP_QUIET_TARGET_S after the cancel (inflating runs at a few hundred MB/s here).
    members, size = (48 if ctx.quick else 256), 64 * _MIB
    bomb = abuse_files.zip_bomb(members, size)
    sent = (
        f"a {len(bomb) / _MIB:.1f} MB zip of {members} members x {size // _MIB} MiB deflated zeros with wrong "
        f"CRC-32, listed twice in one /batch_edit through the queue; then /cancel and Gradio's cancel"
    )
    session = new_session("attacker")
    with app.http() as http:
        code, paths = upload(http, [("bomb.zip", bomb)])
    if code != 200:
        ctx.honest.start()
        return ProbeOutcome(sent, True, f"the zip upload was refused ({code})", {"upload_status": code})
    zip_file = file_data(paths[0], "bomb.zip")
    data = [[zip_file, zip_file], EDIT_INSTRUCTION, "matrix", "", 3.0, 1.5, 2, 0.3, True, "draft", 1, "fixed", 0, False]
    events: dict[str, float] = {}
    batch: dict[str, CallResult] = {}

    def on_event(message: dict) -> None:
        events.setdefault(str(message.get("msg")), time.monotonic())
        if message.get("event_id"):
            events.setdefault("event_id:" + message["event_id"], 0.0)

    def run_batch() -> None:
        with app.http() as http:
            batch["result"] = call_api(app, http, "batch_edit", data, session, timeout=ctx.left(), on_event=on_event)

    fn_index, _ = app.dependency("batch_edit")
    thread = threading.Thread(target=run_batch, daemon=True)
    joined_at = time.monotonic()
    thread.start()
    ctx.honest.start()
    wait_until(lambda: "process_starts" in events or "result" in batch, min(20.0, ctx.left()), every=0.05)
    time.sleep(1.0)  # let the expansion get going: the cancel must stop work already started
    event_id = next((k.split(":", 1)[1] for k in events if k.startswith("event_id:")), None)
    server = psutil.Process(app.process.pid)
    cancel_at = time.monotonic()
    cpu_at_cancel = app.cpu_seconds()
    with app.http() as http:
        cancelled = call_api(app, http, "cancel", [], session, timeout=30)
        gradio_cancel = http.post(
            "/gradio_api/cancel",
            json={"session_hash": session, "fn_index": fn_index, "event_id": event_id or ""},
            timeout=30,
        )
    # The device lane: a job that does nothing (no image: refused by the handler at once) joined now
    # waits for whatever still holds the lane.
    with app.http() as http:
        lane = queue_call(
            app, http, app.dependency("edit")[0], edit_data(None, "lane probe"), new_session("lane"), timeout=ctx.left()
        )
    lane_free_s = round(time.monotonic() - cancel_at, 2) if lane.status == 200 else None
    ended_before_cancel = "result" in batch and batch["result"].ended_at <= cancel_at
    # When did the server go quiet? CPU below a quarter of a core over a second.
    server.cpu_percent(None)
    quiet_at = None
    while ctx.left() > 0:
        if server.cpu_percent(1.0) < 25.0:
            quiet_at = time.monotonic()
            break
    thread.join(timeout=max(0.0, ctx.left()))
    result = batch.get("result")
    quiet_s = round(quiet_at - 1.0 - cancel_at, 1) if quiet_at else None
    figures = {
        "zip_mb": round(len(bomb) / _MIB, 2),
        "members": members,
        "member_mib": size // _MIB,
        "decompressed_if_all_read_gib": round(2 * members * size / 2**30, 1),
        "batch_started_after_s": round(events["process_starts"] - joined_at, 2) if "process_starts" in events else None,
        "cancel_answer": cancelled.data[0] if cancelled.ran and cancelled.data else cancelled.short(),
        "gradio_cancel_status": gradio_cancel.status_code,
        "batch_answer": result.short() if result else "no answer by the probe's deadline",
        "batch_ended_before_cancel": ended_before_cancel,
        "lane_free_after_cancel_s": lane_free_s,
        "server_cpu_s_after_cancel": round(app.cpu_seconds() - cpu_at_cancel, 1),
        "server_busy_after_cancel_s": quiet_s,
    }
    refused_early = result is not None and not result.ran and "process_starts" not in events
    check = refused_early or (quiet_s is not None and quiet_s <= ZIP_QUIET_TARGET_S and lane_free_s is not None)
    busy = quiet_s if quiet_s is not None else ">budget"
    text = (
        f"/cancel: {str(figures['cancel_answer'])[:50]!r}; server busy {busy} s "
        f"after the cancel (target <= {ZIP_QUIET_TARGET_S:.0f} s); lane free after "
        f"{lane_free_s if lane_free_s is not None else '-'} s"
    )
    return ProbeOutcome(sent, check, text, figures)


# ---------------------------------------------------------------------------------------------
# 3. ICO decoded inside Image.open; a text chunk after 25 MP of pixels
# ---------------------------------------------------------------------------------------------


def ico_decode(ctx: ProbeContext) -> ProbeOutcome:
    from hidream_ui.outputs import METADATA_KEY  # lazy: numpy and PIL, not for `bench abuse --help`

    app = ctx.app
    side = 4000 if ctx.quick else 12000
    ico_reads = 1 if ctx.quick else 4
    text_side, text_reads = (2000, 4) if ctx.quick else (5000, 16)
    ico = abuse_files.ico_with_png(abuse_files.png_of_zeros(side, side, "RGBA"))
    late_text = abuse_files.png_of_zeros(
        text_side, text_side, "RGB", text_after={METADATA_KEY: json.dumps({"format": "x", "params": {}})}
    )
    ico_path = upload_one(app, "icon.png", ico)
    text_path = upload_one(app, "settings.png", late_text)
    session = new_session("attacker")
    ctx.honest.start()

    def read_settings(path: str) -> Callable[[int], CallResult]:
        def work(index: int) -> CallResult:
            with app.http() as http:
                return call_api(
                    app,
                    http,
                    "settings_from_file",
                    [file_data(path, "icon.png")],
                    f"{session}-{index}",
                    timeout=ctx.left(),
                )

        return work

    icos = in_threads(ico_reads, read_settings(ico_path), ctx.left())
    with app.http() as http:
        edit = call_api(app, http, "edit", edit_data(file_data(ico_path, "icon.png")), session, timeout=ctx.left())
    texts = in_threads(text_reads, read_settings(text_path), ctx.left())
    figures = {
        "ico_kb": round(len(ico) / 1024, 1),
        "ico_embedded_png": f"{side}x{side} RGBA",
        "settings_reads_of_ico": tally_answers(icos),
        "edit_of_ico": edit.short(),
        "late_text_png_kb": round(len(late_text) / 1024, 1),
        "late_text_png": f"{text_side}x{text_side} RGB, tEXt after IDAT",
        "parallel_reads_of_late_text_png": tally_answers(texts),
    }
    check = not edit.ran and all(not r.ran for r in icos)
    text = (
        f"ICO: settings reader {figures['settings_reads_of_ico']['refused']}/{ico_reads} refused, /edit "
        f"{edit.short()[:60]}; late-text PNG x{text_reads}: "
        f"{figures['parallel_reads_of_late_text_png']['ran']} read"
    )
    sent = (
        f"a {figures['ico_kb']} KB .ico (directory 256x256, embeds a {side}x{side} PNG) uploaded as icon.png: "
        f"{ico_reads} parallel settings-from-PNG reads + one /edit; {text_reads} parallel settings reads of a "
        f"{figures['late_text_png_kb']} KB {text_side}x{text_side} PNG whose tEXt follows the pixels"
    )
    return ProbeOutcome(sent, check, text, figures)


# ---------------------------------------------------------------------------------------------
# 4. One client fills the shared cache; a refused upload leaves its spool behind
# ---------------------------------------------------------------------------------------------


def _tmp_files(app: AbuseApp) -> list[tuple[Path, int]]:
    """(path, bytes) of the upload spools (`tmp*`) in the app's temporary folder."""
    out = []
    for path in app.gradio_tmp.rglob("tmp*"):
        try:
            if path.is_file():
                out.append((path, path.stat().st_size))
        except OSError:  # removed while we looked
            continue
    return out


def cache_evict(ctx: ProbeContext) -> ProbeOutcome:
    import httpx

    app = ctx.app
    max_upload_mb = 2 if ctx.quick else 50
    many = 300
    part_bytes = int(0.9 * max_upload_mb * _MIB)
    with app.http(timeout=max(30.0, ctx.left())) as http:
        files = [("files", (f"tiny{i}.png", attacker_png(f"{i}"), "image/png")) for i in range(many)]
        flood = http.post("/gradio_api/upload", files=files)
        boundary = uuid.uuid4().hex
        body = abuse_files.multipart_stream(boundary, [(f"big{i}.png", part_bytes) for i in range(9)])
        try:
            oversized = http.post(
                "/gradio_api/upload",
                content=body,
                headers={"content-type": f"multipart/form-data; boundary={boundary}"},
            ).status_code
        except httpx.HTTPError as exc:  # the server may cut the connection instead of answering
            oversized = f"{type(exc).__name__}"
    # The janitor runs every few seconds: give it the chance to evict the victim (the honest client).
    victim = Path(ctx.honest.upload_path)
    wait_until(lambda: not victim.is_file(), min(7.0, ctx.left()))
    evicted = not victim.is_file()
    ctx.honest.start()  # the victim's re-edit of its earlier upload
    ctx.honest.finish(ctx.deadline)
    leftovers = _tmp_files(app)
    figures = {
        "flood_upload_status": flood.status_code,
        "flood_files": many,
        "oversized_upload": f"9 x {part_bytes / _MIB:.1f} MB, chunked",
        "oversized_status": oversized,
        "victim_upload_evicted": evicted,
        "tmp_files_left": len(leftovers),
        "tmp_mb_left": round(sum(size for _, size in leftovers) / _MIB, 1),
    }
    check = oversized == 413 and not leftovers and not evicted
    text = (
        f"{many} files in one upload: {flood.status_code}; oversized chunked upload: {oversized}; victim's upload "
        f"{'evicted' if evicted else 'kept'}; {len(leftovers)} tmp files ({figures['tmp_mb_left']} MB) left"
    )
    sent = (
        f"one POST /gradio_api/upload of {many} tiny distinct files (cache cap 200), then a chunked upload of "
        f"9 x {part_bytes / _MIB:.1f} MB (--max-upload-mb {max_upload_mb}); the victim re-edits its earlier upload"
    )
    return ProbeOutcome(sent, check, text, figures)


# ---------------------------------------------------------------------------------------------
# 5. A long file name in the metadata escapes --retention
# ---------------------------------------------------------------------------------------------

LONG_NAME_RETENTION = 3


def long_name(ctx: ProbeContext) -> ProbeOutcome:
    app = ctx.app
    # Pillow refuses a PNG once its text chunks pass 64 MiB (PngImagePlugin.MAX_TEXT_MEMORY): then the
    # app no longer recognises the file as its own. The 68 M characters pass it; --quick
    # sends 2 M (the plumbing only: it cannot reproduce the finding).
    length = 2 * _MIB if ctx.quick else 68_000_000
    if ctx.quick:
        ctx.notes.append(
            "--quick: a 2 M-character name stays under Pillow's 64 MiB text limit; finding 5 needs the default run"
        )
    edits = LONG_NAME_RETENTION + 1
    path = upload_one(app, "mine.png", attacker_png())
    session = new_session("attacker")
    ctx.honest.start()
    answers = []
    with app.http(timeout=120) as http:
        for index in range(edits):
            if ctx.left() <= 0:
                break
            name = f"{index}" + "n" * (length - 5) + ".png"
            answers.append(
                call_api(
                    app,
                    http,
                    "edit",
                    edit_data(file_data(path, name), f"long name {index}"),
                    session,
                    timeout=ctx.left(),
                )
            )
    ctx.honest.finish(ctx.deadline)  # its result counts towards --retention too
    pngs = sorted(app.output_dir.glob("*.png"))
    sizes = [p.stat().st_size for p in pngs]
    figures = {
        "name_chars": length,
        "edits_sent": len(answers),
        "edits": tally_answers(answers),
        "retention": LONG_NAME_RETENTION,
        "pngs_kept": len(pngs),
        "largest_png_mb": round(max(sizes) / _MIB, 2) if sizes else None,
        "output_mb": round(sum(sizes) / _MIB, 1),
    }
    check = len(pngs) <= LONG_NAME_RETENTION
    text = (
        f"{figures['edits']['ran']} of {len(answers)} edits with a {length / 1e6:.0f} M-character orig_name ran; "
        f"{len(pngs)} PNGs kept with --retention {LONG_NAME_RETENTION} (largest {figures['largest_png_mb']} MB)"
    )
    sent = f"{edits} queued /edit calls whose FileData orig_name is {length / 1e6:.0f} M characters"
    return ProbeOutcome(sent, check, text, figures)
