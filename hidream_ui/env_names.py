"""Environment variables that were renamed, and the one reader that honours both names.

Three names were easy to mix up (issue 53): `HIDREAM_CACHE` (the step cache of edits),
`HIDREAM_UI_CACHE` (where the offline model is built) and `HIDREAM_CACHE_MAX_*` (Gradio's
upload/result cache). Each has a clear name now; the old one still works, says once per process
that it is deprecated and which name replaces it, and is refused only when both are set to
different values (which one was meant is then not ours to guess). CHANGELOG.md lists the renames.

Standard library only: the config and the model builder (model/tiny/build.py) read through here.
"""

from __future__ import annotations

import os
import warnings
from types import MappingProxyType
from typing import Mapping

# old name -> new name
RENAMED_VARIABLES: Mapping[str, str] = MappingProxyType(
    {
        "HIDREAM_CACHE": "HIDREAM_STEP_CACHE",
        "HIDREAM_UI_CACHE": "HIDREAM_MODEL_CACHE",
        "HIDREAM_CACHE_MAX_FILES": "HIDREAM_UPLOAD_CACHE_MAX_FILES",
        "HIDREAM_CACHE_MAX_MB": "HIDREAM_UPLOAD_CACHE_MAX_MB",
        "HIDREAM_CACHE_MAX_AGE": "HIDREAM_UPLOAD_CACHE_MAX_AGE",
    }
)
OLD_NAMES: Mapping[str, str] = MappingProxyType({new: old for old, new in RENAMED_VARIABLES.items()})
# Where the offline model is built, and other downloads of the app's own (model/tiny/build.py).
MODEL_CACHE_VARIABLE = "HIDREAM_MODEL_CACHE"

_warned: set[str] = set()


class RenamedVariableError(ValueError):
    """A variable and its deprecated old name are both set, to different values."""


def read_variable(name: str, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(the variable it came from, its value stripped) for `name`, else for its deprecated old name
    (warning once that it is deprecated); None when neither is set (blank counts as not set).
    RenamedVariableError, naming both, when both are set to different values."""
    environ = os.environ if environ is None else environ
    value = environ.get(name, "").strip()
    old = OLD_NAMES.get(name)
    old_value = environ.get(old, "").strip() if old is not None else ""
    if old_value and value and old_value != value:
        raise RenamedVariableError(
            f"{name}={value!r} and its deprecated old name {old}={old_value!r} are both set, to different "
            f"values: keep {name} only"
        )
    if value:
        return name, value
    if old_value:
        warn_deprecated(old)
        return old, old_value
    return None


def warn_deprecated(old: str) -> None:
    """Once per process and name: `old` is deprecated, set its new name instead."""
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(
        f"{old} is deprecated: set {RENAMED_VARIABLES[old]} instead (same meaning and values); "
        f"{old} still works for now",
        FutureWarning,
        stacklevel=3,
    )


def model_cache_variable(environ: Mapping[str, str] | None = None) -> str | None:
    """The folder `HIDREAM_MODEL_CACHE` (or the deprecated `HIDREAM_UI_CACHE`) names, or None."""
    found = read_variable(MODEL_CACHE_VARIABLE, environ)
    return found[1] if found else None
