"""The trained tiny model's weights in the repository (assets/tiny_trained/) and how a build uses them.

`train-tiny` writes, and the repository ships, one folder:

```
weights.safetensors   every tensor of the six parts, bf16, keyed "<part>/<key as in the part's own files>"
trained.json          the VAE's latent shift/scale (its config.json needs them) and how the weights were made
```

`overlay` replaces the random tensors of a finished tiny build with these, file by file, so the tree keeps
the exact layout, key names and sharding of every other profile and loads through the usual path.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from hidream_ui.model.layout import E1_FULL_DIR, E1_FULL_FILE, E11_DIR, I1_DIR, LLAMA_DIR
from hidream_ui.model.tiny.files import _default_file_mode, _write_json

if TYPE_CHECKING:  # pragma: no cover
    import torch

ASSETS_DIR = Path(__file__).resolve().parents[3] / "assets"
WEIGHTS_FILE = "weights.safetensors"
META_FILE = "trained.json"

# Folder of the build (relative to its root) -> the part its weight files hold.
PART_FOLDERS: Mapping[str, str] = {
    LLAMA_DIR: "llama",
    f"{I1_DIR}/text_encoder": "clip_l",
    f"{I1_DIR}/text_encoder_2": "clip_g",
    f"{I1_DIR}/text_encoder_3": "t5",
    f"{I1_DIR}/vae": "vae",
    f"{I1_DIR}/transformer": "transformer",
    f"{E11_DIR}/transformer": "transformer",
    "single_file": "transformer",
}


def asset_dir(name: str) -> Path:
    return ASSETS_DIR / name


def asset_digest(folder: Path) -> str:
    """Short digest of the shipped weights and metadata: the cache folder's name carries it, so new weights
    never reuse an old build."""
    digest = hashlib.sha256()
    for name in (WEIGHTS_FILE, META_FILE):
        path = folder / name
        try:
            digest.update(path.read_bytes())
        except OSError as error:
            raise FileNotFoundError(
                f"trained tiny weights missing: {path} ({error.strerror}); run `python -m hidream_ui train-tiny "
                f"{folder}` or restore the file from git"
            ) from None
    return digest.hexdigest()[:10]


def read_meta(folder: Path) -> dict[str, Any]:
    return json.loads((folder / META_FILE).read_text(encoding="utf-8"))


# trained.json's record of the last held-out evaluation (`train-tiny --eval N`): what the banner quotes.
HELD_OUT_KEY = "held_out"


def record_held_out(folder: Path, summary: Mapping[str, Any], command: str) -> None:
    """Writes an evaluation's summary (`train-tiny --eval N`) into the folder's trained.json, with its command."""
    meta = read_meta(folder)
    meta[HELD_OUT_KEY] = {**summary, "command": command}
    _write_json(folder / META_FILE, meta)


def held_out_success(folder: Path) -> tuple[float, int] | None:
    """(success rate, cases) of the weights' recorded held-out evaluation; None when none was recorded."""
    try:
        record = read_meta(folder).get(HELD_OUT_KEY) or {}
    except (OSError, ValueError):
        return None
    success, cases = record.get("success"), record.get("cases")
    if not isinstance(success, (int, float)) or not isinstance(cases, int) or cases < 1:
        return None
    return float(success), cases


# trained.json's MagCache calibration of these weights (`train-tiny OUT --calibrate-magcache N`): the build
# writes it where the loader looks for a checkpoint's ratios (pipeline/speed/mag_ratios.py).
MAG_RATIOS_KEY = "mag_ratios"


def record_mag_ratios(folder: Path, ratios: Mapping[str, Any], command: str) -> None:
    meta = read_meta(folder)
    meta[MAG_RATIOS_KEY] = {**ratios, "command": command}
    _write_json(folder / META_FILE, meta)


