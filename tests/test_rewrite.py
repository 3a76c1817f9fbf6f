"""Instruction rewriting without the app: the strict parser, the E1-Full prompt, the flags, the
OpenAI-compatible client against a real HTTP server on 127.0.0.1 (tests/fake_vlm.py), the cache,
batch items, result metadata, and the local Llama rewriter on the tiny model.
"""

from __future__ import annotations

import json
import time

import pytest
from fake_vlm import SLOW_SECONDS, FakeVLM, canned_lines, user_images, user_text
from helpers import random_picture, run_info

from hidream_ui.config import AppConfig, ConfigError, from_args
from hidream_ui.edits import EditParams, EditResult, RequestError, Timings, target_prompt
from hidream_ui.rewrite.openai_backend import OpenAIRewriter
from hidream_ui.rewrite.prompt import (
    TEXT_LABELS,
    VISION_SYSTEM_PROMPT,
    RewriteError,
    RewriteResult,
    parse_answer,
)
from hidream_ui.rewrite.service import RewriteService, api_key


@pytest.fixture(scope="module")
def vlm():
    server = FakeVLM()
    yield server
    server.close()


def result(**overrides) -> RewriteResult:
    values = dict(
        original="make the car blue",
        source="Two cars on a street.",
        instruction="Paint the left car blue.",
        target="Two cars on a street, the left one blue.",
        backend="openai",
        model="fake-vl",
        seconds=0.5,
    )
    return RewriteResult(**{**values, **overrides})


# ---------------------------------------------------------------------------------------------
# The answer format
# ---------------------------------------------------------------------------------------------


def test_parser_takes_three_labelled_lines_and_common_decorations():
    assert parse_answer("SOURCE: a red car\nINSTRUCTION: paint it blue\nTARGET: a blue car") == (
        "a red car",
        "paint it blue",
        "a blue car",
    )
    decorated = (
        "```\n1. **Source:** A red car.\n\n2. **Editing Instruction:** Paint the left car blue.\n"
        '3. **Target Image Description:** "A blue car."\n```'
    )
    assert parse_answer(decorated) == ("A red car.", "Paint the left car blue.", "A blue car.")
    # No labels: by position.
    assert parse_answer("A red car.\nPaint it blue.\nA blue car.") == ("A red car.", "Paint it blue.", "A blue car.")
    assert parse_answer("INSTRUCTION: make it blue\nTARGET: a blue car", TEXT_LABELS) == ("make it blue", "a blue car")


@pytest.mark.parametrize(
    "answer, needle",
    [
        ("", "empty answer"),
        ("Sure! Here you go, a lovely picture.", "is not 3 lines (SOURCE, INSTRUCTION, TARGET): it has 1"),
        ("I'm sorry, but I can't help with that.", "the rewriter declined"),
        (
            "SOURCE: a\nTARGET: c\nINSTRUCTION: b",
            "line 2 of the rewriter's answer is labelled 'TARGET'; expected INSTRUCTION",
        ),
        ("SOURCE: a\nINSTRUCTION: ...\nTARGET: c", "line 2 (INSTRUCTION) of the rewriter's answer is empty"),
        ("SOURCE: a\nINSTRUCTION: <the instruction>\nTARGET: c", "is a placeholder"),
        ("SOURCE: a\nINSTRUCTION: b. Target Image Description: c\nTARGET: c", "contains 'Target Image Description:'"),
        ("SOURCE: a\nINSTRUCTION: b\nTARGET: c\nNOTE: d", "it has 4"),
        ("SOURCE: a\nINSTRUCTION: " + "b" * 1001 + "\nTARGET: c", "1001 characters long (at most 1000)"),
    ],
)
def test_parser_refuses_unusable_answers_quoting_them(answer, needle):
    with pytest.raises(RewriteError) as refused:
        parse_answer(answer)
    assert needle in str(refused.value)


def test_compose_builds_the_e1_full_prompt_whose_target_drives_the_refine_stage():
    rewrite = result()
    assert rewrite.compose("e1.1") == "Paint the left car blue."
    full = rewrite.compose("e1-full")
    assert full == (
        "Editing Instruction: Paint the left car blue. "
        "Target Image Description: Two cars on a street, the left one blue."
    )
    assert target_prompt(full) == "Two cars on a street, the left one blue."
    assert EditParams(instruction=full).validated().instruction == full
    assert result(instruction="Make it blue").compose("e1-full").startswith("Editing Instruction: Make it blue. Target")


