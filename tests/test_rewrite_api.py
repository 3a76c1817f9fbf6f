"""Instruction rewriting through the running app (gradio_client): `/rewrite`, `/edit` with
`rewrite=True`, `/edit_rewritten`, `/batch_edit`, `/status`, against a real OpenAI-compatible server
on 127.0.0.1 (tests/fake_vlm.py), and `--rewriter local` on the tiny model.
"""

from __future__ import annotations

import json
import time
import zipfile

import helpers
import pytest
from fake_vlm import SLOW_SECONDS, FakeVLM, canned_lines, user_images, user_text
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from PIL import Image

from hidream_ui.archive import MANIFEST_NAME
from hidream_ui.edits import EditParams
from hidream_ui.outputs import load_settings, read_metadata
from hidream_ui.ui.layout import ASSETS_DIR

EXAMPLE = ASSETS_DIR / "apple.png"
FAST = {"num_inference_steps": 2, "working_resolution": "draft"}
FORMATTED = "Editing Instruction: Make the apple blue. Target Image Description: A blue apple on a table."


def full_prompt(instruction: str) -> str:
    _, refined, target = canned_lines(instruction)
    return f"Editing Instruction: {refined.rstrip(' .')}. Target Image Description: {target}"


@pytest.fixture(scope="module")
def vlm():
    server = FakeVLM()
    yield server
    server.close()


@pytest.fixture(scope="module")
def app(launch_app, vlm):
    return launch_app(
        "rewrite_api",
        variant="e1-full",
        rewriter_url=vlm.url,
        rewriter_model="fake-vl",
        rewriter_timeout=1.0,
        max_batch_items=8,
    )


@pytest.fixture(scope="module")
def client(app):
    return Client(app["url"], verbose=False)


def edit(client, instruction, image=EXAMPLE, **kwargs):
    return client.predict(
        image=handle_file(str(image)), instruction=instruction, **{**FAST, **kwargs}, api_name="/edit"
    )


def lane(app, api_name: str) -> str:
    return next(fn.concurrency_id for fn in app["demo"].fns.values() if fn.api_name == api_name)


@pytest.mark.slow
def test_rewrite_sends_image_and_instruction_and_returns_the_e1_full_prompt(client, vlm, app):
    before = len(vlm.chat_requests())
    prompt, answer = client.predict(
        image=handle_file(str(EXAMPLE)), instruction="make the apple green", api_name="/rewrite"
    )
    assert prompt == full_prompt("make the apple green")
    source, refined, target = canned_lines("make the apple green")
    assert answer["original"] == "make the apple green"
    assert (answer["source"], answer["instruction"], answer["target"]) == (source, refined, target)
    assert (answer["backend"], answer["model"]) == ("openai", "fake-vl")
    [sent] = vlm.chat_requests()[before:]
    assert user_text(sent["body"]) == "Editing request: make the apple green"
    [image] = user_images(sent["body"])
    with Image.open(EXAMPLE) as original:
        scale = min(1.0, 768 / max(original.size))
        assert image.size == (round(original.width * scale), round(original.height * scale))
    # A remote rewriter waits on the network in its own lane, not behind edits.
    assert lane(app, "rewrite") == "rewriter" and lane(app, "edit") == "device"


@pytest.mark.slow
def test_edit_with_rewrite_saves_original_and_rewritten_in_the_png(client, vlm, tmp_path):
    before = len(vlm.chat_requests())
    (_, _), png, _, summary = edit(client, "make the apple green", rewrite=True)
    assert len(vlm.chat_requests()) == before  # the answer of the test above, from the cache
    metadata = read_metadata(png)
    used = full_prompt("make the apple green")
    assert metadata["params"]["instruction"] == used
    assert load_settings(png) == EditParams.from_dict(metadata["params"])  # reproduces what ran
    rewrite = metadata["rewrite"]
    assert rewrite["original"] == "make the apple green" and rewrite["prompt"] == used
    assert rewrite["edited"] is False and rewrite["backend"] == "openai"
    assert "rewritten by openai" in summary
    # A new image misses the cache and is sent.
    edit(client, "make the apple green", image=write_picture(tmp_path, 1), rewrite=True)
    assert len(vlm.chat_requests()) == before + 1


def write_picture(folder, seed: int, size=(80, 60)):
    return helpers.write_picture(folder / f"picture-{seed}.png", seed, size)


