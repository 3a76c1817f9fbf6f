"""`python -m hidream_ui edit --image IN --instruction TEXT [--mask PATH] [--out PATH] [parameters]`.

Runs one edit through the same engine as the app and prints a JSON summary. With no model
configured it runs on the offline tiny model (the summary says which and what it can do, and
`instruction_note` names the words of an instruction that model has never seen).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from hidream_ui.cli.quiet import StepBar, add_verbose_argument, quiet_libraries
from hidream_ui.config import ConfigError, add_model_arguments, from_namespace
from hidream_ui.edits import add_edit_arguments


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hidream_ui edit", description=__doc__.splitlines()[0])
    parser.add_argument("--image", required=True, help="source image file")
    parser.add_argument(
        "--mask",
        help="region edit: an image of the source's shape, white = may change, black = "
        "keep (with transparency: painted = may change)",
    )
    parser.add_argument("--out", help="also copy the result PNG (with its metadata) to this path")
    add_edit_arguments(parser)  # one flag per field of hidream_ui.edits.FIELDS
    add_model_arguments(parser)
    add_verbose_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    quiet_libraries(args.verbose)  # before torch, transformers and diffusers are imported
    import dataclasses

    from hidream_ui.edits import EditRequest, RequestError, params_from_args, validated_mask
    from hidream_ui.engine.errors import EngineError
    from hidream_ui.engine.pool import EnginePool
    from hidream_ui.engine.runner import JobEvent, run_job
    from hidream_ui.imaging import ImageError, open_image, open_mask
    from hidream_ui.results import file_sha256

    try:
        config = from_namespace(args)
        params = params_from_args(args, config.variant)
        if args.mask:
            mask = validated_mask(open_mask(args.mask), Path(args.mask).name)
            params = dataclasses.replace(params, mask=mask).validated()
        request = EditRequest(
            image=open_image(args.image),
            params=params,
            source_name=Path(args.image).name,
            source_sha256=file_sha256(args.image),
        ).validated()
        # --devices / HIDREAM_DEVICES: one edit runs on the first device (the others are not loaded).
        engine = EnginePool.for_config(config, limit=1)
        bar = StepBar("edit")  # stderr: stdout carries only the JSON summary

        def on_event(event: JobEvent) -> None:
            if event.kind == "step":
                bar.update(event.payload)

        try:  # saved by the engine's result store (mask file, `parent`, sidecar), as the Edit tab's
            result = run_job(lambda emit: engine.edit(request, lambda info: emit("step", info)), on_event)
        finally:
            bar.close()
    except (ConfigError, RequestError, ImageError, EngineError) as exc:
        print(json.dumps({"ok": False, "error": str(exc)}), file=sys.stdout)
        return 1
    if args.out and result.saved_png is not None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(result.saved_png, args.out)
    summary = {
        "ok": True,
        "output": str(args.out or result.saved_png),
        "saved_png": str(result.saved_png),
        "saved_json": str(result.saved_json),
        "seed": result.params.seed,
        "working_size": list(result.working_size),
        "source_size": list(result.source_size),
        "timings": result.timings.to_dict(),
        "peak_memory_bytes": result.peak_memory_bytes,
        "mask": (result.saved_metadata or {}).get("mask"),
        "parent": (result.saved_metadata or {}).get("parent"),
        **{k: getattr(result.info, k) for k in ("variant", "model_source", "device", "dtype", "attention")},
    }
    if result.info.model_source == "tiny" and not config.uses_trained_tiny_model:
        summary["note"] = "tiny random-weight model: the output is noise; use --model-dir for real weights"
    elif result.info.model_source == "tiny":
        from hidream_ui.model.tiny import world

        summary["note"] = (
            f"offline tiny model trained on a world of coloured shapes: it knows {world.instruction_forms('')}; "
            "use --model-dir for real weights"
        )
        # Words it has never seen: the edit ran, and this says why the result may be a guess.
        instruction_note = world.vocabulary_note(result.params.instruction)
        if instruction_note:
            summary["instruction_note"] = instruction_note
    print(json.dumps(summary, indent=2))
    return 0
