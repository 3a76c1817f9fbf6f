"""The routes of "Send to my phone" and the booth's wall (server/share_links.py), one
`service_routes.Service`:

* ``GET /share/<token>``: a result's PNG for whoever holds the link (a phone has none of the
  visitor's cookies: the token is the key), read through the app's own file route as the visitor who
  made the edit (`Loopback.fetch`), so it serves only what the app would serve that visitor. An
  unknown or expired token answers 404.
* ``GET /wall`` and ``GET /wall/list.json`` (with ``--wall``; 404 without): a self-contained page
  (no controls, no external resources) that cycles the opted-in results, and the links it polls.
  Where the app has a login the wall answers only a signed-in browser (the booth screen signs in
  once on the main page); with no login it is as public as the app.
"""

from __future__ import annotations

from dataclasses import dataclass

from hidream_ui.server.loopback import CallRefused, Loopback
from hidream_ui.server.service_routes import Service
from hidream_ui.server.share_links import PHONE_PATH, WALL_PATH, ShareLinks

POLL_SECONDS = 5  # the wall asks for its list this often
SHOW_SECONDS = 6  # and shows each result this long

WALL_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>HiDream-E1 wall</title>
<style>
html, body { margin: 0; height: 100%; background: #000; color: #bbb; font: 2.2vw sans-serif; overflow: hidden; }
#wall { width: 100vw; height: 100vh; object-fit: contain; display: none; }
#empty { position: absolute; inset: 0; display: flex; align-items: center; justify-content: center; }
</style></head>
<body><img id="wall" alt="A visitor's edit"><div id="empty">Edits that visitors share appear here.</div>
<script>
(() => {
  let links = [], at = 0;
  const img = document.getElementById("wall"), empty = document.getElementById("empty");
  function show() {
    if (!links.length) { img.style.display = "none"; empty.style.display = "flex"; return; }
    at = at % links.length;
    img.src = links[at]; img.dataset.index = String(at); at += 1;
    img.style.display = "block"; empty.style.display = "none";
  }
  async function poll() {
    try {
      const answer = await fetch("__LIST__", {cache: "no-store", credentials: "same-origin"});
      if (!answer.ok) return;
      const first = !links.length;
      links = (await answer.json()).results;
      if (first || !links.length) show();
    } catch (error) { /* the server restarts: keep showing what we have */ }
  }
  poll(); setInterval(poll, __POLL__ * 1000); setInterval(show, __SHOW__ * 1000);
})();
</script></body></html>
"""


@dataclass(frozen=True)
class ShareService(Service):
    """A `Service` owning two prefixes: ``/share`` (phone links) and ``/wall``."""

    also: tuple[str, ...] = ()

    def owns(self, path: str) -> bool:
        return any(path == prefix or path.startswith(prefix + "/") for prefix in (self.prefix, *self.also))


class ShareRoutes:
    def __init__(self, table: ShareLinks, loopback: Loopback, *, wall: bool, public: bool, signed_in=None):
        self.table = table
        self.loopback = loopback
        self.wall = wall
        self.public = public
        if signed_in is None:
            from hidream_ui.server.gradio_internals import logged_in_user

            signed_in = logged_in_user
        self.signed_in = signed_in  # scope -> the login (or None)

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(
            routes=[
                Route(PHONE_PATH + "/{token}", self.result, methods=["GET", "HEAD"]),
                Route(WALL_PATH, self.page, methods=["GET", "HEAD"]),
                Route(WALL_PATH + "/list.json", self.list, methods=["GET", "HEAD"]),
            ]
        )

    async def result(self, request):
        from starlette.responses import PlainTextResponse, Response

        gone = PlainTextResponse("This link is unknown or has expired (links answer for an hour).", status_code=404)
        link = self.table.get(request.path_params["token"])
        if link is None:
            return gone
        try:
            png = await self.loopback.fetch(link.caller, link.path)
        except CallRefused as exc:
            if exc.status in (403, 404):
                return PlainTextResponse("This result is no longer kept by the server.", status_code=404)
            return PlainTextResponse(exc.message, status_code=exc.status)
        remaining = max(0, int(link.expires - self.table.links.now()))
        return Response(png, media_type="image/png", headers={"Cache-Control": f"private, max-age={remaining}"})

    def _refusal(self, request):
        from starlette.responses import HTMLResponse, PlainTextResponse

        if not self.wall:
            return PlainTextResponse("Not Found", status_code=404)
        if not self.public and self.signed_in(request.scope) is None:
            return HTMLResponse(
                '<p>The wall needs this screen to be signed in: <a href="/">sign in</a>, then open /wall again.</p>',
                status_code=401,
            )
        return None

    async def page(self, request):
        from starlette.responses import HTMLResponse

        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        body = (
            WALL_PAGE.replace("__LIST__", WALL_PATH + "/list.json")
            .replace("__POLL__", str(POLL_SECONDS))
            .replace("__SHOW__", str(SHOW_SECONDS))
        )
        return HTMLResponse(body, headers={"Cache-Control": "no-store"})

    async def list(self, request):
        from starlette.responses import JSONResponse

        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        results = [f"{PHONE_PATH}/{token}" for token in self.table.wall_tokens()]
        return JSONResponse({"results": results}, headers={"Cache-Control": "no-store"})


def service(config, services, loopback: Loopback, table: ShareLinks, *, signed_in=None) -> ShareService:
    """The routes as one service (``/share`` and ``/wall``); GET only, so no request body is taken."""
    routes = ShareRoutes(table, loopback, wall=bool(config.wall), public=bool(services.public), signed_in=signed_in)
    return ShareService(name="share", prefix=PHONE_PATH, app=routes.app(), max_body_bytes=0, also=(WALL_PATH,))


__all__ = ["ShareRoutes", "ShareService", "service"]
