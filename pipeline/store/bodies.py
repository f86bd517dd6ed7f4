"""Large answer bodies, stored once (docs/internals.md, "Large answers"). An answer longer than
``PIPELINE_BODY_INLINE_MAX`` is written by its attempt with a plain ``SET`` to a key of its own
(:meth:`Keys.body`) just before the finish script, which never sees it: the record's result,
the Celery result and the result-list entry carry ``"payload_ref": <key>`` instead of
``"payload"``, and every reader puts the body back (:func:`with_body`)."""

from __future__ import annotations

import codecs
from typing import Any

from redis.client import NEVER_DECODE

from ..errors import UnknownRequest

PAYLOAD_REF = "payload_ref"
PIECE = 1 << 20  # bytes of a body a reader takes per command (read_body)


def stored_apart(payload: str, limit: int, wire: str | None) -> bool:
    """Whether an answer's body goes to a key of its own: longer than ``limit`` (0: never), and
    not a reference producer's request (``wire``: its consumers read the body inline from the
    result list; docs/llm-d-async.md)."""
    return 0 < limit < len(payload) and not wire


def read_body(client: Any, key: str) -> str | None:
    """The body stored at ``key`` (a redis-py client's), read in ``GETRANGE``s of
    :data:`PIECE` bytes, one round trip each: no command copies more than a piece into its
    reply (one ``GET`` of 15 MiB held Redis 7-40 ms), and other clients' commands run in
    between. None when it is gone (or went while it was read)."""
    size = int(client.strlen(key))
    text, got = codecs.getincrementaldecoder("utf-8")("replace"), 0
    parts: list[str] = []
    for at in range(0, size, PIECE):
        piece = client.execute_command("GETRANGE", key, at, at + PIECE - 1, **{NEVER_DECODE: []})
        got += len(piece)
        parts.append(text.decode(piece))
    if size == 0 or got != size:
        return None
    parts.append(text.decode(b"", final=True))
    return "".join(parts)


def with_body(data: dict[str, Any], client: Any) -> dict[str, Any]:
    """A result as stored (its JSON, parsed) as readers hand it out: a body stored apart read
    back from ``client`` (:func:`read_body`) into ``payload``, ``payload_ref`` dropped; any
    other result as it is. Raises UnknownRequest when that body is gone (it expires with the
    result)."""
    ref = data.get(PAYLOAD_REF)
    if not isinstance(ref, str) or "payload" in data:
        return data
    body = read_body(client, ref)
    if body is None:
        raise UnknownRequest(str(data.get("id", "")))
    out = {k: v for k, v in data.items() if k != PAYLOAD_REF}
    out["payload"] = body
    return out
