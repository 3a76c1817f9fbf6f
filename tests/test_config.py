import argparse
import dataclasses
from pathlib import Path

import pytest

from hidream_ui.config import (
    AppConfig,
    ConfigError,
    add_model_arguments,
    add_server_arguments,
    from_args,
    from_namespace,
    read_auth_file,
)


def parse(argv, environ=None):
    return from_args(argv, environ or {})


def test_defaults_use_tiny_model_and_auto_device():
    config = parse([])
    assert config.uses_tiny_model
    assert (config.device, config.dtype, config.attention, config.variant) == ("auto", "auto", "auto", "e1.1")


def test_flag_beats_env_beats_default():
    env = {"HIDREAM_DEVICE": "cuda:1", "HIDREAM_DTYPE": "fp16"}
    assert parse(["--device", "cpu"], env).device == "cpu"
    assert parse([], env).device == "cuda:1"
    assert parse([], env).dtype == "fp16"


def test_preferred_device_is_accepted_after_hidream_device():
    assert parse([], {"PREFERRED_DEVICE": "npu:1"}).device == "npu:1"
    assert parse([], {"PREFERRED_DEVICE": "npu:1", "HIDREAM_DEVICE": "cpu"}).device == "cpu"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--device", "gpu"], "device='gpu'"),
        (["--device", "cpu:1"], "device='cpu:1'"),
        (["--dtype", "fp8"], "dtype='fp8'"),
        (["--variant", "e2"], "variant='e2'"),
        (["--port", "http"], "--port='http' is not a whole number"),
        (["--port", "70000"], "port=70000"),
        (["--auth", "nopassword"], "user:password"),
        (["--text-encoders", "gpu"], "text_encoders='gpu'"),
        (["--refiner", "x"], "refiner='x'"),
        (["--max-queue", "0"], "max_queue=0"),
        (["--attention", "flash3"], "attention='flash3' is not one of: auto, "),
    ],
)
def test_bad_values_are_named(argv, needle):
    with pytest.raises(ConfigError) as info:
        parse(argv)
    assert needle in str(info.value)


def test_env_errors_name_the_variable():
    with pytest.raises(ConfigError, match="HIDREAM_PORT='abc'"):
        parse([], {"HIDREAM_PORT": "abc"})


def test_model_dir_disables_tiny_model(tmp_path):
    config = parse(["--model-dir", str(tmp_path)])
    assert config.model_dir == tmp_path and not config.uses_tiny_model


def test_config_is_frozen_and_replace_validates():
    config = AppConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.device = "cpu"
    assert config.replace(device="cpu").device == "cpu"
    with pytest.raises(ConfigError):
        config.replace(device="tpu")


def test_auth_and_auth_file(tmp_path):
    assert parse(["--auth", "ann:secret"]).auth == ("ann", "secret")
    f = tmp_path / "users.txt"
    f.write_text("# users\nann:one\n\nbob:two:with:colons\n")
    assert read_auth_file(f) == [("ann", "one"), ("bob", "two:with:colons")]
    f.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="no user:password"):
        read_auth_file(f)
    with pytest.raises(ConfigError, match="cannot read"):
        read_auth_file(tmp_path / "missing.txt")


def test_namespace_with_share_flag():
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    add_server_arguments(parser)
    config = from_namespace(parser.parse_args(["--share", "--port", "8000"]), {})
    assert config.share and config.port == 8000 and config.output_dir == Path("outputs")


# --- Ray in the table (issue 53) ----------------------------------------------------------------


def test_ray_address_and_replicas_are_settings_with_flags_and_variables():
    assert (parse([]).ray, parse([]).replicas, parse([]).replica_bounds) == (None, None, (0, None))
    env = {"HIDREAM_RAY_ADDRESS": "auto", "HIDREAM_RAY_REPLICAS": "1-4"}
    config = parse([], env)
    assert (config.ray, config.replicas, config.replica_bounds) == ("auto", "1-4", (1, 4))
    config = parse(["--ray", "local", "--replicas", "2"], env)  # the flags win
    assert (config.ray, config.replica_bounds) == ("local", (2, None))
    for bad in ("0", "4-1", "two", "1-"):
        with pytest.raises(ConfigError, match=f"HIDREAM_RAY_REPLICAS='{bad}'"):
            parse([], {"HIDREAM_RAY_REPLICAS": bad})
    with pytest.raises(ConfigError, match="--replicas='0'"):
        parse(["--replicas", "0"])
    with pytest.raises(ConfigError, match="replicas='x'"):
        AppConfig().replace(replicas="x")


