"""The README stays a front page (under 250 lines) and every relative link in it and in docs/ leads
to a file that exists (and to a heading that exists, for `page.md#anchor` links). The README's install line,
seed default, the shipped model's held-out figures and the release's memory figures (README and docs/memory.md)
are checked against their sources: requirements.txt, the edit schema, trained.json and the planner."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors, fence = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return anchors


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def broken_links(pages: list[Path]) -> list[str]:
    broken = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{_name(page)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{_name(page)}: {target} (no such heading)")
    return broken


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < README_MAX_LINES, (
        f"README.md has {len(lines)} lines; move topics to docs/ (at most {README_MAX_LINES - 1})"
    )
    text = "\n".join(lines)
    assert "python -m pytest -q tests" in text  # the test command people copy
    assert "<!-- edit-flags:begin -->" in text and "<!-- edit-flags:end -->" in text


def test_every_relative_link_resolves():
    broken = broken_links(_pages())
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    (tmp_path / "other.md").write_text("# A title\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#a-title) [gone](missing.md) [bad](other.md#nope) [web](https://x.y)\n"
    )
    assert broken_links([page]) == [f"{page}: missing.md (no such file)", f"{page}: other.md#nope (no such heading)"]


def test_the_readmes_download_commands_exist_in_the_installed_huggingface_hub():
    """README's weight downloads name a console script that the huggingface_hub the requirements install
    really has (2.x ships `hf`; `huggingface-cli` is gone)."""
    from importlib.metadata import entry_points

    scripts = {
        entry.name for entry in entry_points(group="console_scripts") if entry.value.startswith("huggingface_hub")
    }
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    used = set(re.findall(r"(?:^|`)(hf|huggingface-cli) (?:download|auth|login)\b", text, flags=re.M))
    assert used and used <= scripts, f"README uses {sorted(used)}; huggingface_hub installs {sorted(scripts)}"


def _flat(path: Path) -> str:
    """A page's text with every run of white space one space (figures may wrap across lines)."""
    return " ".join(path.read_text(encoding="utf-8").split())


def test_the_readme_installs_the_cpu_torch_first():
    """A plain `pip install torch==X` on Linux pulls PyPI's CUDA build: the README's first command says how to get
    the CPU one, with the torch release requirements.txt pins, before the requirements."""
    pin = re.search(r"^torch==(\S+)", (ROOT / "requirements.txt").read_text(encoding="utf-8"), flags=re.M).group(1)
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    cpu = f"pip install torch=={pin} --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in text, f"README does not say `{cpu}`"
    assert text.index(cpu) < text.index("pip install -r requirements.txt")


def test_the_readme_quotes_the_shipped_models_held_out_figures():
    """README's success figures are the ones recorded with the shipped weights (assets/tiny_trained/trained.json)."""
    import json

    held = json.loads((ROOT / "assets" / "tiny_trained" / "trained.json").read_text(encoding="utf-8"))["held_out"]

    def pct(x: float) -> str:
        return f"{100 * x:.1f}".removesuffix(".0")

    expected = (
        f"on the {held['cases']} held-out edits of `bench quality` it succeeds on {pct(held['success'])} % "
        f"(recolour {pct(held['recolour'])} %, remove {pct(held['remove'])} %, background {pct(held['background'])} %; "
        f"untouched PSNR {held['untouched_psnr_median_db']:.1f} dB"
    )
    text = _flat(ROOT / "README.md")
    assert expected in text, f"README should say: {expected}"
    assert "minority" not in text  # an older sentence beside these figures


def test_the_readme_says_the_apps_seed_is_random():
    """The generated flag table's seed default is the `edit` command's; the app's form ticks "Random seed"."""
    from hidream_ui.edits import FIELD_SPECS

    text = _flat(ROOT / "README.md")
    assert FIELD_SPECS["randomize_seed"].default is True
    assert f"The seed default {FIELD_SPECS['seed'].default} is the `edit` command's" in text
    assert f"**{FIELD_SPECS['randomize_seed'].label}** is ticked by default" in text


@pytest.mark.slow
def test_the_release_memory_figures_are_the_planners():
    """README's hardware line and docs/memory.md's release figures are what the planner predicts for E1.1 at
    1024x1024 in bf16 (from the release configs; nothing is loaded)."""
    from hidream_ui.model.planner import estimate, margin, sizes_from_configs
    from hidream_ui.model.tiny.profiles import RELEASE_CONFIGS

    sizes = sizes_from_configs(RELEASE_CONFIGS)

    def gb(plan: str, weights: str, what: str = "peak") -> str:
        return f"{getattr(estimate(sizes, plan, weights, (1024, 1024), 2), what) / 1e9:.1f} GB"

    full_fp8 = estimate(sizes, "full", "fp8", (1024, 1024), 2).peak
    least = f"about {round((full_fp8 + margin(full_fp8)) / 1e9)} GB"
    readme, memory = _flat(ROOT / "README.md"), _flat(ROOT / "docs" / "memory.md")
    for fragment in (
        f"{least} of accelerator memory with every weight on the card (`full · fp8`, peak {gb('full', 'fp8')}",
        f"{gb('full', 'bf16')} in bf16",
        f"when {gb('encoders-offload', 'fp8', 'host')} of host RAM is free for the text encoders "
        f"(`encoders-offload · fp8`, peak {gb('encoders-offload', 'fp8')})",
        f"down to {gb('blocks', 'fp8')} streaming the transformer from {gb('blocks', 'fp8', 'host')} of host RAM",
    ):
        assert fragment in readme, f"README should say: {fragment}"
    for fragment in (
        f"`full` {gb('full', 'bf16')} ({gb('full', 'fp8')} with fp8)",
        f"`encoders-cpu` {gb('encoders-cpu', 'bf16')}",
        f"the same with fp8 {gb('encoders-offload', 'fp8')}",
        f"`blocks` {gb('blocks', 'fp8')} (fp8) / {gb('blocks', 'bf16')} (bf16), "
        f"`sequential` {gb('sequential', 'bf16')}",
        f"keep {gb('encoders-offload', 'bf16', 'host')} on the host, the streamed ones {gb('blocks', 'fp8', 'host')} "
        f"(fp8) / {gb('blocks', 'bf16', 'host')} (bf16)",
        f"the least it needs is {least}",
        f"`encoders-offload` fp8 on 24 GB (predicted {gb('encoders-offload', 'fp8')}",
    ):
        assert fragment in memory, f"docs/memory.md should say: {fragment}"
