"""One schema for an edit (hidream_ui.edits.FIELDS): the CLI `edit` flags, the widgets and the
handlers' inputs of the Edit, Batch and Compare tabs, the form round trip and README's flag table
are derived from it. Each test here fails when one of them drifts from the others."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
from helpers import random_picture

from hidream_ui import edits
from hidream_ui.config import TINY_PROFILES, from_args
from hidream_ui.edits import (
    EDIT_FLAGS_BEGIN,
    EDIT_FLAGS_END,
    EDIT_FORM,
    FIELD_SPECS,
    FIELDS,
    SETTING_NAMES,
    SHARED_FORM,
    EditParams,
    EditRequest,
    EditSettings,
    edit_flags_table,
    form_values,
    params_from_form,
)

README = Path(__file__).resolve().parents[1] / "README.md"
FLAGGED = [spec for spec in FIELDS if spec.flag is not None]


# --- the CLI ------------------------------------------------------------------------------------


def test_the_edit_command_has_one_flag_per_field_and_no_other_for_a_field():
    from hidream_ui.cli.edit import _parser

    by_field: dict[str, list[str]] = {}
    for action in _parser()._actions:
        if action.dest in FIELD_SPECS:
            by_field.setdefault(action.dest, []).extend(action.option_strings)
    # One flag per field that has one, and no hand-written second flag for a field of the schema.
    assert {name: options for name, options in by_field.items() if FIELD_SPECS[name].flag is not None} == {
        spec.name: [spec.flag] for spec in FLAGGED
    }
    # The fields without a flag of their own say why (the step cache: the app-wide --cache sets it).
    assert all(spec.why_no_flag for spec in FIELDS if spec.flag is None)
    for name, options in by_field.items():
        if FIELD_SPECS[name].flag is None:
            assert all(option in FIELD_SPECS[name].why_no_flag for option in options)


def test_the_edit_flags_become_params_over_the_variants_defaults():
    from hidream_ui.cli.edit import _parser

    args = _parser().parse_args(
        [
            "--image",
            "x.png",
            "--instruction",
            " snow ",
            "--steps",
            "5",
            "--padded",
            "--no-clip-cfg-norm",
            "--seed",
            "9",
            "--working-resolution",
            "512",
        ]
    )
    params = edits.params_from_args(args, "e1-full")
    assert params == EditParams(
        "snow",
        9,
        EditSettings.defaults_for("e1-full"),
        num_inference_steps=5,
        collapse_padding=False,
        clip_cfg_norm=False,
        working_resolution="512",
    )
    plain = edits.params_from_args(_parser().parse_args(["--image", "x", "--instruction", "a"]), "e1.1")
    assert plain == EditParams.defaults_for("e1.1", "a").validated()


# --- composition ----------------------------------------------------------------------------------


def test_params_are_instruction_seed_settings_and_an_optional_mask():
    settings = EditSettings(guidance_scale=4.0, working_resolution="draft")
    params = EditParams("x", 1, settings)
    assert params.settings is settings and params.guidance_scale == 4.0 and params.working_resolution == "draft"
    assert EditParams("x", guidance_scale=2).settings == EditSettings(guidance_scale=2)
    assert dataclasses.replace(params, num_inference_steps=9).settings == dataclasses.replace(
        settings, num_inference_steps=9
    )
    # DESIGN.md: EditParams = settings + instruction + seed + optional mask (not a setting: not in to_dict).
    assert [f.name for f in dataclasses.fields(EditParams)] == ["instruction", "seed", "settings", "mask"]
    assert params.mask is None
    assert list(params.to_dict()) == [spec.name for spec in FIELDS if spec.name != "randomize_seed"]
    with pytest.raises(TypeError, match="guidance"):
        EditParams("x", guidance=3)


# --- README -------------------------------------------------------------------------------------


def test_the_readme_flag_table_is_the_generated_one():
    text = README.read_text(encoding="utf-8")
    assert text.count(EDIT_FLAGS_BEGIN) == 1 and text.count(EDIT_FLAGS_END) == 1
    table = text.split(EDIT_FLAGS_BEGIN)[1].split(EDIT_FLAGS_END)[0].strip()
    assert table == edit_flags_table(), (
        "README's edit flag table drifted from hidream_ui.edits.FIELDS; regenerate it with: python -c "
        '"from pathlib import Path; from hidream_ui.edits import with_edit_flags_table as w; '
        "p = Path('README.md'); p.write_text(w(p.read_text()))\""
    )
    rows = [line for line in table.splitlines()[2:]]
    assert [row.split("`")[1] for row in rows] == [spec.flag for spec in FLAGGED]


def test_the_table_shows_each_variants_defaults_from_the_one_table():
    table = edit_flags_table()
    for variant, values in edits.VARIANT_DEFAULTS.items():
        for value in values.values():
            assert f"{value:g} ({variant})" in table
        assert EditParams.defaults_for(variant).settings == EditSettings(**values)


# --- the UI -------------------------------------------------------------------------------------


def _parameters(fn) -> list[str]:
    return [name for name in inspect.signature(fn).parameters if name not in ("self", "request", "progress")]


def test_the_handlers_take_the_forms_fields_in_their_order():
    from hidream_ui.ui.batch_tab import BatchTab
    from hidream_ui.ui.compare_tab import CompareTab
    from hidream_ui.ui.edit_handlers import EditHandlers

    assert _parameters(EditHandlers.edit) == ["image", *EDIT_FORM, "rewrite", "mask"]
    assert _parameters(EditHandlers.edit_rewritten) == ["image", "rewritten", "rewrite", *EDIT_FORM[1:], "mask"]
    assert _parameters(BatchTab.run) == [
        "files",
        "instructions",
        "mode",
        *SHARED_FORM,
        "seed",
        "seed_policy",
        "batch_size",
        "rewrite",
    ]
    assert _parameters(CompareTab.run) == [
        "image",
        "instruction",
        "axis_x",
        "values_x",
        "axis_y",
        "values_y",
        *SHARED_FORM,
        "seed",
        "mask",
    ]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from hidream_ui.config import AppConfig
    from hidream_ui.engine.pool import EnginePool
    from hidream_ui.ui.layout import build_demo

    return build_demo(EnginePool.for_config(AppConfig(device="cpu", output_dir=tmp_path_factory.mktemp("out"))))


def _event(demo, api_name: str):
    (fn,) = [fn for fn in demo.fns.values() if fn.api_name == api_name]
    return fn


def _check_widgets(widgets, names) -> None:
    assert [w.label for w in widgets] == [FIELD_SPECS[name].label for name in names]
    for widget, name in zip(widgets, names):
        spec = FIELD_SPECS[name]
        if spec.kind in ("float", "int"):
            assert (type(widget).__name__, widget.minimum, widget.maximum, widget.step) == (
                "Slider",
                spec.lo,
                spec.hi,
                spec.step,
            ), name


def test_the_widgets_of_each_api_are_the_fields_in_order(demo):
    edit = _event(demo, "edit").inputs
    _check_widgets(edit[1:-2], EDIT_FORM)
    _check_widgets(_event(demo, "edit_rewritten").inputs[3:-1], EDIT_FORM[1:])
    _check_widgets(_event(demo, "batch_edit").inputs[3 : 3 + len(SHARED_FORM)], SHARED_FORM)
    _check_widgets(_event(demo, "compare").inputs[6 : 6 + len(SHARED_FORM)], SHARED_FORM)
    # The form round trip (History's "Load these settings", a PNG's settings) fills the same widgets.
    loaders = [
        fn for fn in demo.fns.values() if getattr(fn.fn, "__name__", "") in ("apply_history", "settings_from_file")
    ]
    assert len(loaders) == 2
    for fn in loaders:
        assert [id(w) for w in fn.outputs[:-1]] == [id(w) for w in edit[1:-2]]
    # The widgets start at the variant's defaults: a random seed (Edit twice, two different images).
    defaults = {**EditParams.defaults_for("e1.1").to_dict(), "randomize_seed": True}
    assert [w.value for w in edit[2:-2]] == [defaults[name] for name in EDIT_FORM[1:]]


def test_the_form_round_trip_gives_back_the_params():
    params = EditParams(
        "a cat",
        77,
        negative_prompt="blur",
        guidance_scale=4.5,
        image_guidance_scale=2.0,
        num_inference_steps=12,
        refine_strength=0.1,
        clip_cfg_norm=False,
        working_resolution="768",
        collapse_padding=False,
    ).validated()
    values = form_values(params)
    assert len(values) == len(EDIT_FORM)
    assert params_from_form(dict(zip(EDIT_FORM, values))) == params
    assert params_from_form({**dict(zip(EDIT_FORM, values)), "randomize_seed": True}).seed == -1


# --- one home per list of choices ------------------------------------------------------------------


def test_tiny_profiles_are_the_builders_and_deep_is_accepted():
    from hidream_ui.config import _MODEL_OPTIONS
    from hidream_ui.model.tiny.profiles import FULL_PROFILE_NAME, PROFILES

    assert TINY_PROFILES == (*PROFILES, FULL_PROFILE_NAME)
    assert from_args(["--tiny-profile", "deep"]).tiny_profile == "deep"
    helps = {flag: text for flag, _, _, text in _MODEL_OPTIONS}
    assert all(name in helps["--tiny-profile"] for name in TINY_PROFILES)


def test_choice_help_texts_name_every_choice():
    from hidream_ui.config import _MODEL_OPTIONS, COMPILE_CHOICES, MOE_CHOICES
    from hidream_ui.model.plans import MEMORY_CHOICES, WEIGHT_CHOICES
    from hidream_ui.pipeline.speed.settings import SPEED_PRESETS

    helps = {flag: text for flag, _, _, text in _MODEL_OPTIONS}
    for flag, choices in (
        ("--memory", MEMORY_CHOICES),
        ("--weights", WEIGHT_CHOICES),
        ("--moe", MOE_CHOICES),
        ("--compile", COMPILE_CHOICES),
        ("--cache", tuple(SPEED_PRESETS)),
    ):
        assert " | ".join(choices) in helps[flag], flag


def test_the_pipelines_defaults_are_the_schemas():
    from hidream_ui.pipeline.edit_pipeline import HiDreamEditPipeline

    signature = inspect.signature(HiDreamEditPipeline.__call__).parameters
    defaults = EditSettings()
    for name in (
        "negative_prompt",
        "guidance_scale",
        "image_guidance_scale",
        "num_inference_steps",
        "refine_strength",
        "clip_cfg_norm",
        "collapse_padding",
    ):
        assert signature[name].default == getattr(defaults, name), name


# --- validated once -----------------------------------------------------------------------------


def test_params_are_checked_once_on_the_way_in(monkeypatch):
    calls = []
    check = edits._check_field
    monkeypatch.setattr(edits, "_check_field", lambda spec, value: calls.append(spec.name) or check(spec, value))
    values = dict(zip(EDIT_FORM, form_values(EditParams("make it snow", 5).validated())))
    calls.clear()
    params = params_from_form(values)
    assert sorted(calls) == sorted([*SETTING_NAMES, "instruction", "seed"])  # each field once
    calls.clear()
    request = EditRequest(image=random_picture(0), params=params).validated()
    assert request.params is params and params.validated() is params
    assert params.resolve_seed().is_validated
    assert calls == []
    # A changed copy is checked again: the mark does not outlive a change.
    changed = dataclasses.replace(params, guidance_scale="not a number")
    assert not changed.is_validated
    with pytest.raises(edits.RequestError, match="guidance_scale"):
        changed.validated()


def _doc_rows() -> list[str]:
    """Table rows of README.md and docs/ (where the flag tables live)."""
    root = README.parent
    pages = [README, *sorted((root / "docs").rglob("*.md"))] if (root / "docs").is_dir() else [README]
    return [line for page in pages for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("|")]


def test_the_docs_flag_tables_name_every_choice_of_its_home():
    from hidream_ui.config import (
        COMPILE_CHOICES,
        MOE_CHOICES,
        REFINERS,
        REWRITERS,
        TEXT_ENCODER_MODES,
        VARIANTS,
    )
    from hidream_ui.device.backends import DTYPE_SPECS
    from hidream_ui.model.plans import MEMORY_CHOICES, WEIGHT_CHOICES
    from hidream_ui.pipeline.attention.registry import strategy_names
    from hidream_ui.pipeline.speed.settings import SPEED_PRESETS

    rows = _doc_rows()
    homes = {
        "--variant": VARIANTS,
        "--tiny-profile": TINY_PROFILES,
        "--memory": MEMORY_CHOICES,
        "--weights": WEIGHT_CHOICES,
        "--moe": MOE_CHOICES,
        "--compile": COMPILE_CHOICES,
        "--rewriter": REWRITERS,
        "--text-encoders": TEXT_ENCODER_MODES,
        "--refiner": REFINERS,
        "--dtype": tuple(DTYPE_SPECS),
        "--cache": tuple(SPEED_PRESETS),
    }
    for flag, choices in homes.items():
        # README's common-flags table and docs/command-line.md may both list a flag: each row must be whole.
        found = [line for line in rows if line.startswith(f"| `{flag}`")]
        assert found, f"no table row for {flag} in README.md / docs/"
        for row in found:
            missing = [choice for choice in choices if f"`{choice}`" not in row]
            assert not missing, f"a {flag} row does not name {missing}: {row}"
    # The attention strategies' table: each registered name starts a row (or shares its first cell).
    names = " ".join(line.split("|")[1] for line in rows if line.startswith("| `") and not line.startswith("| `--"))
    assert [name for name in strategy_names() if f"`{name}`" not in names] == []
