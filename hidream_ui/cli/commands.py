"""Dispatch of a command table (`python -m hidream_ui <command>`, `... bench <kind>`).

A table maps a name to (module, one-line help); the module exposes `main(argv) -> int` and is
imported only when its command runs, so `--help` stays instant (no torch, no gradio).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Mapping, Sequence

CommandTable = Mapping[str, tuple[str, str]]

# Said instead of a ModuleNotFoundError traceback when torch is missing (torch is not in
# requirements.txt on purpose: a bare `torch` requirement pulls a multi-GB CUDA build).
NO_TORCH = (
    "error: torch is not installed in this Python ({python}). Install it first: "
    "`pip install torch==2.13.0` (CPU build) or a CUDA build from pytorch.org; for Ascend NPUs the "
    "torch and torch_npu versions of docs/npu.md. Then `pip install -r requirements.txt`."
)


def run_main(main: Callable[[list[str]], int | None], argv: Sequence[str]) -> int:
    """`main(argv)`, with a missing torch reported in one line (exit 1) instead of a traceback."""
    try:
        return int(main(list(argv)) or 0)
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        print(NO_TORCH.format(python=sys.executable), file=sys.stderr)
        return 1


def dispatch(table: CommandTable, argv: Sequence[str], *, prog: str, description: str, what: str = "command") -> int:
    """Runs `argv[0]`'s module with the rest of `argv`. No argument: usage, exit 2; `-h`: usage,
    exit 0; an unknown name: argparse's one-line error, exit 2."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest=what, metavar=what.upper())
    for name, (_, help_text) in table.items():
        sub.add_parser(name, help=help_text, add_help=False)
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in table:
        parser.error(f"unknown {what} {name!r}; choose from {', '.join(table)}")
    module = importlib.import_module(table[name][0])
    return run_main(module.main, rest)


__all__ = ["NO_TORCH", "CommandTable", "dispatch", "run_main"]
