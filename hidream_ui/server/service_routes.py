"""The app's own routes beside gradio's: the OpenAI-compatible images API (`/v1/...`) and, with
``--mcp``, the MCP server (`/mcp`).

`ServiceRoutes` is ASGI middleware inside the guard (cli/app.py): a request under a service's
prefix goes to that service's ASGI app, everything else to gradio. A service's work reaches the
editor only through `server/loopback.py` (the app's own routes, as its caller), so there is one
queue, one admission and one set of per-client limits for every caller.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, AsyncContextManager, Callable, Sequence


@dataclass(frozen=True)
class Service:
    """One service: its path prefix, its ASGI app, the largest request body it takes, and an
    optional lifespan (entered with the app's, e.g. MCP's session manager)."""

    name: str
    prefix: str  # "/v1", "/mcp": the service answers this path and everything under it
    app: Callable[..., Any]  # ASGI
    max_body_bytes: int
    lifespan: Callable[[], AsyncContextManager[Any]] | None = None
    # The JSON body of a refusal the guard answers for this service before it sees the request (a body
    # over `max_body_bytes`): in the service's own error shape, so that its clients show the reason.
    refusal_body: Callable[[str], dict] = field(default=lambda message: openai_error(message))

    def owns(self, path: str) -> bool:
        return path == self.prefix or path.startswith(self.prefix + "/")


def openai_error(message: str, code: str = "request_too_large") -> dict:
    """OpenAI's error shape (its SDK reads `error.message`)."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


def jsonrpc_error(message: str) -> dict:
    """A JSON-RPC error answering no particular request (MCP's clients show `error.message`)."""
    return {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": message}}


class ServiceRoutes:
    """ASGI middleware: `Middleware(ServiceRoutes, services=[...])` after the guard in FastAPI's list."""

    def __init__(self, app, *, services: Sequence[Service]):
        self.app = app
        self.services = tuple(services)

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http":
            path = str(scope.get("path", ""))
            for service in self.services:
                if service.owns(path):
                    return await service.app(scope, receive, send)
        return await self.app(scope, receive, send)


@contextlib.asynccontextmanager
async def lifespans(services: Sequence[Service]):
    """Every service's lifespan, entered in order and left in reverse (with the app's)."""
    async with contextlib.AsyncExitStack() as stack:
        for service in services:
            if service.lifespan is not None:
                await stack.enter_async_context(service.lifespan())
        yield


__all__ = ["Service", "ServiceRoutes", "lifespans", "openai_error", "jsonrpc_error"]
