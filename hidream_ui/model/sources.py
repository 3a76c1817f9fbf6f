"""Where each part of the model comes from (explicit part > --model-dir > the tiny checkpoint), and a
check that names exactly what is missing before a multi-minute load starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from hidream_ui.model.errors import ModelError  # noqa: F401  re-exported: callers import it from here
from hidream_ui.model.layout import E1_FULL_DIR, E1_FULL_FILE, E11_DIR, HUB_IDS, I1_COMPONENTS, I1_DIR, LLAMA_DIR
from hidream_ui.model.settings import ModelSettings
from hidream_ui.model.tiny import build
from hidream_ui.model.tiny.profiles import FULL_PROFILE_NAME


@dataclass(frozen=True)
class ModelSources:
    """Resolved locations of the three parts a variant needs."""

    variant: str
    llama: str
    i1: str
    e1: str
    kind: str  # "tiny" or "real"
    tiny_profile: str | None = None

    def to_dict(self, *, names_only: bool = False) -> dict:
        """The sources as JSON; `names_only` gives each local part's folder name, not its absolute
        path (what an app without login may show of the server's disk; hub ids stay as they are)."""

        def shown(source: str) -> str:
            return Path(source).name if names_only and os.path.isabs(source) else source

        return {
            "variant": self.variant,
            "kind": self.kind,
            "llama": shown(self.llama),
            "i1": shown(self.i1),
            "e1": shown(self.e1),
            "tiny_profile": self.tiny_profile,
        }


def resolve_sources(config: ModelSettings, *, build_tiny: bool = True) -> ModelSources:
    """Decides where each part comes from: explicit part > --model-dir > the tiny checkpoint."""
    if config.uses_tiny_model:
        # The full profile is made in memory (model/tiny/in_memory.py); its tokenizers, scheduler and config
        # keys come from the tiny build.
        on_disk = "tiny" if config.tiny_profile == FULL_PROFILE_NAME else config.tiny_profile
        if build_tiny:
            base = build.ensure_tiny(profile=on_disk, seed=config.tiny_seed)
        else:
            base = build.tiny_path(profile=on_disk, seed=config.tiny_seed)
        return _sources_in(base, config.variant, kind="tiny", tiny_profile=config.tiny_profile)
    base = config.model_dir
    e1_default = E11_DIR if config.variant == "e1.1" else E1_FULL_DIR

    def pick(explicit: str | None, folder: str, hub_key: str) -> str:
        if explicit:
            return explicit
        if base is not None:
            return str(base / folder)
        return HUB_IDS[hub_key]

    kind = "real"
    if base is not None and _is_tiny(base):
        kind = "tiny"
    return ModelSources(
        variant=config.variant,
        llama=pick(config.llama, LLAMA_DIR, "llama"),
        i1=pick(config.i1, I1_DIR, "i1"),
        e1=pick(config.e1, e1_default, config.variant),
        kind=kind,
    )


def _is_tiny(base: Path) -> bool:
    return (Path(base) / "hidream_ui_tiny.json").is_file()


def _sources_in(base: Path, variant: str, *, kind: str, tiny_profile: str | None = None) -> ModelSources:
    e1 = base / (E11_DIR if variant == "e1.1" else E1_FULL_DIR)
    return ModelSources(
        variant=variant,
        llama=str(base / LLAMA_DIR),
        i1=str(base / I1_DIR),
        e1=str(e1),
        kind=kind,
        tiny_profile=tiny_profile,
    )


def _is_local(source: str) -> bool:
    # A hub id is "org/name" and does not exist on disk; anything that exists, or looks like a path, is local.
    return os.path.exists(source) or source.startswith((".", "/", "~")) or source.count("/") != 1


# ----------------------------------------------------------------------------------------------
# Verification: name exactly what is missing before a multi-minute load starts.
# ----------------------------------------------------------------------------------------------


def _check_weights_folder(folder: Path, index_name: str, single_name: str, problems: list[str]) -> None:
    """Checks a folder with either one safetensors file or an index naming its shards."""
    index = folder / index_name
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            problems.append(f"{index}: unreadable index ({exc})")
            return
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).is_file():
                problems.append(f"{folder / shard}: shard listed in {index.name} is missing")
    elif not (folder / single_name).is_file():
        problems.append(f"{folder}: no {index_name} and no {single_name}")


def _check_diffusers_folder(folder: Path, problems: list[str]) -> None:
    """A diffusers model folder (transformer, vae): its config and its weights, sharded or one file."""
    _check_config(folder, problems)
    _check_weights_folder(
        folder, "diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model.safetensors", problems
    )


def _check_config(folder: Path, problems: list[str], name: str = "config.json") -> None:
    if not (folder / name).is_file():
        problems.append(f"{folder / name}: missing")


def verify_sources(sources: ModelSources) -> list[str]:
    """Returns human-readable problems (empty when every local file a load needs is present).

    Hub ids are not checked here (they need the network); their problems surface at load.
    """
    problems: list[str] = []
    if _is_local(sources.llama):
        llama = Path(sources.llama).expanduser()
        if not llama.is_dir():
            problems.append(f"{llama}: Llama folder does not exist")
        else:
            _check_config(llama, problems)
            if not (llama / "tokenizer.json").is_file():
                problems.append(f"{llama / 'tokenizer.json'}: missing")
            _check_weights_folder(llama, "model.safetensors.index.json", "model.safetensors", problems)
    if _is_local(sources.i1):
        i1 = Path(sources.i1).expanduser()
        if not i1.is_dir():
            problems.append(f"{i1}: HiDream-I1-Full folder does not exist")
        else:
            _check_config(i1, problems, "model_index.json")
            for component in I1_COMPONENTS:
                folder = i1 / component
                if not folder.is_dir():
                    problems.append(f"{folder}: missing component folder")
                    continue
                if component == "scheduler":
                    _check_config(folder, problems, "scheduler_config.json")
                elif component.startswith("tokenizer"):
                    if not any(folder.iterdir()):
                        problems.append(f"{folder}: empty tokenizer folder")
                elif component == "transformer" or component == "vae":
                    _check_diffusers_folder(folder, problems)
                else:
                    _check_config(folder, problems)
                    _check_weights_folder(folder, "model.safetensors.index.json", "model.safetensors", problems)
    if _is_local(sources.e1):
        e1 = Path(sources.e1).expanduser()
        if sources.variant == "e1.1":
            folder = e1 / "transformer"
            if not folder.is_dir():
                problems.append(f"{folder}: HiDream-E1-1 transformer folder does not exist")
            else:
                _check_diffusers_folder(folder, problems)
        else:
            path = e1 / E1_FULL_FILE if e1.is_dir() or not e1.suffix else e1
            if not path.is_file():
                problems.append(f"{path}: HiDream-E1-Full LoRA checkpoint is missing")
    return problems