def test_rewrite_result_round_trips_and_checks_client_values():
    assert RewriteResult.from_dict(result().to_dict()) == result()
    assert RewriteResult.from_dict(result(source=None, backend="local").to_dict()).source is None
    with pytest.raises(RequestError) as bad:
        RewriteResult.from_dict({**result().to_dict(), "instruction": 5})
    assert str(bad.value).startswith("rewrite.instruction:")
    with pytest.raises(RequestError, match="^rewrite:"):
        RewriteResult.from_dict(["not", "a", "mapping"])


# ---------------------------------------------------------------------------------------------
# Flags and environment variables
# ---------------------------------------------------------------------------------------------


def test_rewriter_flags_env_twins_and_auto():
    config = from_args(["--rewriter-url", "http://127.0.0.1:8000/v1", "--rewriter-model", "qwen-vl"], environ={})
    assert (config.rewriter_backend, config.rewriter_model, config.rewriter_timeout) == ("openai", "qwen-vl", 20.0)
    env = {
        "HIDREAM_REWRITER_URL": "https://api.example.com/v1",
        "HIDREAM_REWRITER_MODEL": "gpt-4o-mini",
        "HIDREAM_REWRITER_TIMEOUT": "7.5",
    }
    config = from_args([], environ=env)
    assert (config.rewriter_backend, config.rewriter_url, config.rewriter_timeout) == (
        "openai",
        "https://api.example.com/v1",
        7.5,
    )
    assert from_args(["--rewriter-timeout", "3"], environ=env).rewriter_timeout == 3.0  # the flag wins
    assert from_args(["--rewriter", "OFF"], environ=env).rewriter_backend == "off"  # explicit off wins over a URL
    assert from_args(["--rewriter", "local"], environ={}).rewriter_backend == "local"
    assert from_args([], environ={}).rewriter_backend == "off"
    assert AppConfig().rewriter_backend == "off"


@pytest.mark.parametrize(
    "argv, env, needle",
    [
        (["--rewriter", "gpt"], {}, "rewriter='gpt' is not one of: auto, off, local, openai"),
        (["--rewriter", "openai"], {}, "rewriter='openai' needs --rewriter-url"),
        (["--rewriter-url", "http://127.0.0.1:8000/v1"], {}, "--rewriter-url needs --rewriter-model"),
        (["--rewriter-url", "127.0.0.1:8000", "--rewriter-model", "m"], {}, "rewriter_url='127.0.0.1:8000' is not an"),
        (["--rewriter-timeout", "soon"], {}, "--rewriter-timeout='soon' is not a number"),
        ([], {"HIDREAM_REWRITER_TIMEOUT": "0"}, "rewriter_timeout=0.0 must be a number of seconds from 0.5 to 600"),
    ],
)
def test_bad_rewriter_settings_are_named(argv, env, needle):
    with pytest.raises(ConfigError) as refused:
        from_args(argv, environ=env)
    assert needle in str(refused.value)


def test_app_parser_has_the_rewriter_flags():
    from hidream_ui.cli.app import build_parser

    text = build_parser().format_help()
    for flag in ("--rewriter ", "--rewriter-url", "--rewriter-model", "--rewriter-timeout", "HIDREAM_REWRITER_URL"):
        assert flag in text


def test_api_key_comes_from_the_environment_only():
    assert api_key({"HIDREAM_REWRITER_API_KEY": "sk-a", "OPENAI_API_KEY": "sk-b"}) == "sk-a"
    assert api_key({"OPENAI_API_KEY": "sk-b"}) == "sk-b"
    assert api_key({"HIDREAM_REWRITER_API_KEY": "  "}) is None
    assert "sk-secret" not in repr(OpenAIRewriter("http://127.0.0.1:1/v1", "m", "sk-secret", 1))


