"""Dispatch of a command table (`python -m hidream_ui <command>`, `... bench <kind>`).

A table maps a name to (module, one-line help); the module exposes `main(argv) -> int` and is
imported only when its command runs, so `--help` stays instant (no torch, no gradio).
"""

from __future__ import annotations

import argparse
import importlib
from typing import Mapping, Sequence

CommandTable = Mapping[str, tuple[str, str]]


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
    return int(module.main(rest) or 0)


__all__ = ["CommandTable", "dispatch"]