def overlay(root: Path, folder: Path) -> None:
    """Put the trained tensors of ``folder`` into the tiny build at ``root`` (all of them: a key the build has
    and the asset lacks, or a shape that differs, is an error naming it). E1-Full's LoRA gets zero B matrices
    and the trained plain keys, so that variant runs the same trained transformer."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / WEIGHTS_FILE))
    meta = read_meta(folder)
    replace_parts(root, tensors)
    lora = root / E1_FULL_DIR / E1_FULL_FILE
    if lora.is_file():
        stored = load_file(str(lora))
        new = {
            key: (torch.zeros_like(value) if ".lora_B." in key else value)
            if "lora_" in key
            else _take(tensors, "transformer", key, value, lora)
            for key, value in stored.items()
        }
        save_file(new, str(lora), metadata={"format": "pt"})
        os.chmod(lora, _default_file_mode(lora.parent))
    vae_config = root / I1_DIR / "vae" / "config.json"
    config = json.loads(vae_config.read_text(encoding="utf-8"))
    config.update(
        {"scaling_factor": float(meta["vae"]["scaling_factor"]), "shift_factor": float(meta["vae"]["shift_factor"])}
    )
    _write_json(vae_config, config)
    if meta.get(MAG_RATIOS_KEY):
        from hidream_ui.pipeline.speed import mag_ratios

        ratios = mag_ratios.MagRatios.from_json(meta[MAG_RATIOS_KEY], f"{folder / META_FILE} {MAG_RATIOS_KEY}")
        mag_ratios.write(root / E11_DIR / "transformer", ratios)


def replace_parts(root: Path, tensors: Mapping[str, "torch.Tensor"], parts: Iterable[str] | None = None) -> None:
    """Rewrite the weight files of `parts` (default: every part) in the tiny build at ``root`` with `tensors`,
    keyed as in weights.safetensors (every key of those files is needed: a missing one is an error naming it)."""
    from safetensors.torch import load_file, save_file

    wanted = None if parts is None else set(parts)
    for relative, part in PART_FOLDERS.items():
        target = root / relative
        if not target.is_dir() or (wanted is not None and part not in wanted):
            continue
        mode = _default_file_mode(target)
        for path in sorted(target.glob("*.safetensors")):
            stored = load_file(str(path))
            prefix = "model.diffusion_model." if path.name.endswith("comfyui_bf16.safetensors") else ""
            new = {key: _take(tensors, part, key[len(prefix) :], value, path) for key, value in stored.items()}
            save_file(new, str(path), metadata={"format": "pt"})
            os.chmod(path, mode)


def _take(tensors: Mapping[str, "torch.Tensor"], part: str, key: str, like: "torch.Tensor", path: Path):
    name = f"{part}/{key}"
    value = tensors.get(name)
    if value is None:
        raise KeyError(
            f"trained weights have no {name!r} (needed by {path}): the asset and the profile disagree; "
            "retrain with `python -m hidream_ui train-tiny`"
        )
    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(f"trained weight {name!r} has shape {tuple(value.shape)}, {path} needs {tuple(like.shape)}")
    return value.to(like.dtype).contiguous()


def part_tensors(root: Path) -> dict[str, "torch.Tensor"]:
    """Every tensor of the build at ``root`` keyed as in weights.safetensors (one copy of the transformer)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for relative, part in PART_FOLDERS.items():
        folder = root / relative
        if part == "transformer" and relative != f"{E11_DIR}/transformer":
            continue
        for path in sorted(folder.glob("*.safetensors")):
            out.update({f"{part}/{key}": value for key, value in load_file(str(path)).items()})
    return out


def write_asset(folder: Path, tensors: Mapping[str, "torch.Tensor"], meta: Mapping[str, Any]) -> None:
    """The asset layout: bf16 tensors in one file (sorted keys, so the bytes depend on the values only)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {key: tensors[key].detach().to("cpu", torch.bfloat16).contiguous() for key in sorted(tensors)},
        str(folder / WEIGHTS_FILE),
        metadata={"format": "pt"},
    )
    os.chmod(folder / WEIGHTS_FILE, _default_file_mode(folder))  # safetensors leaves 0o600
    _write_json(folder / META_FILE, dict(meta))