# ---------------------------------------------------------------------------------------------
# The OpenAI-compatible client against a real server
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_request_carries_the_image_the_instruction_and_the_key(vlm):
    backend = OpenAIRewriter(vlm.url, "fake-vl", api_key="sk-test", timeout=5)
    picture = random_picture(1, (1600, 1200))
    assert backend.lines(picture, "make the sky purple") == canned_lines("make the sky purple")
    sent = vlm.chat_requests()[-1]
    assert sent["path"] == "/v1/chat/completions"
    assert sent["headers"]["authorization"] == "Bearer sk-test"
    body = sent["body"]
    assert body["model"] == "fake-vl" and body["temperature"] == 0
    assert body["messages"][0] == {"role": "system", "content": VISION_SYSTEM_PROMPT}
    assert user_text(body) == "Editing request: make the sky purple"
    [image] = user_images(body)
    assert image.format == "JPEG" and image.size == (768, 576)  # downscaled, aspect kept
    # It is this picture: the mean colour survives the downscale and the JPEG round trip.
    import numpy as np

    sent_mean = np.asarray(image.convert("RGB"), dtype=float).mean(axis=(0, 1))
    assert np.allclose(sent_mean, np.asarray(picture, dtype=float).mean(axis=(0, 1)), atol=3)


def test_a_pasted_full_endpoint_url_and_a_missing_key_still_work(vlm):
    backend = OpenAIRewriter(vlm.url + "/chat/completions/", "fake-vl", api_key=None, timeout=5)
    assert backend.url == vlm.url
    assert backend.lines(random_picture(2), "make it red")[1] == canned_lines("make it red")[1]
    assert vlm.chat_requests()[-1]["headers"]["authorization"] == "Bearer not-needed"


@pytest.mark.parametrize(
    "tag, needle",
    [
        ("[http500]", "the rewriter answered HTTP 500: model overloaded"),
        ("[garbage]", "is not 3 lines"),
        ("[refuse]", "the rewriter declined: \"I'm sorry"),
        ("[refusal-field]", "the rewriter declined: 'This request violates the policy.'"),
        ("[length]", "was cut off after 400 tokens"),
        ("[swapped]", "labelled 'TARGET'; expected INSTRUCTION"),
        ("[notjson]", "the rewriter's reply"),
    ],
)
def test_server_failures_and_bad_answers_are_clear_rewrite_errors(vlm, tag, needle):
    backend = OpenAIRewriter(vlm.url, "fake-vl", api_key=None, timeout=5)
    with pytest.raises(RewriteError) as failed:
        backend.lines(random_picture(3), f"{tag} make it red")
    assert needle in str(failed.value)


def test_timeout_is_the_configured_one_without_retries(vlm):
    backend = OpenAIRewriter(vlm.url, "fake-vl", api_key=None, timeout=0.5)
    before = len(vlm.chat_requests())
    started = time.perf_counter()
    with pytest.raises(RewriteError) as failed:
        backend.lines(random_picture(4), "[slow] make it red")
    assert str(failed.value) == "the rewriter did not answer within 0.5 s"
    assert time.perf_counter() - started < SLOW_SECONDS
    time.sleep(0.1)
    assert len(vlm.chat_requests()) == before + 1  # one request: no silent retries


def test_unreachable_server_is_a_clear_error():
    from conftest import free_port

    backend = OpenAIRewriter(f"http://127.0.0.1:{free_port()}/v1", "m", api_key=None, timeout=2)
    with pytest.raises(RewriteError, match="cannot reach the rewriter server"):
        backend.lines(random_picture(5), "make it red")


# ---------------------------------------------------------------------------------------------
# The service: cache, failures, batch items
# ---------------------------------------------------------------------------------------------


def openai_service(vlm, variant="e1-full", environ=None) -> RewriteService:
    config = AppConfig(rewriter_url=vlm.url, rewriter_model="fake-vl", variant=variant, rewriter_timeout=5)
    return RewriteService.for_config(config, engine=None, environ=environ or {})


