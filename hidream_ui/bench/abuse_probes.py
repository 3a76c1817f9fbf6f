"""The probes of `bench abuse`: one function per finding of issue 19, each bounded in count and time.

A probe gets a `ProbeContext` (the app, the honest client, `quick`, a deadline), sends its attack
over raw HTTP, starts the honest client's edit while the attack is under way, and returns what it
sent, its own check (what the finding needs to count as fixed) and its figures. The common
figures (RSS, cache, /status, honest edit, files removed) are taken by `abuse.run_probe`.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hidream_ui.bench import abuse_files
from hidream_ui.bench.abuse_client import (
    EDIT_INSTRUCTION,
    AbuseApp,
    CallResult,
    ProbeContext,
    ProbeOutcome,
    _apple,
    call_api,
    client_address,
    edit_data,
    file_data,
    new_session,
    queue_call,
    run_direct,
    upload,
)

_MIB = 1 << 20
BASE_ARGS = ["--max-queue", "16", "--max-jobs-per-client", "2"]
# How soon after a cancel the server must stop working on a cancelled zip (issue 19: "bounded in time").
ZIP_QUIET_TARGET_S = 10.0
# What one fresh session may cost (issue 19: "a fresh session costs under 20 KB until it runs a job").
SESSION_TARGET_KB = 20.0
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.@+-]+/)+[\w.@+-]*")


@dataclass(frozen=True)
class ProbeSpec:
    run: Callable[[ProbeContext], ProbeOutcome]
    app_args: Callable[[bool], tuple[list[str], tuple[str, str] | None]]
    # Without the flag the probe needs (for a flag today's app may not know): what to run instead.
    fallback_args: Callable[[bool], tuple[list[str], tuple[str, str] | None]] | None = None
    # Seconds its attack may take (quick -> seconds); None: the runner's default (90, 25 with --quick).
    budget: Callable[[bool], float] | None = None
    # Gradio's session table capped at this many sessions (abuse_child.py; quick -> cap); None: gradio's 10,000.
    session_capacity: Callable[[bool], int] | None = None


def attacker_png(tag: str = "", side: int = 96) -> bytes:
    """A PNG of the attacker's own (distinct bytes, so it never shares the honest client's cached
    copy, which Gradio names after the content)."""
    return abuse_files.png_of_zeros(side, side, "RGB", text_before={"attacker": tag or uuid.uuid4().hex})


def attacker_apple() -> bytes:
    """The bundled apple with a text chunk of the attacker's: the honest client's pixels (so an edit
    costs what a real one costs; a black image edits many times faster), distinct bytes."""
    import io

    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("attacker", uuid.uuid4().hex)
    with Image.open(_apple()) as image:
        out = io.BytesIO()
        image.save(out, format="PNG", pnginfo=info)
    return out.getvalue()


def _in_threads(count: int, work: Callable[[int], object], timeout: float) -> list:
    results: list = [None] * count

    def one(index: int) -> None:
        try:
            results[index] = work(index)
        except Exception as exc:  # noqa: BLE001 - a call that blew up is an answer too
            results[index] = CallResult(False, None, f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return [r if r is not None else CallResult(False, None, f"no answer in {timeout:.0f} s") for r in results]


def _upload_one(app: AbuseApp, name: str, data: bytes) -> str:
    with app.http() as http:
        code, paths = upload(http, [(name, data)])
    if code != 200:
        raise RuntimeError(f"upload of {name} refused: {code} {str(paths)[:200]}")
    return paths[0]


def _saved_with(app: AbuseApp, prefix: str) -> int:
    """Results in --output-dir whose sidecar records an instruction starting with `prefix`."""
    count = 0
    for sidecar in app.output_dir.glob("*.json"):
        try:
            params = json.loads(sidecar.read_text(encoding="utf-8")).get("params") or {}
        except (OSError, ValueError):
            continue
        if str(params.get("instruction", "")).startswith(prefix):
            count += 1
    return count


def _answers(results: list[CallResult]) -> dict:
    texts: dict[str, int] = {}
    for r in results:
        key = r.short()[:120]
        texts[key] = texts.get(key, 0) + 1
    return {"ran": sum(r.ran for r in results), "refused": sum(r.refused for r in results), "answers": texts}


def _wait(condition: Callable[[], bool], timeout: float, every: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return condition()


# ---------------------------------------------------------------------------------------------
# 1. /run/<api_name> skips the queue
# ---------------------------------------------------------------------------------------------


def run_bypass(ctx: ProbeContext) -> ProbeOutcome:
    app, parallel = ctx.app, 8
    steps = 2 if ctx.quick else 4
    # The most steps the app takes (200): ~5 s on an idle 2-core box, 5x the second its client waits.
    abandoned_steps, give_up_s = 200, 1.0
    path = _upload_one(app, "mine.png", attacker_apple())
    session = new_session("attacker")
    since = time.monotonic()

    def direct_edit(index: int) -> CallResult:
        with app.http() as http:
            return run_direct(
                http,
                "edit",
                edit_data(file_data(path), f"run bypass {index}", steps, seed=index),
                session,
                timeout=ctx.left(),
            )

    ctx.honest.start()
    edits = _in_threads(parallel, direct_edit, ctx.left())
    queue_seen = [s.get("queue") or {} for s in ctx.statuses.statuses(since)]
    with app.http() as http:
        attention = run_direct(http, "set_attention", ["math", "all"], session, timeout=min(60.0, ctx.left()))
        load = run_direct(http, "load_model", [], session, timeout=min(60.0, ctx.left()))
        # A client that gives up after a second: with no event id, no cancel can reach its job.
        before = _saved_with(app, "abandoned run")
        abandoned = run_direct(
            http, "edit", edit_data(file_data(path), "abandoned run", abandoned_steps), session, timeout=give_up_s
        )
    abandoned_saved, abandoned_busy = 0, None
    if not abandoned.ran:
        # Did the job go on without its client? Seen busy within a few seconds, then idle again,
        # then (a save follows the last step) a moment for the file.
        abandoned_busy = _wait(lambda: _state(app) not in ("idle", None), min(5.0, ctx.left()), every=0.1)
        if abandoned_busy:
            _wait(lambda: _state(app) == "idle", ctx.left(), every=0.2)
            _wait(lambda: _saved_with(app, "abandoned run") > before, min(3.0, ctx.left()))
        abandoned_saved = _saved_with(app, "abandoned run") - before
    saved = _saved_with(app, "run bypass")
    figures = {
        "run_edit": _answers(edits),
        "run_edit_saved": saved,
        "queue_max_waiting": max((q.get("waiting", 0) for q in queue_seen), default=None),
        "queue_max_running": max((q.get("running", 0) for q in queue_seen), default=None),
        "run_set_attention": attention.short(),
        "run_load_model": load.short(),
        "abandoned_run_edit": abandoned.short(),
        "abandoned_engine_busy_after": abandoned_busy,
        "abandoned_run_edit_saved": abandoned_saved,
    }
    ran = figures["run_edit"]["ran"]
    check = ran == 0 and not attention.ran and not load.ran and abandoned_saved == 0
    text = (
        f"/run/edit x{parallel} (one session): {ran} ran, {saved} saved; /run/set_attention "
        f"{attention.short()[:40]}; /run/load_model {load.short()[:40]}; abandoned {abandoned_steps}-step "
        f"/run/edit saved {abandoned_saved}"
    )
    sent = (
        f"{parallel} parallel POST /gradio_api/run/edit ({steps} steps) with one session_hash; "
        f"POST /run/set_attention ['math'], /run/load_model; one {abandoned_steps}-step /run/edit given up "
        f"after {give_up_s:.0f} s"
    )
    return ProbeOutcome(sent, check, text, figures)


def _state(app: AbuseApp) -> str | None:
    import httpx

    try:
        with app.http(timeout=10) as http:
            answer = http.post("/gradio_api/run/status", json={"data": [], "session_hash": new_session("state")})
        return answer.json()["data"][0].get("state")
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


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
    _wait(lambda: "process_starts" in events or "result" in batch, min(20.0, ctx.left()), every=0.05)
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
    ico_path = _upload_one(app, "icon.png", ico)
    text_path = _upload_one(app, "settings.png", late_text)
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

    icos = _in_threads(ico_reads, read_settings(ico_path), ctx.left())
    with app.http() as http:
        edit = call_api(app, http, "edit", edit_data(file_data(ico_path, "icon.png")), session, timeout=ctx.left())
    texts = _in_threads(text_reads, read_settings(text_path), ctx.left())
    figures = {
        "ico_kb": round(len(ico) / 1024, 1),
        "ico_embedded_png": f"{side}x{side} RGBA",
        "settings_reads_of_ico": _answers(icos),
        "edit_of_ico": edit.short(),
        "late_text_png_kb": round(len(late_text) / 1024, 1),
        "late_text_png": f"{text_side}x{text_side} RGB, tEXt after IDAT",
        "parallel_reads_of_late_text_png": _answers(texts),
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
    _wait(lambda: not victim.is_file(), min(7.0, ctx.left()))
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
    path = _upload_one(app, "mine.png", attacker_png())
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
        "edits": _answers(answers),
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


# ---------------------------------------------------------------------------------------------
# 6. The per-user login limit, bypassed by the body's shape
# ---------------------------------------------------------------------------------------------

LOGIN_USER = "booth"
LOGIN_FAILURES = 3


def login_bypass(ctx: ProbeContext) -> ProbeOutcome:
    import httpx

    app = ctx.app
    user, password = app.auth
    counter = iter(range(1, 10_000))

    def login(kind: str, secret: str) -> int:
        n = next(counter)
        address = f"10.19.{n // 250}.{n % 250 + 1}"
        headers = {"x-forwarded-for": address}
        with httpx.Client(base_url=app.url, timeout=30) as http:
            if kind == "form":
                answer = http.post("/login", data={"username": user, "password": secret}, headers=headers)
            elif kind == "multipart":
                answer = http.post(
                    "/login", files={"username": (None, user), "password": (None, secret)}, headers=headers
                )
            elif kind == "duplicated":
                # A new decoy name each time: the decoy collects failures of its own otherwise.
                answer = http.post(
                    "/login",
                    content=f"username=decoy{n}&username={user}&password={secret}",
                    headers={**headers, "content-type": "application/x-www-form-urlencoded"},
                )
            else:  # oversized: past the 64 KB the guard reads
                answer = http.post(
                    "/login", data={"pad": "x" * 70_000, "username": user, "password": secret}, headers=headers
                )
        return answer.status_code

    ctx.honest.start()  # logged in before the lock (its cookie stays valid)
    lock = [login("form", f"wrong{i}") for i in range(LOGIN_FAILURES + 1)]
    control = login("form", password)
    variants = {}
    for kind in ("multipart", "duplicated", "oversized"):
        wrong = [login(kind, f"wrong-{kind}-{i}") for i in range(LOGIN_FAILURES)]
        variants[kind] = {"wrong_password": wrong, "right_password": login(kind, password)}
    bypassed = [kind for kind, codes in variants.items() if codes["right_password"] == 200]
    figures = {
        "lock_codes": lock,
        "control_right_password_while_locked": control,
        "variants": variants,
        "bypassed_by": bypassed,
    }
    check = control == 429 and not bypassed
    text = (
        f"locked user, right password (form): {control}; multipart / duplicated username / >64 KB body with the "
        f"right password: {', '.join(str(v['right_password']) for v in variants.values())}"
        + (f" (200 = bypassed by {', '.join(bypassed)})" if bypassed else "")
    )
    sent = (
        f"--auth, --max-login-failures {LOGIN_FAILURES}: {LOGIN_FAILURES + 1} wrong logins lock '{user}', then "
        f"per variant (multipart, duplicated username, 70 KB body) {LOGIN_FAILURES} wrong + 1 right password, "
        f"each from a new X-Forwarded-For address"
    )
    return ProbeOutcome(sent, check, text, figures)


# ---------------------------------------------------------------------------------------------
# 7. What a fresh session costs
# ---------------------------------------------------------------------------------------------


# Sessions one address opens per minute in this probe: under the app's --max-new-sessions (120), so that
# every session is admitted and costs what a session costs (a refused one costs nothing).
SESSIONS_PER_ADDRESS = 100
SESSION_SETTLE_S = 0.5  # after a round, before RSS is read: the last answers' buffers are freed


def session_cost_kb(rounds: list[tuple[float, float, int]]) -> dict:
    """The figure from measured rounds [(RSS MB before, RSS MB after, sessions admitted)]: KB per
    session in each round, their median (the figure checked: one round in which the allocator grew
    an arena, or something else of the server's happened, cannot move it), and the overall mean."""
    per_round = [round((after - before) * 1024 / count, 1) for before, after, count in rounds if count > 0]
    counted = sum(count for _, _, count in rounds)
    overall = round(sum(after - before for before, after, _ in rounds) * 1024 / counted, 1) if counted else None
    ordered = sorted(per_round)
    median = None
    if ordered:
        middle = len(ordered) // 2
        median = ordered[middle] if len(ordered) % 2 else round((ordered[middle - 1] + ordered[middle]) / 2, 1)
    return {"kb_per_session": median, "kb_per_session_rounds": per_round, "kb_per_session_mean": overall}


def sessions_check(figures: dict) -> bool:
    """Held when every wanted session was sent and the median round cost under SESSION_TARGET_KB."""
    kb = figures.get("kb_per_session")
    return (
        kb is not None
        and kb < SESSION_TARGET_KB
        and figures.get("sessions") == figures.get("sessions_wanted")
        and len(figures.get("kb_per_session_rounds") or []) >= 3
    )


def sessions(ctx: ProbeContext) -> ProbeOutcome:
    """Fresh sessions, each a POST /run/status and one queued /edit without an image (refused by the
    handler). The first fifth run beside the honest client's edit (unmeasured: an edit's own memory
    would land in the figure); then `rounds` rounds, RSS read before and after each once the server
    settled; the figure is the median round's KB per session (an RSS step of a few MB in one or two
    rounds, the allocator's, cannot move it). Sessions come from 127.0.2.x addresses,
    SESSIONS_PER_ADDRESS each, so that the app's per-address limit on new sessions admits them all;
    each worker keeps one connection per address, as a browser does."""
    import contextlib

    import httpx

    app = ctx.app
    wanted = 60 if ctx.quick else 500
    rounds = 5 if ctx.quick else 7
    workers = 4
    warm = wanted // 5
    per_round = (wanted - warm) // rounds
    warm = wanted - per_round * rounds
    fn_index = app.dependency("edit")[0]
    counter = [0]
    lock = threading.Lock()
    answers: dict[str, int] = {}

    def open_sessions(count: int) -> int:
        """Opens `count` fresh sessions (4 at a time); returns how many were admitted."""
        target = counter[0] + count
        admitted = [0]

        def worker(_: int) -> None:
            with contextlib.ExitStack() as stack:
                clients: dict = {}
                while ctx.left() > 2.0:
                    with lock:
                        if counter[0] >= target:
                            return
                        index = counter[0]
                        counter[0] += 1
                    address = client_address(f"127.0.2.{index // SESSIONS_PER_ADDRESS + 1}")
                    if address not in clients:
                        clients[address] = stack.enter_context(app.http(timeout=30, address=address))
                    http = clients[address]
                    session = new_session("fresh")
                    try:
                        status = http.post("/gradio_api/run/status", json={"data": [], "session_hash": session})
                        # A queued call that costs the device nothing: no image, refused by the handler.
                        queued = queue_call(app, http, fn_index, edit_data(None, "fresh session"), session, timeout=30)
                        key = f"status {status.status_code}, edit {queued.status}"
                        ok = status.status_code == 200
                    except httpx.HTTPError as exc:
                        key, ok = type(exc).__name__, False
                    with lock:
                        answers[key] = answers.get(key, 0) + 1
                        admitted[0] += ok

        _in_threads(workers, worker, ctx.left())
        return admitted[0]

    ctx.honest.start()
    open_sessions(warm)  # beside the honest edit
    ctx.honest.finish(ctx.deadline)
    measured: list[tuple[float, float, int]] = []
    for _ in range(rounds):
        if ctx.left() <= 2.0:
            break
        time.sleep(SESSION_SETTLE_S)
        before = app.rss_mb()
        count = open_sessions(per_round)
        time.sleep(SESSION_SETTLE_S)
        measured.append((before, app.rss_mb(), count))
    cost = session_cost_kb(measured)
    count = counter[0]
    figures = {
        "sessions": count,
        "sessions_wanted": wanted,
        "sessions_unmeasured_beside_honest_edit": warm,
        "rounds": [{"rss_before_mb": round(b, 1), "rss_after_mb": round(a, 1), "sessions": n} for b, a, n in measured],
        **cost,
        "target_kb_per_session": SESSION_TARGET_KB,
        "answers": answers,
        "addresses": (count - 1) // SESSIONS_PER_ADDRESS + 1 if client_address("127.0.2.1") and count else 1,
    }
    if not client_address("127.0.2.1"):
        ctx.notes.append(
            "this machine connects from 127.0.0.1 only: every fresh session shares one address, "
            "and the app's new-session limit refuses most of them"
        )
    check = sessions_check(figures)
    text = (
        f"{count} fresh sessions: median {cost['kb_per_session']} KB each over {len(measured)} rounds "
        f"(rounds: {cost['kb_per_session_rounds']}; target < {SESSION_TARGET_KB:.0f} KB)"
        + ("" if count == wanted else f"; only {count} of {wanted} within the budget")
    )
    sent = (
        f"{wanted} fresh session_hash values ({SESSIONS_PER_ADDRESS} per 127.0.2.x address), each POST /run/status "
        f"+ one queued /edit without an image ({workers} at a time): {warm} beside the honest edit, then "
        f"{rounds} measured rounds of {per_round}"
    )
    return ProbeOutcome(sent, check, text, figures)


# ---------------------------------------------------------------------------------------------
# 8. A visitor changes the engine for everyone
# ---------------------------------------------------------------------------------------------


def _settings(app: AbuseApp) -> dict:
    with app.http(timeout=30) as http:
        status = http.post("/gradio_api/run/status", json={"data": [], "session_hash": new_session("read")}).json()
    status = status["data"][0]
    return {"attention": status.get("attention"), "speed": (status.get("speed") or {}).get("cache_default")}


def engine_settings(ctx: ProbeContext) -> ProbeOutcome:
    app = ctx.app
    session = new_session("visitor")
    ctx.honest.start()
    before = _settings(app)
    with app.http(timeout=60) as http:  # a visitor: no operator login
        attention = call_api(app, http, "set_attention", ["math", "all"], session, timeout=min(60.0, ctx.left()))
        speed = call_api(app, http, "set_speed", ["faster"], session, timeout=min(60.0, ctx.left()))
    after = _settings(app)
    changed = [key for key in before if before[key] != after[key]]
    kiosk = "--kiosk" in app.args
    figures = {
        "kiosk": kiosk,
        "before": before,
        "after": after,
        "set_attention": attention.short(),
        "set_speed": speed.short(),
        "changed": changed,
    }
    check = kiosk and not attention.ran and not speed.ran and not changed
    text = (
        f"{'with' if kiosk else 'WITHOUT'} --kiosk, a visitor: set_attention math {attention.short()[:50]}, "
        f"set_speed faster {speed.short()[:50]}; changed: {', '.join(changed) or 'nothing'}"
    )
    sent = (
        "a visitor (no operator login) calls set_attention('math') and set_speed('faster') the way the API offers them"
    )
    return ProbeOutcome(sent, check, text, figures)


# ---------------------------------------------------------------------------------------------
# 9. LOW: a URL as a FileData path, a 1e-320 range step, paths in progress messages
# ---------------------------------------------------------------------------------------------


def _empty_dirs(folder: Path) -> set[Path]:
    out = set()
    for path in folder.rglob("*"):
        try:
            if path.is_dir() and not any(path.iterdir()):
                out.add(path)
        except OSError:
            continue
    return out


def _paths_in(texts: list[str]) -> list[str]:
    return sorted({m.group(0) for text in texts for m in _ABSOLUTE_PATH.finditer(text or "")})


def low(ctx: ProbeContext) -> ProbeOutcome:
    app = ctx.app
    session = new_session("attacker")
    path = _upload_one(app, "mine.png", attacker_png())
    ctx.honest.start()
    empty_before = _empty_dirs(app.gradio_tmp)
    url_answers = []
    with app.http(timeout=60) as http:
        for index in range(3):
            url = f"http://example.invalid/probe{index}.png"
            url_answers.append(
                call_api(
                    app,
                    http,
                    "edit",
                    edit_data({"path": url, "url": url, "meta": {"_type": "gradio.FileData"}}),
                    session,
                    timeout=min(30.0, max(1.0, ctx.left())),
                )
            )
        compare = call_api(
            app,
            http,
            "compare",
            [
                file_data(path),
                EDIT_INSTRUCTION,
                "guidance",
                "1:2:1e-320",
                "none",
                "",
                "",
                3.0,
                1.5,
                2,
                0.3,
                True,
                "draft",
                1,
            ],
            session,
            timeout=min(60.0, max(1.0, ctx.left())),
        )
    new_empty = _empty_dirs(app.gradio_tmp) - empty_before
    # Progress messages /status showed while the model loaded (the warm-up edit loaded it).
    messages = [str((s.get("progress") or {}).get("message") or "") for s in ctx.statuses.statuses()]
    messages += [
        str((row.get("progress") or {}).get("message") or "")
        for s in ctx.statuses.statuses()
        for row in s.get("devices") or []
    ]
    load_messages = sorted({m for m in messages if m})
    status_paths = _paths_in(load_messages)
    stream_paths = _paths_in(ctx.honest.warm_up_messages)
    compare_text = compare.error or ""
    url_ok = all(not r.ran for r in url_answers) and not new_empty
    compare_ok = not compare.ran and "OverflowError" not in compare_text and "Traceback" not in compare_text
    status_ok = not status_paths
    figures = {
        "url_filedata": _answers(url_answers),
        "empty_dirs_left": len(new_empty),
        "compare_1e-320": compare.short(),
        "status_progress_messages_seen": len(load_messages),
        "status_progress_paths": status_paths,
        "edit_stream_progress_paths": stream_paths,
        "cancel_during_save": "not probed (timing-dependent)",
    }
    if not load_messages:
        ctx.notes.append("no /status progress message was seen during the model load (sampled every 0.2 s)")
    if stream_paths:
        ctx.notes.append(f"the edit's own progress stream named {len(stream_paths)} absolute path(s) during the load")
    check = url_ok and compare_ok and status_ok
    text = (
        f"http:// FileData: {figures['url_filedata']['refused']}/3 refused, {len(new_empty)} empty dirs left; "
        f"range step 1e-320: {compare.short()[:70]}; /status progress paths: {len(status_paths)}"
    )
    sent = (
        "3 queued /edit calls whose FileData path is an http:// URL; /compare guidance '1:2:1e-320'; "
        "/status polled every 0.2 s through a model load"
    )
    return ProbeOutcome(sent, check, text, figures)


# ---------------------------------------------------------------------------------------------


def _args(*extra: str) -> Callable[[bool], tuple[list[str], None]]:
    return lambda quick: ([*BASE_ARGS, *extra], None)


def _login_args(quick: bool) -> tuple[list[str], tuple[str, str]]:
    password = uuid.uuid4().hex[:16]
    # The probe spreads its guesses over X-Forwarded-For addresses, as clients behind a proxy would: the
    # app trusts its local proxy here (--forwarded-allow-ips), so only the per-user limit can stop them.
    return (
        [
            *BASE_ARGS,
            "--auth",
            f"{LOGIN_USER}:{password}",
            "--max-login-failures",
            str(LOGIN_FAILURES),
            "--forwarded-allow-ips",
            "127.0.0.1",
        ],
        (LOGIN_USER, password),
    )


PROBES: dict[str, ProbeSpec] = {
    "run-bypass": ProbeSpec(run_bypass, _args()),
    "zip-bomb": ProbeSpec(zip_bomb, _args()),
    "ico-decode": ProbeSpec(ico_decode, _args()),
    "cache-evict": ProbeSpec(
        cache_evict,
        lambda quick: ([*BASE_ARGS, "--cache-max-files", "200", "--max-upload-mb", "2" if quick else "50"], None),
    ),
    "long-name": ProbeSpec(long_name, _args("--retention", str(LONG_NAME_RETENTION))),
    "login-bypass": ProbeSpec(login_bypass, _login_args),
    "sessions": ProbeSpec(sessions, _args()),
    "engine-settings": ProbeSpec(engine_settings, _args("--kiosk"), fallback_args=_args()),
    "low": ProbeSpec(low, _args()),
}

__all__ = ["PROBES", "ProbeSpec", "attacker_png", "ZIP_QUIET_TARGET_S", "SESSION_TARGET_KB"]
