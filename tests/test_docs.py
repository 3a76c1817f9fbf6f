"""The README stays a front page (under 250 lines) and every relative link in it and in docs/ leads
to a file that exists (and to a heading that exists, for `page.md#anchor` links)."""

from __future__ import annotations

import re
from pathlib import Path

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
