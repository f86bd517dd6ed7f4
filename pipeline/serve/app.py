"""The HTTP API of ``pipeline serve`` (Starlette; endpoints: docs/batches.md). Handlers are
plain functions, run in Starlette's thread pool (Redis calls block); the upload streams."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..batch import Batches, FileElsewhere, Files, UnknownBatch, UnknownFile
from ..client import CANCEL_RUNNING
from ..errors import InvalidRequest, PipelineError, UnknownRequest
from .auth import ApiKeys
from .background import Background
from .body import json_object
from .errors import ApiError, bad_request, log_refusal
from .guard import AllowedHosts, Guard
from .upload import receive

log = logging.getLogger("pipeline.serve")
UNKNOWN: dict[type, str] = {UnknownBatch: "batch", UnknownFile: "file", UnknownRequest: "request"}
LIMIT = re.compile(r"[0-9]{1,9}")  # a ``limit`` query parameter: ASCII digits only


def _asset(name: str) -> str:
    return (resources.files("pipeline.serve") / name).read_text(encoding="utf-8")


# the batch page at ``/``: its script (it refreshes itself from ``/ui/batches``) and style are
# files of their own, so that its Content-Security-Policy allows no inline script or style
PAGE, PAGE_JS, PAGE_CSS = _asset("page.html"), _asset("page.js"), _asset("page.css")
PAGE_CSP = "default-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"


@dataclass
class Service:
    batches: Batches
    files: Files
    keys: ApiKeys | None
    background: Background

    def owner(self, request: Request) -> str | None:
        """The caller's tenant (API keys on; 401 without a valid key), or None (keys off:
        everything is visible, nothing is attributed)."""
        if self.keys is None:
            return None
        tenant = self.keys.tenant(request.headers.get("authorization"))
        if tenant is None:
            message = "You didn't provide an API key (Authorization: Bearer <key>)."
            if request.headers.get("authorization"):
                message = "Incorrect API key provided."
            raise ApiError(401, message, code="invalid_api_key")
        return tenant

    # -- files ------------------------------------------------------------------------------
    async def upload(self, request: Request) -> Response:
        limit = self.batches.settings.max_file_bytes
        info = await receive(request, self.files, limit, self.owner(request) or "")
        log.info("file %s uploaded: %d bytes", info.id, info.bytes)
        return JSONResponse(info.to_openai())

    def list_files(self, request: Request) -> Response:
        owner = self.owner(request)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be 'asc' or 'desc'", "order")
        limit = _limit(request, 10000, 10000)
        after = _after(request, partial(self.files.get, owner=owner), UnknownFile, "file")
        data, more = self.files.list(
            owner=owner,
            purpose=request.query_params.get("purpose"),
            after=after,
            limit=limit,
            order=order,
        )
        return _page([f.to_openai() for f in data], more)

    def get_file(self, request: Request) -> Response:
        info = self.files.get(request.path_params["file_id"], self.owner(request))
        return JSONResponse(info.to_openai())

    def delete_file(self, request: Request) -> Response:
        fid = request.path_params["file_id"]
        self.files.delete(fid, self.owner(request))
        return JSONResponse({"id": fid, "object": "file", "deleted": True})

    def file_content(self, request: Request) -> Response:
        info = self.files.get(request.path_params["file_id"], self.owner(request))
        fh = self.files.open(info)  # FileElsewhere: in another service's store

        def chunks() -> Iterator[bytes]:
            with fh:
                while block := fh.read(256 * 1024):
                    yield block

        return StreamingResponse(
            chunks(),
            media_type="application/octet-stream",
            headers={"content-length": str(info.bytes)},
        )

    # -- batches ----------------------------------------------------------------------------
    async def create_batch(self, request: Request) -> Response:
        owner = self.owner(request)
        body = await json_object(request)
        return await run_in_threadpool(self._create_batch, owner, body)

    def _create_batch(self, owner: str | None, body: dict[str, Any]) -> Response:
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(name), str) or not body[name]:
                raise bad_request(f"missing required parameter: {name}", name)
        fid = body["input_file_id"]
        try:
            info = self.files.get(fid, owner)
        except UnknownFile:
            raise bad_request(f"input_file_id: no such file {fid}", "input_file_id") from None
        if info.purpose != "batch":
            raise bad_request("input_file_id: the file's purpose is not 'batch'", "input_file_id")
        most = self.batches.settings.max_active
        if owner is not None and self.batches.active_count(owner) >= most:
            message = f"at most {most} open batches per tenant"
            raise ApiError(429, message, type="requests", code="rate_limit_exceeded")
        batch, _ = self.batches.create(
            endpoint=body["endpoint"],
            completion_window=body["completion_window"],
            metadata=body.get("metadata"),
            tenant=owner,
            queue=self.batches.settings.queue,
            input_file_id=fid,
            source={"kind": "file"},
            files=True,
        )
        log.info("batch %s created from %s", batch.id, fid)
        self.background.submit("ingest", batch.id)
        return JSONResponse(batch.to_openai())

    def list_batches(self, request: Request) -> Response:
        owner = self.owner(request)
        limit = _limit(request, 20, 100)
        after = _after(request, partial(self.batches.get, owner=owner), UnknownBatch, "batch")
        data, more = self.batches.list(after=after, limit=limit, owner=owner)
        return _page([x.to_openai() for x in data], more)

    def get_batch(self, request: Request) -> Response:
        batch = self.batches.get(request.path_params["batch_id"], self.owner(request))
        return JSONResponse(batch.to_openai())

    async def cancel_batch(self, request: Request) -> Response:
        """OpenAI's cancel (attempts in flight finish), or with ``{"running": "abort"}`` in the
        body (the OpenAI SDK's ``extra_body``) one that also ends them, closing their calls.
        The key is checked before the body is read."""
        owner = self.owner(request)
        body = await json_object(request)
        running = body.get("running", "finish")
        if not isinstance(running, str) or running not in CANCEL_RUNNING:
            raise bad_request(f"running must be one of {', '.join(CANCEL_RUNNING)}", "running")
        return await run_in_threadpool(self._cancel_batch, request, owner, running)

    def _cancel_batch(self, request: Request, owner: str | None, running: str) -> Response:
        bid = request.path_params["batch_id"]
        batch = self.batches.get(bid, owner)
        if batch.done or batch.status == "finalizing":
            raise bad_request(f"cannot cancel a batch that is {batch.status}", "batch_id")
        batch = self.batches.cancel(bid, owner, lines=False, running=running)
        if batch.status == "cancelling":
            self.background.submit("cancel", bid)
        return JSONResponse(batch.to_openai())

    # -- single requests, the page ----------------------------------------------------------
    def _request_record(self, request: Request) -> tuple[str, dict[str, Any]]:
        """The path's request id and its record, if the caller's key may see it (else 404)."""
        owner = self.owner(request)
        rid = request.path_params["request_id"]
        rec = self.batches.pipeline.record(rid)
        if not rec or not self._may_see(rec, owner):
            raise UnknownRequest(rid)
        return rid, rec

    def _may_see(self, rec: dict[str, Any], owner: str | None) -> bool:
        if owner is None:
            return True
        if rec.get("batch"):  # a batch's line: the batch's owner (a batch gone: nobody)
            bid = rec["batch"]
            return self.batches.at(bid).record(bid).get("owner") == owner
        try:
            meta = json.loads(rec.get("metadata") or "{}")
        except ValueError:
            return False
        return bool(meta.get(self.batches.pipeline.settings.fairness_attribute) == owner)

    def get_request(self, request: Request) -> Response:
        rid, rec = self._request_record(request)
        pl = self.batches.pipeline
        result = pl.load_result(rec["result"]).to_dict() if rec.get("result") else None
        return JSONResponse(
            {
                "id": rid,
                "object": "request",
                "state": rec.get("state"),
                "queue": rec.get("queue"),
                "batch_id": rec.get("batch"),
                "custom_id": rec.get("custom_id"),
                "attempts": int(rec.get("attempts") or 0),
                "submitted_at": float(rec["submitted_at"]) if rec.get("submitted_at") else None,
                "deadline": float(rec["deadline"]) if rec.get("deadline") else None,
                "result": result,
            }
        )

    def explain_request(self, request: Request) -> Response:
        """``pipeline explain ID --json`` over HTTP: where the request is and why."""
        rid, _ = self._request_record(request)
        return JSONResponse(self.batches.pipeline.explain(rid).to_dict())

    def page(self, request: Request) -> Response:
        self.owner(request)
        return HTMLResponse(PAGE, headers={"content-security-policy": PAGE_CSP})

    def page_js(self, request: Request) -> Response:
        return Response(PAGE_JS, media_type="text/javascript")

    def page_css(self, request: Request) -> Response:
        return Response(PAGE_CSS, media_type="text/css")

    def ui_batches(self, request: Request) -> Response:
        data, _ = self.batches.list(limit=500, owner=self.owner(request))
        now = self.files.now()
        return JSONResponse({"now": now, "data": [x.to_openai() for x in data]})

    def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    def routes(self) -> list[Route]:
        return [
            Route("/", self.page),
            Route("/ui/page.js", self.page_js),
            Route("/ui/page.css", self.page_css),
            Route("/ui/batches", self.ui_batches),
            Route("/healthz", self.healthz),
            Route("/v1/files", self.upload, methods=["POST"]),
            Route("/v1/files", self.list_files, methods=["GET"]),
            Route("/v1/files/{file_id}", self.get_file, methods=["GET"]),
            Route("/v1/files/{file_id}", self.delete_file, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", self.file_content, methods=["GET"]),
            Route("/v1/batches", self.create_batch, methods=["POST"]),
            Route("/v1/batches", self.list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.get_batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel_batch, methods=["POST"]),
            Route("/v1/requests/{request_id:path}/explain", self.explain_request, methods=["GET"]),
            Route("/v1/requests/{request_id:path}", self.get_request, methods=["GET"]),
        ]


def create_app(
    svc: Service, hosts: AllowedHosts | None = None, port: int | None = None
) -> Starlette:
    """The app behind its :class:`Guard` (``hosts``: the Host names served, None for any;
    ``port``: the service's own, when the connection does not say)."""
    handled = (ApiError, HTTPException, *UNKNOWN, InvalidRequest, PipelineError, Exception)
    return Starlette(
        routes=svc.routes(),
        exception_handlers=dict.fromkeys(handled, _error),
        middleware=[Middleware(Guard, hosts=hosts, port=port)],
    )


async def _error(request: Request, exc: Exception) -> Response:
    """Every error in OpenAI's shape: a client's (4xx) with one WARNING line, a server's (500)
    with its traceback."""
    if isinstance(exc, FileElsewhere):  # a misconfiguration: one line, the fix in its text
        log.error("%s %s: %s", request.method, request.url.path, exc)
        return ApiError(503, str(exc), type="server_error", code="file_store_mismatch").response()
    error = _client_error(request, exc)
    if error is None:
        log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        return ApiError(500, "internal error", type="server_error").response()
    log_refusal(request.scope, error)
    return error.response()


def _client_error(request: Request, exc: Exception) -> ApiError | None:
    if isinstance(exc, ApiError):
        return exc
    kind = UNKNOWN.get(type(exc))
    if kind is not None:
        return ApiError(404, f"No such {kind}: {exc.args[0]}", param="id")
    if isinstance(exc, InvalidRequest):
        return bad_request(str(exc), exc.field)
    if isinstance(exc, HTTPException) and exc.status_code < 500:  # the router's 404 and 405
        what = f"{request.method} {request.url.path}"
        if exc.status_code == 405:
            return ApiError(405, f"method not allowed: {what}", headers=exc.headers)
        return ApiError(exc.status_code, f"Invalid URL ({what})", code="unknown_url")
    return None


def _limit(request: Request, default: int, most: int) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not LIMIT.fullmatch(raw) or not 1 <= int(raw) <= most:
        raise bad_request(f"limit must be an integer from 1 to {most}", "limit")
    return int(raw)


def _after(
    request: Request, find: Callable[[str], object], unknown: type[Exception], kind: str
) -> str | None:
    """The ``after`` cursor of a list call: an id the caller can see (``find`` raises
    ``unknown`` for any other), else an OpenAI-shaped 400 naming ``after``."""
    after = request.query_params.get("after")
    if after is not None:
        try:
            find(after)
        except unknown:
            raise bad_request(f"after: no such {kind}", "after") from None
    return after


def _page(data: list[dict[str, Any]], more: bool) -> JSONResponse:
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }
    )
