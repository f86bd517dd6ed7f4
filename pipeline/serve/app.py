"""The HTTP API of ``pipeline serve`` (Starlette): OpenAI's Files and Batches endpoints under
``/v1``, ``GET /v1/requests/{id}``, the batch page at ``/`` and ``/healthz``. Handlers are
plain functions (Starlette runs them in its thread pool: Redis calls block); the upload
streams. Every error is OpenAI's shape (:mod:`.errors`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..batch import Batches, Files, UnknownBatch, UnknownFile
from ..client import Result
from ..errors import InvalidRequest, PipelineError, UnknownRequest
from .auth import ApiKeys
from .background import Background
from .errors import ApiError, bad_request, not_found, too_many, unauthorized
from .page import page
from .upload import receive

log = logging.getLogger("pipeline.serve")
JSON_LIMIT = 1024 * 1024  # largest JSON request body (batch create)


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
            if request.headers.get("authorization"):
                raise unauthorized("Incorrect API key provided.")
            raise unauthorized("You didn't provide an API key (Authorization: Bearer <key>).")
        return tenant


def _limit(request: Request, default: int, most: int) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise bad_request(f"limit must be an integer from 1 to {most}", "limit")
    return int(raw)


def _json_body(request: Request, raw: bytes) -> dict[str, Any]:
    if len(raw) > JSON_LIMIT:
        raise bad_request("request body too large")
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


class Api:
    """The handlers, bound to one :class:`Service`."""

    def __init__(self, svc: Service) -> None:
        self.svc, self.b, self.files = svc, svc.batches, svc.files

    # -- files ------------------------------------------------------------------------------
    async def upload(self, request: Request) -> Response:
        owner = self.svc.owner(request)
        up = await receive(request, self.files.blobs, self.b.settings.max_file_bytes)
        info = self.files.add(up.file_id, up.filename, up.purpose, owner or "")
        log.info("file %s uploaded: %d bytes", info.id, info.bytes)
        return JSONResponse(info.to_openai())

    def list_files(self, request: Request) -> Response:
        owner = self.svc.owner(request)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be 'asc' or 'desc'", "order")
        data, more = self.files.list(
            owner=owner,
            purpose=request.query_params.get("purpose"),
            after=request.query_params.get("after"),
            limit=_limit(request, 10000, 10000),
            order=order,
        )
        return _page([f.to_openai() for f in data], more)

    def get_file(self, request: Request) -> Response:
        return JSONResponse(
            self.files.get(request.path_params["file_id"], self.svc.owner(request)).to_openai()
        )

    def delete_file(self, request: Request) -> Response:
        fid = request.path_params["file_id"]
        self.files.delete(fid, self.svc.owner(request))
        return JSONResponse({"id": fid, "object": "file", "deleted": True})

    def file_content(self, request: Request) -> Response:
        info = self.files.get(request.path_params["file_id"], self.svc.owner(request))
        fh = self.files.blobs.open(info.id)

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
        owner = self.svc.owner(request)
        body = _json_body(request, await request.body())
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
        if owner is not None and self.b.active_count(owner) >= self.b.settings.max_active:
            raise too_many(f"at most {self.b.settings.max_active} open batches per tenant")
        batch, _ = self.b.create(
            endpoint=body["endpoint"],
            completion_window=body["completion_window"],
            metadata=body.get("metadata"),
            tenant=owner,
            queue=self.b.settings.queue,
            input_file_id=fid,
            source={"kind": "file"},
            files=True,
        )
        log.info("batch %s created from %s", batch.id, fid)
        self.svc.background.submit("ingest", batch.id)
        return JSONResponse(batch.to_openai())

    def list_batches(self, request: Request) -> Response:
        owner = self.svc.owner(request)
        data, more = self.b.list(
            after=request.query_params.get("after"), limit=_limit(request, 20, 100), owner=owner
        )
        return _page([x.to_openai() for x in data], more)

    def get_batch(self, request: Request) -> Response:
        return JSONResponse(
            self.b.get(request.path_params["batch_id"], self.svc.owner(request)).to_openai()
        )

    def cancel_batch(self, request: Request) -> Response:
        bid = request.path_params["batch_id"]
        owner = self.svc.owner(request)
        batch = self.b.get(bid, owner)
        if batch.status in ("completed", "failed", "expired", "cancelled", "finalizing"):
            raise bad_request(f"cannot cancel a batch that is {batch.status}", "batch_id")
        batch = self.b.cancel(bid, owner, lines=False)
        if batch.status == "cancelling":
            self.svc.background.submit("cancel", bid)
        return JSONResponse(batch.to_openai())

    # -- single requests, the page ----------------------------------------------------------
    def _request_record(self, request: Request) -> tuple[str, dict[str, Any]]:
        """The path's request id and its record, if the caller's key may see it (else 404)."""
        owner = self.svc.owner(request)
        rid = request.path_params["request_id"]
        rec = self.b.pipeline.record(rid)
        if not rec or not _may_see(self.b, rec, owner):
            raise UnknownRequest(rid)
        return rid, rec

    def get_request(self, request: Request) -> Response:
        rid, rec = self._request_record(request)
        result = Result.from_json(rec["result"]).to_dict() if rec.get("result") else None
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
        return JSONResponse(self.b.pipeline.explain(rid).to_dict())

    def page(self, request: Request) -> Response:
        self.svc.owner(request)
        return HTMLResponse(page())

    def ui_batches(self, request: Request) -> Response:
        owner = self.svc.owner(request)
        data, _ = self.b.list(limit=500, owner=owner)
        return JSONResponse(
            {"now": self.b.records.server_time(), "data": [x.to_openai() for x in data]}
        )

    def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    def routes(self) -> list[Route]:
        return [
            Route("/", self.page),
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


def create_app(svc: Service) -> Starlette:
    return Starlette(routes=Api(svc).routes(), exception_handlers=_handlers())


def _may_see(b: Batches, rec: dict[str, Any], owner: str | None) -> bool:
    if owner is None:
        return True
    if rec.get("batch"):
        try:
            return b.get(rec["batch"]).owner == owner
        except UnknownBatch:
            return False
    try:
        meta = json.loads(rec.get("metadata") or "{}")
    except ValueError:
        return False
    return bool(meta.get(b.pipeline.settings.fairness_attribute) == owner)


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


def _handlers() -> dict[Any, Any]:
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def unknown(request: Request, exc: Exception) -> Response:
        kinds: dict[type, str] = {UnknownBatch: "batch", UnknownFile: "file"}
        kind = kinds.get(type(exc), "request")
        return not_found(kind, str(exc.args[0]) if exc.args else "").response()

    async def invalid(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, InvalidRequest)
        return bad_request(str(exc), exc.field).response()

    async def internal(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        return ApiError(500, "internal error", type="server_error").response()

    return {
        ApiError: api_error,
        UnknownBatch: unknown,
        UnknownFile: unknown,
        UnknownRequest: unknown,
        InvalidRequest: invalid,
        PipelineError: internal,
        Exception: internal,
    }
