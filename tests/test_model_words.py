"""Say what the model can do (issue 56): with the trained offline model the placeholders, the hint and the banner
come from its world (model/tiny/world.py, the one home of its words), and an instruction with words it has never
seen gets a friendly note naming the words it knows (the edit still runs); real weights get placeholders in their
variant's own format. Visitors' summaries name the speed mode when it is not exact."""

from __future__ import annotations

import pytest
from helpers import edit_params, run_info
from PIL import Image

from hidream_ui.config import AppConfig
from hidream_ui.edits import TARGET_MARKER, EditResult, Timings
from hidream_ui.model.tiny import world
from hidream_ui.ui import world_examples

TRAINED = AppConfig(tiny_profile="trained")
RANDOM = AppConfig(tiny_profile="tiny")
E11 = AppConfig(model_dir="/models")
E1_FULL = AppConfig(model_dir="/models", variant="e1-full")


# --- the world's vocabulary ---------------------------------------------------------------------


def test_unknown_words_are_named_once_in_order_and_case_counts():
    assert world.unknown_words("make the square pink") == ("pink",)
    assert world.unknown_words("make the square blue!") == ()  # punctuation is no word
    # Trained on lower case only: a capital is a word it has not learnt (the note says so).
    assert world.unknown_words("Make the SQUARE blue") == ("Make", "SQUARE")
    assert "(it learnt its words in lower case)" in world.vocabulary_note("Make the square blue")
    assert "lower case" not in world.vocabulary_note("make the square pink")
    assert world.unknown_words("turn the sky into a sunset, the sky!") == ("turn", "sky", "into", "a", "sunset")
    assert world.unknown_words("make the circle 2x red") == ("x",)  # digits are no words; letters are


def test_every_instruction_of_the_world_is_known_and_gets_no_note():
    """Every edit the world can draw (each kind, each target and value), written as the world writes it."""
    edits = [world.Edit("recolour", shape, colour) for shape in world.SHAPES for colour in world.COLOURS]
    edits += [world.Edit("remove", shape, "") for shape in world.SHAPES]
    edits += [world.Edit("background", "background", background) for background in world.BACKGROUNDS]
    assert {edit.kind for edit in edits} == set(world.EDIT_KINDS)
    for instruction in [edit.instruction for edit in edits] + list(world.example_instructions()):
        assert world.is_known_instruction(instruction), instruction
        assert world.vocabulary_note(instruction) is None, instruction
    assert world.vocabulary_note("  ") is None  # nothing to say about an empty box (the form refuses it)


def test_the_note_names_the_new_words_and_every_word_the_model_knows():
    note = world.vocabulary_note("make the square pink")
    assert note.startswith("The offline model has never seen \u201cpink\u201d.")
    for form in world.INSTRUCTION_FORMS:
        assert form in note
    for word in (*world.SHAPES, *world.COLOURS, *world.BACKGROUNDS):
        assert word in note, word
    assert "edited anyway" in note
    # Known words in an order it was not trained on (a shape colour as the background): said too.
    assert "but not this instruction" in world.vocabulary_note("make the background red")
    assert "but not this instruction" in world.vocabulary_note("remove the background")
    # Many new words: the first six, then "...".
    many = world.vocabulary_note("one two three four five six seven eight")
    assert "\u201csix\u201d, ..." in many and "seven" not in many


def test_the_forms_are_made_of_the_worlds_words_only():
    words = set(world.WORDS)
    for form in world.INSTRUCTION_FORMS:
        fixed = [word for word in form.split() if not word.startswith("{")]
        assert set(fixed) <= words, form
    text = world.instruction_forms("")
    for word in (*world.SHAPES, *world.COLOURS, *world.BACKGROUNDS):
        assert word in text


# --- what the tabs suggest ----------------------------------------------------------------------


def test_the_offline_models_placeholders_and_hint_come_from_its_world():
    placeholder = world_examples.world_placeholder(TRAINED)
    assert world.is_known_instruction(placeholder)
    lines = world_examples.batch_placeholder(TRAINED).splitlines()
    assert len(lines) == len(world.EDIT_KINDS) and all(world.is_known_instruction(line) for line in lines)
    hint = world_examples.world_hint(TRAINED)
    for word in (*world.SHAPES, *world.COLOURS, *world.BACKGROUNDS, "remove the", "make the background"):
        assert word in hint, word
    assert "sunset" not in hint and "snow" not in " ".join(lines)


@pytest.mark.parametrize("config", [E11, E1_FULL, RANDOM], ids=["e1.1", "e1-full", "random-tiny"])
def test_other_models_get_their_variants_wording_and_no_note(config):
    assert world_examples.world_placeholder(config) is None  # the tab uses ui/common.py's, per variant
    assert world_examples.world_hint(config) is None
    assert world_examples.instruction_note(config, "make the square pink") is None
    lines = world_examples.batch_placeholder(config).splitlines()
    assert len(lines) == 2
    if config.variant == "e1-full":  # E1-Full's two-part prompt on every line
        assert all(line.startswith("Editing Instruction: ") and TARGET_MARKER in line for line in lines)
    else:
        assert not any(TARGET_MARKER in line for line in lines)


def test_the_note_is_the_offline_models_only():
    assert world_examples.instruction_note(TRAINED, "make the square pink") == world.vocabulary_note(
        "make the square pink"
    )
    assert world_examples.instruction_note(TRAINED, "remove the circle") is None


