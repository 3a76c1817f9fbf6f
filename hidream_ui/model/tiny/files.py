"""Small deterministic writers the tiny builder shares (JSON, text, file modes)."""

from __future__ import annotations

import json
import stat
import uuid
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------------------------
# Small writers


def _json_text(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_json_text(obj), encoding="utf-8")


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _library_versions() -> tuple[str, str]:
    import diffusers
    import transformers

    return diffusers.__version__, transformers.__version__


def _default_file_mode(folder: Path) -> int:
    """The mode a plain new file gets here (0o644 under the usual umask). safetensors writes through a private
    temporary file and would leave the weights 0o600, unlike every other file of the tree."""
    probe = folder / f".mode-probe-{uuid.uuid4().hex[:8]}"
    probe.touch()
    try:
        return stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink()
