"""The worker's status report: `status()` for the System panel and `/status`, `_info()` for each
result's metadata, and `model_facts()` (what a caller outside engine/ may know of the loaded model).

A mixin of `EditEngine` (engine/engine.py), which owns the fields read here. Nothing here takes the
device lock or syncs the device, so the panel can poll while an edit runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hidream_ui.edits import RunInfo
from hidream_ui.engine.errors import EngineError
from hidream_ui.engine.status import EngineStatus, ModelFacts, PromptCacheStats, WeightSwapStats

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.config import AppConfig
    from hidream_ui.model.loading import LoadedModel


class StatusReporting:
    """The status half of the worker (see the module's docstring)."""

    config: "AppConfig"
    _model: "LoadedModel | None"

    def model_facts(self) -> ModelFacts | None:
        """The loaded model's facts as plain data; None while nothing is loaded."""
        model = self._model
        if model is None:
            return None
        from hidream_ui.device.backends import dtype_name

        encoder = getattr(model.pipeline, "text_encoder_4", None)
        llama = encoder.config if encoder is not None else None
        keys = ("vocab_size", "hidden_size", "tie_word_embeddings")
        return ModelFacts(
            sources=model.sources,
            geometry=model.geometry,
            dtype=dtype_name(model.dtype),
            element_bytes=model.dtype.itemsize,
            plan=model.plan,
            llama_config={key: getattr(llama, key) for key in keys if hasattr(llama, key)},
        )

    def _info(self) -> RunInfo:
        import diffusers
        import torch
        import transformers

        from hidream_ui import __version__
        from hidream_ui.device.backends import dtype_name

        model = self._model
        sources = model.sources if model else None
        return RunInfo(
            variant=self.config.variant,
            model_source=self.model_source,
            model_paths=sources.to_dict(names_only=self.hide_paths) if sources else None,
            device=self.device.torch_device,
            device_name=self.device.name,
            dtype=dtype_name(self.dtype),
            attention=self._attention,
            refiner=self.config.refiner,
            engine=self.pool_label,
            memory_plan=model.plan.to_dict() if model is not None and model.plan is not None else None,
            versions={
                "hidream_ui": __version__,
                "torch": torch.__version__,
                "diffusers": diffusers.__version__,
                "transformers": transformers.__version__,
            },
        )

    def status(self) -> EngineStatus:
        """A snapshot for the status panel and `/status`. Cheap: no lock, no device sync."""
        from hidream_ui.device.backends import dtype_name
        from hidream_ui.device.memory import snapshot

        model = self._model
        status = EngineStatus(
            state=self._state,
            progress=self._progress,
            loaded=model is not None,
            variant=self.config.variant,
            model_source=self.model_source,
            tiny_profile=self.config.tiny_profile if self.config.uses_tiny_model else None,
            attention=self._attention or self._attention_request,
            attention_note=self._attention_note,
            refiner=self.config.refiner,
            text_encoders=self.config.text_encoders,
            prompt_cache=PromptCacheStats(entries=len(self._cache), hits=self._cache.hits, misses=self._cache.misses),
            counters=dict(self.counters),
            last_error=self._last_error,
            speed=self._speed.status(),
        )
        try:
            device = self.device
            status = status.replace(
                device=device.torch_device,
                device_type=device.type,
                device_name=device.name,
                dtype=dtype_name(self.dtype) if self._dtype is not None else self.config.dtype,
                memory=snapshot(device, backends=self._backends),
            )
        except EngineError as exc:
            status = status.replace(device_error=str(exc))
        if model is not None:
            swap = model.swap
            status = status.replace(
                model_paths=model.sources.to_dict(names_only=self.hide_paths),
                load_seconds=round(model.load_seconds, 3),
                memory_plan=model.plan,
                weight_swap=None
                if swap is None
                else WeightSwapStats(
                    tensors=len(swap.inactive),
                    bytes=swap.nbytes,
                    on_device=swap.on_device,
                    swaps=swap.swaps,
                    bytes_copied=swap.bytes_copied,
                ),
            )
        return status


__all__ = ["StatusReporting"]
