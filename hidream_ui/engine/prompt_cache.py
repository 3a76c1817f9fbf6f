"""`PromptCache`: the worker's bounded LRU of instruction text -> embeddings.

Text encoders (Llama 8B among them) dominate an edit's fixed cost; users re-run the same instruction
with other seeds or settings all the time, and a comparison runs one instruction in every cell.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.pipeline.edit_pipeline import PromptEmbeds


class PromptCache:
    """Bounded LRU of text -> embeddings (the key also names the text encoder and the dtype)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[tuple, "PromptEmbeds"] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple, compute: Callable[[], "PromptEmbeds"]) -> "PromptEmbeds":
        if key in self._items:
            self._items.move_to_end(key)
            self.hits += 1
            return self._items[key]
        self.misses += 1
        value = compute()
        self._items[key] = value
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return value

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


__all__ = ["PromptCache"]
