"""`python -m hidream_ui acceptance --out DIR [model and device flags]`: the one run to send back.

Runs, on the configured model and device, each step below and records what it saw: `doctor`; an
exactness check (padding collapse on vs off, the upstream computation, on two edits); seconds per step
for each Speed setting, `--compile blocks` and `--moe sync-free`; the device's measured peak for each
memory plan the planner says fits, beside its prediction; each available attention strategy's time; three
sample edits saved as images. Writes DIR/report.json, DIR/report.md and DIR/acceptance.zip (the two
reports and the samples): the zip is what to share (docs/trace-and-acceptance.md).

A step that cannot run on the device is "skipped" with the reason; one that runs out of memory is
"oom"; any other failure is "error" with its message. None stops the run. Exit 0 when no step erred.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

INSTRUCTIONS = ("make the sky purple", "turn the scene into a watercolor painting", "add snow on the ground")
SAMPLE_SEED = 0
STEP_NAMES = ("doctor", "exactness", "speed", "compile", "moe", "memory", "attention", "samples")


class Skip(Exception):
    """A step that cannot run here; its message is the reason."""


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory of any backend (torch.OutOfMemoryError, NPU's and CPU allocators' RuntimeErrors)."""
    import torch

    if isinstance(exc, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "failed to allocate" in text


def _source_image(path: str | None, side: int):
    """The user's image, or a synthetic one (sky, ground, a sun) when none is given."""
    from PIL import Image, ImageDraw

    if path:
        from hidream_ui.imaging import open_image

        return open_image(path)
    image = Image.new("RGB", (side, side), (120, 170, 230))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, side * 2 // 3, side, side), fill=(70, 130, 60))
    draw.ellipse((side // 8, side // 8, side // 3, side // 3), fill=(250, 220, 90))
    return image


class Runner:
    """Holds the run's settings and the engine currently loaded (one at a time: memory)."""

    def __init__(self, config, args):
        self.config = config
        self.args = args
        self.image = _source_image(args.image, args.image_side)
        self._engine = None
        self._engine_key = None

    # ------------------------------------------------------------------ engines
    def engine(self, **changes):
        """The device's engine for the config with `changes` (compile, moe, memory, weights): the one
        worker of a pool of one (acceptance measures one card, attention switches included); the
        previous one is released first so two models never share the device."""
        from hidream_ui.engine.pool import EnginePool

        key = tuple(sorted(changes.items()))
        if self._engine is not None and self._engine_key == key:
            return self._engine
        self.release()
        self._engine = EnginePool.for_config(dataclasses.replace(self.config, **changes), limit=1).primary
        self._engine_key = key
        return self._engine

    def release(self) -> None:
        engine, self._engine, self._engine_key = self._engine, None, None
        device = engine.device if engine is not None and engine.loaded else None
        del engine
        gc.collect()
        if device is not None:
            from hidream_ui.device.backends import default_backends

            backend = default_backends().get(device.type)
            if backend is not None:
                backend.empty_cache()

    def edit(self, engine, instruction: str, **params):
        from hidream_ui.edits import EditParams, EditRequest

        values = EditParams.defaults_for(self.config.variant, instruction).to_dict()
        values.update(
            num_inference_steps=self.args.steps, seed=SAMPLE_SEED, working_resolution=self.args.working_resolution
        )
        values.update(params)
        request = EditRequest(image=self.image, params=EditParams.from_dict(values), source_name="acceptance.png")
        return engine.edit(request, save=False)

    def timed(self, engine, **params) -> dict:
        result = self.edit(engine, INSTRUCTIONS[0], **params)
        return {
            "seconds_per_step": round(result.timings.per_step, 4),
            "denoise_s": round(result.timings.denoise, 3),
            "working_size": list(result.working_size),
            "peak_memory_bytes": result.peak_memory_bytes,
        }

    @property
    def on_cpu(self) -> bool:
        from hidream_ui.device.detect import resolve_device

        return resolve_device(self.config.device).type == "cpu"

    # ------------------------------------------------------------------ steps
    def doctor(self) -> dict:
        from hidream_ui.cli.doctor import collect

        report = collect(self.config)
        return {"ok": report.get("ok"), "report": report}

    def exactness(self) -> dict:
        import numpy as np

        engine = self.engine()
        edits = []
        for instruction in INSTRUCTIONS[:2]:
            on = np.asarray(self.edit(engine, instruction, collapse_padding=True).image, dtype=np.int16)
            off = np.asarray(self.edit(engine, instruction, collapse_padding=False).image, dtype=np.int16)
            diff = np.abs(on - off)
            edits.append(
                {
                    "instruction": instruction,
                    "max_abs_diff": int(diff.max()),
                    "mean_abs_diff": round(float(diff.mean()), 4),
                }
            )
        # Collapsing the padding drops keys the upstream mask zeroes: equal up to reduction order.
        return {
            "edits": edits,
            "identical": all(e["max_abs_diff"] == 0 for e in edits),
            "close": all(e["mean_abs_diff"] <= 1.0 for e in edits),
        }

    def speed(self) -> dict:
        from hidream_ui.pipeline.speed.settings import SPEED_PRESETS

        engine = self.engine()
        out = {}
        try:
            for name in SPEED_PRESETS:
                engine.set_speed(name)
                out[name] = self.timed(engine)
        finally:
            engine.set_speed("exact")
        return {"settings": out}

    def compile(self) -> dict:
        if self.on_cpu:
            raise Skip(
                "torch.compile of the blocks is measured on an accelerator (on CPU it compiles for minutes "
                "and says nothing about the card)"
            )
        # --compile blocks needs the sync-free MoE (config validation ties them).
        engine = self.engine(compile="blocks", moe="sync-free")
        first = self.timed(engine)  # includes the compilation
        return {"first_edit": first, "steady": self.timed(engine)}

    def moe(self) -> dict:
        return {"sync_free": self.timed(self.engine(moe="sync-free")), "default": self.timed(self.engine())}

    def memory(self) -> dict:
        import torch

        from hidream_ui.device.detect import resolve_device, resolve_dtype
        from hidream_ui.model.planner import plan_for

        device = resolve_device(self.config.device)
        if device.type == "cpu":
            raise Skip(
                "a device peak needs an accelerator's allocator counters (on CPU the peak is the process's "
                "RSS, shared with everything else)"
            )
        dtype = resolve_dtype(self.config.dtype, device)
        self.release()  # the free memory the planner reads must not include a model loaded by an earlier step
        # Every plan and storage (not only the configured one); which fit is decided at the largest working size.
        choice = plan_for(dataclasses.replace(self.config, memory="auto", weights="auto"), device, dtype)
        element = torch.tensor([], dtype=dtype).element_size()
        rows = []
        for row in choice.rows:
            entry = {
                "plan": row.plan,
                "weights": row.weights,
                "predicted_peak_largest_size": row.peak,
                "fits": row.fits,
                "note": row.note,
            }
            if not row.fits or row.note:
                entry["status"] = "skipped"
                entry["reason"] = row.note or "the planner predicts it does not fit"
            else:
                entry.update(_guarded(lambda r=row: self._measure_plan(r, device, element)))
            rows.append(entry)
        return {"free": choice.free, "plans": rows}

    def _measure_plan(self, row, device, element: int) -> dict:
        from hidream_ui.model.planner import estimate, read_configs, sizes_from_configs
        from hidream_ui.model.plans import use_streams

        try:
            result = self.timed(self.engine(memory=row.plan, weights=row.weights))
        finally:
            self.release()
        size = tuple(result["working_size"])
        # The prediction at the size the edit ran at (--working-resolution may be smaller than the largest).
        predicted = estimate(
            sizes_from_configs(read_configs(self.config)),
            row.plan,
            row.weights,
            size,
            element,
            prefetch=use_streams(device),
        ).peak
        peak = result["peak_memory_bytes"]
        return {
            "status": "ok",
            "predicted_peak": predicted,
            "measured_peak": peak,
            "predicted_over_measured": None if not peak else round(predicted / peak, 3),
            **result,
        }

    def attention(self) -> dict:
        engine = self.engine()
        engine.load()
        state = engine.attention_state()
        out = {}
        try:
            for status in engine.attention_choices():
                if status.name == "auto":
                    continue
                if not status.available:
                    out[status.name] = {"status": "skipped", "reason": status.reason}
                    continue

                def run(name=status.name):
                    engine.set_attention(name)
                    return {"status": "ok", **self.timed(engine)}

                out[status.name] = _guarded(run)
        finally:
            engine.restore_attention(state)
        return {"strategies": out}

    def samples(self, folder: Path) -> dict:
        engine = self.engine()
        folder.mkdir(parents=True, exist_ok=True)
        self.image.save(folder / "source.png")
        saved = []
        for i, instruction in enumerate(INSTRUCTIONS, 1):
            result = self.edit(engine, instruction)
            path = folder / f"sample-{i}.png"
            result.image.save(path)
            saved.append(
                {
                    "instruction": instruction,
                    "file": f"samples/{path.name}",
                    "seconds_per_step": round(result.timings.per_step, 4),
                }
            )
        return {"images": saved}


def _guarded(fn: Callable[[], dict]) -> dict:
    """Runs one measurement; an out-of-memory or other failure becomes its record, never the run's end."""
    started = time.perf_counter()
    try:
        out = fn()
        out.setdefault("status", "ok")
    except Skip as exc:
        out = {"status": "skipped", "reason": str(exc)}
    # Any failure of a step is data for the report (the point of the run); KeyboardInterrupt still stops.
    except Exception as exc:  # noqa: BLE001
        out = {"status": "oom" if is_oom(exc) else "error", "error": f"{type(exc).__name__}: {exc}"[:2000]}
        gc.collect()
    out["wall_s"] = round(time.perf_counter() - started, 2)
    return out


def run(config, args, out_dir: Path, steps=STEP_NAMES) -> dict:
    """Every step in `steps`; returns the report (also written as report.json / report.md / acceptance.zip)."""
    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    runner = Runner(config, args)
    actions: dict[str, Callable[[], dict]] = {
        "doctor": runner.doctor,
        "exactness": runner.exactness,
        "speed": runner.speed,
        "compile": runner.compile,
        "moe": runner.moe,
        "memory": runner.memory,
        "attention": runner.attention,
        "samples": lambda: runner.samples(out_dir / "samples"),
    }
    report: dict[str, Any] = {
        "command": "acceptance",
        "settings": {
            "variant": config.variant,
            "model": "tiny " + config.tiny_profile if config.uses_tiny_model else "configured",
            "device": config.device,
            "dtype": config.dtype,
            "steps": args.steps,
            "working_resolution": args.working_resolution,
            "image": args.image or "synthetic",
        },
        "steps": {},
    }
    for name in STEP_NAMES:
        if name not in steps:
            report["steps"][name] = {"status": "skipped", "reason": "not asked for (--only)"}
            continue
        report["steps"][name] = _guarded(actions[name])
        print(f"acceptance: {name}: {report['steps'][name]['status']}", file=sys.stderr)
    runner.release()
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["summary"] = {
        status: sorted(n for n, s in report["steps"].items() if s["status"] == status)
        for status in ("ok", "skipped", "oom", "error")
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
    (out_dir / "report.md").write_text(format_markdown(report), encoding="utf-8")
    with zipfile.ZipFile(out_dir / "acceptance.zip", "w", zipfile.ZIP_DEFLATED) as archive:
        for path in [out_dir / "report.json", out_dir / "report.md", *sorted((out_dir / "samples").glob("*.png"))]:
            if path.exists():
                archive.write(path, path.relative_to(out_dir).as_posix())
    return report


def format_markdown(report: dict) -> str:
    lines = [
        "# hidream_ui acceptance report",
        "",
        "Settings: " + ", ".join(f"{k} `{v}`" for k, v in report["settings"].items()),
        "",
        f"Wall time: {report['wall_s']} s",
        "",
        "| step | status | notes |",
        "|---|---|---|",
    ]
    for name, step in report["steps"].items():
        note = step.get("reason") or step.get("error") or _step_note(name, step)
        lines.append(f"| {name} | {step['status']} | {str(note).replace('|', '/')} |")
    lines += ["", "Details: report.json. Please share acceptance.zip (docs/trace-and-acceptance.md)."]
    return "\n".join(lines) + "\n"


def _step_note(name: str, step: dict) -> str:
    if name == "exactness" and "edits" in step:
        return ", ".join(f"max diff {e['max_abs_diff']}, mean {e['mean_abs_diff']}" for e in step["edits"])
    if name == "speed" and "settings" in step:
        return ", ".join(f"{k} {v['seconds_per_step']} s/step" for k, v in step["settings"].items())
    if name == "moe" and "sync_free" in step:
        return (
            f"sync-free {step['sync_free']['seconds_per_step']} s/step, "
            f"default {step['default']['seconds_per_step']} s/step"
        )
    if name == "attention" and "strategies" in step:
        return ", ".join(f"{k} {v.get('seconds_per_step', v['status'])}" for k, v in step["strategies"].items())
    if name == "memory" and "plans" in step:
        return ", ".join(
            f"{p['plan']}·{p['weights']} {p.get('predicted_over_measured', p.get('status'))}" for p in step["plans"]
        )
    if name == "samples" and "images" in step:
        return ", ".join(i["file"] for i in step["images"])
    return ""


def main(argv: list[str] | None = None) -> int:
    from hidream_ui.config import ConfigError, add_model_arguments, from_namespace

    parser = argparse.ArgumentParser(prog="python -m hidream_ui acceptance", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for report.json, report.md, samples/ and acceptance.zip")
    parser.add_argument("--steps", type=int, default=28, help="denoising steps per edit (default 28)")
    parser.add_argument("--working-resolution", default="auto", help="auto | draft | a side in pixels")
    parser.add_argument("--image", help="source image (default: a synthetic landscape)")
    parser.add_argument("--image-side", type=int, default=1024, help="side of the synthetic source image")
    parser.add_argument(
        "--only",
        default=",".join(STEP_NAMES),
        help=f"comma-separated steps to run (default all: {','.join(STEP_NAMES)})",
    )
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    steps = tuple(s.strip() for s in args.only.split(",") if s.strip())
    unknown = [s for s in steps if s not in STEP_NAMES]
    if unknown or args.steps < 1 or args.image_side < 16:
        print(
            f"acceptance: bad --only {unknown} / --steps {args.steps} / --image-side {args.image_side} "
            f"(steps: {', '.join(STEP_NAMES)}; steps >= 1; side >= 16)",
            file=sys.stderr,
        )
        return 2
    try:
        config = from_namespace(args)
    except ConfigError as exc:
        print(f"acceptance: {exc}", file=sys.stderr)
        return 2
    report = run(config, args, Path(args.out), steps)
    print(
        json.dumps(
            {"out": str(Path(args.out) / "acceptance.zip"), "summary": report["summary"], "wall_s": report["wall_s"]},
            indent=2,
        )
    )
    return 1 if report["summary"]["error"] else 0
