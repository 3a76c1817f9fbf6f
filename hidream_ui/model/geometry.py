"""Sizes derived from the transformer and VAE configs: working sides, token budget."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hidream_ui.model.sources import ModelSources


@dataclass(frozen=True)
class Geometry:
    """Sizes derived from the transformer and VAE configs (so the tiny model scales the same rules).

    `image_size` is the side of the largest working area for E1.1 (1024 for the real model),
    `e1_full_side` the fixed E1-Full working side (768), `max_seq` the token budget the
    transformer pads non-square inputs to (E1.1: 8192, E1-Full: 4608 for the real model).
    """

    vae_scale: int
    patch_size: int
    image_size: int
    e1_full_side: int
    max_seq: int

    @property
    def multiple(self) -> int:
        return self.vae_scale * self.patch_size


def geometry_for(variant: str, transformer_config, vae_config) -> Geometry:
    vae_scale = 2 ** (len(vae_config["block_out_channels"]) - 1)
    patch = int(transformer_config["patch_size"])
    res = transformer_config["max_resolution"]
    base_tokens = int(res[0]) * int(res[1]) // (patch * patch)
    unit = vae_scale * patch
    side_tokens = int(round(base_tokens**0.5))
    image_size = side_tokens * unit  # real: 64 * 16 = 1024
    # E1-Full works at 768 = 3/4 of E1.1's 1024 side; keep the ratio for smaller test models.
    e1_full_side = max(unit, (image_size * 3 // 4) // unit * unit)
    if variant == "e1.1":
        max_seq = 2 * base_tokens  # the edit input is H x 2W: twice the largest image
    else:
        max_seq = 2 * (e1_full_side // unit) ** 2
    return Geometry(
        vae_scale=vae_scale, patch_size=patch, image_size=image_size, e1_full_side=e1_full_side, max_seq=max_seq
    )


def read_geometry(sources: "ModelSources") -> Geometry:
    """The geometry from the transformer and VAE config files, without reading any weight.

    Raises OSError / ValueError / KeyError when the configs are not on local disk (a hub id, a
    tiny checkpoint not built yet) or are not HiDream configs.
    """
    transformer_root = sources.e1 if sources.variant == "e1.1" else sources.i1
    configs = []
    for folder in (Path(transformer_root) / "transformer", Path(sources.i1) / "vae"):
        configs.append(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    return geometry_for(sources.variant, configs[0], configs[1])
