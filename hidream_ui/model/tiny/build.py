"""Builds the offline tiny checkpoint (`make-tiny`) and keeps one per (profile, seed) in the cache."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from hidream_ui.env_names import model_cache_variable
from hidream_ui.model.fp8 import read_tensors, weight_files
from hidream_ui.model.layout import E1_FULL_DIR, E1_FULL_FILE, E11_DIR, I1_DIR, LLAMA_DIR
from hidream_ui.model.tiny import trained
from hidream_ui.model.tiny.files import _default_file_mode, _tree_bytes, _write_json
from hidream_ui.model.tiny.parts import (
    _scheduler_config,
    _write_clip,
    _write_e1_full,
    _write_llama,
    _write_model_index,
    _write_t5,
    _write_transformer,
    _write_vae,
)
from hidream_ui.model.tiny.profiles import (
    COMFYUI_PREFIX,
    FORMAT_VERSION,
    MARKER_FILENAME,
    PROFILES,
    SINGLE_FILE_DIR,
    SINGLE_FILES,
    TinyMarker,
    TinyProfile,
)
from hidream_ui.model.tiny.tokenizers import _Vocabularies

logger = logging.getLogger(__name__)


def default_cache_root() -> Path:
    """Where ``ensure_tiny`` keeps its builds: ``$HIDREAM_MODEL_CACHE`` (or its deprecated old name
    ``$HIDREAM_UI_CACHE``) if set, else ``~/.cache/hidream_ui``."""
    configured = model_cache_variable()
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "hidream_ui"


def read_marker(path: str | os.PathLike[str]) -> TinyMarker | None:
    """Return the marker of a tiny build at ``path``, or None if ``path`` is not one (or the marker is broken)."""
    marker_path = Path(path) / MARKER_FILENAME
    try:
        data = json.loads(marker_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    profile, seed, version = data.get("profile"), data.get("seed"), data.get("format_version")
    if not isinstance(profile, str) or type(seed) is not int or type(version) is not int:
        return None
    return TinyMarker(profile=profile, seed=seed, format_version=version)


def is_tiny_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is the top folder of a finished tiny build (of any profile, seed or format version)."""
    return read_marker(path) is not None


