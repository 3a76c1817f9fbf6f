"""History entries: what a browser keeps of its own results (gr.BrowserState, so it survives a
reload), and how the server reads them back.

An entry lives in the browser's storage, which the browser can rewrite, so everything read back
is checked, and only its first MAX_ENTRIES, each only as far as the keys read here (a request
of any length under the body limit costs no more than a full History): the settings are
validated like any request, the thumbnails must be small JPEG data URIs, and the result counts
only with the server's signature and while this server still serves it.

An entry never holds a server path. It names its result by an opaque id (`ServedResults.result_id`,
random, mapped to the file on the server) and carries a ticket: HMAC-SHA256 under this server
process's key of the id together with the browser's secret (`new_browser_secret`, made once per
browser and kept in its own storage beside the History). The ticket binds exactly those three:
an entry opens its result only in a browser holding the same secret, on the process that signed it
(once retention deleted the file, the entry keeps its settings only; a restart ends every ticket,
and gradio's BrowserState, encrypted under a key of each process, then reads as empty). Copied
into another browser (another secret), or made up, an entry shows "not on this server" and opens
nothing. It does not bind the rest of the entry (settings, thumbnails, time, chain: the browser's
own words, shown as such), and it cannot tell a browser from a copy of its whole storage: whoever
copies the secret with the entries is that browser. "Forget this browser's history" makes a new
secret, so copies of the old entries open nothing here either.
No gradio here: the History tab (history_tab.py) and the handlers use it.
"""

from __future__ import annotations

import base64
import html
import io
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from hidream_ui.edits import MAX_PROMPT_CHARS, SETTING_NAMES, EditParams, RequestError