def test_replica_counts_are_read_by_one_parser():
    from hidream_ui.config import parse_replicas

    assert parse_replicas("--replicas", "3") == (3, None) and parse_replicas("--replicas", " 1-4 ") == (1, 4)
    assert parse_replicas("--replicas", None) == (0, None)
    for bad in ("0", "4-1", "x", "-2"):
        with pytest.raises(ConfigError, match=f"--replicas='{bad}'"):
            parse_replicas("--replicas", bad)


# --- renamed variables (issue 53): the old names still work, say so once, and never disagree ----

RENAMES = [
    ("HIDREAM_CACHE", "HIDREAM_STEP_CACHE", "cache", "interval:2", "interval:3", "interval:2"),
    ("HIDREAM_CACHE_MAX_FILES", "HIDREAM_UPLOAD_CACHE_MAX_FILES", "cache_max_files", "7", "8", 7),
    ("HIDREAM_CACHE_MAX_MB", "HIDREAM_UPLOAD_CACHE_MAX_MB", "cache_max_mb", "70", "80", 70),
    ("HIDREAM_CACHE_MAX_AGE", "HIDREAM_UPLOAD_CACHE_MAX_AGE", "cache_max_age", "60", "90", 60),
]


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each test sees the once-per-process deprecation warnings anew."""
    from hidream_ui import env_names

    monkeypatch.setattr(env_names, "_warned", set())


@pytest.mark.parametrize("old, new, field, value, other, expected", RENAMES)
def test_a_renamed_variable_works_by_either_name(fresh_warnings, old, new, field, value, other, expected):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name alone warns about nothing
        assert getattr(parse([], {new: value}), field) == expected
        assert getattr(parse([], {new: value, old: value}), field) == expected  # the same value twice: fine
    with pytest.warns(FutureWarning, match=f"{old} is deprecated: set {new} instead"):
        assert getattr(parse([], {old: value}), field) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert getattr(parse([], {old: value}), field) == expected
    with pytest.raises(ConfigError, match=f"{new}='{other}' and its deprecated old name {old}='{value}'"):
        parse([], {new: other, old: value})


def test_the_help_names_the_new_variable_and_the_deprecated_one():
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    add_server_arguments(parser)
    text = " ".join(parser.format_help().split())  # argparse wraps lines
    assert "HIDREAM_STEP_CACHE, deprecated HIDREAM_CACHE]" in text
    assert "HIDREAM_UPLOAD_CACHE_MAX_FILES, deprecated HIDREAM_CACHE_MAX_FILES]" in text


def test_the_model_cache_variable_has_a_new_name(fresh_warnings, tmp_path):
    from hidream_ui.env_names import RenamedVariableError, model_cache_variable

    assert model_cache_variable({}) is None
    assert model_cache_variable({"HIDREAM_MODEL_CACHE": str(tmp_path)}) == str(tmp_path)
    with pytest.warns(FutureWarning, match="HIDREAM_UI_CACHE is deprecated: set HIDREAM_MODEL_CACHE instead"):
        assert model_cache_variable({"HIDREAM_UI_CACHE": str(tmp_path)}) == str(tmp_path)
    with pytest.raises(RenamedVariableError, match="HIDREAM_MODEL_CACHE='/a' and its deprecated old name"):
        model_cache_variable({"HIDREAM_MODEL_CACHE": "/a", "HIDREAM_UI_CACHE": "/b"})


# --- one table ---------------------------------------------------------------------------------


def test_every_config_field_but_the_internal_ones_has_a_flag():
    from hidream_ui.config_table import _SWITCHES, VALUE_OPTIONS

    tabled = {dest for _, _, dest, _ in VALUE_OPTIONS + _SWITCHES}
    # Not settings of a run: the prompt cache's size and the offline model's seed are set by code (tests, the lab).
    internal = {"prompt_cache_size", "tiny_seed"}
    assert {f.name for f in dataclasses.fields(AppConfig)} - internal == tabled


def test_the_model_package_reads_what_app_config_has():
    """model/settings.py's protocol (the model package never imports the config) matches AppConfig."""
    from hidream_ui.model.settings import MODEL_SETTING_NAMES, ModelSettings

    config = AppConfig()
    assert all(hasattr(config, name) for name in MODEL_SETTING_NAMES)
    declared = set(ModelSettings.__annotations__) | {"uses_tiny_model"}
    assert declared == set(MODEL_SETTING_NAMES)
