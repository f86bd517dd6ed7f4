"""The llm-d-async reference's Redis wire format, for queues with ``"ingest": "llm-d-async"``
(the envelope and result records: docs/llm-d-async.md).

:func:`parse` reads one sorted-set member into an :class:`Envelope` (or the reason it cannot
be served); :meth:`pipeline.store.Store.ingest` moves a batch of them into the queue
(``ingest.lua``: one atomic step, at most once per entry); ``lib.lua``'s ``terminal`` writes
the result in the reference's format (``ref_result``) on the list :func:`result_list` names.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ..http.rules import (  # the HTTP client's rules: what is ingested, it can send
    MAX_ID_LENGTH,
    endpoint_error,
    header_name_error,
    header_value_error,
    request_id_error,
)

KINDS = ("plain", "redis", "pubsub")
DEFAULT_RESULT_LIST = "result-list"  # the reference's transport default
PAYLOAD_JSON = json.JSONEncoder(allow_nan=False, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class Envelope:
    """One request as a reference producer wrote it, checked against this pipeline's rules."""

    id: str
    token: str  # internal.request_token ("" for old token-less envelopes)
    deadline: float  # Unix s
    payload: str  # compact JSON text ("" when it is in payload_ref)
    payload_ref: str  # the key holding the payload (WithPayloadKeys), else ""
    metadata: dict[str, str]
    headers: dict[str, str]
    endpoint: str
    result_list: str  # the message's own result list, "" when it names none


@dataclass(frozen=True)
class Malformed:
    """A member that cannot be served: its id (or the member itself), what is wrong, and
    whatever routing could still be read from it."""

    id: str
    message: str
    token: str = ""
    result_list: str = ""


def _str_map(value: Any, field: str, *, header: bool = False) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"data.{field} must be an object of strings")
    for k, v in value.items():
        if not isinstance(v, str):
            raise ValueError(f"data.{field}[{k!r}] must be a string")
        if header and (header_name_error(k) or header_value_error(v)):
            raise ValueError(f"data.headers: {k!r} is not a valid HTTP header")
    return dict(value)


def _text(value: Any, field: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a string")
    return value


def _envelope(doc: Any, max_payload_bytes: int) -> Envelope:
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if doc.get("request_kind") not in KINDS:
        raise ValueError(f"request_kind must be one of {', '.join(KINDS)}")
    internal = doc.get("internal") or {}
    data = doc.get("data")
    if not isinstance(internal, dict) or not isinstance(data, dict):
        raise ValueError("internal and data must be objects")
    deadline = data.get("deadline")
    if isinstance(deadline, bool) or not isinstance(deadline, int | float):
        raise ValueError("data.deadline must be a Unix time in seconds")
    if not math.isfinite(deadline) or deadline <= 0:
        raise ValueError("data.deadline must be a positive Unix time")
    payload_ref = _text(internal.get("payload_ref"), "internal.payload_ref")
    payload = data.get("payload")
    if payload is None and payload_ref:
        body = ""
    elif isinstance(payload, dict):
        body = PAYLOAD_JSON.encode(payload)
        if len(body.encode("utf-8")) > max_payload_bytes:
            raise ValueError(f"data.payload is larger than max_payload_bytes ({max_payload_bytes})")
    else:
        raise ValueError("data.payload must be a JSON object")
    endpoint = _text(data.get("endpoint"), "data.endpoint")
    wrong = endpoint_error(endpoint) if endpoint else None
    if wrong is not None:
        raise ValueError(f"data.endpoint {wrong}")
    result_list = _text(internal.get("result_queue_name"), "internal.result_queue_name")
    if not result_list and doc.get("request_kind") == "redis":
        result_list = _text(data.get("result_queue_name"), "data.result_queue_name")
    return Envelope(
        id=_id(data.get("id")),
        token=_text(internal.get("request_token"), "internal.request_token"),
        deadline=float(deadline),
        payload=body,
        payload_ref=payload_ref,
        metadata=_str_map(data.get("metadata"), "metadata"),
        headers=_str_map(data.get("headers"), "headers", header=True),
        endpoint=endpoint,
        result_list=result_list,
    )


def _id(value: Any) -> str:
    wrong = request_id_error(value)
    if wrong is not None:
        raise ValueError(f"data.id {wrong}")
    return str(value)


def parse(member: str, max_payload_bytes: int) -> Envelope | Malformed:
    """One sorted-set member as an :class:`Envelope`, or :class:`Malformed` saying why not."""
    try:
        doc = json.loads(member)
    except ValueError as exc:
        return Malformed(member[:MAX_ID_LENGTH], f"malformed queue entry: not JSON ({exc})")
    try:
        return _envelope(doc, max_payload_bytes)
    except (ValueError, TypeError, RecursionError) as exc:
        return _salvage(doc, f"malformed queue entry: {exc}", member)


def _salvage(doc: Any, message: str, member: str) -> Malformed:
    """What a malformed envelope still tells: its id, token and result list, if readable."""
    data = doc.get("data") if isinstance(doc, dict) else None
    internal = doc.get("internal") if isinstance(doc, dict) else None
    rid = data.get("id") if isinstance(data, dict) else None
    token = internal.get("request_token") if isinstance(internal, dict) else None
    routed = internal.get("result_queue_name") if isinstance(internal, dict) else None
    return Malformed(
        rid if isinstance(rid, str) and rid else member[:MAX_ID_LENGTH],
        message,
        token if isinstance(token, str) else "",
        routed if isinstance(routed, str) else "",
    )


def result_list(configured: str | None, message: str) -> str:
    """The reference's result routing: the queue's configured list wins, then the message's,
    then its default ``result-list``."""
    return configured or message or DEFAULT_RESULT_LIST
