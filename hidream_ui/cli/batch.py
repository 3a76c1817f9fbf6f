"""`python -m hidream_ui batch --manifest FILE.jsonl --out DIR [--ray ADDRESS]`: dataset-scale edits.

One JSON object a line (`image`, `instruction`, optional `seed`, `mask`, `id`, `meta` and any edit
setting by its API name; see `cli/batch_manifest.py`). Writes each result as `DIR/<id or image
stem>-<settings hash>.png` with its metadata (in the PNG and a `.json` sidecar) and
`DIR/results.jsonl` (one row per line of this run: input line, output file, seed, status, error,
timings). A rerun skips every item whose output exists with the same settings hash and says how
many. Locally the items run on the engine pool (`--device` / `--devices`); with `--ray` on Ray
Data, an actor pool of engines (one per device). Either way this process saves every result
through `results.ResultStore`, as the Edit tab does (mask file, `parent`, sidecar; no retention: see `main`), and
the batch is one job of `engine/runner.py` whose `item` events are the finished items. Prints a
JSON summary on stdout, the progress bar on stderr; exit 0 when every line ran (or was skipped),
1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from hidream_ui.cli.batch_manifest import ManifestItem
from hidream_ui.cli.batch_work import ItemOutput
from hidream_ui.cli.quiet import add_verbose_argument, quiet_libraries
from hidream_ui.config import AppConfig, ConfigError, add_model_arguments, from_namespace
from hidream_ui.config_table import add_ray_token_argument

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.engine.jobs import CancelToken

RESULTS_FILE = "results.jsonl"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hidream_ui batch", description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", required=True, help="JSONL file: one edit a line (see docs/cluster.md)")
    parser.add_argument("--out", required=True, help="folder for the result PNGs and results.jsonl")
    parser.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="run on Ray Data at this cluster address (`auto`: the running local cluster; "
        "`local`: start one in this process); needs `pip install hidream_ui[ray]`",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="with --ray: engines (Ray actors) in the pool, one per device (default: the "
        "cluster's GPUs, NPUs, or 1 on CPUs)",
    )
    add_ray_token_argument(parser)
    add_model_arguments(parser)
    add_verbose_argument(parser)
    return parser


def run_local(config: AppConfig, items: list[ManifestItem], token: "CancelToken") -> Iterator[ItemOutput]:
    """The items on the local engine pool, each an edit of its own (so results equal one-by-one
    edits, and equal the Ray path's), yielded unsaved as they finish. One thread per engine keeps
    every engine busy: the pool's own batch path (`run_batch`) shares one set of settings and
    decodes every source up front, while a manifest line brings its own settings and mask."""
    from hidream_ui.cli.batch_work import ItemTask, run_item
    from hidream_ui.engine.pool import EnginePool

    pool = EnginePool.for_config(config)
    stop = threading.Event()

    def work(item: ManifestItem) -> ItemOutput:
        if stop.is_set():
            return ItemOutput(line=item.line, ok=False, error="not started: the batch was interrupted")
        return run_item(pool, ItemTask.of(item), token)

    with ThreadPoolExecutor(max_workers=pool.size, thread_name_prefix="hidream-manifest") as executor:
        futures = [executor.submit(work, item) for item in items]
        finished = False
        try:
            for future in as_completed(futures):
                yield future.result()
            finished = True
        finally:
            if not finished:  # Ctrl-C or a consumer that stops: the running edits stop after their step
                stop.set()
                token.cancel("the batch was interrupted")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    quiet_libraries(args.verbose)
    from hidream_ui.cli.batch_manifest import read_manifest
    from hidream_ui.cli.batch_work import ItemBar, clear_partial, output_done, result_row, save_item
    from hidream_ui.engine.jobs import CancelToken
    from hidream_ui.engine.runner import JobEvent, run_job
    from hidream_ui.results import ResultStore

    try:
        config = from_namespace(args)
        if args.replicas is not None and args.replicas < 1:
            raise ConfigError(f"--replicas: got {args.replicas}; expected 1 or more")
        manifest = Path(args.manifest)
        items, bad = read_manifest(manifest, config)
    except ConfigError as exc:
        print(json.dumps({"ok": False, "error": str(exc)}))
        return 1
    except OSError as exc:
        print(json.dumps({"ok": False, "error": f"--manifest: cannot read {args.manifest!r}: {exc.strerror or exc}"}))
        return 1
    token = CancelToken()
    if args.ray is not None:
        from hidream_ui.engine.ray_env import RayUnavailable, check_cluster, require_ray

        try:
            require_ray(args.ray, config.ray_token_file)
            check_cluster(args.ray, config.ray_token_file)  # a refusing head: one line, now
        except RayUnavailable as exc:
            print(json.dumps({"ok": False, "error": str(exc)}))
            return 1
        from hidream_ui.cli.batch_ray import run_ray

        def execute(todo: list[ManifestItem]) -> Iterator[ItemOutput]:
            return run_ray(config, todo, args.ray, replicas=args.replicas)
    else:

        def execute(todo: list[ManifestItem]) -> Iterator[ItemOutput]:
            return run_local(config, todo, token)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The app's one save path. No retention: it only ever prunes timestamp-named results, so a manifest's
    # `<id>-<hash>` outputs would never be pruned, and its scan of the folder after every save would make a
    # dataset-sized run quadratic in its items.
    store = ResultStore.at(out, None)
    for line in bad:
        print(f"{manifest}: line {line.line}: {line.error} (skipped)", file=sys.stderr)
    seen: set[str] = set()
    todo, skipped, duplicates = [], [], []
    for item in items:
        if output_done(out, item):
            skipped.append(item)
        elif item.stem in seen:  # the same image and settings twice: one edit, one output
            duplicates.append(item)
        else:
            seen.add(item.stem)
            clear_partial(out, item)
            todo.append(item)
    if skipped:
        print(
            f"skipping {len(skipped)} finished item(s): their outputs exist with the same settings hash",
            file=sys.stderr,
        )
    counts = {"done": 0, "errors": len(bad), "skipped": len(skipped) + len(duplicates)}
    by_line = {item.line: item for item in todo}
    with open(out / RESULTS_FILE, "w", encoding="utf-8") as rows:

        def write_row(row: dict) -> None:
            rows.write(json.dumps(row, ensure_ascii=False) + "\n")
            rows.flush()  # a killed run keeps the rows of what finished

        for line in bad:
            write_row(line.row())
        for item in skipped:
            write_row(result_row(item, "skipped"))
        bar = ItemBar(len(todo))

        def on_event(event: JobEvent) -> None:
            if event.kind != "item":
                return
            item = by_line[event.payload.line]
            output = save_item(store, item, event.payload, token)  # here, in the driver, for both paths
            counts["done" if output.ok else "errors"] += 1
            write_row(result_row(item, "ok" if output.ok else "error", output))
            bar.advance(output.ok)

        def work(emit) -> None:  # the batch is one job; each finished item one `item` event
            for output in execute(todo) if todo else ():
                emit("item", output)

        try:
            run_job(work, on_event)
        finally:
            bar.close()
        for item in duplicates:  # after the run: their output is the first line's
            write_row(
                {
                    **result_row(item, "skipped" if output_done(out, item) else "error"),
                    "error": None if output_done(out, item) else "its duplicate line failed",
                }
            )
    summary = {
        "ok": counts["errors"] == 0,
        "items": len(items) + len(bad),
        **counts,
        "bad_lines": len(bad),
        "out": str(out),
        "results": str(out / RESULTS_FILE),
        "ray": args.ray,
    }
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1
