"""`python -m hidream_ui plan [--device-memory 24GB] [--weights ...] [--working-resolution ...] [--json]`.

Asks the planner before loading anything: every memory plan with its predicted device peak, the
host RAM it needs for the weights it keeps there and its rough relative speed, and the one `auto`
picks. Reads only config files (the release's dimensions for `--tiny-profile full`). With no weights
configured and no `--tiny-profile` (or HIDREAM_TINY_PROFILE) it plans the release model at its real size,
the `full` profile: the offline demo model's few MB would show every row at 0.0 GB. Exit 1 when
nothing fits, with the numbers. With `--placement`, the table is the transformer's device's and one
line per device follows (what each holds, its predicted peak against its free memory); a device
that cannot hold its placed parts also exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys

from hidream_ui.config import ConfigError, add_model_arguments, from_namespace
from hidream_ui.device.backends import DeviceError
from hidream_ui.device.detect import resolve_device, resolve_dtype
from hidream_ui.env_names import read_variable
from hidream_ui.model.planner import default_working_size, margin, parse_bytes, plan_for, read_configs
from hidream_ui.model.tiny.profiles import FULL_PROFILE_NAME


def _working_size(text: str, variant: str, configs) -> tuple[int, int]:
    from hidream_ui.edits import (  # lazy: PIL, not for --help
        WORKING_SIDE_MAX,
        WORKING_SIDE_MIN,
        WORKING_SIDE_MULTIPLE,
    )

    if text == "auto":
        return default_working_size(variant, configs)
    if text == "draft":
        return 512, 512
    if not text.isdigit() or not WORKING_SIDE_MIN <= int(text) <= WORKING_SIDE_MAX or int(text) % WORKING_SIDE_MULTIPLE:
        raise ValueError(
            f"--working-resolution {text!r} must be auto, draft or a side from {WORKING_SIDE_MIN} to "
            f"{WORKING_SIDE_MAX} in steps of {WORKING_SIDE_MULTIPLE}"
        )
    return int(text), int(text)


def _table(choice, header: str) -> str:
    gb = 1e9
    lines = [header, f"  {'plan':17s} {'weights':7s} {'device peak':>11s} {'host RAM':>9s} {'speed':>6s}  fits"]
    for row in choice.rows:
        fits = "—" if row.fits is None else ("yes" if row.fits else "no")
        mark = (
            "  <- auto"
            if choice.chosen and (row.plan, row.weights) == (choice.chosen.name, choice.chosen.weights)
            else ""
        )
        note = f"  ({row.note})" if row.note else ""
        lines.append(
            f"  {row.plan:17s} {row.weights:7s} {row.peak / gb:9.1f}GB {row.host / gb:7.1f}GB "
            f"{row.relative_speed:6.2f}  {fits}{mark}{note}"
        )
    if choice.chosen is not None:
        lines.append(f"picks {choice.chosen.label}: {choice.chosen.reason}")
    else:
        lines.append(f"refused: {choice.refusal}")
    return "\n".join(lines)


def _per_device(choice, engine: str, free: int | None) -> list[dict]:
    """One entry per device of `--placement`: the transformer's (the chosen plan's peak) and the others."""
    # The transformer's device: the chosen plan, or (another device refused) the plan it would take.
    row = next((r for r in choice.rows if not r.note and r.fits is not False), None)
    peak = choice.chosen.predicted_peak if choice.chosen else (row.peak if row else None)
    elsewhere = {part for need in choice.devices for part in need.parts}
    own = {
        "device": engine,
        "parts": ["transformer", *(p for p in ("encoders", "vae") if p not in elsewhere)],
        "peak": peak,
        "free": free,
        "margin": None if free is None else margin(free),
        "fits": None if free is None else row is not None,
    }
    others = [
        {**need.to_dict(), "parts": list(need.parts), "margin": None if need.free is None else margin(need.free)}
        for need in choice.devices
    ]
    return [own, *others]


def _device_lines(devices: list[dict]) -> str:
    lines = ["per device (--placement):"]
    for entry in devices:
        peak = "—" if entry["peak"] is None else f"{entry['peak'] / 1e9:.1f} GB"
        free = "unknown free" if entry["free"] is None else f"{entry['free'] / 1e9:.1f} GB free"
        fits = {None: "—", True: "fits", False: "does not fit"}[entry["fits"]]
        lines.append(f"  {entry['device']:8s} {', '.join(entry['parts']):28s} predicted peak {peak} of {free}  {fits}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hidream_ui plan", description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument(
        "--device-memory",
        default=None,
        help="free device memory to plan for, e.g. 24GB (10^9 bytes) or 24GiB, on each card (with "
        "--placement: every card it names; a cpu there is the host's); default: what each "
        "device has free now",
    )
    parser.add_argument(
        "--host-memory",
        default=None,
        help="host RAM available for the weights a plan keeps there, e.g. 64GB; default: what this "
        "machine has available now (a plan needing more does not fit)",
    )
    parser.add_argument("--working-resolution", default="auto", help="auto | draft | a side in pixels (square)")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="trace one edit of the release-size model on the meta device (no memory, minutes) and "
        "print each plan's traced peak beside the prediction, per storage and attention path",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        args.release_by_default = plans_release_by_default(args)
        if args.release_by_default:
            args.tiny_profile = FULL_PROFILE_NAME
        config = from_namespace(args)
        if args.trace:
            return _trace(config, args)
        return _run(config, args)
    except (ConfigError, ValueError) as exc:  # PlanRefused is a ValueError
        print(f"plan: {exc}", file=sys.stderr)
        return 2


def plans_release_by_default(args: argparse.Namespace) -> bool:
    """True when nothing names a model or an offline profile: `plan` then plans the release (E1.1 or E1-Full at
    the published dimensions, nothing loaded), what a reader of its table wants to know before downloading."""
    named = ("model_dir", "llama", "i1", "e1", "tiny_profile")
    variables = ("HIDREAM_MODEL_DIR", "HIDREAM_LLAMA", "HIDREAM_I1", "HIDREAM_E1", "HIDREAM_TINY_PROFILE")
    return all(getattr(args, name, None) is None for name in named) and all(
        read_variable(name) is None for name in variables
    )


def _run(config, args) -> int:
    import torch

    free = parse_bytes(args.device_memory) if args.device_memory else None
    host_free = parse_bytes(args.host_memory) if args.host_memory else None
    if host_free is None and free is not None:
        from hidream_ui.model.planner import host_available

        host_free = host_available()  # planning for a card: its host-kept weights live in this machine's RAM
    placed = dict(config.placement)
    try:
        # The engine's device is the transformer's (--placement); a memory size to plan for may stand for cards
        # this machine lacks, so then the placement's device names are planned for as they are written.
        device = resolve_device(placed["transformer"] if placed and free is None else config.device)
        # Planning for a given memory size means planning for an accelerator: its dtype (bf16 unless --dtype).
        if free is not None and config.dtype == "auto":
            dtype = torch.bfloat16
        else:
            dtype = resolve_dtype(config.dtype, device)
    except DeviceError as exc:
        raise ValueError(str(exc)) from None
    configs = read_configs(config)
    size = _working_size(args.working_resolution, config.variant, configs)
    # A memory size to plan for stands for an accelerator, whose streams prefetch the next group.
    other_free = None
    if free is not None:
        other_free = {name: free for name in set(placed.values()) if name != "cpu"}
    choice = plan_for(
        config,
        device,
        dtype,
        free=free,
        working_size=size,
        prefetch=True if free is not None else None,
        other_free=other_free,
        host_free=host_free,
    )
    free = choice.free
    devices = _per_device(choice, placed.get("transformer", device.torch_device), free) if placed else None
    planned = planned_model(config, release_by_default=getattr(args, "release_by_default", False))
    if args.json:
        report = {
            "variant": config.variant,
            "model": planned,
            "working_size": list(size),
            "dtype": str(dtype),
            "free": free,
            "margin": None if free is None else margin(free),
            "rows": [r.to_dict() for r in choice.rows],
            "chosen": choice.chosen.to_dict() if choice.chosen else None,
            "refusal": choice.refusal,
        }
        if devices is not None:
            report["devices"] = devices
        print(json.dumps(report, indent=2))
    else:
        what = (
            "the release model at its real size (no weights needed: --tiny-profile full)"
            if config.uses_tiny_model and config.tiny_profile == FULL_PROFILE_NAME
            else ("tiny " + config.tiny_profile if config.uses_tiny_model else "configured model")
        )
        memory = "unknown" if free is None else f"{free / 1e9:.1f} GB free (margin {margin(free) / 1e9:.1f} GB)"
        header = f"{config.variant}, {what}, {size[0]}x{size[1]}, compute {str(dtype).replace('torch.', '')}, {memory}"
        print(_table(choice, header))
        if devices is not None:
            print(_device_lines(devices))
        if planned["note"]:
            print(planned["note"])
    return 0 if choice.chosen is not None else 1


def planned_model(config, *, release_by_default: bool = False) -> dict:
    """Which model a plan is for, and, for the offline tiny checkpoints, how to plan the release: their
    weights are a few MB, so every row shows ~0.0 GB, which reads like a bug without this line. Planned
    by default (nothing named a model), the release's note says so and how to plan something else."""
    if not config.uses_tiny_model:
        return {"kind": "configured", "profile": None, "note": None}
    if config.tiny_profile == FULL_PROFILE_NAME:
        note = None
        if release_by_default:
            note = (
                f"note: no --model-dir or --tiny-profile given, so this planned the release model "
                f"({config.variant} at its published dimensions; nothing was loaded). --model-dir plans your "
                "weights; --tiny-profile trained plans the offline demo model."
            )
        return {"kind": "release-size", "profile": config.tiny_profile, "note": note}
    return {
        "kind": "offline",
        "profile": config.tiny_profile,
        "note": (
            f"note: this planned the offline tiny model (--tiny-profile {config.tiny_profile}, a few MB of "
            f"weights). Plan the release with --tiny-profile {FULL_PROFILE_NAME} (its dimensions, "
            "nothing is loaded), or point --model-dir at the real weights."
        ),
    }


