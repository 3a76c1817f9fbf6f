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