@pytest.mark.slow
def test_edit_with_this_records_a_hand_edited_prompt(client):
    prompt, answer = client.predict(
        image=handle_file(str(EXAMPLE)), instruction="make the apple purple", api_name="/rewrite"
    )
    mine = prompt + " Keep the shadows."
    values = {
        **FAST,
        "negative_prompt": "low resolution, blur",
        "guidance_scale": 5.0,
        "image_guidance_scale": 4.0,
        "refine_strength": 0.3,
        "clip_cfg_norm": True,
        "seed": 11,
        "randomize_seed": False,
        "collapse_padding": True,
    }
    _, png, seed, _ = client.predict(
        image=handle_file(str(EXAMPLE)), rewritten=mine, rewrite=answer, **values, api_name="/edit_rewritten"
    )
    metadata = read_metadata(png)
    assert seed == 11 and metadata["params"]["instruction"] == mine
    assert metadata["rewrite"]["original"] == "make the apple purple"
    assert metadata["rewrite"]["prompt"] == prompt and metadata["rewrite"]["edited"] is True
    # Without an answer (a failed rewrite left the user's own text in the box): a plain edit.
    _, png, _, _ = client.predict(
        image=handle_file(str(EXAMPLE)),
        rewritten="make the apple purple",
        rewrite=None,
        **values,
        api_name="/edit_rewritten",
    )
    assert "rewrite" not in read_metadata(png)
    with pytest.raises(AppError, match="press Rewrite first"):
        client.predict(
            image=handle_file(str(EXAMPLE)), rewritten="  ", rewrite=None, **values, api_name="/edit_rewritten"
        )


@pytest.mark.parametrize(
    "tag, reason",
    [
        ("[slow]", "the rewriter did not answer within 1 s"),
        ("[http500]", "the rewriter answered HTTP 500: model overloaded"),
        ("[garbage]", "is not 3 lines (SOURCE, INSTRUCTION, TARGET)"),
        ("[refuse]", "the rewriter declined"),
    ],
)
@pytest.mark.slow
def test_failures_are_clear_and_the_app_keeps_serving(client, tag, reason):
    instruction = f"{tag} make the apple green"
    started = time.perf_counter()
    with pytest.raises(AppError) as failed:
        client.predict(image=handle_file(str(EXAMPLE)), instruction=instruction, api_name="/rewrite")
    message = str(failed.value)
    assert reason in message and "Edit with this" in message and "Traceback" not in message
    if tag == "[slow]":
        assert time.perf_counter() - started < SLOW_SECONDS + 2
    with pytest.raises(AppError) as failed_edit:
        edit(client, instruction, rewrite=True)
    assert reason in str(failed_edit.value) and "Nothing was edited" in str(failed_edit.value)
    assert "uncheck" in str(failed_edit.value)
    # Still serving: the status answers and the original instruction edits.
    status = client.predict(api_name="/status")
    assert status["state"] == "idle" and status["rewriter"]["failures"] >= 2
    _, png, _, _ = edit(client, instruction, rewrite=False)
    assert load_settings(png).instruction == instruction


def test_a_prompt_already_in_the_e1_full_format_is_used_as_written(client, vlm):
    before = len(vlm.chat_requests())
    _, png, _, _ = edit(client, FORMATTED, rewrite=True)
    assert len(vlm.chat_requests()) == before
    metadata = read_metadata(png)
    assert metadata["params"]["instruction"] == FORMATTED and "rewrite" not in metadata
    # The Rewrite button agrees: no call to the rewriter, the prompt comes back as written.
    prompt, answer = client.predict(image=handle_file(str(EXAMPLE)), instruction=FORMATTED, api_name="/rewrite")
    assert prompt == FORMATTED and answer is None
    assert len(vlm.chat_requests()) == before


def test_status_names_the_rewriter_without_its_url(client, vlm):
    for _ in range(2):  # one rewrite and one cache hit of its own, whichever tests ran before
        client.predict(image=handle_file(str(EXAMPLE)), instruction="make the sky green", api_name="/rewrite")
    status = client.predict(api_name="/status")
    rewriter = status["rewriter"]
    assert (rewriter["backend"], rewriter["model"], rewriter["timeout"]) == ("openai", "fake-vl", 1.0)
    assert rewriter["rewrites"] >= 1 and rewriter["cache_hits"] >= 1
    assert vlm.url not in json.dumps(status)


