"""Files in and out of the app: which client paths it may open, which results it serves, and a
cache that does not grow without bound. One job per module; this one names them and keeps the
names other modules import from here:

* `upload_gate.UploadGate`: a client's file value becomes a path only when gradio stored it for
  this app, it lies in a trusted folder (the bundled examples), or it is gradio's copy of a result
  the app serves; anything else gets one generic message (`NOT_UPLOADED`), an aged-out file
  "expired, upload it again" (`PictureExpired`, `EXPIRED`).
* `served_results.ServedResults`: each result PNG the app wrote is served individually, and a
  History entry names it by a signed opaque id.
* `client_storage.ClientStorage` (limits in `storage_limits`): who holds what in gradio's cache;
  clients age out instead of being refused.
* `janitor.CacheJanitor`: runs the pruning (`gradio_cache.prune_cache`) on a timer and on demand.
"""

from __future__ import annotations

from hidream_ui.server.client_storage import ClientStorage
from hidream_ui.server.janitor import CacheJanitor
from hidream_ui.server.served_results import ServedResults
from hidream_ui.server.storage_limits import (
    ARRIVING_GRACE,
    HEADROOM,
    LATEST_HOLD,
    CacheEntry,
    Refusal,
    StorageLimits,
)
from hidream_ui.server.upload_gate import EXPIRED, NOT_UPLOADED, PictureExpired, UploadGate

__all__ = [
    "UploadGate",
    "ServedResults",
    "CacheJanitor",
    "ClientStorage",
    "StorageLimits",
    "CacheEntry",
    "Refusal",
    "NOT_UPLOADED",
    "EXPIRED",
    "PictureExpired",
    "ARRIVING_GRACE",
    "LATEST_HOLD",
    "HEADROOM",
]