MAX_ENTRIES = 30  # newest first; the oldest go (thumbnails are a few kB each in localStorage)
THUMB_SIDE = 160  # px, the longer side of a History thumbnail
MAX_THUMB_CHARS = 48_000  # a 160 px JPEG is ~5-10 kB; anything far larger is not ours
_THUMB = re.compile(r"data:image/jpeg;base64,[A-Za-z0-9+/]+={0,2}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# The browser's secret: secrets.token_urlsafe(32). Anything else the browser sends is replaced.
_SECRET = re.compile(r"[A-Za-z0-9_-]{43}")
# The params keys EditParams.from_dict reads: only these are looked at (a params mapping of any
# size costs a dozen lookups), and only scalars (a container would cost its repr in the error).
_PARAM_KEYS = ("instruction", "seed", *SETTING_NAMES)
_SCALARS = (str, int, float, bool, type(None))
# An opener: (result id, ticket) -> the result's path on this server, or None (ServedResults.stored
# with the browser's secret bound in).
Opener = Callable[[Any, Any], "str | None"]


def new_browser_secret() -> str:
    """A new random secret for one browser (kept in its own storage; see the module docstring)."""
    return secrets.token_urlsafe(32)


def browser_secret(value: Any) -> str:
    """The browser's secret as it sent it, or a new one when it has none (a first visit, storage
    cleared, or a restart: gradio's BrowserState then reads nothing) or sent something else."""
    return value if isinstance(value, str) and _SECRET.fullmatch(value) else new_browser_secret()


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


def new_entry(
    *,
    result: str | None,
    name: str | None,
    params: Mapping[str, Any],
    before: Any,
    after: Any,
    seconds: float | None = None,
    parent: Mapping[str, Any] | None = None,
    sha256: str | None = None,
) -> dict:
    """The History entry of a finished edit (JSON: it is stored in the browser), not yet signed
    (`signed` adds the ticket once the browser's secret is known). `result`: the result's opaque id
    (`ServedResults.result_id`), `name`: its file name, never its path. `parent`: the metadata's
    parent of the image it was made from, of which only the sha256 is kept; `sha256`: the saved
    PNG's own, so that an edit of this result (whose parent is this PNG) finds it: History draws the chain."""
    link = _sha(parent.get("sha256")) if isinstance(parent, Mapping) else None
    return {
        "result": result,
        "ticket": None,
        "name": name,
        "params": dict(params),
        "before": thumbnail(before),
        "after": thumbnail(after),
        "seconds": seconds,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "parent": {"sha256": link} if link else None,
        "sha256": sha256,
    }


def signed(entry: Mapping[str, Any], ticket: Callable[[str], str]) -> dict:
    """`entry` with its ticket for one browser (`ticket(result_id)`: ServedResults.ticket with the
    browser's secret bound in); an entry without a result stays unsigned."""
    result = entry.get("result")
    return {**entry, "ticket": ticket(result) if isinstance(result, str) else None}


@dataclass(frozen=True)
class CheckedEntry:
    """An entry read back from a browser and checked. `available`: its result is this server's,
    signed for this browser, and still served; `png` is then the result's path on this server
    (found from the entry's id, never read from the entry; kept server-side, in a gr.State)."""

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
        return " · ".join(
            f"{label} {fmt.format(values[key])}" for key, label, fmt in READABLE_SETTINGS if values.get(key) is not None
        )


def _thumb(value: Any) -> str | None:
    if isinstance(value, str) and len(value) <= MAX_THUMB_CHARS and _THUMB.fullmatch(value):
        return value
    return None


def _sha(value: Any) -> str | None:
    return value if isinstance(value, str) and _SHA256.fullmatch(value) else None


def _params(value: Any) -> EditParams | None:
    """An entry's settings, validated; None when they are not settings. Reads only the keys
    from_dict reads, and refuses containers and over-long text before validating."""
    if not isinstance(value, Mapping):
        return None
    read = {key: value[key] for key in _PARAM_KEYS if key in value}
    if any(
        not isinstance(item, _SCALARS) or (isinstance(item, str) and len(item) > MAX_PROMPT_CHARS)
        for item in read.values()
    ):
        return None
    try:
        return EditParams.from_dict(read)
    except (RequestError, TypeError, ValueError):
        return None


def _first(entries: Any) -> list:
    """The first MAX_ENTRIES items of the browser's list, before anything is looked at: the browser
    keeps no more (`added`), and a longer list costs no more than a full one."""
    return entries[:MAX_ENTRIES] if isinstance(entries, list) else []


def check_entries(entries: Any, opened: Opener) -> list[CheckedEntry]:
    """The browser's first MAX_ENTRIES entries, checked (`opened(result_id, ticket)`: the result's
    path when the ticket is this server's for this browser, else None: `ServedResults.stored` with
    the browser's secret bound in); entries that are not entries (wrong types, settings that do not
    validate) are left out. An entry of an older version (a `png` path, no id) keeps its settings only."""
    checked = []
    for entry in _first(entries):
        if not isinstance(entry, Mapping):
            continue
        params = _params(entry.get("params"))
        if params is None:
            continue
        png = opened(entry.get("result"), entry.get("ticket"))
        name = entry.get("name") if isinstance(entry.get("name"), str) else ""
        moment = entry.get("time") if isinstance(entry.get("time"), str) else ""
        parent = entry.get("parent") if isinstance(entry.get("parent"), Mapping) else {}
        checked.append(
            CheckedEntry(
                params=params,
                png=png,
                available=png is not None,
                before=_thumb(entry.get("before")),
                after=_thumb(entry.get("after")),
                time=moment[:19],
                name=name[:120],
                sha256=_sha(entry.get("sha256")),
                parent_sha256=_sha(parent.get("sha256")),
            )
        )
    return checked


def added(entries: Any, entry: Mapping[str, Any] | None) -> list:
    """The browser's list with `entry` first (newest first), at most MAX_ENTRIES."""
    kept = [e for e in _first(entries) if isinstance(e, Mapping)]
    return ([dict(entry)] if entry else []) + kept[: MAX_ENTRIES - (1 if entry else 0)]


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
    parent = {
        index: by_sha.get(entry.parent_sha256)
        for index, entry in enumerate(entries)
        if entry.parent_sha256 is not None and by_sha.get(entry.parent_sha256) not in (None, index)
    }

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
        return (
            '<div class="hui-history"><p class="hui-h-empty">No results yet in this browser. '
            "Your edits appear here, and stay after a reload.</p></div>"
        )
    cards = []
    links = chains(entries)
    for number, entry in enumerate(entries, start=1):
        gone = "" if entry.available else ('<div class="hui-h-gone">no longer on this server: settings only</div>')
        chain = _chain_text(links.get(number - 1), entries)
        cards.append(
            f'<div class="hui-h-card" data-entry="{number}">'
            f'<div class="hui-h-number">{number}</div>'
            f'<div class="hui-h-pair">{_img(entry.before, "before")}<span>→</span>{_img(entry.after, "after")}</div>'
            f'<div class="hui-h-text"><div class="hui-h-instruction">{html.escape(entry.params.instruction)}</div>'
            f'{chain}<div class="hui-h-settings">{html.escape(entry.readable_settings())}</div>'
            f'<div class="hui-h-time">{html.escape(entry.time)}</div>{gone}</div></div>'
        )
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


__all__ = [
    "ChainLink",
    "CheckedEntry",
    "HISTORY_CSS",
    "MAX_ENTRIES",
    "Opener",
    "READABLE_SETTINGS",
    "added",
    "browser_secret",
    "chains",
    "check_entries",
    "new_browser_secret",
    "new_entry",
    "picker_choices",
    "render_entries",
    "signed",
    "thumbnail",
]
