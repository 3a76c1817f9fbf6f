"""docs/development.md's project layout is true: every module of the package is named under its folder,
every module it names exists, and no module is over the size the layout promises (issue 53).

The layout is the fenced block under "## Project layout". Inside it, a line indented by two spaces starts an
entry of `hidream_ui/`: one or more top-level modules (`config.py config_table.py`) or a folder (`engine/`).
A folder's entry runs until the next entry; its text names the folder's modules as `name.py`, modules of a
subfolder as `sub/name.py`, and several at once as `sub/{a,b}.py`.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hidream_ui"
PAGE = ROOT / "docs" / "development.md"
MAX_MODULE_LINES = 600  # issue 53: no module over 600 lines (after `ruff format`)
ENTRY = re.compile(r"^  (\S.*?)\s{2,}")
NAMED = re.compile(r"(?<![\w/.])((?:[a-z_0-9]+/)*)(?:\{([a-z_0-9,\s]+)\}|([a-z_0-9]+))\.py\b")


def layout_block(text: str) -> list[str]:
    section = text.split("## Project layout", 1)[1]
    return section.split("```", 2)[1].splitlines()


def named_modules(lines: list[str]) -> tuple[set[str], list[str]]:
    """(package-relative paths the layout names, folder entries) from the block's `hidream_ui/` part."""
    named: set[str] = set()
    texts: dict[str, str] = {}  # folder entry -> its text, continuation lines joined (a {group} may wrap)
    folder: str | None = None
    inside = False
    for line in lines:
        if line.startswith("hidream_ui/"):
            inside = True
            continue
        if inside and line and not line.startswith(" "):
            break  # the next top-level entry (assets/, tests/)
        if not inside:
            continue
        entry = ENTRY.match(line)
        text = line
        if entry:
            head, text = entry.group(1), line[entry.end() :]
            folder = head if head.endswith("/") else None
            if folder is None:
                named.update(name for name in head.split() if name.endswith(".py"))
                continue
            texts[folder] = ""
        if folder is not None:
            texts[folder] += " " + text.strip()
    for folder, text in texts.items():
        for prefix, group, single in NAMED.findall(text):
            for stem in group.replace(" ", "").split(",") if group else [single]:
                if stem and not stem.startswith("__"):  # __init__.py: every folder has one
                    named.add(f"{folder}{prefix}{stem}.py")
    return named, list(texts)


def package_modules() -> set[str]:
    return {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py" and "__pycache__" not in path.parts
    }


def layout_problems(text: str, modules: set[str]) -> list[str]:
    named, folders = named_modules(layout_block(text))
    problems = [f"{name}: in the package, not in docs/development.md's layout" for name in sorted(modules - named)]
    problems += [
        f"{name}: named in docs/development.md's layout, not in the package" for name in sorted(named - modules)
    ]
    real_folders = {str(Path(m).parts[0]) + "/" for m in modules if len(Path(m).parts) > 1}
    problems += [f"{f}: a folder of the package without its entry" for f in sorted(real_folders - set(folders))]
    return problems


def test_the_layout_names_every_module_and_only_modules_that_exist():
    assert layout_problems(PAGE.read_text(encoding="utf-8"), package_modules()) == []


def test_the_layout_check_sees_a_missing_and_a_stale_module():
    text = PAGE.read_text(encoding="utf-8")
    modules = package_modules()
    problems = layout_problems(text, modules | {"engine/teleport.py"})
    assert problems == ["engine/teleport.py: in the package, not in docs/development.md's layout"]
    stale = text.replace("runner.py (the one job runner", "runner.py rerunner.py (the one job runner", 1)
    assert layout_problems(stale, modules) == [
        "engine/rerunner.py: named in docs/development.md's layout, not in the package"
    ]
    braces = text.replace("attention/{registry,", "attention/{", 1)
    assert layout_problems(braces, modules) == [
        "pipeline/attention/registry.py: in the package, not in docs/development.md's layout"
    ]


def test_no_module_is_over_the_size_the_layout_promises():
    long = {
        str(path.relative_to(PACKAGE)): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"
