"""Large answer bodies, stored once (docs/internals.md, "Large answers"). An answer longer than
``PIPELINE_BODY_INLINE_MAX`` is written by its attempt with a plain ``SET`` to a key of its own
(:meth:`Keys.body`) just before the finish script, which never sees it: the record's result,
the Celery result and the result-list entry carry ``"payload_ref": <key>`` instead of
``"payload"``, and every reader puts the body back (:func:`with_body`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import UnknownRequest

PAYLOAD_REF = "payload_ref"


def stored_apart(payload: str, limit: int, wire: str | None) -> bool:
    """Whether an answer's body goes to a key of its own: longer than ``limit`` (0: never), and
    not a reference producer's request (``wire``: its consumers read the body inline from the
    result list; docs/llm-d-async.md)."""
    return 0 < limit < len(payload) and not wire


def with_body(data: dict[str, Any], get: Callable[[str], str | bytes | None]) -> dict[str, Any]:
    """A result as stored (its JSON, parsed) as readers hand it out: a body stored apart read
    back with ``get`` (a Redis GET) into ``payload``, ``payload_ref`` dropped; any other result
    as it is. Raises UnknownRequest when that body is gone (it expires with the result)."""
    ref = data.get(PAYLOAD_REF)
    if not isinstance(ref, str) or "payload" in data:
        return data
    raw = get(ref)
    if raw is None:
        raise UnknownRequest(str(data.get("id", "")))
    out = {k: v for k, v in data.items() if k != PAYLOAD_REF}
    out["payload"] = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    return out