def test_service_caches_per_image_and_instruction_not_failures(vlm):
    service = openai_service(vlm, environ={"HIDREAM_REWRITER_API_KEY": "sk-h", "OPENAI_API_KEY": "sk-o"})
    picture = random_picture(10)
    count = len(vlm.chat_requests())
    first = service.rewrite(picture, "make it red")
    assert vlm.chat_requests()[-1]["headers"]["authorization"] == "Bearer sk-h"
    assert service.rewrite(picture.copy(), "  make it red ") is first  # same pixels, same (stripped) text
    assert len(vlm.chat_requests()) == count + 1 and service.cache_hits == 1
    service.rewrite(random_picture(11), "make it red")  # other pixels
    service.rewrite(picture, "make it blue")  # other instruction
    assert len(vlm.chat_requests()) == count + 3
    assert first.original == "make it red" and (first.source, first.instruction, first.target) == canned_lines(
        "make it red"
    )
    assert service.prompt(first) == first.compose("e1-full")
    for _ in range(2):  # failures are not cached: the next try asks again
        with pytest.raises(RewriteError):
            service.rewrite(picture, "[http500] make it red")
    assert len(vlm.chat_requests()) == count + 5
    status = service.status()
    assert (status.backend, status.model, status.timeout, status.rewrites, status.failures) == (
        "openai",
        "fake-vl",
        5.0,
        3,
        2,
    )
    assert "HTTP 500" in status.last_error
    with pytest.raises(RequestError, match="^instruction:"):
        service.rewrite(picture, "   ")


def test_rewrite_items_rewrites_each_pair_once_and_fails_items_alone(vlm):
    from hidream_ui.edits import EditSettings
    from hidream_ui.engine.batch import BatchRequest, BatchSource, plan_batch

    service = openai_service(vlm)
    formatted = "Editing Instruction: make it green. Target Image Description: a green picture"
    request = BatchRequest(
        sources=(BatchSource("a.png", random_picture(20)), BatchSource("b.png", random_picture(21))),
        instructions=("make it red", "[http500] make it blue", formatted, "make it red"),
        settings=EditSettings(),
    )
    plan = plan_batch(request, lambda data, name: data, max_items=16)
    count = len(vlm.chat_requests())
    failed = []
    assert service.rewrite_items(plan, on_failed=failed.append) == 4  # 2 images x "make it red" (twice each)
    assert len(vlm.chat_requests()) == count + 4  # 2 images x 2 distinct instructions to rewrite
    by_text = {}
    for item in plan.items:
        by_text.setdefault(item.original_instruction or item.instruction, []).append(item)
    for item in by_text["make it red"]:
        assert item.status == "pending" and item.rewrite is not None
        assert item.instruction == item.rewrite.compose("e1-full") and item.rewrite.original == "make it red"
        assert item.manifest_row()["original_instruction"] == "make it red"
    assert failed == by_text["[http500] make it blue"] and len(failed) == 2
    assert all(item.status == "error" and "HTTP 500" in item.error and "rewriting off" in item.error for item in failed)
    assert [item.instruction for item in by_text[formatted]] == [formatted, formatted]  # used as written
    assert all(item.rewrite is None for item in by_text[formatted])


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------


def test_metadata_keeps_the_used_prompt_reproducible_and_records_the_rewrite(tmp_path):
    from hidream_ui.outputs import load_settings, read_metadata, save_result

    rewrite = result()
    used = rewrite.compose("e1-full")
    params = EditParams.defaults_for("e1-full", used).validated()
    picture = random_picture(30)
    edit = EditResult(
        image=picture,
        source_image=picture,
        params=params,
        working_size=(64, 64),
        source_size=picture.size,
        timings=Timings(),
        peak_memory_bytes=None,
        info=run_info(variant="e1-full"),
        rewrite=rewrite,
    )
    saved = save_result(edit, tmp_path)
    metadata = read_metadata(saved.saved_png)
    assert metadata["params"]["instruction"] == used
    assert EditParams.from_dict(metadata["params"]) == params
    assert load_settings(saved.saved_png) == params
    assert metadata["rewrite"] == {**rewrite.to_dict(), "prompt": used, "edited": False}
    assert json.loads(saved.saved_json.read_text())["rewrite"]["original"] == "make the car blue"
    # A hand-edited prompt: the metadata says so, and still reproduces what ran.
    changed = EditParams.from_dict({**params.to_dict(), "instruction": used + " Keep the shadows."})
    edited = EditResult(**{**edit.__dict__, "params": changed})
    assert edited.metadata()["rewrite"]["edited"] is True
    # Without a rewrite nothing changes.
    assert "rewrite" not in EditResult(**{**edit.__dict__, "rewrite": None}).metadata()


