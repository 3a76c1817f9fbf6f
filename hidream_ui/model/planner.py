"""The planner: predicts each plan's device peak and host-RAM need before anything loads, and picks
the plan `--memory auto` uses.

Parameter bytes come from the configs alone (model/sizes.py: every part instantiated on torch's
`meta` device and counted the way the plan's hooks group them). Activations come from a
per-working-size model whose constants were calibrated on peaks measured on this project's CPU
machine (bench profile: the real attention geometry), see `ACTIVATION_*` below and README "Memory
plans". No accelerator was available to check them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping

from hidream_ui.device import memory as device_memory  # device_memory.snapshot: looked up per call
from hidream_ui.device.backends import DeviceError
from hidream_ui.device.detect import resolve_device
from hidream_ui.model.fp8 import fp8_unavailable
from hidream_ui.model.geometry import geometry_for
from hidream_ui.model.plans import (
    PLAN_SPECS,
    PLANS,
    WEIGHTS,
    MemoryPlan,
    PlanRefused,
    check_compatible,
    requested_plan,
    use_streams,
)
from hidream_ui.model.settings import ModelSettings
from hidream_ui.model.sizes import (  # noqa: F401  re-exported: the planner's callers import them from here
    ENCODER_PARTS,
    ConfigsUnavailable,
    ModelSizes,
    PartSize,
    read_configs,
    sizes_from_configs,
)
from hidream_ui.pipeline.prompts import PROMPT_TOKENS

if TYPE_CHECKING:  # pragma: no cover
    import torch

# Live activation bytes of one transformer call at its peak, per (batch item x token x hidden unit x element),
# with a fused attention kernel (flash / memory-efficient / NPU fused: no score matrix). Fitted to the full-scale
# trace of the release model on the meta device (`plan --trace`, model/trace.py): 22.1 at 1024x1024 (E1.1),
# 23.5 at 768x768 (E1-Full), bf16. Was 17.0 from small CPU runs (bench profile, `bench memory --calibrate`),
# which under-predicted the release model's MoE (its int64 scatter index per expert is tokens x hidden x 8 B).
ACTIVATION_PER_TOKEN_UNIT = 23.0
# The math attention path (no fused kernel) adds score matrices, batch x heads x tokens^2 x element each: the
# q.k^T product and its softmax are live together. Traced: 1.92 of them at 1024 px, 1.86 at 768 px on top of the
# fused peak (the fused peak's own tensors are partly freed by then).
ATTENTION_SCORE_COPIES = 1.9
ATTENTION_STRATEGIES = ("fused", "math")
# VAE decode peak per (output pixel x first-block channels x element): 6.0 traced at both 1024 and 768 px (the
# up-blocks at full resolution, not the mid-block's attention: the same with either attention path). Was 10.0
# from CPU runs at 256-512 px in fp32, where fixed overheads weigh more.
ACTIVATION_PER_PIXEL_CHANNEL = 6.0
# Headroom auto keeps free: the larger of 1 GiB and this share of the free memory (allocator fragmentation,
# the CUDA/NPU context, the prompt cache's embeddings).
MARGIN_FRACTION = 0.05
MARGIN_MIN = 1 << 30
GUIDANCE_BATCH = 3  # the editing step runs [uncond, image-cond, full-cond] in one call


@dataclass(frozen=True)
class PlanEstimate:
    """One (plan, weights) row of the planner's table."""

    plan: str
    weights: str
    peak: int  # predicted device bytes
    host: int  # host bytes for weights the plan keeps there
    relative_speed: float
    phases: dict[str, int]  # encode / denoise / decode peaks
    fits: bool | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------------------------
# Prediction


