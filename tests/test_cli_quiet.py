"""The command line speaks to people: quiet by default (`--verbose` for the libraries' logs), one
progress bar of ours, a taken port names --port, `plan` says which model it planned, and a missing
torch is one line, not a traceback."""

from __future__ import annotations

import errno
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import write_picture

from hidream_ui.cli.quiet import QUIET_ENVIRONMENT, StepBar, quiet_libraries
from hidream_ui.config import AppConfig
from hidream_ui.engine.jobs import StepInfo

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], tmp_path, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in QUIET_ENVIRONMENT}
    environ.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_edit_is_quiet_by_default_with_one_bar_of_ours_and_verbose_shows_the_libraries(tmp_path, tiny_cache):
    source = write_picture(tmp_path / "in.png")
    common = [
        "-m",
        "hidream_ui",
        "edit",
        "--image",
        str(source),
        "--instruction",
        "make it blue",
        "--steps",
        "2",
        "--working-resolution",
        "draft",
        "--output-dir",
        str(tmp_path / "out"),
        "--device",
        "cpu",
    ]
    quiet = _run(common, tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert json.loads(quiet.stdout)["ok"] is True  # stdout is the JSON summary alone
    assert "LOAD REPORT" not in quiet.stderr and "Loading pipeline components" not in quiet.stderr
    assert "it/s]" not in quiet.stderr  # no tqdm bar of any library
    lines = [line for line in quiet.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("edit ") and "2/2 steps" in lines[0]  # ours, once (not a tty)
    verbose = _run([*common, "--verbose"], tmp_path)
    assert verbose.returncode == 0, verbose.stderr
    assert "LOAD REPORT" in verbose.stderr or "Loading pipeline components" in verbose.stderr


def test_a_users_own_library_settings_win_over_the_quiet_default():
    environ = {"TRANSFORMERS_VERBOSITY": "info"}
    quiet_libraries(False, environ)
    assert environ["TRANSFORMERS_VERBOSITY"] == "info" and environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    untouched: dict[str, str] = {}
    quiet_libraries(True, untouched)
    assert untouched == {}


def test_the_step_bar_draws_in_place_on_a_terminal_and_once_elsewhere():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, live in ((io.StringIO(), False), (Terminal(), True)):
        bar = StepBar("edit", stream)
        for step in (1, 2, 3):
            bar.update(StepInfo(step=step, total=3, stage="edit", elapsed=0.1, eta=0.0))
        bar.close()
        text = stream.getvalue()
        assert text.count("\r") == (4 if live else 0)
        assert text.endswith("3/3 steps · " + text.rsplit("· ", 1)[1]) and text.endswith(" s\n")
        assert ("1/3 steps" in text) == live


def test_a_taken_port_names_our_flag_not_gradios_variable(tmp_path, tiny_cache, capsys):
    from hidream_ui.cli.app import main, serve_error

    config = AppConfig(port=7990)
    gradio_says = OSError(
        "Cannot find empty port in range: 7990-7990. You can specify a different port by setting "
        "the GRADIO_SERVER_PORT environment variable or passing the `server_port` parameter"
    )
    for exc in (gradio_says, OSError(errno.EADDRINUSE, "Address already in use")):
        message = serve_error(config, exc)
        assert "--port 7991" in message and "HIDREAM_PORT" in message and "GRADIO_SERVER_PORT" not in message
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["--port", str(port), "--device", "cpu", "--output-dir", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is already in use" in err and f"--port {port + 1}" in err


def test_plan_says_which_model_it_planned_and_how_to_plan_the_release(tiny_cache, capsys):
    from hidream_ui.cli.plan import main

    main(["--device", "cpu"])
    out = capsys.readouterr().out
    assert "planned the offline tiny model (--tiny-profile tiny" in out and "--tiny-profile full" in out
    main(["--device", "cpu", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["kind"] == "offline" and report["model"]["profile"] == "tiny"
    main(["--device", "cpu", "--tiny-profile", "full", "--json"])
    assert json.loads(capsys.readouterr().out)["model"] == {"kind": "release-size", "profile": "full", "note": None}


def test_a_missing_torch_is_one_line_with_the_install_command(tmp_path):
    # sys.modules["torch"] = None makes `import torch` raise ModuleNotFoundError(name="torch"), as on a
    # machine without it (installing and removing torch here is not an option).
    code = "import sys; sys.modules['torch'] = None; from hidream_ui.__main__ import main; sys.exit(main(['doctor']))"
    result = _run(["-c", code], tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "torch is not installed" in result.stderr and "pip install torch==2.13.0" in result.stderr
