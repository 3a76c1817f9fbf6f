"""History entries: what a browser keeps of its own results (gr.BrowserState, so it survives a
reload), and how the server reads them back.

An entry lives in the browser's storage, which the browser can rewrite, so everything read back
is checked: the settings are validated like any request, the thumbnails must be small JPEG data
URIs, and the result path counts only with the server's signature (`ServedResults.ticket`) and
while this server still serves it. A forged or foreign path is shown as "not on this server" and
is never opened. No gradio here: the History tab (history_tab.py) and the handlers use it.
"""

from __future__ import annotations

import base64
import html
import io
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from hidream_ui.edits import EditParams, RequestError

MAX_ENTRIES = 30  # newest first; the oldest go (thumbnails are a few kB each in localStorage)
THUMB_SIDE = 160  # px, the longer side of a History thumbnail
MAX_THUMB_CHARS = 48_000  # a 160 px JPEG is ~5-10 kB; anything far larger is not ours
_THUMB = re.compile(r"data:image/jpeg;base64,[A-Za-z0-9+/]+={0,2}")
_SHA256 = re.compile(r"[0-9a-f]{64}")

# The settings shown under each entry: (params key, label, format).
READABLE_SETTINGS = (
    ("guidance_scale", "guidance", "{:g}"),
    ("image_guidance_scale", "image guidance", "{:g}"),
    ("num_inference_steps", "steps", "{}"),
    ("refine_strength", "refine", "{:g}"),
    ("working_resolution", "resolution", "{}"),
    ("seed", "seed", "{}"),
)


def thumbnail(image: Any, side: int = THUMB_SIDE) -> str:
    """A small JPEG data URI of a PIL image (the before or the after of an entry)."""
    picture = image.convert("RGB")
    picture.thumbnail((side, side))
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def new_entry(*, png: str | None, ticket: str | None, params: Mapping[str, Any], before: Any, after: Any,
              seconds: float | None = None, parent: Mapping[str, Any] | None = None,
              sha256: str | None = None) -> dict:
    """The History entry of a finished edit (JSON: it is stored in the browser). `parent`: the
    metadata's {file, sha256, of} of the image it was made from; `sha256`: the saved PNG's own, so
    that an edit of this result (whose parent is this PNG) finds it: History draws the chain."""
    return {
        "png": png, "ticket": ticket, "name": Path(png).name if png else None,
        "params": dict(params), "before": thumbnail(before), "after": thumbnail(after),
        "seconds": seconds, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "parent": parent, "sha256": sha256,
    }


@dataclass(frozen=True)
class CheckedEntry:
    """An entry read back from a browser and checked. `available`: the result file is this
    server's, signed for this browser's entry, and still served."""

    params: EditParams
    png: str | None
    available: bool
    before: str | None
    after: str | None
    time: str
    name: str
    sha256: str | None = None  # the result PNG's (what an edit of it names as its parent)
    parent_sha256: str | None = None  # the image it was made from (an earlier result's PNG, or an upload)

    def readable_settings(self) -> str:
        values = self.params.to_dict()
        return " · ".join(f"{label} {fmt.format(values[key])}" for key, label, fmt in READABLE_SETTINGS
                          if values.get(key) is not None)


def _thumb(value: Any) -> str | None:
    if isinstance(value, str) and len(value) <= MAX_THUMB_CHARS and _THUMB.fullmatch(value):
        return value
    return None


def _sha(value: Any) -> str | None:
    return value if isinstance(value, str) and _SHA256.fullmatch(value) else None


def check_entries(entries: Any, stored) -> list[CheckedEntry]:
    """The browser's entries, checked (`stored(path, ticket)`: `ServedResults.stored`); entries that
    are not entries (wrong types, settings that do not validate) are left out."""
    checked = []
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, Mapping):
            continue
        try:
            params = EditParams.from_dict(entry.get("params"))
        except (RequestError, TypeError, ValueError):
            continue
        png = entry.get("png") if isinstance(entry.get("png"), str) else None
        available = png is not None and stored(png, entry.get("ticket"))
        name = entry.get("name") if isinstance(entry.get("name"), str) else ""
        moment = entry.get("time") if isinstance(entry.get("time"), str) else ""
        parent = entry.get("parent") if isinstance(entry.get("parent"), Mapping) else {}
        checked.append(CheckedEntry(params=params, png=png if available else None, available=available,
                                    before=_thumb(entry.get("before")), after=_thumb(entry.get("after")),
                                    time=moment[:19], name=name[:120], sha256=_sha(entry.get("sha256")),
                                    parent_sha256=_sha(parent.get("sha256"))))
        if len(checked) >= MAX_ENTRIES:
            break
    return checked


def added(entries: Any, entry: Mapping[str, Any] | None) -> list:
    """The browser's list with `entry` first (newest first), at most MAX_ENTRIES."""
    kept = [e for e in (entries if isinstance(entries, list) else []) if isinstance(e, Mapping)]
    return ([dict(entry)] if entry else []) + kept[:MAX_ENTRIES - (1 if entry else 0)]


@dataclass(frozen=True)
class ChainLink:
    """Where an entry sits in a chain of edits ("Edit the result", "Edit again") that this History
    holds: edit `step` of `length`; `parent` is the index of the entry it was made from (None: the
    chain starts here)."""

    step: int
    length: int
    parent: int | None


