"""EditParams / EditRequest / EditResult: validation, coercion, seeds, prompt parsing, metadata."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import random
from pathlib import Path

import pytest
from helpers import run_info
from PIL import Image

from hidream_ui.config import VARIANTS
from hidream_ui.edits import (
    MAX_PROMPT_CHARS,
    SEED_MAX,
    EditParams,
    EditRequest,
    EditResult,
    RequestError,
    RunInfo,
    Timings,
    parse_working_resolution,
)


def _params(**overrides) -> EditParams:
    return dataclasses.replace(EditParams(instruction="make it snow"), **overrides)


# --- validation: every bad field names itself ----------------------------------------------------

BAD_VALUES = [
    ("instruction", ""),
    ("instruction", "   \n\t "),
    ("instruction", None),
    ("instruction", 42),
    ("instruction", "x" * (MAX_PROMPT_CHARS + 1)),
    ("instruction", "Editing Instruction: snow. Target Image Description:   "),
    ("negative_prompt", "y" * (MAX_PROMPT_CHARS + 1)),
    ("negative_prompt", 3),
    ("guidance_scale", -0.5),
    ("guidance_scale", 30.01),
    ("guidance_scale", float("nan")),
    ("guidance_scale", float("inf")),
    ("guidance_scale", "abc"),
    ("guidance_scale", True),
    ("guidance_scale", None),
    ("image_guidance_scale", 31),
    ("image_guidance_scale", "-1"),
    ("image_guidance_scale", "nan"),
    ("num_inference_steps", 0),
    ("num_inference_steps", 201),
    ("num_inference_steps", 1.5),
    ("num_inference_steps", "abc"),
    ("num_inference_steps", "28.5"),
    ("num_inference_steps", float("inf")),
    ("refine_strength", 1.0001),
    ("refine_strength", -0.1),
    ("seed", -2),
    ("seed", SEED_MAX + 1),
    ("seed", 1.5),
    ("seed", "abc"),
    ("seed", "1e100"),
    ("seed", float("nan")),
    ("clip_cfg_norm", "maybe"),
    ("clip_cfg_norm", 2),
    ("collapse_padding", None),
    ("working_resolution", "1000"),  # not a multiple of 16
    ("working_resolution", "128"),  # too small
    ("working_resolution", 8192),  # too large
    ("working_resolution", "huge"),
    ("working_resolution", 1.5),
]


@pytest.mark.parametrize("field,value", BAD_VALUES, ids=[f"{f}={v!r}"[:40] for f, v in BAD_VALUES])
def test_bad_field_is_named(field, value):
    with pytest.raises(RequestError) as info:
        _params(**{field: value}).validated()
    err = info.value
    assert err.field == field
    assert err.value is value or (isinstance(value, float) and math.isnan(value))
    assert str(err).startswith(f"{field}: got ")
    assert "expected" in str(err)


def test_error_message_states_allowed_range():
    with pytest.raises(RequestError, match=r"num_inference_steps: got 500; expected a whole number from 1 to 200"):
        _params(num_inference_steps=500).validated()
    with pytest.raises(RequestError, match=r"guidance_scale: got 99.0; expected a number from 0 to 30"):
        _params(guidance_scale=99.0).validated()


def test_request_error_is_a_value_error_and_pickles():
    err = RequestError("seed", "abc", "a whole number")
    assert isinstance(err, ValueError)
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.field, clone.value, str(clone)) == (err.field, err.value, str(err))


def test_valid_boundaries_pass():
    p = _params(
        guidance_scale=0,
        image_guidance_scale=30,
        num_inference_steps=200,
        refine_strength=1,
        seed=SEED_MAX,
        working_resolution="4096",
    ).validated()
    assert (p.guidance_scale, p.image_guidance_scale, p.num_inference_steps, p.refine_strength, p.seed) == (
        0.0,
        30.0,
        200,
        1.0,
        SEED_MAX,
    )
    assert _params(seed=-1, num_inference_steps=1, working_resolution="256").validated().seed == -1


# --- coercion from API / widget types --------------------------------------------------------------


def test_coercion_from_api_strings():
    p = _params(
        instruction="  turn day into night \n",
        negative_prompt=None,
        guidance_scale="4.5",
        image_guidance_scale=" 2 ",
        num_inference_steps="30",
        refine_strength="0",
        clip_cfg_norm="false",
        seed="12.0",
        working_resolution=" AUTO ",
        collapse_padding="0",
    ).validated()
    assert p == EditParams(
        instruction="turn day into night",
        negative_prompt="",
        guidance_scale=4.5,
        image_guidance_scale=2.0,
        num_inference_steps=30,
        refine_strength=0.0,
        clip_cfg_norm=False,
        seed=12,
        working_resolution="auto",
        collapse_padding=False,
    )
    assert type(p.num_inference_steps) is int and type(p.seed) is int and type(p.guidance_scale) is float


def test_int_like_floats_from_widgets_are_accepted():
    p = _params(num_inference_steps=28.0, seed=7.0, clip_cfg_norm=1, working_resolution=768).validated()
    assert (p.num_inference_steps, p.seed, p.clip_cfg_norm, p.working_resolution) == (28, 7, True, "768")


@pytest.mark.parametrize(
    "value,expected",
    [("auto", "auto"), ("Draft", "draft"), ("512", 512), (1024, 1024), ("2048px", 2048), (768.0, 768)],
)
def test_parse_working_resolution(value, expected):
    assert parse_working_resolution(value) == expected


def test_validated_is_idempotent_and_keeps_the_original():
    raw = _params(guidance_scale="3", instruction=" a ")
    once = raw.validated()
    assert once.validated() == once
    assert raw.guidance_scale == "3" and raw.instruction == " a "  # frozen input untouched


# --- seeds -----------------------------------------------------------------------------------------


def test_random_seed_resolves_in_range_and_is_reproducible_with_rng():
    p = _params(seed=-1).validated()
    seeds = {p.resolve_seed(random.Random(i)).seed for i in range(20)}
    assert all(isinstance(s, int) and 0 <= s <= SEED_MAX for s in seeds)
    assert len(seeds) > 1
    assert p.resolve_seed(random.Random(5)).seed == p.resolve_seed(random.Random(5)).seed
    resolved = p.resolve_seed()  # OS entropy path
    assert 0 <= resolved.seed <= SEED_MAX
    assert resolved.to_dict()["seed"] == resolved.seed  # the used seed is what gets recorded
    assert dataclasses.replace(resolved, seed=-1) == p


def test_fixed_seed_is_kept():
    assert _params(seed=123).resolve_seed(random.Random(0)).seed == 123
    assert _params(seed="0").resolve_seed().seed == 0


# --- dict round trip, defaults -------------------------------------------------------------------


def test_dict_round_trip_ignores_unknown_keys_and_validates():
    p = _params(seed=99, guidance_scale=2.5, working_resolution="draft").validated()
    d = p.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert EditParams.from_dict({**d, "future_option": 1}) == p
    assert EditParams.from_dict({"instruction": "x"}) == EditParams(instruction="x")
    with pytest.raises(RequestError) as info:
        EditParams.from_dict({**d, "num_inference_steps": "many"})
    assert info.value.field == "num_inference_steps"
    with pytest.raises(RequestError) as info:
        EditParams.from_dict({"seed": 1})
    assert info.value.field == "instruction"
    with pytest.raises(RequestError):
        EditParams.from_dict(["instruction"])


def test_defaults_for_variants():
    e11 = EditParams.defaults_for("e1.1", "x")
    full = EditParams.defaults_for("e1-full", "x")
    assert (e11.guidance_scale, e11.image_guidance_scale) == (3.0, 1.5)
    assert (full.guidance_scale, full.image_guidance_scale) == (5.0, 4.0)
    for p in (e11, full):
        assert (p.num_inference_steps, p.refine_strength, p.clip_cfg_norm, p.seed) == (28, 0.3, True, 3)
        assert p.validated() == p
    assert set(VARIANTS) == {"e1.1", "e1-full"}
    with pytest.raises(RequestError) as info:
        EditParams.defaults_for("e2")
    assert info.value.field == "variant" and "e1.1" in str(info.value)


# --- E1-Full prompt parsing ----------------------------------------------------------------------


def test_target_prompt_with_marker():
    p = EditParams(
        instruction="Editing Instruction: Convert the image into a Ghibli style. "
        "Target Image Description:  A person in a pink t-shirt, Ghibli style. "
    )
    assert p.target_prompt() == "A person in a pink t-shirt, Ghibli style."


def test_target_prompt_without_marker_is_the_instruction():
    assert EditParams(instruction=" make it snow ").target_prompt() == "make it snow"


def test_target_prompt_marker_is_case_sensitive_like_upstream():
    text = "Editing Instruction: x. target image description: y"
    assert EditParams(instruction=text).target_prompt() == text


def test_target_prompt_stops_at_a_second_marker_like_upstream():
    p = EditParams(instruction="a Target Image Description: b Target Image Description: c")
    assert p.target_prompt() == "b"


# --- request / result ----------------------------------------------------------------------------


def test_edit_request_validated():
    image = Image.new("RGB", (32, 32))
    req = EditRequest(image=image, params=_params(seed="5"), source_name="a.png").validated()
    assert req.params.seed == 5 and req.image is image and req.source_name == "a.png"
    with pytest.raises(RequestError) as info:
        EditRequest(image="a.png", params=_params()).validated()
    assert info.value.field == "image"


def _result(**overrides) -> EditResult:
    image = Image.new("RGB", (40, 24), (200, 10, 10))
    fields = dict(
        image=image,
        source_image=image,
        params=_params(seed=17).validated(),
        working_size=(1024, 608),
        source_size=(40, 24),
        timings=Timings(total=1.25, denoise=float("nan")),
        peak_memory_bytes=12345,
        info=run_info(model_paths={"i1": Path("/m/x")}),
        source_name="cat.png",
    )
    fields.update(overrides)
    return EditResult(**fields)


def test_metadata_is_json_ready_and_core_keys_win():
    meta = _result().metadata()
    assert json.loads(json.dumps(meta, allow_nan=False)) == meta
    assert meta["format"] == "hidream_ui/1"
    # No engine fact may ever disguise a core key (the core keys win anyway).
    core = {"format", "params", "working_size", "source_size", "source_name", "timings", "peak_memory_bytes"}
    assert not core & {f.name for f in dataclasses.fields(RunInfo)}
    assert meta["params"] == _params(seed=17).validated().to_dict()
    assert meta["working_size"] == [1024, 608] and meta["source_size"] == [40, 24]
    assert meta["source_name"] == "cat.png"
    assert meta["timings"] == {**Timings().to_dict(), "total": 1.25, "denoise": None}
    assert meta["peak_memory_bytes"] == 12345
    assert meta["variant"] == "e1.1" and meta["model_source"] == "tiny"
    assert meta["model_paths"] == {"i1": str(Path("/m/x"))}
