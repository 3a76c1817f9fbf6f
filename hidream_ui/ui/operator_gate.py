"""`@operator_only`: the one check in front of every handler that changes the engine for everyone.

With ``--kiosk`` visitors edit, batch and compare, but the engine-wide controls (loading the model,
the attention strategy, the speed setting) are the operator's (server/operator.py says who that is).
Their widgets are hidden from visitors' pages; this decorator makes their events and API names
refuse visitors too, so a hidden control cannot be reached by calling its API. Without ``--kiosk``
everyone may, and the decorator lets every call through.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, TypeVar

from hidream_ui.config import AppConfig
from hidream_ui.server.operator import may_change_engine, refusal
from hidream_ui.ui.common import gr_error

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def require_operator(config: AppConfig, request: Any, what: str) -> None:
    """Raises the refusal (a gr.Error a visitor reads) when `request` may not change `what` for
    everyone; nothing without --kiosk."""
    if not may_change_engine(config, request):
        logger.info("%s: refused to a visitor in kiosk mode", what)
        raise gr_error(refusal(config, what), title="Operator only")


def operator_only(what: str) -> Callable[[F], F]:
    """Decorates a handler method whose object holds `services` (ui/services.py `AppServices`) and
    which takes a `request` parameter (gradio fills it with the caller's `gr.Request`): the method
    runs only for whoever may change `what` ("the attention strategy") for everyone.

    `functools.wraps` keeps the signature, which gradio reads to inject the request and to name the
    API's parameters. Put it under `@guarded`, so its refusal passes through unchanged.
    """

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)
        if "request" not in signature.parameters:
            raise TypeError(f"{fn.__qualname__}: @operator_only needs a `request` parameter (gradio fills it)")

        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            # Bound as gradio calls it: the request by keyword, or positionally in a direct call.
            request = signature.bind(self, *args, **kwargs).arguments.get("request")
            require_operator(self.services.config, request, what)
            return fn(self, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


__all__ = ["operator_only", "require_operator"]