def test_a_batch_gets_one_note_naming_each_new_word_once():
    from hidream_ui.ui.batch_tab import BatchRun

    lines = ["make the square pink", "remove the circle", "make the circle pink", "make it snow"]
    note = world_examples.instructions_note(TRAINED, lines)
    assert note.startswith("The offline model has never seen \u201cpink\u201d, \u201cit\u201d, \u201csnow\u201d.")
    assert world_examples.instructions_note(TRAINED, ["remove the circle", "make the background black"]) is None
    assert world_examples.instructions_note(E11, lines) is None
    run = BatchRun(4, [])
    run.note = note
    assert run.report().endswith(f"\n\nℹ️ {note}")


def test_the_banners_first_sentence_names_the_three_forms():
    """A phone shows only the banner's first sentence (APP_CSS hides .hui-banner-more)."""
    from hidream_ui.ui.layout import offline_banner

    banner = offline_banner(TRAINED)
    first, more = banner.split('<span class="hui-banner-more">')
    for form in ("make the {shape} {colour}", "remove the {shape}", "make the background {white / black / gray}"):
        assert form in first, form
    for word in (*world.SHAPES, *world.COLOURS):
        assert word in more


# --- the result's summary -----------------------------------------------------------------------


def test_speed_mode_names_the_preset_or_the_spec_and_nothing_when_exact():
    from hidream_ui.ui.edit_handlers import speed_mode

    assert speed_mode(None) is None
    assert speed_mode({"cache": "none", "compile": "none", "moe": "diffusers"}) is None
    assert speed_mode({"cache": "magcache:0.24@20", "compile": "none", "moe": "diffusers"}) == (
        "fast (magcache:0.24@20)"
    )
    assert speed_mode({"cache": "magcache:0.24@10"}) == "faster (magcache:0.24@10)"
    assert speed_mode({"cache": "interval:2", "compile": "none", "moe": "diffusers"}) == "interval:2"
    assert speed_mode({"cache": "none@14"}) == "none@14"  # fewer steps is a speed mode too
    assert speed_mode({"cache": "none", "compile": "blocks (inductor)", "moe": "sync-free"}) == (
        "compiled blocks (inductor), sync-free MoE"
    )


def _result(instruction: str, speed=None) -> EditResult:
    image = Image.new("RGB", (16, 16))
    return EditResult(
        image=image,
        source_image=image,
        params=edit_params(instruction, seed=5).validated(),
        working_size=(128, 128),
        source_size=(16, 16),
        timings=Timings(total=1.0, denoise=0.8, per_step=0.1),
        peak_memory_bytes=None,
        info=run_info(speed=speed),
    )


@pytest.fixture
def handlers(tmp_path, monkeypatch):
    monkeypatch.setenv("HIDREAM_MODEL_CACHE", str(tmp_path))
    from hidream_ui.ui.edit_handlers import EditHandlers
    from hidream_ui.ui.services import AppServices

    def make(config: AppConfig) -> EditHandlers:
        return EditHandlers(object(), AppServices.for_config(config))

    return make


def test_the_summary_says_the_speed_mode_and_the_words_the_model_does_not_know(handlers):
    fast = {"moe": "diffusers", "compile": "none", "cache": "magcache:0.24@20", "skipped_fraction": 0.4}
    summary = handlers(TRAINED).summary(_result("make the square pink", speed=fast))
    assert summary.startswith("Seed **5**")
    assert " · speed: fast (magcache:0.24@20)" in summary
    line, note = summary.split("\n\n")
    assert "pink" not in line and note.startswith("ℹ️ The offline model has never seen \u201cpink\u201d")
    # An instruction of its world, run exact: the usual line alone.
    plain = handlers(TRAINED).summary(_result("make the square blue"))
    assert "speed" not in plain and "\n" not in plain
    # Real weights: no vocabulary to check against.
    assert "\n" not in handlers(E11).summary(_result("make the square pink", speed=fast))


@pytest.mark.slow
@pytest.mark.parametrize("profile, variant", [("trained", "e1.1"), ("tiny", "e1-full")])
def test_the_page_shows_the_placeholders_and_hint_of_the_model_in_use(profile, variant, tmp_path, monkeypatch):
    """The built page: the offline model's own instructions, or (any other model) the variant's format."""
    import gradio as gr

    from hidream_ui.engine.pool import EnginePool
    from hidream_ui.ui.common import instruction_placeholder, variant_hint
    from hidream_ui.ui.layout import build_demo

    monkeypatch.setenv("HIDREAM_MODEL_CACHE", str(tmp_path / "cache"))
    config = AppConfig(device="cpu", output_dir=tmp_path / "out", tiny_profile=profile, variant=variant)
    demo = build_demo(EnginePool.for_config(config))
    blocks = {block.elem_id: block for block in demo.blocks.values() if getattr(block, "elem_id", None)}
    hints = [
        b.value for b in demo.blocks.values() if isinstance(b, gr.Markdown) and "hui-hint" in (b.elem_classes or [])
    ]
    edit, batch = blocks["hui-instruction"].placeholder, blocks["hui-batch-instructions"].placeholder
    if profile == "trained":
        assert edit == world.example_instructions()[0] and batch == "\n".join(world.example_instructions())
        assert world_examples.world_hint(config) in hints
    else:
        assert edit == instruction_placeholder(variant) and batch == world_examples.E1_FULL_BATCH_PLACEHOLDER
        assert variant_hint(variant) in hints