@pytest.mark.slow
def test_batch_rewrites_per_item_and_lists_failed_rewrites(client, vlm, tmp_path):
    files = [write_picture(tmp_path, seed) for seed in (50, 51)]

    def run():
        return client.predict(
            files=[handle_file(str(f)) for f in files],
            instructions="make it red\n[http500] make it blue",
            mode="matrix",
            seed=5,
            seed_policy="fixed",
            batch_size=0,
            rewrite=True,
            **FAST,
            api_name="/batch_edit",
        )

    before = len(vlm.chat_requests())
    gallery, report, archive = run()
    assert len(vlm.chat_requests()) == before + 4  # each (image, instruction) once
    assert len(gallery) == 2 and all(entry["caption"] == "make it red (rewritten) · seed 5" for entry in gallery)
    assert "Done: 2/4" in report and report.count("rewriting the instruction failed") == 2
    with zipfile.ZipFile(archive) as bundle:
        manifest = json.loads(bundle.read(MANIFEST_NAME))
        rows = manifest["items"]
        ok = [row for row in rows if row["status"] == "ok"]
        assert [row["original_instruction"] for row in ok] == ["make it red", "make it red"]
        for row in ok:
            metadata = json.loads(bundle.read(row["sidecar"]))
            assert metadata["params"]["instruction"] == row["instruction"] == full_prompt("make it red")
            assert metadata["rewrite"]["original"] == "make it red"
        assert [row["status"] for row in rows if row["instruction"].startswith("[http500]")] == ["error", "error"]
    # Again: the answers that came back are cached, the failures are asked again.
    run()
    assert len(vlm.chat_requests()) == before + 6


@pytest.mark.slow
def test_an_app_without_rewriter_refuses_rewriting_clearly(launch_app):
    app = launch_app("rewrite_off")
    client = Client(app["url"], verbose=False)
    with pytest.raises(AppError, match="no rewriter is configured"):
        client.predict(image=handle_file(str(EXAMPLE)), instruction="make it red", api_name="/rewrite")
    with pytest.raises(AppError, match="^rewrite: .*--rewriter-url URL --rewriter-model NAME, or --rewriter local"):
        edit(client, "make it red", rewrite=True)
    assert client.predict(api_name="/status")["rewriter"] is None


# ---------------------------------------------------------------------------------------------
# --rewriter local on the tiny model
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_app(launch_app):
    return launch_app("rewrite_local", rewriter="local")


@pytest.mark.slow
def test_local_rewriter_end_to_end_on_the_tiny_model(local_app, monkeypatch, tiny_dir):
    from hidream_ui.rewrite.local_backend import LocalRewriter

    client = Client(local_app["url"], verbose=False)
    assert lane(local_app, "rewrite") == "device"  # it runs the Llama on the device
    # The tiny Llama writes noise: a clear refusal to use it, and the app keeps serving.
    with pytest.raises(AppError) as failed:
        client.predict(image=handle_file(str(EXAMPLE)), instruction="make the apple green", api_name="/rewrite")
    assert "the rewriter's answer is not 2 lines (INSTRUCTION, TARGET)" in str(failed.value)
    status = client.predict(api_name="/status")
    llama = json.loads((tiny_dir / "Llama-3.1-8B-Instruct" / "config.json").read_text())
    rewriter = status["rewriter"]
    assert (rewriter["backend"], rewriter["model"], rewriter["lm_head_loaded"]) == (
        "local",
        "Llama-3.1-8B-Instruct",
        True,
    )
    assert rewriter["lm_head_bytes"] == llama["vocab_size"] * llama["hidden_size"] * 4  # fp32 here
    assert status["state"] == "idle"

    # The same flow with the generated tokens swapped for a fixed answer's (after the real run).
    answer = "INSTRUCTION: Make the red apple green.\nTARGET: A green apple on a wooden table."
    real_greedy = LocalRewriter._greedy
    runs = []

    def greedy(self, llama_model, head, prompt, stop, cancel):
        runs.append(len(real_greedy(self, llama_model, head, prompt, stop, cancel)))
        return self.engine.primary.model.pipeline.tokenizer_4.encode(answer, add_special_tokens=False)

    monkeypatch.setattr(LocalRewriter, "_greedy", greedy)
    prompt, details = client.predict(
        image=handle_file(str(EXAMPLE)), instruction="make the apple green now", api_name="/rewrite"
    )
    assert runs and runs[0] > 0
    assert prompt == "Make the red apple green."  # E1.1: the refined instruction as is
    assert details["source"] is None and details["target"] == "A green apple on a wooden table."
    _, png, _, _ = edit(client, "make the apple green now", rewrite=True)
    metadata = read_metadata(png)
    assert metadata["params"]["instruction"] == "Make the red apple green."
    assert metadata["rewrite"]["original"] == "make the apple green now" and metadata["rewrite"]["backend"] == "local"
    assert len(runs) == 1  # the edit used the cached answer