def chains(entries: list[CheckedEntry]) -> dict[int, ChainLink]:
    """The chains among `entries` (newest first): index -> ChainLink, for entries in a chain of two
    or more. An entry's parent is the entry whose result PNG it was made from (its sha256). The
    browser's storage can say anything: links form no loop here (a visited set), each entry has one
    parent, and only entries of this list are named."""
    by_sha: dict[str, int] = {}
    for index, entry in enumerate(entries):
        if entry.sha256 is not None:
            by_sha.setdefault(entry.sha256, index)
    parent = {index: by_sha.get(entry.parent_sha256) for index, entry in enumerate(entries)
              if entry.parent_sha256 is not None and by_sha.get(entry.parent_sha256) not in (None, index)}

    def ancestry(index: int) -> list[int]:  # index, its parent, its parent's parent, ... (no loops)
        line, seen = [index], {index}
        while line[-1] in parent and parent[line[-1]] not in seen:
            seen.add(parent[line[-1]])
            line.append(parent[line[-1]])
        return line

    lines = {index: ancestry(index) for index in range(len(entries))}
    length: dict[int, int] = {}  # root -> the longest chain from it
    for line in lines.values():
        length[line[-1]] = max(length.get(line[-1], 1), len(line))
    links = {}
    for index, line in lines.items():
        total = length[line[-1]]
        if total >= 2:
            links[index] = ChainLink(step=len(line), length=total, parent=line[1] if len(line) > 1 else None)
    return links


def _chain_text(link: ChainLink | None, entries: list[CheckedEntry]) -> str:
    if link is None:
        return ""
    text = f"edit {link.step} of a chain of {link.length}"
    if link.parent is not None:
        instruction = " ".join(entries[link.parent].params.instruction.split())
        instruction = instruction if len(instruction) <= 80 else instruction[:79] + "…"
        text += f" · from result {link.parent + 1}: “{instruction}”"
    return f'<div class="hui-h-chain">{html.escape(text)}</div>'


def _img(src: str | None, alt: str) -> str:
    if src is None:
        return f'<div class="hui-h-missing">{html.escape(alt)}</div>'
    return f'<img src="{src}" alt="{html.escape(alt)}">'


def render_entries(entries: list[CheckedEntry]) -> str:
    """HTML cards, newest first: number, before → after, instruction, readable settings."""
    if not entries:
        return ('<div class="hui-history"><p class="hui-h-empty">No results yet in this browser. '
                "Your edits appear here, and stay after a reload.</p></div>")
    cards = []
    links = chains(entries)
    for number, entry in enumerate(entries, start=1):
        gone = "" if entry.available else ('<div class="hui-h-gone">no longer on this server: '
                                           "settings only</div>")
        chain = _chain_text(links.get(number - 1), entries)
        cards.append(
            f'<div class="hui-h-card" data-entry="{number}">'
            f'<div class="hui-h-number">{number}</div>'
            f'<div class="hui-h-pair">{_img(entry.before, "before")}<span>→</span>{_img(entry.after, "after")}</div>'
            f'<div class="hui-h-text"><div class="hui-h-instruction">{html.escape(entry.params.instruction)}</div>'
            f'{chain}<div class="hui-h-settings">{html.escape(entry.readable_settings())}</div>'
            f'<div class="hui-h-time">{html.escape(entry.time)}</div>{gone}</div></div>')
    return '<div class="hui-history">' + "".join(cards) + "</div>"


def picker_choices(entries: list[CheckedEntry]) -> list[tuple[str, int]]:
    """(label, index) for the History's result picker."""
    choices = []
    for number, entry in enumerate(entries, start=1):
        text = " ".join(entry.params.instruction.split())
        text = text if len(text) <= 60 else text[:59] + "…"
        choices.append((f"{number}. {text} · seed {entry.params.seed}", number - 1))
    return choices


HISTORY_CSS = """
.hui-history { display: flex; flex-direction: column; gap: 0.5em; }
.hui-h-card { display: flex; gap: 0.8em; align-items: center; border: 1px solid rgba(127,127,127,0.25);
              border-radius: 8px; padding: 0.4em 0.6em; }
.hui-h-number { font-weight: 700; min-width: 1.6em; text-align: center; opacity: 0.7; }
.hui-h-pair { display: flex; align-items: center; gap: 0.3em; flex-shrink: 0; }
.hui-h-pair img, .hui-h-missing { width: 96px; height: 96px; object-fit: contain; border-radius: 4px;
                                  background: rgba(127,127,127,0.12); }
.hui-h-missing { display: flex; align-items: center; justify-content: center; font-size: 0.75em; }
.hui-h-text { min-width: 0; overflow-wrap: anywhere; }
.hui-h-instruction { font-weight: 600; }
.hui-h-settings, .hui-h-time { font-size: 0.85em; opacity: 0.8; }
.hui-h-chain { font-size: 0.85em; color: var(--color-accent, #6366f1); }
.hui-h-gone { font-size: 0.85em; color: #b45309; }
@media (max-width: 640px) { .hui-h-card { flex-wrap: wrap; } .hui-h-text { flex-basis: 100%; }
                            .hui-h-pair img, .hui-h-missing { width: 80px; height: 80px; } }
"""


__all__ = ["ChainLink", "CheckedEntry", "HISTORY_CSS", "MAX_ENTRIES", "READABLE_SETTINGS", "added", "chains",
           "check_entries", "new_entry", "picker_choices", "render_entries", "thumbnail"]
