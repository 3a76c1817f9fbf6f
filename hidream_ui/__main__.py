"""`python -m hidream_ui <command>`: app, edit, batch, doctor, plan, acceptance, bench, make-tiny, train-tiny.

Each command's module is imported only when that command runs, so `--help` is instant.
"""

from __future__ import annotations

import sys

from hidream_ui.bench import KINDS
from hidream_ui.cli.commands import dispatch

# command -> (module, one-line help). The module exposes `main(argv: list[str]) -> int`.
COMMANDS = {
    "app": ("hidream_ui.cli.app", "run the Gradio app (same flags as `python app.py`)"),
    "edit": ("hidream_ui.cli.edit", "edit one image from the command line; prints a JSON summary"),
    "batch": (
        "hidream_ui.cli.batch",
        "edit a JSONL manifest of images x instructions, resumable; locally or on Ray (--ray)",
    ),
    "doctor": (
        "hidream_ui.cli.doctor",
        "report versions, devices, dtypes and model paths; non-zero if the model cannot load",
    ),
    "plan": ("hidream_ui.cli.plan", "predict every memory plan's device peak before loading; mark the one auto picks"),
    "acceptance": (
        "hidream_ui.cli.acceptance",
        "run every check once on this model and device; writes report.json, report.md and a zip to share",
    ),
    "bench": ("hidream_ui.bench", f"benchmarks: {' | '.join(KINDS)} (print JSON with --json)"),
    "make-tiny": (
        "hidream_ui.model.tiny.build",
        "build the offline random-weight HiDream checkpoint in the upstream layout",
    ),
    "train-tiny": (
        "hidream_ui.lab.train.cli",
        "train the `trained` tiny model on the synthetic shapes world (CPU) and write its weights",
    ),
}


def main(argv: list[str] | None = None) -> int:
    return dispatch(
        COMMANDS,
        sys.argv[1:] if argv is None else argv,
        prog="python -m hidream_ui",
        description="HiDream-E1.1 / E1-Full image editing: app, CLI, diagnostics and benchmarks.",
    )


if __name__ == "__main__":
    sys.exit(main())
