"""The OpenAI-compatible images API, on the app's own server under ``/v1`` (cli/app.py `_services`):

* ``POST /v1/images/edits``: OpenAI's multipart edit (``image``, ``prompt``, optional ``mask``
  with OpenAI's meaning: transparent = may change, ``n``, ``size``, ``response_format``
  ``b64_json`` | ``url``, ``model``), plus the extensions ``seed`` and the Edit form's settings by
  their ``/edit`` names (`openai_shapes.EXTENSION_FIELDS`). Each image is one ``/edit`` (seed,
  seed + 1, ...); its PNG is the one the browser would download, with the same settings embedded.
* ``GET /v1/models`` (and ``/v1/models/<id>``): the one model this server runs.
* ``GET /v1/images/results/<token>``: the PNG behind a ``response_format=url`` answer
  (`openai_links`: unguessable, an hour, never a server path).

**Not a second way in.** Every edit runs through `loopback.Loopback`, i.e. through the app's own
upload, queue, cancel and file routes, as its caller (`api_keys.ApiGate`: the key or the address,
and the key's login where the app has one): the guard's body and storage limits, the queue's
admission (``--max-queue``: 503 with Retry-After; ``--max-jobs-per-client``: 429), the kiosk
rules (the route only edits) and ``/status`` see it as they see a browser. A caller that
disconnects while its edit waits or runs cancels it (after its current step; nothing is saved).
Errors are OpenAI's shape (`openai_shapes.OpenAIError`), so OpenAI's SDK raises its own classes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import secrets
import time
from typing import Any, Callable

from hidream_ui.edit_values import SEED_MAX
from hidream_ui.server.api_keys import ApiGate
from hidream_ui.server.loopback import Caller, CallRefused, Loopback, file_data
from hidream_ui.server.openai_links import ResultLinks
from hidream_ui.server.openai_shapes import (
    EditsRequest,
    OpenAIError,
    app_mask,
    form_defaults,
    from_refusal,
    image_size,
    invalid,
    model_id,
    model_object,
    parse_edits,
)
from hidream_ui.server.service_routes import Service

logger = logging.getLogger(__name__)

PREFIX = "/v1"
RESULTS_PATH = "/images/results"  # under PREFIX: the PNGs of response_format=url
# /edit's inputs by name, in the order of its API (ui/edit_tab.py `wire_edit_tab`: the source, the
# Edit form's fields, "rewrite", the region): tests/test_openai_api.py checks it against the app's.
REWRITE_INPUT, MASK_INPUT = "rewrite", "mask"
# The text fields of a form are small; the files are capped one by one (--max-upload-mb) and the
# whole body by the guard (`max_body_bytes`).
FORM_ROOM = 256 * 1024
MAX_NAME = 120  # characters of an upload's file name kept (the result's metadata names its parent)


def max_body_bytes(config) -> int:
    """The largest request body the route takes: an image and a mask at --max-upload-mb each, and the
    text fields. The guard refuses a larger one (413, OpenAI's shape) before the route reads it."""
    return 2 * config.max_upload_mb * 1024 * 1024 + FORM_ROOM


class OpenAIImages:
    """The routes' state: the app's config, the gate (who calls), the loopback (how), the links."""

    def __init__(
        self,
        config,
        loopback: Loopback,
        gate: ApiGate,
        *,
        sizes: Callable[[], list[str]] | None = None,
        links: ResultLinks | None = None,
        created: int | None = None,
    ):
        self.config = config
        self.loopback = loopback
        self.gate = gate
        self.sizes = sizes
        self.links = links or ResultLinks()
        self.model = model_id(config)
        self.created = int(time.time()) if created is None else created
        self.defaults = form_defaults(config.variant)

    # ------------------------------------------------------------------ the ASGI app
    def app(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        async def not_found(request, exc: HTTPException):
            status = exc.status_code if exc.status_code in (404, 405) else 400
            what = "not found" if status == 404 else f"does not take {request.method}"
            return _error(OpenAIError(status, f"{request.method} {request.url.path}: {what} on this server."))

        routes = [
            Route(f"{PREFIX}/models", self.models, methods=["GET"]),
            Route(f"{PREFIX}/models/{{model:path}}", self.model_info, methods=["GET"]),
            Route(f"{PREFIX}/images/edits", self.edits, methods=["POST"]),
            Route(f"{PREFIX}{RESULTS_PATH}/{{token}}", self.result, methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: not_found})

    # ------------------------------------------------------------------ models
    async def models(self, request):
        try:
            self._caller(request)
        except OpenAIError as exc:
            return _error(exc)
        return _json({"object": "list", "data": [model_object(self.model, self.created)]})

    async def model_info(self, request):
        try:
            self._caller(request)
            name = request.path_params["model"]
            if name != self.model:
                raise OpenAIError(
                    404, f"The model '{name}' does not exist: this server runs {self.model}.", code="model_not_found"
                )
        except OpenAIError as exc:
            return _error(exc)
        return _json(model_object(self.model, self.created))

    # ------------------------------------------------------------------ edits
    async def edits(self, request):
        from starlette.requests import ClientDisconnect

        form = None
        try:
            _same_site(request)
            caller = self._caller(request)
            # One of the caller's job slots first, before its body is read or its images looked at:
            # so one caller reads and decodes at most --max-jobs-per-client requests at a time (each up
            # to 2 x --max-upload-mb, a mask decoded in full), however many it sends at once.
            async with self.loopback.reserve(caller) as slot:
                form = await self._form(request)
                edit, image, mask = await self._request(form)
                cancelled = asyncio.Event()
                watcher = asyncio.ensure_future(_watch_disconnect(request.receive, cancelled))
                try:
                    data = await self._run(caller, slot, edit, image, mask, cancelled, _base_url(request))
                finally:
                    watcher.cancel()
        except OpenAIError as exc:
            return _error(exc)
        except CallRefused as exc:
            if form is None and exc.code == "per_client_limit":
                await _drain(request)  # refused unread: a client still sending would see a reset, not the 429
            if exc.status == 499:
                logger.info("an API edit was stopped: its caller went away")
            return _error(from_refusal(exc.status, exc.code, exc.message, exc.retry_after))
        except ClientDisconnect:
            return _error(OpenAIError(499, "The client went away before its request arrived.", code="cancelled"))
        except Exception:  # noqa: BLE001 - any failure is the caller's 500, the details the log's
            logger.exception("an API edit failed")
            return _error(OpenAIError(500, "The edit failed on the server (see the app's log).", code="server_error"))
        finally:
            if form is not None:
                await form.close()
        return _json(data)

    async def _form(self, request):
        from starlette.exceptions import HTTPException
        from starlette.formparsers import MultiPartException

        kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind != "multipart/form-data":
            raise invalid(None, f"Send the edit as multipart/form-data (got '{kind or 'no content type'}').")
        try:
            return await request.form(max_files=4, max_fields=32, max_part_size=FORM_ROOM)
        except (HTTPException, MultiPartException) as exc:
            detail = str(getattr(exc, "detail", None) or exc).rstrip(".")
            raise invalid(None, f"The form could not be read: {detail}.", "invalid_form") from None

    async def _request(self, form) -> tuple[EditsRequest, "_Upload", bytes | None]:
        """The checked request, its image and its mask in the app's meaning (None: no mask)."""
        fields = {name: value for name, value in form.multi_items() if isinstance(value, str)}
        images = [value for name, value in form.multi_items() if name in ("image", "image[]") and _is_file(value)]
        masks = [value for name, value in form.multi_items() if name == "mask" and _is_file(value)]
        if len(images) != 1:
            raise invalid("image", f"Send one image to edit (got {len(images)}).", "invalid_image")
        if len(masks) > 1:
            raise invalid("mask", f"Send at most one mask (got {len(masks)}).", "invalid_mask")
        edit = parse_edits(fields, models=(self.model,), sides=self._sides())
        image = _Upload(
            name=_file_name(images[0].filename, "image.png"),
            content_type=images[0].content_type or "image/png",
            data=await self._read(images[0], "image"),
        )
        size = await asyncio.to_thread(image_size, image.data, "image", self.config.max_pixels)
        mask = None
        if masks:
            raw = await self._read(masks[0], "mask")
            mask = await asyncio.to_thread(app_mask, raw, size, self.config.max_pixels)
        return edit, image, mask

    async def _read(self, upload, param: str) -> bytes:
        limit = self.config.max_upload_mb * 1024 * 1024
        size = upload.size
        if size is None or size > limit:
            what = f"{size:,} bytes" if size is not None else "of unknown size"
            raise OpenAIError(
                413,
                f"The {param} is {what}: at most {limit:,} bytes ({self.config.max_upload_mb} MB, --max-upload-mb).",
                param=param,
                code=f"{param}_too_large",
            )
        data = await upload.read()
        if not data:
            raise invalid(param, f"The {param} is empty (0 bytes).", f"invalid_{param}")
        return data

    def _sides(self) -> tuple[str, ...]:
        """The square sides `size` may name: the numeric working resolutions the model takes."""
        if self.sizes is None:
            return ()
        try:
            return tuple(choice for choice in self.sizes() if choice.isdigit())
        except Exception:  # noqa: BLE001 - sizes unknown: "auto" still works, the edit checks anyway
            logger.warning("working resolutions unknown", exc_info=True)
            return ()

    async def _run(
        self,
        caller: Caller,
        slot: int,
        edit: EditsRequest,
        image: "_Upload",
        mask: bytes | None,
        cancelled: asyncio.Event,
        base_url: str,
    ) -> dict[str, Any]:
        """Uploads the files and runs the edits, one after another in the caller's `slot` (held by
        the caller: `Loopback.reserve`)."""
        items: list[dict[str, Any]] = []
        size = None
        source = await self.loopback.upload(caller, image.name, image.data, image.content_type)
        region = await self.loopback.upload(caller, "mask.png", mask) if mask is not None else None
        first = edit.seed if edit.seed is not None else secrets.randbelow(SEED_MAX + 1)
        for seed in edit.seeds(first):
            if cancelled.is_set():
                raise CallRefused(499, "cancelled", "the caller went away: the edit was stopped")
            data = self.edit_data(edit, file_data(source, image.name), seed, region)
            outputs = await self.loopback.call(caller, "edit", data, cancelled=cancelled, slot=slot)
            path = _saved_path(outputs)
            png = await _read_back(self.loopback, caller, path)
            item, size = await asyncio.to_thread(_describe, png, edit.prompt, outputs, seed)
            if edit.response_format == "url":
                item["url"] = f"{base_url}{PREFIX}{RESULTS_PATH}/{self.links.add(caller, path)}"
            else:
                item["b64_json"] = base64.b64encode(png).decode("ascii")
            items.append(item)
        answer: dict[str, Any] = {"created": int(time.time()), "data": items, "output_format": "png"}
        if size is not None:
            answer["size"] = f"{size[0]}x{size[1]}"
        return answer

    def edit_data(self, edit: EditsRequest, source: dict, seed: int, region: str | None) -> list[Any]:
        """/edit's inputs for one image: the Edit form's defaults for the variant, the request's
        prompt, size, seed and extensions, no rewrite, the region (or none)."""
        values = {
            **self.defaults,
            **edit.extensions,
            "instruction": edit.prompt,
            "working_resolution": edit.size,
            "seed": seed,
            "randomize_seed": False,
        }
        mask = file_data(region, "mask.png") if region is not None else None
        return [source, *(values[name] for name in self.defaults), False, mask]

    # ------------------------------------------------------------------ result links
    async def result(self, request):
        from starlette.responses import Response

        link = self.links.get(request.path_params["token"])
        try:
            if link is None:
                raise OpenAIError(404, "This result link is unknown or has expired (links answer for an hour).")
            try:
                png = await self.loopback.fetch(link.caller, link.path)
            except CallRefused as exc:
                if exc.status in (403, 404):
                    raise OpenAIError(404, "This result is no longer kept by the server.") from None
                raise from_refusal(exc.status, exc.code, exc.message, exc.retry_after) from None
        except OpenAIError as exc:
            return _error(exc)
        remaining = max(0, int(link.expires - self.links.now()))
        return Response(png, media_type="image/png", headers={"Cache-Control": f"private, max-age={remaining}"})

    # ------------------------------------------------------------------ callers
    def _caller(self, request) -> Caller:
        try:
            return self.gate.caller(request.scope)
        except CallRefused as exc:
            raise from_refusal(exc.status, exc.code, exc.message, exc.retry_after) from None


class _Upload:
    __slots__ = ("name", "content_type", "data")

    def __init__(self, name: str, content_type: str, data: bytes):
        self.name, self.content_type, self.data = name, content_type, data


def _is_file(value: Any) -> bool:
    return hasattr(value, "read") and hasattr(value, "filename")


def _file_name(name: str | None, default: str) -> str:
    """The last component of a client's file name (the metadata records it), else `default`."""
    base = os.path.basename(str(name or "").replace("\\", "/")).strip()
    return base[-MAX_NAME:] if base and base not in (".", "..") else default


async def _read_back(loopback: Loopback, caller: Caller, path: str) -> bytes:
    """The result PNG at `path`, read through the app's file route. Refused there (pruned before it
    was read), a 500 that names no path: gradio's refusal names the server path it refused."""
    try:
        return await loopback.fetch(caller, path)
    except CallRefused as exc:
        if exc.status not in (403, 404):
            raise
        logger.warning("an API edit's result could not be read back (HTTP %d): %s", exc.status, exc.message)
        raise CallRefused(500, "server_error", "The result was not kept by the server (see the app's log).") from None


def _saved_path(outputs: list[Any]) -> str:
    """The saved PNG of /edit's outputs ([before/after, saved PNG, seed, summary]): the file the
    browser's "Download PNG" serves, with the settings embedded."""
    saved = outputs[1] if len(outputs) > 1 else None
    path = saved.get("path") if isinstance(saved, dict) else None
    if not isinstance(path, str):
        # Stopped on the server (the app shutting down, a job cancelled there): the summary says how far.
        summary = outputs[3] if len(outputs) > 3 and isinstance(outputs[3], str) and outputs[3] else None
        if summary is None:  # the outputs name server paths (the previews): the log's, not the caller's
            logger.warning("an API edit answered no saved PNG: %.300s", outputs)
        raise CallRefused(500, "server_error", summary or "The edit answered no saved PNG (see the app's log).")
    return path


def _describe(png: bytes, prompt: str, outputs: list[Any], seed: int) -> tuple[dict[str, Any], tuple[int, int]]:
    """One `data` item without its image: the instruction the edit used (`revised_prompt`, from the
    PNG's metadata) and the seed (an extension), and the result's size."""
    import io

    from PIL import Image

    from hidream_ui.outputs import MetadataError, read_metadata

    try:
        params = read_metadata(png).get("params") or {}
        used = params.get("instruction", prompt)
    except (MetadataError, ValueError):
        used = prompt
    with Image.open(io.BytesIO(png)) as picture:
        size = picture.size
    seed_used = outputs[2] if len(outputs) > 2 and isinstance(outputs[2], (int, float)) else seed
    return {"revised_prompt": used, "seed": int(seed_used)}, size


def _same_site(request) -> None:
    """Refuses (403) an edit a browser sends for a page of another site. A multipart POST needs no
    CORS preflight, so without this any web page could make its visitors' browsers run edits here,
    each charged to a visitor's address (and reach an app on their private network); it could not
    read the answers, but the queue would be theirs. Programs (OpenAI's SDK, curl) send no
    ``Sec-Fetch-Site``; a page of this app's own site (any port of the same host) is "same-site"."""
    if request.headers.get("sec-fetch-site", "").strip().lower() == "cross-site":
        raise OpenAIError(
            403,
            "A web page of another site cannot send edits here from its visitors' browsers: call the API "
            "from a program, or from a page of this app's own site.",
            code="cross_site",
        )


async def _drain(request) -> None:
    """Reads a refused request's body to its end, keeping none of it (the guard caps its size)."""
    from starlette.requests import ClientDisconnect

    with contextlib.suppress(ClientDisconnect, RuntimeError):
        async for _ in request.stream():
            pass


async def _watch_disconnect(receive, cancelled: asyncio.Event) -> None:
    """Sets `cancelled` when the client goes away (the body is read: the server's next message is
    the disconnect)."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            cancelled.set()
            return


def _base_url(request) -> str:
    return str(request.base_url).rstrip("/")


def _json(body: dict[str, Any], status: int = 200):
    from starlette.responses import JSONResponse

    return JSONResponse(body, status_code=status)


def _error(exc: OpenAIError):
    from starlette.responses import JSONResponse

    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


def service(config, services, loopback: Loopback, gate: ApiGate, *, sizes=None, links=None) -> Service:
    """The route as a `service_routes.Service` (prefix /v1). `sizes()`: the working resolutions the
    model takes (`Engine.working_resolution_choices`); `links`: the result links (tests move their
    clock)."""
    images = OpenAIImages(config, loopback, gate, sizes=sizes, links=links)
    return Service(name="openai", prefix=PREFIX, app=images.app(), max_body_bytes=max_body_bytes(config))


__all__ = ["PREFIX", "RESULTS_PATH", "OpenAIImages", "max_body_bytes", "service"]