def activation_terms(sizes: ModelSizes, working_size: tuple[int, int], element: int, batch: int = 1) -> dict:
    """The activation model's units: `tokens` of the guidance call, `scores` (bytes of one math-path score
    matrix set: guidance batch x heads x tokens^2), `encode_unit` (Llama's hidden states, bytes)."""
    width, height = working_size
    image_tokens = 2 * (width // sizes.unit) * (height // sizes.unit) + 1  # H x 2W, plus the collapsed pad token
    tokens = image_tokens + 2 * PROMPT_TOKENS  # single-stream blocks carry the T5 and Llama tokens too
    scores = GUIDANCE_BATCH * batch * sizes.heads * tokens * tokens * element
    vae_tokens = (width // (sizes.unit // 2 or 1)) * (height // (sizes.unit // 2 or 1))
    return {
        "tokens": tokens,
        "scores": scores,
        "vae_scores": batch * vae_tokens * vae_tokens * element,
        "encode_unit": (sizes.llama_layers + 1) * PROMPT_TOKENS * sizes.llama_hidden * element,
    }


def activation_bytes(
    sizes: ModelSizes, working_size: tuple[int, int], element: int, batch: int = 1, attention: str = "fused"
) -> dict:
    """Activation peaks (bytes) of each phase for `batch` images at `working_size` (width, height), with a
    fused attention kernel or the `math` path (its score matrices on top)."""
    if attention not in ATTENTION_STRATEGIES:
        raise ValueError(f"attention {attention!r} must be one of {', '.join(ATTENTION_STRATEGIES)}")
    width, height = working_size
    terms = activation_terms(sizes, working_size, element, batch)
    transformer = int(GUIDANCE_BATCH * batch * terms["tokens"] * sizes.inner_dim * element * ACTIVATION_PER_TOKEN_UNIT)
    if attention == "math":
        transformer += int(ATTENTION_SCORE_COPIES * terms["scores"])
    decode = int(batch * width * height * sizes.vae_channels * element * ACTIVATION_PER_PIXEL_CHANNEL)
    # Llama returns every layer's hidden states (HiDream reads them all); the rest is small at 128 tokens.
    encode = 2 * terms["encode_unit"]
    return {"encode": encode, "denoise": transformer, "decode": decode}


def _weights(part: PartSize, element: int, fp8: bool) -> int:
    return part.fp8 + (part.total - part.fp8) * element if fp8 else part.total * element


def _streamed(part: PartSize, how: str, element: int, fp8: bool, prefetch: bool) -> int:
    """Device bytes of a streamed part while it runs: its resident group plus the running group and, with
    `prefetch` (a side stream: CUDA, NPU), the next one already arriving."""
    size = (1 if fp8 else element) * (2 if prefetch else 1)
    if how == "blocks":
        return part.unmatched * element + part.max_block * size
    return part.nonleaf * element + part.max_leaf * size


@dataclass(frozen=True)
class Split:
    """What `--placement` does to the engine's device (the transformer's): `encoders` is "plan" (not placed:
    the memory plan decides), "resident" (placed on the engine's device: resident there whatever the plan
    says) or "away" (placed on another device: neither their weights nor their activations count here);
    `vae_away`: the VAE (and its decode) lives on another device. `others`: (device, parts) of each other
    device named, checked on its own (`placed_need`)."""

    encoders: str = "plan"
    vae_away: bool = False
    others: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def where(self) -> list[tuple[str, str]]:
        """(part, device) of every part living on another device than the engine's."""
        return [(part, device) for device, parts in self.others for part in parts]


NO_SPLIT = Split()


def split_for(placement: tuple[tuple[str, str], ...], engine_device: str) -> Split:
    """The Split of `--placement` pairs for an engine on `engine_device` (its transformer's device: the
    placement's own `transformer=` where given, so a plan can be asked for cards this machine lacks)."""
    parts = dict(placement)
    if not parts:
        return NO_SPLIT
    engine = parts.get("transformer", engine_device)
    others: dict[str, list[str]] = {}
    encoders = "plan"
    if "encoders" in parts:
        encoders = "resident" if parts["encoders"] == engine else "away"
        if encoders == "away":
            others.setdefault(parts["encoders"], []).append("encoders")
    vae_away = parts.get("vae", engine) != engine
    if vae_away:
        others.setdefault(parts["vae"], []).append("vae")
    return Split(
        encoders=encoders, vae_away=vae_away, others=tuple((device, tuple(names)) for device, names in others.items())
    )


def estimate(
    sizes: ModelSizes,
    plan: str,
    weights: str,
    working_size: tuple[int, int],
    element: int,
    batch: int = 1,
    prefetch: bool = True,
    split: Split = NO_SPLIT,
    attention: str = "fused",
) -> PlanEstimate:
    """Predicted device peak and host need of `plan` with `weights` storage at `working_size` (`prefetch`:
    the device has a side stream, so streamed plans hold two groups at once) on the engine's device; with
    `split` (`--placement`), parts placed on another device count there, not here (`placed_need`)."""
    spec = PLAN_SPECS[plan]
    if split.encoders != "plan":
        spec = dataclasses.replace(spec, encoders="resident")  # placed encoders are resident on their card
    fp8 = weights == "fp8"
    act = dict(activation_bytes(sizes, working_size, element, batch, attention))
    t_all = _weights(sizes.transformer, element, fp8)
    e_all = 0 if split.encoders == "away" else sizes.encoder_total * element
    vae = 0 if split.vae_away else sizes.vae.total * element
    if split.encoders == "away":
        act["encode"] = 0  # the embeddings arrive here afterwards (small: inside the margin)
    if split.vae_away:
        act["decode"] = 0
    cast = sizes.transformer.max_fp8_leaf * element if fp8 else 0  # one layer's compute-dtype copy
    # Weights resident between calls, then what each phase brings in on top.
    resident = vae + (t_all if spec.transformer == "resident" else 0) + (e_all if spec.encoders == "resident" else 0)
    if spec.encoders in ("blocks", "leaf"):
        encoder_in = max(_streamed(part, spec.encoders, element, False, prefetch) for part in sizes.encoders.values())
    else:
        encoder_in = 0
    transformer_in = (
        0 if spec.transformer == "resident" else _streamed(sizes.transformer, spec.transformer, element, fp8, prefetch)
    )
    phases = {
        "encode": resident + encoder_in + act["encode"],
        "denoise": resident + transformer_in + cast + act["denoise"],
        "decode": resident + act["decode"],
    }
    host = 0
    if spec.encoders != "resident":
        host += e_all
    if spec.transformer != "resident":
        host += t_all
    return PlanEstimate(
        plan=plan,
        weights=weights,
        peak=max(phases.values()),
        host=host,
        relative_speed=spec.relative_speed,
        phases=phases,
    )


@dataclass(frozen=True)
class DeviceNeed:
    """The predicted need of a device other than the engine's, holding the parts `--placement` puts there
    (resident whatever the plan says) and their activations, against its free memory."""

    device: str
    parts: tuple[str, ...]  # "encoders", "vae"
    weights: int  # resident bytes of the placed parts
    peak: int  # predicted device bytes: weights + the largest activation of the placed parts
    phases: dict[str, int]
    free: int | None = None
    fits: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def placed_need(
    sizes: ModelSizes,
    device: str,
    parts: tuple[str, ...],
    working_size: tuple[int, int],
    element: int,
    batch: int = 1,
    free: int | None = None,
) -> DeviceNeed:
    """What `parts` ("encoders", "vae") placed on `device` need there: their weights, resident for the whole
    run, plus each phase's activations (encode for the encoders, decode for the VAE)."""
    act = activation_bytes(sizes, working_size, element, batch)
    weights = (sizes.encoder_total * element if "encoders" in parts else 0) + (
        sizes.vae.total * element if "vae" in parts else 0
    )
    phases = {
        "encode": weights + (act["encode"] if "encoders" in parts else 0),
        "decode": weights + (act["decode"] if "vae" in parts else 0),
    }
    peak = max(phases.values())
    fits = None if free is None else peak <= free - margin(free)
    return DeviceNeed(
        device=device, parts=tuple(parts), weights=weights, peak=peak, phases=phases, free=free, fits=fits
    )


def margin(free: int) -> int:
    return max(MARGIN_MIN, int(free * MARGIN_FRACTION))


def candidates(memory: str, weights: str) -> list[tuple[str, str]]:
    """(plan, weights) pairs in the order auto tries them: the exact bf16 storage while the transformer can
    stay resident, then fp8 resident (faster than streaming 34 GB every step), then the streaming plans
    (fp8 first: half the bytes to move)."""
    plans = PLANS if memory == "auto" else (memory,)
    storages = WEIGHTS if weights == "auto" else (weights,)
    order = []
    for store in ("bf16", "fp8"):
        order += [(p, store) for p in plans if PLAN_SPECS[p].transformer == "resident" and store in storages]
    for p in plans:
        if PLAN_SPECS[p].transformer != "resident":
            order += [(p, store) for store in ("fp8", "bf16") if store in storages]
    return order


@dataclass(frozen=True)
class PlanChoice:
    """The planner's answer: every row it considered and the one it picked (None: nothing fits, or a device
    named in `--placement` cannot hold its parts). `devices`: the other devices' needs (`--placement`)."""

    rows: tuple[PlanEstimate, ...]
    chosen: MemoryPlan | None
    refusal: str | None
    devices: tuple[DeviceNeed, ...] = ()
    free: int | None = None  # the engine's device's free bytes the choice was made against


def choose(
    sizes: ModelSizes,
    *,
    free: int | None,
    memory: str = "auto",
    weights: str = "auto",
    working_size: tuple[int, int],
    element: int,
    refiner: str = "e1",
    fp8_reason: str | None = None,
    batch: int = 1,
    prefetch: bool = True,
    split: Split = NO_SPLIT,
    other_free: Mapping[str, int | None] | None = None,
    host_free: int | None = None,
) -> PlanChoice:
    """Picks the first candidate whose predicted peak fits `free` minus the margin. `free=None` (unknown)
    takes the first candidate. Every row is kept for the `plan` command's table. With `split`
    (`--placement`), the rows are the engine's device's and every other device named is checked against
    its free memory in `other_free` (same margin; unknown: not checked); one that cannot hold its parts
    refuses the whole choice. `host_free`: the host RAM available for the weights a plan keeps there (the
    streamed and host-kept parts); a plan needing more does not fit, however small its device peak."""
    rows, chosen = [], None
    limit = None if free is None else free - margin(free)
    other_free = other_free or {}
    devices = tuple(
        placed_need(sizes, device, parts, working_size, element, batch, other_free.get(device))
        for device, parts in split.others
    )
    for plan, store in candidates(memory, weights):
        row = estimate(sizes, plan, store, working_size, element, batch, prefetch, split)
        note = check_compatible(plan, refiner=refiner) or (fp8_reason if store == "fp8" else None)
        fits = None if limit is None else row.peak <= limit
        if host_free is not None and row.host > host_free:
            fits = False
            note = note or f"needs {_gb(row.host)} of host RAM, {_gb(host_free)} available"
        usable = note is None and fits is not False
        row = PlanEstimate(**{**row.to_dict(), "fits": fits, "note": note or ""})
        rows.append(row)
        if chosen is None and usable:
            chosen = MemoryPlan(
                name=plan,
                weights=store,
                requested=memory,
                requested_weights=weights,
                predicted_peak=row.peak,
                host_bytes=row.host,
                free=free,
                working_size=tuple(working_size),
                reason=_reason(memory, weights, plan, store, row.peak, free) + _placed_note(sizes, split, element),
            )
    refusal = None if chosen is not None else _refusal(rows, free, working_size, weights, memory)
    crowded = [need for need in devices if need.fits is False]
    if crowded:
        chosen, refusal = None, "; ".join(_placed_refusal(need, working_size) for need in crowded)
    return PlanChoice(rows=tuple(rows), chosen=chosen, refusal=refusal, devices=devices, free=free)


def _gb(n: int | float) -> str:
    return f"{n / 1e9:.1f} GB"


def _reason(memory: str, weights: str, plan: str, store: str, peak: int, free: int | None) -> str:
    asked = "asked for" if memory != "auto" else "the fastest that fits"
    where = f" of {_gb(free)} free" if free is not None else " (free memory unknown)"
    return f"{plan} · {store}: {asked}; predicted peak {_gb(peak)}{where}"


def _placed_note(sizes: ModelSizes, split: Split, element: int) -> str:
    notes = []
    if split.encoders == "resident":
        notes.append("text encoders resident here by --placement")
    for part, device in split.where():
        size = sizes.encoder_total if part == "encoders" else sizes.vae.total
        name = "text encoders" if part == "encoders" else "VAE"
        notes.append(f"{name} ({_gb(size * element)}) on {device} by --placement, not counted here")
    return "; " + "; ".join(notes) if notes else ""


def _placed_refusal(need: DeviceNeed, working_size) -> str:
    size = "x".join(map(str, working_size))
    free = need.free or 0
    return (
        f"{need.device} (--placement {', '.join(need.parts)}) needs at least {_gb(need.peak + margin(need.peak))} "
        f"at {size} (weights {_gb(need.weights)} + activations {_gb(need.peak - need.weights)}, predicted peak "
        f"{_gb(need.peak)} + margin) but {_gb(free)} is free; try a card with more free memory there, or leave "
        f"{' and '.join(need.parts)} out of --placement so the memory plan places them"
    )


def _refusal(rows: list[PlanEstimate], free: int | None, working_size, weights: str, memory: str) -> str:
    usable = [r for r in rows if not r.note]
    size = "x".join(map(str, working_size))
    if not usable:
        notes = "; ".join(sorted({r.note for r in rows}))
        return f"no memory plan can be used: {notes}"
    smallest = min(usable, key=lambda r: r.peak)
    needed = smallest.peak + margin(smallest.peak)
    hints = []
    if memory != "auto":
        hints.append("--memory auto")
    if weights != "fp8" and not any(r.weights == "fp8" for r in usable):
        hints.append("--weights fp8")
    hints.append("a smaller working resolution")
    # Plans left out for host RAM (their device peak may fit): say so, or the refusal reads as device-only.
    host_bound = [r for r in rows if "host RAM" in r.note]
    host = ""
    if host_bound:
        least = min(host_bound, key=lambda r: r.host)
        host = (
            f"; the plans keeping weights on the host need more RAM than is available (least: {least.plan} · "
            f"{least.weights}, {least.note}): use a machine with more RAM or --host-memory"
        )
    return (
        f"needs at least {_gb(needed)} of device memory at {size} (smallest: {smallest.plan} · {smallest.weights}, "
        f"predicted peak {_gb(smallest.peak)} + margin) but {_gb(free or 0)} is free; try {' / '.join(hints)}"
        f"{host}"
    )


def default_working_size(variant: str, configs: Mapping[str, Mapping[str, Any]]) -> tuple[int, int]:
    """The largest working size the app uses for `variant` (E1.1: its full area, 1024x1024 for the release;
    E1-Full: its fixed side, 768x768)."""
    geometry = geometry_for(variant, configs["transformer"], configs["vae"])
    side = geometry.image_size if variant == "e1.1" else geometry.e1_full_side
    return side, side


def plan_for(
    config: ModelSettings,
    device,
    dtype: "torch.dtype",
    backends=None,
    *,
    free: int | None = None,
    working_size: tuple[int, int] | None = None,
    prefetch: bool | None = None,
    other_free: Mapping[str, int | None] | None = None,
    host_free: int | None = None,
) -> PlanChoice:
    """The planner's table and choice for `config` on `device` (its free memory now unless `free` is given),
    from the configs only: nothing is loaded. `chosen` is None (with `refusal`) when nothing fits.

    With `--placement`, `device` is the transformer's; the parts placed on other devices are counted there,
    each of those devices checked against its free memory (now, read the same way as `device`'s, unless
    `other_free` gives it). Host RAM: `host_free`, else what the host has available now (a device plan's
    host-kept weights must fit there too; on a cpu device the device peak is the host's and is checked)."""
    import torch

    configs = read_configs(config)
    sizes = sizes_from_configs(configs)
    if free is None:
        free = device_memory.snapshot(device, backends=backends).free
    split = split_for(config.placement, device.torch_device)
    known = dict(other_free or {})
    for name, _ in split.others:
        if name not in known:
            known[name] = _free_on(name, backends)
    if host_free is None and device.type != "cpu":
        host_free = host_available()
    fp8_reason = None
    if config.weights != "bf16":
        fp8_reason = fp8_unavailable(device)
        if fp8_reason and config.weights == "fp8":
            raise PlanRefused(f"--weights fp8 cannot be used: {fp8_reason}")
    return choose(
        sizes,
        free=free,
        memory=requested_plan(config),
        weights=config.weights,
        working_size=working_size or default_working_size(config.variant, configs),
        element=torch.tensor([], dtype=dtype).element_size(),
        refiner=config.refiner,
        fp8_reason=fp8_reason,
        prefetch=use_streams(device) if prefetch is None else prefetch,
        split=split,
        other_free=known,
        host_free=host_free,
    )


def host_available() -> int:
    """Host RAM available now (bytes): what a plan's host-kept weights can take."""
    import psutil

    return int(psutil.virtual_memory().available)


def _free_on(name: str, backends=None) -> int | None:
    """Free bytes of the device `name` (a `--placement` device), from the same snapshot the engine's device
    is planned with. PlanRefused when it cannot be resolved."""
    try:
        other = resolve_device(name, backends=backends)
    except DeviceError as exc:
        raise PlanRefused(f"--placement names {name}, which cannot be used: {exc}") from None
    return device_memory.snapshot(other, backends=backends).free


def resolve_plan(config: ModelSettings, device, dtype: "torch.dtype", backends=None) -> MemoryPlan:
    """The plan the engine loads with; PlanRefused (with the numbers) when none fits. A model whose configs
    are not local yet (hub ids) gets the plan asked for (auto: `full`, bf16 unless fp8 was asked for)
    without a prediction: diffusers downloads the configs only as it loads."""
    try:
        choice = plan_for(config, device, dtype, backends)
    except ConfigsUnavailable as exc:
        memory = requested_plan(config)
        return MemoryPlan(
            name="full" if memory == "auto" else memory,
            weights="fp8" if config.weights == "fp8" else "bf16",
            requested=memory,
            requested_weights=config.weights,
            reason=f"no prediction: {exc}",
        )
    if choice.chosen is None:
        raise PlanRefused(choice.refusal or "no memory plan fits")
    return choice.chosen


def parse_bytes(text: str) -> int:
    """'24GB' -> 24e9, '24GiB' -> 24 * 2**30, '512MB', '1.5TB'; a bare number is GB. Raises ValueError."""
    units = {"tib": 1 << 40, "gib": 1 << 30, "mib": 1 << 20, "tb": 10**12, "gb": 10**9, "mb": 10**6, "b": 1}
    raw = str(text).strip().lower().replace(" ", "")
    for suffix, factor in units.items():
        if raw.endswith(suffix):
            number, scale = raw[: -len(suffix)], factor
            break
    else:
        number, scale = raw, 10**9
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a memory size; write e.g. 24GB or 24GiB") from None
    if value <= 0:
        raise ValueError(f"{text!r} must be more than 0")
    return int(value * scale)


__all__ = [
    "ConfigsUnavailable",
    "DeviceNeed",
    "ModelSizes",
    "PartSize",
    "PlanChoice",
    "PlanEstimate",
    "Split",
    "activation_bytes",
    "activation_terms",
    "candidates",
    "host_available",
    "choose",
    "default_working_size",
    "estimate",
    "margin",
    "parse_bytes",
    "placed_need",
    "plan_for",
    "read_configs",
    "resolve_plan",
    "sizes_from_configs",
    "split_for",
]
