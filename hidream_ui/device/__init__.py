"""Devices: `backends` (one per device type), `detect` (which device and dtype), `runtime` (per-call
housekeeping), `memory` (snapshots for the status panel).

Which device and dtype to compute on, and the few device operations the app needs.

Detection order is NPU (Ascend, through ``torch_npu``) > CUDA > CPU. A device spec string
(``auto | npu | npu:N | cuda | cuda:N | cpu``) overrides it. Only ``auto`` falls back; a device
that was asked for but is not usable is a `DeviceError` that says why (torch_npu not installed
or not importable, CANN not loaded, index out of range, CUDA build missing). Silent fallback to
CPU would turn "my NPU is misconfigured" into "the demo is 100x slower" with no hint why.

Every device operation goes through a *backend* object (see `Backend`) looked up by device type
in a table (``{"npu": ..., "cuda": ..., "cpu": ...}``). `default_backends()` builds the real
table on demand; every public function takes ``backends=`` so tests can inject a fake NPU (see
``tests/fakes.py``) without putting a fake ``torch_npu`` into ``sys.modules`` (diffusers probes
for it on import and breaks).

Nothing here runs at import time and torch is imported inside functions only: config parsing
and ``--help`` must not pay for torch, and ``torch_npu`` must only be imported when an NPU is
actually considered (importing it patches torch globally).
"""
