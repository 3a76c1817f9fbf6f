"""The probes of `bench abuse`: one function per finding of issue 19, each bounded in count and time.

This module holds the queue, login and session probes (findings 1 and 6-9) and the list of all
nine; the upload probes (2-5) are abuse_uploads.py. A probe gets a `ProbeContext` (the app, the
honest client, `quick`, a deadline), sends its attack over raw HTTP, starts the honest client's
edit while the attack is under way, and returns what it sent, its own check (what the finding
needs to count as fixed) and its figures. The common figures (RSS, cache, /status, honest edit,
files removed) are taken by `abuse.run_probe`.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from pathlib import Path

from hidream_ui.bench.abuse_app import AbuseApp, client_address
from hidream_ui.bench.abuse_client import (
    EDIT_INSTRUCTION,
    CallResult,
    call_api,
    edit_data,
    file_data,
    new_session,
    queue_call,
    run_direct,
)
from hidream_ui.bench.abuse_kit import (
    BASE_ARGS,
    ProbeContext,
    ProbeOutcome,
    ProbeSpec,
    attacker_apple,
    attacker_png,
    fixed_args,
    in_threads,
    saved_with,
    tally_answers,
    upload_one,
    wait_until,
)
from hidream_ui.bench.abuse_uploads import LONG_NAME_RETENTION, cache_evict, ico_decode, long_name, zip_bomb

# What one fresh session may cost (issue 19: "a fresh session costs under 20 KB until it runs a job").
SESSION_TARGET_KB = 20.0
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.@+-]+/)+[\w.@+-]*")


# ---------------------------------------------------------------------------------------------
# 1. /run/<api_name> skips the queue
# ---------------------------------------------------------------------------------------------


def run_bypass(ctx: ProbeContext) -> ProbeOutcome:
    app, parallel = ctx.app, 8
    steps = 2 if ctx.quick else 4
    # The most steps the app takes (200): ~5 s on an idle 2-core box, 5x the second its client waits.
    abandoned_steps, give_up_s = 200, 1.0
    path = upload_one(app, "mine.png", attacker_apple())
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
    edits = in_threads(parallel, direct_edit, ctx.left())
    queue_seen = [s.get("queue") or {} for s in ctx.statuses.statuses(since)]
    with app.http() as http:
        attention = run_direct(http, "set_attention", ["math", "all"], session, timeout=min(60.0, ctx.left()))
        load = run_direct(http, "load_model", [], session, timeout=min(60.0, ctx.left()))
        # A client that gives up after a second: with no event id, no cancel can reach its job.
        before = saved_with(app, "abandoned run")
        abandoned = run_direct(
            http, "edit", edit_data(file_data(path), "abandoned run", abandoned_steps), session, timeout=give_up_s
        )
    abandoned_saved, abandoned_busy = 0, None
    if not abandoned.ran:
        # Did the job go on without its client? Seen busy within a few seconds, then idle again,
        # then (a save follows the last step) a moment for the file.
        abandoned_busy = wait_until(lambda: _state(app) not in ("idle", None), min(5.0, ctx.left()), every=0.1)
        if abandoned_busy:
            wait_until(lambda: _state(app) == "idle", ctx.left(), every=0.2)
            wait_until(lambda: saved_with(app, "abandoned run") > before, min(3.0, ctx.left()))
        abandoned_saved = saved_with(app, "abandoned run") - before
    saved = saved_with(app, "run bypass")
    figures = {
        "run_edit": tally_answers(edits),
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

        in_threads(workers, worker, ctx.left())
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
    path = upload_one(app, "mine.png", attacker_png())
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
        "url_filedata": tally_answers(url_answers),
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
    "run-bypass": ProbeSpec(run_bypass, fixed_args()),
    "zip-bomb": ProbeSpec(zip_bomb, fixed_args()),
    "ico-decode": ProbeSpec(ico_decode, fixed_args()),
    "cache-evict": ProbeSpec(
        cache_evict,
        lambda quick: ([*BASE_ARGS, "--cache-max-files", "200", "--max-upload-mb", "2" if quick else "50"], None),
    ),
    "long-name": ProbeSpec(long_name, fixed_args("--retention", str(LONG_NAME_RETENTION))),
    "login-bypass": ProbeSpec(login_bypass, _login_args),
    "sessions": ProbeSpec(sessions, fixed_args()),
    "engine-settings": ProbeSpec(engine_settings, fixed_args("--kiosk"), fallback_args=fixed_args()),
    "low": ProbeSpec(low, fixed_args()),
}

__all__ = ["PROBES", "SESSION_TARGET_KB", "session_cost_kb", "sessions_check"]
