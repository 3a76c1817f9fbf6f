"""Which device and dtype to use: NPU > CUDA > CPU detection, device specs, dtype probing."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping

from hidream_ui.device.backends import (
    AUTO_DTYPE_ORDER,
    DETECTION_ORDER,
    DEVICE_SPEC_HELP,
    VISIBLE_DEVICES_ENV,
    Backend,
    BackendStatus,
    DetectionReport,
    DeviceError,
    DeviceInfo,
    _canonical_dtype,
    _torch_dtype,
    default_backends,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Device resolution
# --------------------------------------------------------------------------------------------


def parse_device_spec(spec: str) -> tuple[str, int | None]:
    """``"npu:1"`` -> ``("npu", 1)``; ``"auto"`` -> ``("auto", None)``. Case and spaces ignored."""
    if not isinstance(spec, str):
        raise DeviceError(f"device spec must be a string such as 'auto' or 'npu:0', got {spec!r}")
    text = spec.strip().lower()
    kind, colon, index_text = text.partition(":")
    if kind not in ("auto",) + DETECTION_ORDER:
        raise DeviceError(f"device {spec!r} is not valid: use {DEVICE_SPEC_HELP}")
    if not colon:
        return kind, None
    if kind in ("auto", "cpu"):
        raise DeviceError(f"device {spec!r} is not valid: {kind!r} takes no index; use {DEVICE_SPEC_HELP}")
    if not (index_text.isascii() and index_text.isdigit()):
        raise DeviceError(f"device {spec!r} is not valid: the index must be a number, e.g. {kind}:0")
    return kind, int(index_text)


def _visible_ids(kind: str, environ: Mapping[str, str]) -> tuple[str, list[int | None]] | None:
    """(``NAME=value``, physical id per visible index) when the visibility variable is set."""
    name = VISIBLE_DEVICES_ENV.get(kind)
    if name is None or name not in environ:
        return None
    value = environ[name]
    tokens = [token.strip() for token in value.split(",")]
    if not value.strip():
        tokens = []
    # Non-integer entries (CUDA UUIDs "GPU-...", MIG ids) are visible devices of unknown id.
    ids = [int(token) if token.isascii() and token.isdigit() else None for token in tokens if token]
    return f"{name}={value}", ids


def _check_backend(kind: str, backends: Mapping[str, Backend], environ: Mapping[str, str]) -> BackendStatus:
    visible = _visible_ids(kind, environ)
    visible_env = visible[0] if visible else None
    backend = backends.get(kind)
    if backend is None:
        return BackendStatus(kind, False, f"no backend registered for {kind!r}", 0, visible_env)
    try:
        available, reason = backend.availability()
        count = int(backend.device_count()) if available else 0
    except Exception as exc:  # a backend must not take detection down with it
        available, reason, count = False, f"{type(exc).__name__}: {exc}", 0
    if available and visible is not None:
        # The runtime already honours the variable; clamping also covers fakes and odd runtimes.
        count = min(count, len(visible[1]))
    if available and count == 0:
        available = False
        reason = f"no {kind} device visible" + (f" ({visible_env} hides them all)" if visible_env else "")
    elif not available and visible_env:
        reason = f"{reason} [{visible_env}]"
    return BackendStatus(kind, available, reason, count if available else 0, visible_env)


def _device_info(kind: str, index: int | None, backend: Backend, environ: Mapping[str, str]) -> DeviceInfo:
    if kind == "cpu":
        index = None
    visible = _visible_ids(kind, environ)
    if index is None:
        physical = None
    elif visible is None:
        physical = index  # nothing renumbers: visible index == physical id
    else:
        physical = visible[1][index] if index < len(visible[1]) else None
    free_total = _quiet(backend.mem_get_info, index)
    return DeviceInfo(
        type=kind,
        index=index,
        torch_device=kind if index is None else f"{kind}:{index}",
        name=_quiet(backend.get_device_name, index) or kind.upper(),
        physical_index=physical,
        visible_env=visible[0] if visible else None,
        total_memory=free_total[1] if free_total else None,
        bf16_supported=_quiet(backend.is_bf16_supported),
    )


def _quiet(fn: Callable[..., Any], *args: Any) -> Any:
    """Descriptive extras (name, memory) must not block using the device: None on failure."""
    try:
        return fn(*args)
    except Exception as exc:  # any backend failure here only loses a label
        logger.debug("%s%r failed: %s", getattr(fn, "__name__", fn), args, exc)
        return None


def _out_of_range(kind: str, index: int, status: BackendStatus, environ: Mapping[str, str]) -> str:
    message = (
        f"device '{kind}:{index}' was requested but only {status.device_count} {kind} device(s) are "
        f"visible (valid: {kind}:0 .. {kind}:{status.device_count - 1})"
    )
    visible = _visible_ids(kind, environ)
    if visible is not None:
        mapping = ", ".join(
            f"{kind}:{i} is physical {pid if pid is not None else '?'}" for i, pid in enumerate(visible[1])
        )
        message += (
            f". {visible[0]} renumbers devices ({mapping}): use a visible index, or change {VISIBLE_DEVICES_ENV[kind]}"
        )
    return message


def detect_devices(
    spec: str = "auto",
    backends: Mapping[str, Backend] | None = None,
    environ: Mapping[str, str] | None = None,
    survey: bool = True,
) -> DetectionReport:
    """Resolves ``spec`` and reports what was tried; never raises for an unusable device.

    With ``survey=True`` (what ``doctor`` wants) every backend is asked, even those not needed
    for the answer; that imports torch_npu when it is installed. `resolve_device` uses
    ``survey=False`` so that ``--device cpu`` never touches an accelerator runtime.
    """
    backends = default_backends() if backends is None else backends
    environ = os.environ if environ is None else environ
    statuses: dict[str, BackendStatus] = {}

    def status_of(kind: str) -> BackendStatus:
        if kind not in statuses:
            statuses[kind] = _check_backend(kind, backends, environ)
        return statuses[kind]

    device: DeviceInfo | None = None
    error: str | None = None
    skipped: list[tuple[str, str]] = []
    try:
        kind, index = parse_device_spec(spec)
    except DeviceError as exc:
        kind, index, error = "", None, str(exc)

    if kind == "auto":
        for candidate in DETECTION_ORDER:
            status = status_of(candidate)
            if status.available:
                device = _device_info(candidate, 0, backends[candidate], environ)
                break
            skipped.append((candidate, status.reason))
        if device is None:
            error = "no usable device: " + "; ".join(f"{k}: {why}" for k, why in skipped)
    elif kind:
        status = status_of(kind)
        wanted = 0 if index is None else index
        if not status.available:
            error = f"device {spec!r} was requested but {kind} is not usable: {status.reason}"
        elif kind != "cpu" and wanted >= status.device_count:
            error = _out_of_range(kind, wanted, status, environ)
        else:
            device = _device_info(kind, wanted, backends[kind], environ)

    if survey:
        for other in DETECTION_ORDER:
            status_of(other)
    return DetectionReport(
        spec=spec,
        device=device,
        error=error,
        backends=tuple(statuses.values()),
        skipped=tuple(skipped),
    )


def detect(
    spec: str = "auto",
    backends: Mapping[str, Backend] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """JSON-able survey of every backend plus the resolution of ``spec`` (for ``doctor``)."""
    return detect_devices(spec, backends=backends, environ=environ, survey=True).to_dict()


def resolve_device(
    spec: str = "auto",
    backends: Mapping[str, Backend] | None = None,
    environ: Mapping[str, str] | None = None,
) -> DeviceInfo:
    """The device for ``spec`` (``auto | npu | npu:N | cuda | cuda:N | cpu``).

    ``auto`` takes the first usable of NPU, CUDA, CPU (index 0) and logs why it skipped the
    others. Anything else is taken literally: if it is unusable a `DeviceError` explains why
    (its ``report`` attribute holds the `DetectionReport`). Indices are visible indices:
    with ``ASCEND_RT_VISIBLE_DEVICES=4,5``, ``npu:1`` is physical NPU 5. ``environ`` defaults
    to ``os.environ`` and is only read for the visibility variables.
    """
    report = detect_devices(spec, backends=backends, environ=environ, survey=False)
    if report.device is None:
        raise DeviceError(report.error or f"device {spec!r} could not be resolved", report=report)
    for kind, why in report.skipped:
        logger.info("device auto: skipped %s: %s", kind, why)
    logger.info("device: %s", report.device.label)
    return report.device


# --------------------------------------------------------------------------------------------
# dtype
# --------------------------------------------------------------------------------------------


def _backend_for(device: DeviceInfo, backends: Mapping[str, Backend] | None) -> Backend:
    table = default_backends() if backends is None else backends
    try:
        return table[device.type]
    except KeyError:
        raise DeviceError(f"no backend registered for device type {device.type!r} (have: {', '.join(table)})") from None


def _probe(backend: Backend, device: DeviceInfo, name: str) -> tuple[bool, str]:
    try:
        ok, reason = backend.probe_dtype(device.index, name)
    except Exception as exc:  # the probe contract says "never raises"; be safe anyway
        return False, f"{type(exc).__name__}: {exc}"
    return bool(ok), str(reason)


def probe_dtypes(device: DeviceInfo, backends: Mapping[str, Backend] | None = None) -> dict[str, tuple[bool, str]]:
    """Probes bf16, fp16 and fp32 on ``device`` (for ``doctor``): ``{"bf16": (ok, reason), ...}``."""
    backend = _backend_for(device, backends)
    return {name: _probe(backend, device, name) for name in AUTO_DTYPE_ORDER}


def resolve_dtype(spec: str, device: DeviceInfo, backends: Mapping[str, Backend] | None = None) -> "torch.dtype":
    """The compute dtype for ``spec`` (``auto | bf16 | fp16 | fp32``) on ``device``.

    ``auto`` on CPU is fp32 without probing: without bf16 units a bf16 matmul is ~2.8x slower
    than fp32, and fp16 is slower still. On an accelerator ``auto`` probes bf16 (skipped when
    the backend reports no native bf16), then fp16, then fp32 with a real op and takes the
    first that passes. An explicit dtype is probed too and a failure raises `DeviceError`.
    """
    name = _canonical_dtype(spec)
    backend = _backend_for(device, backends)
    if name != "auto":
        ok, reason = _probe(backend, device, name)
        if not ok:
            raise DeviceError(
                f"dtype {name} does not work on {device.torch_device} ({device.name}): {reason}. "
                f"Use --dtype auto, or one of {', '.join(AUTO_DTYPE_ORDER)} that `doctor` reports as working"
            )
        return _torch_dtype(name)
    if device.type == "cpu":
        return _torch_dtype("fp32")
    failures: list[str] = []
    for candidate in AUTO_DTYPE_ORDER:
        if candidate == "bf16" and _quiet(backend.is_bf16_supported) is False:
            failures.append("bf16: the device reports no native bf16 support")
            continue
        ok, reason = _probe(backend, device, candidate)
        if ok:
            for failure in failures:
                logger.info("dtype auto on %s: skipped %s", device.torch_device, failure)
            return _torch_dtype(candidate)
        failures.append(f"{candidate}: {reason}")
    raise DeviceError(
        f"no dtype works on {device.torch_device} ({device.name}): "
        + "; ".join(failures)
        + ". The device looks broken: run `python -m hidream_ui doctor`"
    )
