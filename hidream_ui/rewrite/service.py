"""`RewriteService`: the configured back end, a cache of its answers, and the batch helper.

Answers are cached per (image content, instruction): re-running an edit with other seeds, or a
batch whose items share an image and an instruction, asks the rewriter once. Failures are not
cached (a timeout may not repeat). The service composes nothing itself beyond `RewriteResult.compose`
for the app's variant.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from hidream_ui.config import AppConfig
from hidream_ui.edits import TARGET_MARKER, EditParams
from hidream_ui.engine.errors import EditCancelled, EngineError
from hidream_ui.engine.status import RewriterStatus
from hidream_ui.rewrite.local_backend import LocalRewriter
from hidream_ui.rewrite.openai_backend import OpenAIRewriter
from hidream_ui.rewrite.prompt import RewriteError, RewriteResult

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

    from hidream_ui.engine.batch import BatchItem, BatchPlan
    from hidream_ui.engine.jobs import CancelToken
    from hidream_ui.engine.protocol import Engine

logger = logging.getLogger(__name__)

# Environment variables holding the key for --rewriter-url, first match wins. Not a flag: a key
# on the command line is visible to every user of the machine (ps).
API_KEY_VARIABLES = ("HIDREAM_REWRITER_API_KEY", "OPENAI_API_KEY")
CACHE_SIZE = 256


class Backend(Protocol):
    backend: str

    @property
    def model(self) -> str: ...

    def lines(
        self, image: "Image.Image", instruction: str, cancel: "CancelToken | None" = None
    ) -> tuple[str | None, str, str]: ...

    def status(self) -> dict[str, Any]: ...


def api_key(environ: Mapping[str, str] | None = None) -> str | None:
    environ = os.environ if environ is None else environ
    for name in API_KEY_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            return value
    return None


def image_key(image: "Image.Image") -> str:
    """A digest of the decoded pixels: the same picture uploaded twice (other file name, other
    session) hits the cache; any pixel change misses it."""
    digest = hashlib.sha256(f"{image.mode}:{image.size}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def needs_rewrite(instruction: str) -> bool:
    """False for a prompt already in E1-Full's two-part format: rewriting it again would only
    paraphrase what the user wrote on purpose (the E1-Full examples are written that way)."""
    return TARGET_MARKER not in instruction


class RewriteService:
    """One back end for the app's variant; thread-safe."""

    def __init__(self, backend: Backend, variant: str, cache_size: int = CACHE_SIZE):
        self.backend = backend
        self.variant = variant
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], RewriteResult] = OrderedDict()
        self._lock = threading.Lock()
        self.rewrites = 0
        self.cache_hits = 0
        self.failures = 0
        self.last_error: str | None = None

    @classmethod
    def for_config(
        cls, config: AppConfig, engine: "Engine", environ: Mapping[str, str] | None = None
    ) -> "RewriteService | None":
        """The service `config` asks for, or None when rewriting is off. Builds no client and loads
        nothing: the first rewrite does."""
        kind = config.rewriter_backend
        if kind == "off":
            return None
        if kind == "openai":
            backend: Backend = OpenAIRewriter(
                config.rewriter_url or "", config.rewriter_model or "", api_key(environ), config.rewriter_timeout
            )
        else:
            backend = LocalRewriter(engine)
        return cls(backend, config.variant)

    @property
    def uses_device(self) -> bool:
        """The local back end runs on the device (its events share the device queue)."""
        return self.backend.backend == "local"

    @property
    def label(self) -> str:
        return f"{self.backend.backend} · {self.backend.model}"

    def rewrite(self, image: "Image.Image", instruction: str, cancel: "CancelToken | None" = None) -> RewriteResult:
        """The rewriter's answer for `instruction` on `image` (cached), or RewriteError /
        RequestError (a bad instruction) / EngineError (local: the model failed to load, OOM)."""
        text = EditParams(instruction=instruction).validated().instruction  # the edit's own checks
        key = (image_key(image), text)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return cached
        started = time.perf_counter()
        try:
            source, refined, target = self.backend.lines(image, text, cancel)
        except EditCancelled:
            raise
        except (RewriteError, EngineError) as exc:
            with self._lock:
                self.failures += 1
                self.last_error = str(exc)
            logger.warning("rewriting %r failed: %s", text, exc)
            raise
        result = RewriteResult(
            original=text,
            source=source,
            instruction=refined,
            target=target,
            backend=self.backend.backend,
            model=self.backend.model,
            seconds=round(time.perf_counter() - started, 3),
        )
        with self._lock:
            self.rewrites += 1
            self._cache[key] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return result

    def prompt(self, result: RewriteResult) -> str:
        """The prompt the model gets for this app's variant."""
        return result.compose(self.variant)

    def rewrite_items(
        self,
        plan: "BatchPlan",
        *,
        cancel: "CancelToken | None" = None,
        on_failed: Callable[["BatchItem"], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Rewrites each pending item of a batch plan in place, once per (image, instruction).

        A rewritten item keeps its request in `original_instruction` and its answer in `rewrite`,
        and gets the composed prompt as `instruction` (what the edit uses and the metadata
        reproduces). An item whose rewrite fails becomes an error item (reported through
        `on_failed`); the others go on. Prompts already in the E1-Full format stay as written.
        Returns how many items were rewritten; stops early once `cancel` is set.
        """
        pairs: list[tuple[int, str]] = []
        for item in plan.items:
            pair = (item.source_index, item.instruction)
            if item.status == "pending" and needs_rewrite(item.instruction) and pair not in pairs:
                pairs.append(pair)
        outcomes: dict[tuple[int, str], RewriteResult | Exception] = {}
        down: RewriteError | None = None  # the server did not answer: the remaining items are not asked
        for done, (index, text) in enumerate(pairs):
            if cancel is not None and cancel.cancelled:
                break
            if down is not None:
                outcomes[(index, text)] = RewriteError(f"not asked: {down}")
                continue
            if on_progress is not None:
                on_progress(done, len(pairs))
            try:
                outcomes[(index, text)] = self.rewrite(plan.images[index][1], text, cancel=cancel)
            except EditCancelled:
                break
            except (RewriteError, EngineError, ValueError) as exc:  # ValueError: RequestError
                outcomes[(index, text)] = exc
                if isinstance(exc, RewriteError) and exc.unreachable:
                    down = exc
        rewritten = 0
        for item in plan.items:
            outcome = outcomes.get((item.source_index, item.instruction))
            if outcome is None or item.status != "pending":
                continue
            if isinstance(outcome, RewriteResult):
                item.original_instruction = item.instruction
                item.instruction = self.prompt(outcome)
                item.rewrite = outcome
                rewritten += 1
            else:
                item.status = "error"
                item.error = (
                    f"rewriting the instruction failed: {outcome}. Run the batch with rewriting off to "
                    "use the instruction as written"
                )
                if on_failed is not None:
                    on_failed(item)
        return rewritten

    def status(self) -> RewriterStatus:
        facts = self.backend.status()
        with self._lock:
            return RewriterStatus(
                backend=self.backend.backend,
                model=self.backend.model,
                timeout=facts.get("timeout"),
                lm_head_bytes=facts.get("lm_head_bytes"),
                lm_head_loaded=facts.get("lm_head_loaded"),
                rewrites=self.rewrites,
                cache_hits=self.cache_hits,
                failures=self.failures,
                last_error=self.last_error,
            )


__all__ = ["RewriteService", "API_KEY_VARIABLES", "api_key", "image_key", "needs_rewrite"]
