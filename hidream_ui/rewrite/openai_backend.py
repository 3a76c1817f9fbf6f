"""Rewriting with a vision-language model behind any OpenAI-compatible chat-completions endpoint.

vLLM, Ollama, MindIE Service, LM Studio and the cloud APIs all speak this protocol; the `openai`
package is the client (imported on first use: the app's cold start does not pay for it). The image
goes inline as a base64 data URL, so the server needs no access to this machine's files.
"""

from __future__ import annotations

import base64
import io
import logging
import threading
from typing import Any

from PIL import Image

from hidream_ui.rewrite.prompt import VISION_LABELS, VISION_SYSTEM_PROMPT, RewriteError, parse_answer, user_message

logger = logging.getLogger(__name__)

# Longest side of the picture sent. VLMs tile or resize images themselves (Qwen2.5-VL: 28 px
# patches, ~750 tokens at 768x768); more pixels cost upload and prompt tokens and add nothing to
# "which car is on the left". JPEG keeps the request small (a photo: ~100 kB instead of ~1 MB PNG).
IMAGE_MAX_SIDE = 768
JPEG_QUALITY = 90
# Three short lines fit in far fewer tokens; the margin lets a verbose model finish its lines.
MAX_ANSWER_TOKENS = 400
# A placeholder key for servers that do not check one (vLLM, Ollama, MindIE by default): the
# client refuses to start without any key.
NO_KEY = "not-needed"


def image_data_url(image: Image.Image, max_side: int = IMAGE_MAX_SIDE) -> str:
    """`image` as a `data:image/jpeg;base64,...` URL, downscaled to at most `max_side` px."""
    picture = image.convert("RGB") if image.mode != "RGB" else image.copy()
    picture.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def base_url(url: str) -> str:
    """The API base the client appends `/chat/completions` to. A pasted full endpoint URL is cut
    back to its base (a common slip: the client would otherwise ask `.../chat/completions/chat/completions`)."""
    url = url.strip().rstrip("/")
    return url.removesuffix("/chat/completions")


def build_messages(image: Image.Image, instruction: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": VISION_SYSTEM_PROMPT},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_data_url(image)}},
                {"type": "text", "text": user_message(instruction)},
            ],
        },
    ]


def _server_text(exc: Any, limit: int = 200) -> str:
    """The server's own error text (OpenAI-style `{"error": {"message": ...}}` or the raw body)."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        error = body.get("error", body)
        text = error.get("message") if isinstance(error, dict) else error
    else:
        response = getattr(exc, "response", None)
        text = getattr(response, "text", None) or body or str(exc)
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class OpenAIRewriter:
    """Asks one model at one OpenAI-compatible URL. Thread-safe (one HTTP client, shared)."""

    backend = "openai"

    def __init__(self, url: str, model: str, api_key: str | None, timeout: float, max_tokens: int = MAX_ANSWER_TOKENS):
        self.url = base_url(url)
        self.model = model
        self.timeout = float(timeout)
        self.max_tokens = max_tokens
        self._api_key = api_key or NO_KEY
        self._client = None
        self._client_lock = threading.Lock()

    def __repr__(self) -> str:  # never the key
        return f"OpenAIRewriter(url={self.url!r}, model={self.model!r}, timeout={self.timeout:g})"

    def _openai_client(self):
        with self._client_lock:
            if self._client is None:
                import openai

                # No retries: the timeout is the user's wait, not a third of it.
                self._client = openai.OpenAI(
                    base_url=self.url, api_key=self._api_key, timeout=self.timeout, max_retries=0
                )
            return self._client

    def lines(self, image: Image.Image, instruction: str, cancel=None) -> tuple[str | None, str, str]:
        """(source, instruction, target) for `instruction` on `image`, or RewriteError."""
        source, refined, target = parse_answer(self.ask(image, instruction), VISION_LABELS)
        return source, refined, target

    def ask(self, image: Image.Image, instruction: str) -> str:
        """The model's raw answer text. Every failure is a RewriteError with a readable reason."""
        import openai

        try:
            response = self._openai_client().chat.completions.create(
                model=self.model,
                messages=build_messages(image, instruction),
                temperature=0.0,
                max_tokens=self.max_tokens,
            )
        except openai.APITimeoutError:
            raise RewriteError(f"the rewriter did not answer within {self.timeout:g} s", unreachable=True) from None
        except openai.APIStatusError as exc:
            raise RewriteError(f"the rewriter answered HTTP {exc.status_code}: {_server_text(exc)}") from None
        except openai.APIConnectionError as exc:
            cause = exc.__cause__ or exc
            logger.warning("rewriter at %s unreachable: %r", self.url, cause)
            raise RewriteError(
                f"cannot reach the rewriter server ({type(cause).__name__}: {cause})", unreachable=True
            ) from None
        except openai.APIResponseValidationError as exc:
            raise RewriteError(f"the rewriter's reply is not a chat completion: {_server_text(exc)}") from None
        except openai.OpenAIError as exc:
            raise RewriteError(f"the rewriter request failed: {exc}") from None
        return self._answer_text(response)

    def _answer_text(self, response: Any) -> str:
        # Lenient servers can send a 200 without the usual fields; the client then hands back a
        # half-filled object (or the raw text), so every field is read defensively.
        choices = getattr(response, "choices", None)
        if not isinstance(choices, list) or not choices:
            raise RewriteError(f"the rewriter's reply holds no answer: {str(response)[:160]!r}")
        choice = choices[0]
        message = getattr(choice, "message", None)
        refusal = getattr(message, "refusal", None)
        finish = getattr(choice, "finish_reason", None)
        if refusal:
            raise RewriteError(f"the rewriter declined: {' '.join(str(refusal).split())[:200]!r}")
        if finish == "content_filter":
            raise RewriteError("the rewriter declined (its content filter stopped the answer)")
        content = getattr(message, "content", None)
        if finish == "length":
            raise RewriteError(
                f"the rewriter's answer was cut off after {self.max_tokens} tokens: "
                f"{' '.join(str(content or '').split())[:160]!r}"
            )
        if not isinstance(content, str):
            raise RewriteError("the rewriter's reply holds no text")
        return content

    def status(self) -> dict[str, Any]:
        return {"backend": self.backend, "model": self.model, "timeout": self.timeout}


__all__ = ["OpenAIRewriter", "image_data_url", "base_url", "build_messages", "IMAGE_MAX_SIDE"]
