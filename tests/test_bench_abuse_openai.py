"""`bench abuse`'s probes of the OpenAI-compatible route (issue 57, bench/abuse_openai.py): registered
after issues 19's and 58's, and their verdicts as pure functions of what a probe recorded."""

from __future__ import annotations

import io

from PIL import Image

from hidream_ui.bench import abuse as bench_abuse
from hidream_ui.bench import abuse_openai
from hidream_ui.bench.abuse_client import CallResult


def part(by_status: dict, shaped: int | None = None, retry=("10",)) -> dict:
    refusals = sum(count for status, count in by_status.items() if status not in ("200", "no answer"))
    return {
        "by_status": by_status,
        "ran": by_status.get("200", 0),
        "refusals": refusals,
        "refusals_in_openai_shape": refusals if shaped is None else shaped,
        "retry_after": list(retry),
        "examples": [],
    }


def test_the_openai_probes_come_after_the_others_and_take_either_spelling():
    assert list(bench_abuse.PROBES)[-3:] == ["openai-flood", "openai-bodies", "openai-keys"]
    assert bench_abuse.probe_name("openai_keys") == "openai-keys"
    args, auth = bench_abuse.PROBES["openai-keys"].app_args(True)
    assert auth is None and "--api-keys" in args
    key_file = args[args.index("--api-keys") + 1]
    assert len(open(key_file, encoding="utf-8").read().strip()) >= 32


def test_answers_count_statuses_shapes_and_retry_after():
    results = [
        CallResult(True, 200, data={"retry_after": None, "shape_ok": True}),
        CallResult(False, 429, "per_client_limit: x", data={"retry_after": None, "shape_ok": True}),
        CallResult(False, 503, "queue_full: y", data={"retry_after": "10", "shape_ok": True}),
        CallResult(False, 500, "not OpenAI's shape", data={"retry_after": None, "shape_ok": False}),
        CallResult(False, None, "ReadTimeout"),
    ]
    counted = abuse_openai.answers(results)
    assert counted["by_status"] == {"200": 1, "429": 1, "503": 1, "500": 1, "no answer": 1}
    assert counted["ran"] == 1 and counted["refusals"] == 3 and counted["refusals_in_openai_shape"] == 2
    assert counted["retry_after"] == ["10"]


def flood_figures(**changes) -> dict:
    figures = {
        "per_client": part({"200": 2, "429": 6}),
        "queue": part({"200": 5, "503": 3}),
        "queue_clients_spread": True,
        "hang_ups_stopped": True,
        "hang_ups_saved": 0,
    }
    figures.update(changes)
    return figures


def test_the_flood_holds_only_with_every_limit_in_openais_shape():
    assert abuse_openai.flood_check(flood_figures())
    assert not abuse_openai.flood_check(flood_figures(per_client=part({"200": 8})))  # no per-client limit
    assert not abuse_openai.flood_check(flood_figures(per_client=part({"200": 2, "429": 6}, shaped=0)))
    assert not abuse_openai.flood_check(flood_figures(queue=part({"200": 8}, retry=())))  # the queue never filled
    assert not abuse_openai.flood_check(flood_figures(queue=part({"200": 5, "503": 3}, retry=())))  # no Retry-After
    assert abuse_openai.flood_check(flood_figures(queue=part({"200": 8}, retry=()), queue_clients_spread=False))
    assert not abuse_openai.flood_check(flood_figures(hang_ups_saved=1))
    assert not abuse_openai.flood_check(flood_figures(hang_ups_stopped=False))


def test_the_bodies_hold_only_when_each_gets_its_refusal():
    good = {
        "declared_over_cap": part({"413": 3}),
        "streamed_over_cap": part({"413": 2, "no answer": 1}),
        "image_over_upload_mb": part({"413": 3}),
        "field_flood": part({"400": 3}),
        "pixel_bomb": part({"400": 3}),
        "saved": 0,
    }
    assert abuse_openai.bodies_check(good)
    assert not abuse_openai.bodies_check({**good, "pixel_bomb": part({"200": 1, "400": 2})})
    assert not abuse_openai.bodies_check({**good, "declared_over_cap": part({"413": 3}, shaped=1)})
    assert not abuse_openai.bodies_check({**good, "field_flood": part({})})
    assert not abuse_openai.bodies_check({**good, "saved": 1})


def test_wrong_keys_hold_when_throttled_and_the_good_key_still_edits():
    good = {
        "wrong_keys": part({"401": 5, "429": 35}),
        "good_key_other_address": "ran",
        "other_address_distinct": True,
        "max_login_failures": 5,
        "answers_naming_the_key": 0,
    }
    assert abuse_openai.keys_check(good)
    assert not abuse_openai.keys_check({**good, "wrong_keys": part({"401": 40}, retry=())})  # never throttled
    assert not abuse_openai.keys_check({**good, "good_key_other_address": "refused (429: ...)"})
    assert not abuse_openai.keys_check({**good, "answers_naming_the_key": 1})


def test_the_pixel_bomb_is_a_small_png_claiming_a_huge_size():
    bomb = abuse_openai.pixel_bomb(40_000)
    assert len(bomb) < 200
    limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # the header only, never decoded
    try:
        with Image.open(io.BytesIO(bomb)) as picture:
            assert picture.size == (40_000, 40_000)
    finally:
        Image.MAX_IMAGE_PIXELS = limit
