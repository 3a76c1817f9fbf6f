"""The grammar of `--devices` (one engine per device) and `--placement` (one model's parts on several
devices), and their expansion into concrete devices. No torch: config parsing stays free.

`--devices npu:0,npu:1` / `cuda:0,cuda:1` / `cpu,cpu` / `all`. A device may appear once, except
`cpu`: `cpu,cpu` splits the host's cores between two engines (the pool is testable and measurable
on a machine without accelerators). `all` expands at start-up to every visible device of the first
usable accelerator type (NPU, then CUDA), or one CPU engine.

`--placement transformer=DEV,encoders=DEV[,vae=DEV]`: the transformer's device is the engine's
device; the text encoders (CLIP-L, CLIP-G, T5, Llama) and the VAE may live elsewhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from hidream_ui.device.backends import DETECTION_ORDER, DeviceError
from hidream_ui.device.detect import detect_devices, parse_device_spec, resolve_device

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.device.backends import Backend, DeviceInfo

ALL = "all"
PLACEMENT_PARTS = ("transformer", "encoders", "vae")
PLACEMENT_HELP = "transformer=DEV,encoders=DEV[,vae=DEV] with DEV one of npu:N, cuda:N, cpu"


class PoolSpecError(ValueError):
    """A --devices / --placement value is invalid; the message names the bad part."""


def _device(token: str, what: str) -> str:
    """A canonical device string ("npu" -> "npu:0"); "auto" is refused (a pool names its devices)."""
    try:
        kind, index = parse_device_spec(token)
    except DeviceError as exc:
        raise PoolSpecError(f"{what} {token!r}: {str(exc).split('is not valid: ', 1)[-1]}") from None
    if kind == "auto":
        raise PoolSpecError(f"{what} {token!r}: name a device (npu:N, cuda:N or cpu), not auto")
    return "cpu" if kind == "cpu" else f"{kind}:{0 if index is None else index}"


def split_devices(text: str) -> tuple[str, ...]:
    """`"npu:0, npu:1"` -> `("npu:0", "npu:1")`; `"all"` -> `("all",)`."""
    tokens = [token.strip().lower() for token in text.split(",")]
    if not text.strip() or any(not token for token in tokens):
        raise PoolSpecError("give a comma-separated list of devices (e.g. npu:0,npu:1 or cpu,cpu) or all")
    if ALL in tokens:
        if len(tokens) > 1:
            raise PoolSpecError("'all' stands alone; do not mix it with device names")
        return (ALL,)
    return tuple(_device(token, "device") for token in tokens)


def check_devices(devices: tuple[str, ...], device: str) -> None:
    """Raises PoolSpecError for a duplicated accelerator or --devices given with --device."""
    if not devices:
        return
    if device != "auto":
        raise PoolSpecError(
            f"--devices ({','.join(devices)}) and --device ({device}) are exclusive: use --devices "
            "for several engines, --device for one (check HIDREAM_DEVICE / PREFERRED_DEVICE too)"
        )
    if devices == (ALL,):
        return
    seen = set()
    for name in devices:
        if name in seen and name != "cpu":
            raise PoolSpecError(
                f"--devices names {name} twice: one engine per card (only cpu may repeat, to split the cores)"
            )
        seen.add(name)
    kinds = {name.split(":")[0] for name in devices}
    if len(kinds) > 1:
        raise PoolSpecError(
            f"--devices mixes device types ({', '.join(sorted(kinds))}): a pool runs one type "
            "(results must match whichever engine ran them)"
        )


def split_placement(text: str) -> tuple[tuple[str, str], ...]:
    """`"transformer=npu:0,encoders=npu:1"` -> `(("transformer", "npu:0"), ("encoders", "npu:1"))`."""
    pairs = []
    for token in (t.strip().lower() for t in text.split(",")):
        part, sep, device = token.partition("=")
        part = part.strip()
        if not sep or part not in PLACEMENT_PARTS:
            raise PoolSpecError(
                f"{token!r} is not PART=DEVICE with PART one of {', '.join(PLACEMENT_PARTS)} ({PLACEMENT_HELP})"
            )
        if part in dict(pairs):
            raise PoolSpecError(f"{part} is placed twice")
        pairs.append((part, _device(device.strip(), part)))
    if "transformer" not in dict(pairs):
        raise PoolSpecError(f"name the transformer's device too ({PLACEMENT_HELP})")
    return tuple(pairs)


def check_placement(
    placement: tuple[tuple[str, str], ...], device: str, devices: tuple[str, ...], text_encoders: str
) -> None:
    if not placement:
        return
    parts = dict(placement)
    if devices:
        raise PoolSpecError("--placement splits one model and --devices runs one model per device: use one of them")
    if device != "auto" and _device(device, "device") != parts["transformer"]:
        raise PoolSpecError(
            f"--device {device} and --placement transformer={parts['transformer']} disagree: the "
            "transformer's device is the engine's device (leave --device out)"
        )
    if "encoders" in parts and text_encoders != "device":
        raise PoolSpecError(
            f"--text-encoders {text_encoders} and --placement encoders={parts['encoders']} both say "
            "where the text encoders go: use one of them"
        )
    kinds = {name.split(":")[0] for name in parts.values()} - {"cpu"}
    if len(kinds) > 1:
        raise PoolSpecError(f"--placement mixes accelerator types ({', '.join(sorted(kinds))})")


@dataclass(frozen=True)
class Placement:
    """Where each part of one model lives (torch device strings). The transformer's device is the
    engine's device; the pipeline moves embeddings and latents between parts."""

    transformer: str
    encoders: str
    vae: str

    @property
    def split(self) -> bool:
        return len({self.transformer, self.encoders, self.vae}) > 1


def placement_for(placement: tuple[tuple[str, str], ...], device: str, text_encoders: str) -> Placement:
    """The placement of one engine's parts: `--placement` where given, else today's rule
    (everything on the engine's device; text encoders on the host with --text-encoders cpu/offload).

    Memory-plan seam: a planner that decides placement per device (issue 11) would return its
    choice here; every loader reads this one function.
    """
    parts = dict(placement)
    text_default = device if text_encoders == "device" else "cpu"
    return Placement(transformer=device, encoders=parts.get("encoders", text_default), vae=parts.get("vae", device))


def expand_devices(
    devices: tuple[str, ...], backends: "Mapping[str, Backend] | None" = None, environ: Mapping[str, str] | None = None
) -> list["DeviceInfo"]:
    """The pool's devices, resolved (each checked exactly as `--device` is); `all` becomes every
    visible device of the first usable accelerator type, else one CPU. Raises DeviceError."""
    environ = os.environ if environ is None else environ
    if devices == (ALL,):
        report = detect_devices("auto", backends=backends, environ=environ, survey=False)
        for status in report.backends:
            if status.available and status.type in DETECTION_ORDER and status.type != "cpu":
                return [
                    resolve_device(f"{status.type}:{i}", backends=backends, environ=environ)
                    for i in range(status.device_count)
                ]
        return [resolve_device("cpu", backends=backends, environ=environ)]
    return [resolve_device(name, backends=backends, environ=environ) for name in devices]


__all__ = [
    "ALL",
    "PLACEMENT_PARTS",
    "Placement",
    "PoolSpecError",
    "check_devices",
    "check_placement",
    "expand_devices",
    "placement_for",
    "split_devices",
    "split_placement",
]