# ---------------------------------------------------------------------------------------------
# The local rewriter on the tiny model
# ---------------------------------------------------------------------------------------------


def test_lm_head_cost_of_the_real_llama():
    from hidream_ui.rewrite.local_backend import head_cost

    real = {"vocab_size": 128256, "hidden_size": 4096, "tie_word_embeddings": False}
    assert head_cost(real, 2).bytes == 128256 * 4096 * 2 == 1_050_673_152  # bf16: ~1.05 GB
    assert head_cost(real, 4).bytes == 2 * 1_050_673_152
    assert head_cost({**real, "tie_word_embeddings": True}, 2).bytes == 0


@pytest.fixture(scope="module")
def local_engine(tiny_cache, tmp_path_factory):
    from hidream_ui.engine.engine import EditEngine

    return EditEngine(AppConfig(device="cpu", rewriter="local", output_dir=tmp_path_factory.mktemp("local_out")))


def test_local_rewriter_loads_the_head_only_when_used_and_runs_under_the_lock(local_engine, tiny_dir):
    from hidream_ui.rewrite.local_backend import LocalRewriter

    engine = local_engine
    service = RewriteService.for_config(engine.config, engine)
    backend = service.backend
    assert isinstance(backend, LocalRewriter) and service.uses_device
    assert service.status().lm_head_bytes is None and not engine.loaded  # nothing loaded at build
    engine.load()
    llama = json.loads((tiny_dir / "Llama-3.1-8B-Instruct" / "config.json").read_text())
    expected = llama["vocab_size"] * llama["hidden_size"] * 4  # fp32 on this CPU
    assert service.status().lm_head_bytes == expected and service.status().lm_head_loaded is False

    states = []
    original = backend.generate

    def spy(model, instruction, cancel=None):
        states.append(engine.status().state)
        return original(model, instruction, cancel)

    backend.generate = spy
    try:
        # The tiny model's Llama speaks noise: a clear error naming the answer, never a crash.
        with pytest.raises(RewriteError) as failed:
            service.rewrite(random_picture(40), "make it red")
    finally:
        del backend.generate
    assert "rewriter's answer" in str(failed.value)
    assert states == ["rewriting"] and engine.status().state == "idle"
    assert 0 < backend.last_tokens <= backend.max_new_tokens and backend.last_answer
    status = service.status()
    assert status.lm_head_loaded and status.lm_head_bytes == expected and status.failures == 1
    head = backend._head
    assert tuple(head.shape) == (llama["vocab_size"], llama["hidden_size"]) and head.dtype == engine.dtype


def test_local_rewriter_decodes_parses_and_composes_real_tokens(local_engine, monkeypatch):
    """The tiny Llama cannot write English, so the generated tokens are swapped for the tokens of a
    fixed answer after the real generation ran: tokenizer, chat template, decode, parse and compose
    are the real ones."""
    from hidream_ui.rewrite.local_backend import LocalRewriter

    engine = local_engine
    answer = "INSTRUCTION: Make the red apple green.\nTARGET: A green apple on a wooden table."
    generated = []
    real_greedy = LocalRewriter._greedy

    def greedy(self, llama, head, prompt, stop, cancel):
        generated.append((prompt.shape[-1], real_greedy(self, llama, head, prompt, stop, cancel)))
        return engine.model.pipeline.tokenizer_4.encode(answer, add_special_tokens=False)

    monkeypatch.setattr(LocalRewriter, "_greedy", greedy)
    service = RewriteService(LocalRewriter(engine), "e1-full")
    rewrite = service.rewrite(random_picture(41), "make the apple green")
    prompt_tokens, tokens = generated[0]
    assert prompt_tokens > 20 and tokens  # the chat template and a real generation
    assert (rewrite.source, rewrite.instruction, rewrite.target) == (
        None,
        "Make the red apple green.",
        "A green apple on a wooden table.",
    )
    assert (rewrite.backend, rewrite.model) == ("local", "Llama-3.1-8B-Instruct")
    assert service.prompt(rewrite) == (
        "Editing Instruction: Make the red apple green. Target Image Description: A green apple on a wooden table."
    )