def _trace(config, args) -> int:
    """`plan --trace`: the release model's phases traced on meta at the working size, per plan, storage and
    attention path, beside the planner's prediction (model/trace.py)."""
    import time

    import torch

    from hidream_ui.model import trace
    from hidream_ui.model.planner import read_configs, sizes_from_configs

    started = time.perf_counter()
    if config.uses_tiny_model and config.tiny_profile != "full":
        print(
            "plan: --trace traces the release dimensions: add --tiny-profile full (or point at real configs)",
            file=sys.stderr,
        )
    configs = read_configs(config)
    size = _working_size(args.working_resolution, config.variant, configs)
    dtype = torch.bfloat16  # the accelerators' compute dtype; fp8 storage computes in it too
    element = torch.tensor([], dtype=dtype).element_size()
    sizes = sizes_from_configs(configs)
    parts = trace.build_parts(configs, dtype, config.variant)
    phases = {s: trace.trace_phases(parts, size, dtype, s) for s in trace.ATTENTION_STRATEGIES}
    rows = [row for s in trace.ATTENTION_STRATEGIES for row in trace.plan_traces(sizes, phases[s], size, element)]
    fitted = trace.fitted_constants(sizes, {size: phases}, element)
    seconds = time.perf_counter() - started
    if args.json:
        print(
            json.dumps(
                {
                    "variant": config.variant,
                    "working_size": list(size),
                    "dtype": str(dtype),
                    "phases": {s: p.to_dict() for s, p in phases.items()},
                    "rows": [r.to_dict() for r in rows],
                    "fitted": fitted,
                    "worst_ratio": max(rows, key=lambda r: abs(r.ratio - 1)).ratio,
                    "seconds": round(seconds, 1),
                },
                indent=2,
            )
        )
        return 0
    gb = 1e9
    print(f"{config.variant}, {size[0]}x{size[1]}, bf16 compute, traced on meta in {seconds:.1f} s")
    for s, p in phases.items():
        print(
            f"  activations ({s:5s}): encode {p.encode / gb:.2f} GB, guidance call {p.denoise / gb:.2f} GB, "
            f"refine call {p.refine / gb:.2f} GB, decode {p.decode / gb:.2f} GB"
        )
    print(
        f"  {'plan':17s} {'weights':7s} {'attention':9s} {'traced':>8s} {'predicted':>9s} {'ratio':>6s}  "
        "per phase traced/predicted (encode, denoise, decode)"
    )
    for r in rows:
        detail = ", ".join(f"{r.traced[k] / gb:.1f}/{r.predicted[k] / gb:.1f}" for k in ("encode", "denoise", "decode"))
        print(
            f"  {r.plan:17s} {r.weights:7s} {r.attention:9s} {r.traced_peak / gb:6.1f}GB "
            f"{r.predicted_peak / gb:7.1f}GB {r.ratio:6.3f}  {detail}"
        )
    print(f"fitted constants: {json.dumps(fitted)}")
    return 0
