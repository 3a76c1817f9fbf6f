"""`python -m hidream_ui <command>`: app, edit, doctor, bench, make-tiny.

Each command's module is imported only when that command runs, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, one-line help). The module exposes `main(argv: list[str]) -> int`.
COMMANDS = {
    "app": ("hidream_ui.cli.app", "run the Gradio app (same flags as `python app.py`)"),
    "edit": ("hidream_ui.cli.edit", "edit one image from the command line; prints a JSON summary"),
    "doctor": ("hidream_ui.cli.doctor", "report versions, devices, dtypes and model paths; non-zero if the model cannot load"),
    "bench": ("hidream_ui.bench", "benchmarks: load | edit | attention | batch | app | soak (print JSON with --json)"),
    "make-tiny": ("hidream_ui.model.tiny.build", "build the offline random-weight HiDream checkpoint in the upstream layout"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m hidream_ui",
        description="HiDream-E1.1 / E1-Full image editing: app, CLI, diagnostics and benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        parser.error(f"unknown command {command!r}; choose from {', '.join(COMMANDS)}")
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
