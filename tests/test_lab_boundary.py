"""The lab (hidream_ui/lab/: training, probes, scoring, the world's ground truth) stays out of the runtime.

Read from the source with `ast`, as the import-graph test reads it (nothing is imported; imports inside
functions count, `if TYPE_CHECKING:` blocks do not): no module under hidream_ui/ but lab/ and bench/ imports
hidream_ui.lab. The `train-tiny` entry of `python -m hidream_ui`'s command table names the lab's module as a
string, which is not an import: that command imports the lab only when it runs.
"""

from __future__ import annotations

from pathlib import Path

from test_import_graph import PACKAGE, ROOT, import_graph

LAB = f"{PACKAGE}.lab"
# May import the lab: the lab itself and the benchmarks (bench quality scores with the world's rule).
ALLOWED = (LAB, f"{PACKAGE}.bench")


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def lab_imports(root: Path = ROOT) -> dict[str, list[str]]:
    """{runtime module: the lab modules it imports}, for every module outside ALLOWED that imports the lab."""
    graph = import_graph(root)
    found = {}
    for name, targets in sorted(graph.items()):
        if any(_inside(name, allowed) for allowed in ALLOWED):
            continue
        into_lab = sorted(t for t in targets if _inside(t, LAB))
        if into_lab:
            found[name] = into_lab
    return found


def test_the_runtime_never_imports_the_lab():
    found = lab_imports()
    assert not found, "runtime modules that import the lab (research code the app must not carry):\n" + "\n".join(
        f"{name} -> {', '.join(targets)}" for name, targets in found.items()
    )


def test_the_lab_exists_and_train_tiny_runs_it():
    """What the boundary guards is there: the lab package, and the command that reaches it by name only."""
    from hidream_ui.__main__ import COMMANDS

    assert (ROOT / "lab" / "__init__.py").is_file() and (ROOT / "lab" / "train" / "cli.py").is_file()
    assert COMMANDS["train-tiny"][0] == f"{LAB}.train.cli"


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    """The checker itself: a runtime module importing the lab inside a function is caught, by either form of
    import; the lab and the benchmarks may import it; a TYPE_CHECKING import and a string are not imports."""
    pkg = tmp_path / PACKAGE
    for folder in ("lab", "bench", "ui"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "lab" / "world.py").write_text("")
    (pkg / "lab" / "train.py").write_text("from hidream_ui.lab import world\n")
    (pkg / "bench" / "quality.py").write_text("from hidream_ui.lab import world\n")
    (pkg / "ui" / "tab.py").write_text("def f():\n    from hidream_ui.lab import world\n")
    (pkg / "ui" / "other.py").write_text("import hidream_ui.lab.world\n")
    (pkg / "ui" / "fine.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hidream_ui.lab import world\n"
        "COMMAND = 'hidream_ui.lab.train'\n"
    )
    assert lab_imports(pkg) == {
        f"{PACKAGE}.ui.other": [f"{LAB}.world"],
        f"{PACKAGE}.ui.tab": [f"{LAB}.world"],
    }
