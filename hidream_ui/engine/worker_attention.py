"""Switching a worker's attention strategy: at load, at run time (the System panel), and for a while
(Compare's attention axis puts back what ran before).

A mixin of `EditEngine` (engine/engine.py), which owns the state it reads: `_lock` (a switch never
lands in the middle of an edit: `torch.nn.attention.sdpa_kernel`, used by some strategies, is
process-global), `_model`, `device`, `dtype`, and the three attention fields set in its constructor.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from hidream_ui.engine.errors import EngineError

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.device.backends import DeviceInfo
    from hidream_ui.model.loading import LoadedModel

logger = logging.getLogger(__name__)

# (requested name, the strategy it resolved to, the note on a fallback at load)
AttentionState = tuple[str, "str | None", "str | None"]


class AttentionSwitching:
    """The attention half of the worker (see the module's docstring)."""

    _lock: threading.RLock
    _model: "LoadedModel | None"
    _attention_request: str
    _attention: str | None
    _attention_note: str | None
    device: "DeviceInfo"
    dtype: object

    def _apply_attention_at_load(self) -> None:
        from hidream_ui.pipeline.attention.processor import AttentionUnavailable
        from hidream_ui.pipeline.attention.registry import apply

        transformer = self._model.pipeline.transformer
        try:
            self._attention = apply(transformer, self._attention_request, self.device, self.dtype)
            self._attention_note = None
        except (AttentionUnavailable, ValueError) as exc:
            # The app must come up: use the best available strategy and say why in the status panel.
            self._attention = apply(transformer, "auto", self.device, self.dtype)
            self._attention_note = f"attention {self._attention_request!r} not used: {exc}; using {self._attention}"
            logger.warning(self._attention_note)

    @property
    def attention_request(self) -> str:
        """The strategy name as asked for (e.g. "auto"), as opposed to what it resolved to."""
        return self._attention_request

    def attention_choices(self) -> list:
        from hidream_ui.pipeline.attention.registry import list_strategies

        return list_strategies(self.device, self.dtype)

    def set_attention(self, name: str) -> str:
        """Switches the attention strategy of the loaded transformer (or the one to use at load).

        Raises EngineError with the reason when `name` is unknown or unavailable; the current
        strategy then stays active.
        """
        from hidream_ui.pipeline.attention.processor import AttentionUnavailable
        from hidream_ui.pipeline.attention.registry import apply, get_strategy, resolve

        if name is not None and not isinstance(name, str):
            raise EngineError(f"attention must be a strategy name (text), got {type(name).__name__} {name!r:.40}")
        name = (name or "").strip().lower()
        with self._lock:  # never in the middle of an edit
            try:
                get_strategy(name)
                if self._model is None:
                    resolved = resolve(name, self.device, self.dtype).name
                else:
                    resolved = apply(self._model.pipeline.transformer, name, self.device, self.dtype)
            except AttentionUnavailable as exc:
                raise EngineError(f"attention {name!r} is not available: {exc.reason}") from exc
            except ValueError as exc:
                raise EngineError(str(exc)) from exc
            self._attention_request = name
            self._attention = resolved
            self._attention_note = None
            return resolved

    def attention_state(self) -> AttentionState:
        """(requested name, the strategy it resolved to, the note on a fallback): what
        `restore_attention` puts back after a temporary switch (Compare's attention axis)."""
        return self._attention_request, self._attention, self._attention_note

    def restore_attention(self, state: AttentionState) -> None:
        """Puts back an `attention_state()`. Applies the strategy that was *running*, not the one
        asked for: a request that fell back at load (say flash_attn on a CPU) cannot be applied
        again, and re-asking it would leave the comparison's last strategy in place for everyone."""
        from hidream_ui.pipeline.attention.registry import apply

        request, resolved, note = state
        with self._lock:
            if self._model is not None and resolved is not None:
                apply(self._model.pipeline.transformer, resolved, self.device, self.dtype)
            self._attention_request, self._attention, self._attention_note = request, resolved, note


__all__ = ["AttentionState", "AttentionSwitching"]
