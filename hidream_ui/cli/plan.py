"""`python -m hidream_ui plan [--device-memory 24GB] [--weights ...] [--working-resolution ...] [--json]`.

Asks the planner before loading anything: every memory plan with its predicted device peak, the
host RAM it needs for the weights it keeps there and its rough relative speed, and the one `auto`
picks. Reads only config files (the release's dimensions for `--tiny-profile full`). Exit 1 when
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
from hidream_ui.model.planner import default_working_size, margin, parse_bytes, plan_for, read_configs


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
    if not text.isdigit() or not WORKING_SIDE_MIN <= int(text) <= WORKING_SIDE_MAX \
            or int(text) % WORKING_SIDE_MULTIPLE:
        raise ValueError(f"--working-resolution {text!r} must be auto, draft or a side from {WORKING_SIDE_MIN} to "
                         f"{WORKING_SIDE_MAX} in steps of {WORKING_SIDE_MULTIPLE}")
    return int(text), int(text)


def _table(choice, header: str) -> str:
    gb = 1e9
    lines = [header, f"  {'plan':17s} {'weights':7s} {'device peak':>11s} {'host RAM':>9s} {'speed':>6s}  fits"]
    for row in choice.rows:
        fits = "—" if row.fits is None else ("yes" if row.fits else "no")
        mark = "  <- auto" if choice.chosen and (row.plan, row.weights) == (choice.chosen.name,
                                                                              choice.chosen.weights) else ""
        note = f"  ({row.note})" if row.note else ""
        lines.append(f"  {row.plan:17s} {row.weights:7s} {row.peak / gb:9.1f}GB {row.host / gb:7.1f}GB "
                     f"{row.relative_speed:6.2f}  {fits}{mark}{note}")
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
    own = {"device": engine, "parts": ["transformer", *(p for p in ("encoders", "vae") if p not in elsewhere)],
           "peak": peak, "free": free, "margin": None if free is None else margin(free),
           "fits": None if free is None else row is not None}
    others = [{**need.to_dict(), "parts": list(need.parts),
               "margin": None if need.free is None else margin(need.free)} for need in choice.devices]
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
    parser.add_argument("--device-memory", default=None,
                        help="free device memory to plan for, e.g. 24GB (10^9 bytes) or 24GiB, on each card (with "
                             "--placement: every card it names; a cpu there is the host's); default: what each "
                             "device has free now")
    parser.add_argument("--working-resolution", default="auto", help="auto | draft | a side in pixels (square)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        config = from_namespace(args)
        return _run(config, args)
    except (ConfigError, ValueError) as exc:  # PlanRefused is a ValueError
        print(f"plan: {exc}", file=sys.stderr)
        return 2


def _run(config, args) -> int:
    import torch


    free = parse_bytes(args.device_memory) if args.device_memory else None
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
    choice = plan_for(config, device, dtype, free=free, working_size=size, prefetch=True if free is not None else None,
                      other_free=other_free)
    free = choice.free
    devices = _per_device(choice, placed.get("transformer", device.torch_device), free) if placed else None
    if args.json:
        report = {"variant": config.variant, "working_size": list(size), "dtype": str(dtype),
                  "free": free, "margin": None if free is None else margin(free),
                  "rows": [r.to_dict() for r in choice.rows],
                  "chosen": choice.chosen.to_dict() if choice.chosen else None,
                  "refusal": choice.refusal}
        if devices is not None:
            report["devices"] = devices
        print(json.dumps(report, indent=2))
    else:
        what = "full profile (release dimensions)" if config.uses_tiny_model and config.tiny_profile == "full" \
            else ("tiny " + config.tiny_profile if config.uses_tiny_model else "configured model")
        memory = "unknown" if free is None else f"{free / 1e9:.1f} GB free (margin {margin(free) / 1e9:.1f} GB)"
        header = (f"{config.variant}, {what}, {size[0]}x{size[1]}, compute {str(dtype).replace('torch.', '')}, "
                  f"{memory}")
        print(_table(choice, header))
        if devices is not None:
            print(_device_lines(devices))
    return 0 if choice.chosen is not None else 1