def test_a_cancelled_local_rewrite_stops_between_tokens(local_engine):
    from hidream_ui.engine.errors import EditCancelled
    from hidream_ui.engine.jobs import CancelToken
    from hidream_ui.rewrite.local_backend import LocalRewriter

    token = CancelToken()
    token.cancel("test")
    with pytest.raises(EditCancelled):
        LocalRewriter(local_engine).lines(None, "make it red", cancel=token)
    assert local_engine.status().state == "idle"


# ---------------------------------------------------------------------------------------------
# Start-up cost and the status panel
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_app_does_not_import_openai_until_a_rewrite():
    import subprocess
    import sys

    code = (
        "import sys; import hidream_ui.cli.app, hidream_ui.ui.layout, hidream_ui.rewrite.service; "
        "from hidream_ui.config import AppConfig; from hidream_ui.rewrite.service import RewriteService; "
        "RewriteService.for_config(AppConfig(rewriter_url='http://127.0.0.1:9/v1', rewriter_model='m'), None); "
        "print('openai' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_status_panel_shows_the_rewriter_and_escapes_its_error():
    from hidream_ui.engine.status import EngineStatus, Progress, PromptCacheStats, RewriterStatus
    from hidream_ui.ui.status_panel import render_status

    base = dict(
        progress=Progress(),
        loaded=True,
        variant="e1-full",
        model_source="real",
        attention="sdpa",
        attention_note=None,
        refiner="e1",
        text_encoders="device",
        prompt_cache=PromptCacheStats(0, 0, 0),
    )
    local = RewriterStatus(
        backend="local",
        model="Llama-3.1-8B-Instruct",
        lm_head_bytes=1_050_673_152,
        lm_head_loaded=False,
        last_error="answer <b>noise</b>",
    )
    text = render_status(EngineStatus(state="rewriting", rewriter=local, **base))
    assert "rewriting the instruction" in text and "local · Llama-3.1-8B-Instruct" in text
    assert "1002.0 MiB, loads on the first rewrite" in text
    assert "answer &lt;b&gt;noise&lt;/b&gt;" in text and "<b>noise" not in text
    remote = RewriterStatus(backend="openai", model="qwen-vl", timeout=20.0)
    text = render_status(EngineStatus(state="idle", rewriter=remote, **base))
    assert "openai · qwen-vl" in text and "LM head" not in text
    assert EngineStatus(state="idle", **base).to_dict()["rewriter"] is None  # the key is always there


@pytest.mark.slow
def test_a_batch_stops_asking_a_rewriter_that_does_not_answer(vlm):
    from hidream_ui.edits import EditSettings
    from hidream_ui.engine.batch import BatchRequest, BatchSource, plan_batch
    from hidream_ui.rewrite.openai_backend import OpenAIRewriter
    from hidream_ui.rewrite.service import RewriteService

    service = RewriteService(OpenAIRewriter(vlm.url, "fake-vl", api_key=None, timeout=1.0), "e1-full")
    request = BatchRequest(
        sources=tuple(BatchSource(f"{i}.png", random_picture(30 + i)) for i in range(3)),
        instructions=("[slow] make it red",),
        settings=EditSettings(),
    )
    plan = plan_batch(request, lambda data, name: data, max_items=16)
    count = len(vlm.chat_requests())
    failed = []
    assert service.rewrite_items(plan, on_failed=failed.append) == 0
    # One timeout, then the other two items are not asked (3 x the timeout otherwise).
    assert len(vlm.chat_requests()) == count + 1
    assert len(failed) == 3 and sum("not asked" in item.error for item in failed) == 2


def test_local_rewriter_keeps_one_head_per_llama():
    """An engine pool (--devices) has one Llama per card: each rewrite uses its own Llama's head,
    never the head of the card that rewrote first (copied over on every rewrite)."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaModel

    from hidream_ui.rewrite.local_backend import LocalRewriter

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    llamas = [LlamaModel(config), LlamaModel(config)]
    models = [SimpleNamespace(pipeline=SimpleNamespace(text_encoder_4=llama)) for llama in llamas]
    backend = LocalRewriter(engine=None)
    for _ in range(2):
        for model, llama in zip(models, llamas):
            assert backend._ensure_head(model) is llama.get_input_embeddings().weight
    assert backend.head_loaded