def build_tiny(
    out_dir: str | os.PathLike[str], profile: str = "tiny", seed: int = 0, *, trained_weights: bool = True
) -> Path:
    """Build the tiny checkpoint for ``profile``/``seed`` into ``out_dir`` and return ``out_dir``.

    The tree is written into a temporary sibling folder and renamed into place, so ``out_dir`` is either absent,
    the previous content, or the complete new build, never half written. An existing non-empty ``out_dir`` is only
    replaced if it is itself a tiny build (it carries the marker file); anything else raises ``FileExistsError``.
    A profile with trained weights (``trained``) gets them unless ``trained_weights`` is False (what
    `train-tiny` starts from: the same tree with random weights).
    """
    spec = _resolve_profile(profile)
    seed = _check_seed(seed)
    out_dir = Path(out_dir).expanduser().absolute()
    _refuse_foreign_folder(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    staging = _build_in_staging(out_dir, spec, seed, trained_weights=trained_weights)
    try:
        _refuse_foreign_folder(out_dir)  # again: something may have appeared while we were building
        if out_dir.exists() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        if out_dir.exists():
            # A previous tiny build: move it aside first so the swap is two renames, then delete it.
            retired = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            os.rename(out_dir, retired)
            try:
                os.rename(staging, out_dir)
            except BaseException:
                os.rename(retired, out_dir)
                raise
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def tiny_path(profile: str = "tiny", seed: int = 0, cache_root: str | os.PathLike[str] | None = None) -> Path:
    """Where `ensure_tiny` keeps the build for ``profile``/``seed`` (built or not)."""
    spec = _resolve_profile(profile)
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    name = f"tiny-{spec.name}-seed{_check_seed(seed)}-v{FORMAT_VERSION}"
    if spec.weights_asset:  # new weights in the repository, new cache entry
        name += "-" + trained.asset_digest(trained.asset_dir(spec.weights_asset))
    return root.absolute() / name


def ensure_tiny(profile: str = "tiny", seed: int = 0, cache_root: str | os.PathLike[str] | None = None) -> Path:
    """Return the cached tiny build for ``profile``/``seed``, building it on first use.

    The build lives in ``<cache_root>/tiny-<profile>-seed<seed>-v<FORMAT_VERSION>``. Concurrent callers are safe:
    each builds in its own temporary folder and renames it into place; a caller that loses the race discards its
    copy and returns the winner's.
    """
    spec = _resolve_profile(profile)
    seed = _check_seed(seed)
    target = tiny_path(profile, seed, cache_root)
    root = target.parent
    expected = TinyMarker(profile=spec.name, seed=seed, format_version=FORMAT_VERSION)
    if read_marker(target) == expected:
        return target
    _refuse_unexpected_cache_entry(target, expected)
    root.mkdir(parents=True, exist_ok=True)

    staging = _build_in_staging(target, spec, seed)
    try:
        if target.exists() and not any(target.iterdir()):
            target.rmdir()
        os.rename(staging, target)
    except OSError:
        # Lost the race (the target appeared meanwhile and is not empty): keep the winner's finished build.
        shutil.rmtree(staging, ignore_errors=True)
        if read_marker(target) != expected:
            raise
        logger.info("another process finished %s first; discarded this build", target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def main(argv: list[str] | None = None) -> int:
    """``make-tiny DIR [--profile tiny|bench] [--seed N]``: build a tiny checkpoint and print a short summary."""
    parser = argparse.ArgumentParser(
        prog="python -m hidream_ui make-tiny",
        description="Write a random-weight HiDream checkpoint (I1-Full, E1-1, E1-Full, Llama-3.1) in the "
        "upstream folder layout, for offline tests and demos.",
    )
    parser.add_argument(
        "dir", type=Path, metavar="DIR", help="output folder (must be absent, empty or a previous tiny build)"
    )
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="tiny",
        help="tiny: a few MB; bench: real attention geometry, ~3 GB (default: tiny)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed; same seed, same bytes (default: 0)")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    try:
        out = build_tiny(args.dir, profile=args.profile, seed=args.seed)
    except (FileExistsError, ValueError) as error:
        print(f"make-tiny: error: {error}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started

    print(f"Built HiDream tiny checkpoint (profile={args.profile}, seed={args.seed}) in {out}")
    total = 0
    for child in sorted(out.iterdir()):
        if child.is_dir():
            size = _tree_bytes(child)
            total += size
            print(f"  {child.name + '/':<26} {size:>15,d} bytes")
    total += (out / MARKER_FILENAME).stat().st_size
    print(f"  total {total:,d} bytes in {seconds:.1f} s")
    return 0


# --------------------------------------------------------------------------------------------------------------
# Orchestration


def _resolve_profile(profile: str) -> TinyProfile:
    try:
        return PROFILES[profile]
    except KeyError:
        raise ValueError(f"unknown tiny profile {profile!r}; choose one of {', '.join(sorted(PROFILES))}") from None


def _check_seed(seed: int) -> int:
    if type(seed) is not int or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return seed


def _refuse_foreign_folder(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a folder; choose another output path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not is_tiny_checkpoint(out_dir):
        raise FileExistsError(
            f"{out_dir} is not empty and is not a previous tiny build (no {MARKER_FILENAME}); refusing to "
            "overwrite it. Choose an empty or new folder, or delete this one yourself."
        )


def _refuse_unexpected_cache_entry(target: Path, expected: TinyMarker) -> None:
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        found = read_marker(target)
        what = f"a tiny build with marker {found}" if found else "something that is not a tiny build"
        raise FileExistsError(f"cache entry {target} holds {what}, expected {expected}; delete it so it can be rebuilt")


def _build_in_staging(final_path: Path, spec: TinyProfile, seed: int, trained_weights: bool = True) -> Path:
    """Build the whole tree into a fresh hidden sibling of ``final_path`` and return that folder."""
    final_path.parent.mkdir(parents=True, exist_ok=True)
    staging = final_path.with_name(f".{final_path.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        if trained_weights:
            _build_tree(staging, spec, seed)
        else:  # only train-tiny asks for this (the three-argument call is the one tests stand in for)
            _build_tree(staging, spec, seed, trained_weights=False)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def _build_tree(root: Path, spec: TinyProfile, seed: int, trained_weights: bool = True) -> None:
    """Write every component of one build into ``root`` (an empty folder); the marker goes last."""
    started = time.perf_counter()
    vocab = _Vocabularies.build(spec.extra_words)
    _write_llama(root / LLAMA_DIR, vocab, seed, max_length=spec.text_tokens)
    i1 = root / I1_DIR
    _write_model_index(i1)
    _write_json(i1 / "scheduler" / "scheduler_config.json", _scheduler_config())
    _write_clip(i1 / "text_encoder", i1 / "tokenizer", vocab, seed, big=False)
    _write_clip(i1 / "text_encoder_2", i1 / "tokenizer_2", vocab, seed, big=True)
    _write_t5(i1 / "text_encoder_3", i1 / "tokenizer_3", vocab, seed, max_length=spec.text_tokens)
    _write_vae(i1 / "vae", seed, spec)
    _write_transformer(i1 / "transformer", spec, seed, stream="i1/transformer")
    _write_transformer(root / E11_DIR / "transformer", spec, seed, stream="e1_1/transformer")
    _write_e1_full(root / E1_FULL_DIR / E1_FULL_FILE, spec, seed)
    if spec.name == "tiny":  # two more copies of the transformer: cheap here, ~2.9 GB for the bench profile
        _write_single_files(root / SINGLE_FILE_DIR, root / E11_DIR / "transformer")
    if spec.weights_asset and trained_weights:
        trained.overlay(root, trained.asset_dir(spec.weights_asset))
    marker = {
        "builder": "hidream_ui.tiny",
        "format_version": FORMAT_VERSION,
        "profile": spec.name,
        "seed": seed,
        "layout": {
            "llama": LLAMA_DIR,
            "i1": I1_DIR,
            "e1_1": E11_DIR,
            "e1_full": f"{E1_FULL_DIR}/{E1_FULL_FILE}",
            "single_file": (
                {kind: f"{SINGLE_FILE_DIR}/{name}" for kind, name in SINGLE_FILES.items()}
                if spec.name == "tiny"
                else None
            ),
        },
    }
    _write_json(root / MARKER_FILENAME, marker)
    logger.info("built tiny %s (seed %d) in %.1f s", spec.name, seed, time.perf_counter() - started)


def _write_single_files(folder: Path, transformer: Path) -> None:
    """The E1.1 transformer as one file, twice: diffusers keys, and ComfyUI's repackaged layout."""
    from safetensors.torch import save_file

    tensors = {key: value for path in weight_files(transformer) for key, value in read_tensors(path)}
    folder.mkdir(parents=True, exist_ok=True)
    mode = _default_file_mode(folder)
    for kind, prefix in (("diffusers", ""), ("comfyui", COMFYUI_PREFIX)):
        path = folder / SINGLE_FILES[kind]
        save_file({prefix + key: value for key, value in tensors.items()}, str(path), metadata={"format": "pt"})
        os.chmod(path, mode)
