"""`UploadGate`: which client paths the app may open.

The Edit, Batch and Compare events run with ``preprocess=False`` (so a damaged file gets our clear
per-file message instead of gradio's), which means the handler receives whatever path a raw API
client writes. The gate opens a path only when gradio stored it for this app (an upload through
it, or its copy of an example) or when it lies in a folder the app trusts (the bundled examples),
or when it is gradio's cached copy of a result the app serves (a result handed back: "Edit the
result", History's "Edit again"; the app then opens its own file). Anything else gets one generic
message that says nothing about whether the file exists; a file the app stored and has since
aged out gets "expired, upload it again" (`PictureExpired`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from hidream_ui.edits import NO_FILE, RequestError, cap_name

logger = logging.getLogger(__name__)

NOT_UPLOADED = "a file uploaded to this app (upload it again)"
# A file the app did store for a client, aged out since (client_storage.ClientStorage): the page still shows it.
EXPIRED = "This picture has expired on the server: upload it again."


class PictureExpired(RequestError):
    """A client names a file the app stored for it and has since removed to make room (it aged out).
    Not a failure of the client's: the UI says so in those words (`EXPIRED`)."""

    def __init__(self, field: str, name: str | None):
        super().__init__(field, name or "upload", EXPIRED)

    def __reduce__(self):  # its own two-argument constructor (RequestError's takes three)
        return (type(self), (self.field, self.value))

    def __str__(self) -> str:
        return EXPIRED


class UploadGate:
    """Turns a client's file value into (path, display name), refusing paths the app did not get.

    `is_stored(path)` says whether gradio stored that exact path for this app; `roots` are
    folders whose files anyone may use (the bundled examples). Values that are not paths (PIL
    images, numpy arrays from Python callers) pass through untouched.
    """

    def __init__(
        self,
        is_stored: Callable[[str], bool],
        roots: Iterable[str | os.PathLike] = (),
        result_of: Callable[[str], str | None] | None = None,
        expired: Callable[[str], bool] | None = None,
    ):
        self._is_stored = is_stored
        # `expired(path)`: the app stored `path` for a client and the pruning has removed it since.
        self._expired = expired
        self._roots = [os.path.realpath(r) for r in roots]
        # `result_of(path)`: the app's own result file when `path` is gradio's copy of it (else None).
        self._result_of = result_of

    def allows(self, path: str | os.PathLike) -> bool:
        text = os.fspath(path)
        if self._is_stored(text):
            return True
        real = os.path.realpath(text)
        return any(real == root or real.startswith(root + os.sep) for root in self._roots)

    def path(self, value: Any, field: str = "image") -> tuple[Any, str | None]:
        """(something `open_image` / `open()` reads, the user's file name) for one file value.

        FileData dicts (what ``preprocess=False`` hands over) and FileData-like objects carry the
        user's name in `orig_name`; a refused path raises RequestError naming only the user's
        name, never the path (that would confirm the file exists).
        """
        if value is None:
            raise RequestError(field, None, NO_FILE)
        if isinstance(value, Mapping):
            path, name = value.get("path"), value.get("orig_name")
            if not path:
                raise RequestError(
                    field, value.get("orig_name") or "upload", "an uploaded file (the upload did not arrive)"
                )
        elif isinstance(value, (str, os.PathLike)):
            path, name = value, None
        elif isinstance(getattr(value, "path", None), (str, os.PathLike)):
            path, name = value.path, getattr(value, "orig_name", None)
        else:
            return value, None  # PIL / numpy from Python callers: no file is opened
        if not isinstance(path, (str, os.PathLike)):
            raise RequestError(field, "upload", NOT_UPLOADED)
        if not self.allows(path):
            # A result the app sent to the browser comes back as gradio's cached copy of it (gradio
            # copies every output into its cache and the browser holds that path): the app's own file.
            own = self._result_of(os.fspath(path)) if self._result_of is not None else None
            if own is None and self._expired is not None and self._expired(os.fspath(path)):
                raise PictureExpired(field, cap_name(name))
            if own is None:
                logger.warning("refused a %s path the app did not store", field)
                raise RequestError(field, cap_name(name) or "upload", NOT_UPLOADED)
            path = own
        # The name is the client's to choose and goes into the result's metadata: capped here, where
        # it enters the app (EditResult.metadata caps it again for Python callers).
        return path, cap_name(name or Path(path).name)


__all__ = ["UploadGate", "PictureExpired", "NOT_UPLOADED", "EXPIRED"]
