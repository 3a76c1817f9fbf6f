"""The `batch --manifest` file: one JSON object a line, read into checked items (no torch here).

A line names `image` (relative paths resolve against the manifest's folder), `instruction`, and
optionally `seed`, `mask`, `id` (a name for the output file), `meta` (anything, copied to the
results) and any edit setting by its API name (`hidream_ui.edits.SETTING_NAMES`: guidance_scale,
num_inference_steps, ...). A line that cannot be used (bad JSON, a missing image, an unknown key,
a value out of range) becomes a `BadLine` naming its line number and why: reported and skipped,
never fatal.

Each item gets a settings hash over everything that decides its pixels (the source's bytes, the
mask's bytes, the params with the seed, the model configuration); the output is
`<id or image stem>-<hash>.png`, so a rerun finds the items already finished by their file
name alone, whatever order the lines are in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from hidream_ui.edits import SEED_MAX, SETTING_NAMES, EditParams, RequestError

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.config import AppConfig

PASS_THROUGH = ("id", "meta")  # keys kept with the item, not edit settings
KNOWN_KEYS = ("image", "instruction", "seed", "mask", *PASS_THROUGH, *SETTING_NAMES)
MAX_LINE_CHARS = 64 * 1024  # a manifest line is a few hundred characters; a megabyte line is a mistake
HASH_CHARS = 16
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class BadLine:
    line: int  # 1-based line number in the manifest
    text: str  # the line (cut to 200 characters)
    error: str

    def row(self) -> dict[str, Any]:
        """Its row of results.jsonl."""
        return {
            "line": self.line,
            "input": self.text,
            "output": None,
            "seed": None,
            "status": "error",
            "error": f"line {self.line}: {self.error}",
            "timings": None,
        }


@dataclass(frozen=True)
class ManifestItem:
    """One checked line: everything a worker needs to run it (plain, picklable values)."""

    line: int
    raw: dict[str, Any]  # the line as given (for results.jsonl)
    image: Path  # resolved
    params: EditParams  # validated, seed concrete (the mask is opened when the item runs)
    mask: Path | None
    settings_hash: str
    stem: str  # the output's file name without .png
    source_sha256: str  # of the image file's bytes: the result's `parent`, as the Edit tab records it

    @property
    def output_name(self) -> str:
        return f"{self.stem}.png"


def file_digest(path: Path, cache: dict[Path, str]) -> str:
    """sha256 of a file's bytes (once per file per manifest: benchmarks reuse one image for many lines)."""
    if path not in cache:
        digest = hashlib.sha256()
        with open(path, "rb") as fp:
            for block in iter(lambda: fp.read(1 << 20), b""):
                digest.update(block)
        cache[path] = digest.hexdigest()
    return cache[path]


def model_identity(config: "AppConfig") -> dict[str, Any]:
    """The configuration that decides the pixels besides the params (not the device: the same
    settings on another device or cluster count as done)."""
    return {
        "variant": config.variant,
        "model_dir": str(config.model_dir) if config.model_dir else None,
        "llama": config.llama,
        "i1": config.i1,
        "e1": config.e1,
        "transformer_file": str(config.transformer_file) if config.transformer_file else None,
        "tiny": [config.tiny_profile, config.tiny_seed] if config.uses_tiny_model else None,
        "dtype": config.dtype,
        "weights": config.weights,
        "refiner": config.refiner,
        "cache": config.cache,
    }


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _safe_stem(text: str) -> str:
    stem = _UNSAFE.sub("_", text).strip("._-")[:60]
    return stem or "item"


def parse_line(line_no: int, text: str, folder: Path, config: "AppConfig", digests: dict[Path, str]) -> ManifestItem:
    """One line to an item; ValueError (RequestError, OSError text) with the reason otherwise."""
    if len(text) > MAX_LINE_CHARS:
        raise ValueError(f"{len(text)} characters; at most {MAX_LINE_CHARS} per line")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"expected a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(KNOWN_KEYS)}")
    image = _existing_file(raw, "image", folder, required=True)
    mask = _existing_file(raw, "mask", folder, required=False)
    values = {
        **EditParams.defaults_for(config.variant).to_dict(),
        **{key: value for key, value in raw.items() if key in SETTING_NAMES or key in ("instruction", "seed")},
    }
    if "instruction" not in raw:
        raise RequestError("instruction", None, "an editing instruction")
    params = EditParams.from_dict(values)
    source_digest = file_digest(image, digests)
    mask_digest = file_digest(mask, digests) if mask is not None else None
    if params.seed == -1:
        # Random, but drawn from the line's content: a rerun draws the same seed and finds its output.
        basis = _canonical({"image": source_digest, "mask": mask_digest, "params": params.to_dict()})
        seed = int.from_bytes(hashlib.sha256(basis.encode()).digest()[:8], "big") % (SEED_MAX + 1)
        params = dataclasses.replace(params, seed=seed).validated()
    settings_hash = hashlib.sha256(
        _canonical(
            {
                "image": source_digest,
                "mask": mask_digest,
                "params": params.to_dict(),
                "model": model_identity(config),
            }
        ).encode()
    ).hexdigest()[:HASH_CHARS]
    name = raw.get("id")
    stem = _safe_stem(str(name) if name is not None else image.stem)
    return ManifestItem(
        line=line_no,
        raw=raw,
        image=image,
        params=params,
        mask=mask,
        settings_hash=settings_hash,
        stem=f"{stem}-{settings_hash}",
        source_sha256=source_digest,
    )


def _existing_file(raw: dict[str, Any], key: str, folder: Path, *, required: bool) -> Path | None:
    value = raw.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise RequestError(key, value, "a file path (relative paths start at the manifest's folder)")
    path = Path(value).expanduser()
    path = path if path.is_absolute() else folder / path
    if not path.is_file():
        raise ValueError(f"{key}: no file at {str(path)!r}")
    return path


def read_manifest(path: Path, config: "AppConfig") -> tuple[list[ManifestItem], list[BadLine]]:
    """Every line of the manifest: the items to run and the bad lines (blank lines and lines
    starting with `#` are ignored). OSError only when the manifest itself cannot be read."""
    items, bad = [], []
    digests: dict[Path, str] = {}
    folder = path.resolve().parent
    for line_no, text in _lines(path):
        stripped = text.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            items.append(parse_line(line_no, stripped, folder, config, digests))
        except (ValueError, OSError) as exc:  # RequestError is a ValueError
            bad.append(BadLine(line=line_no, text=stripped[:200], error=str(exc)))
    return items, bad


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8", errors="replace") as fp:
        for line_no, text in enumerate(fp, start=1):
            yield line_no, text


__all__ = [
    "BadLine",
    "KNOWN_KEYS",
    "ManifestItem",
    "file_digest",
    "model_identity",
    "parse_line",
    "read_manifest",
]
