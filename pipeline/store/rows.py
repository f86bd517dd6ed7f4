"""A request as ``submit.lua`` stores it: one named row, sent as a JSON array in this order
(``lua/submit.lua``'s header names the same fields; tests/integration/test_key_schema.py
checks the two agree)."""

from __future__ import annotations

from hashlib import blake2b
from typing import NamedTuple


class RequestRow(NamedTuple):
    """One request to store; every field is text, as Redis keeps it."""

    id: str
    queue: str
    pool: str
    priority: str  # "0".."9"
    deadline: str  # Unix s by the server's clock, or "" (then `timeout` counts from now)
    timeout: str  # s from now by the server's clock, when `deadline` is ""
    payload: str  # JSON text
    metadata: str  # JSON object text
    headers: str  # JSON object text
    endpoint: str  # "" for the queue's
    result_list: str  # key, "" for none
    result_list_max: str
    result_list_ttl: str
    labels: str  # JSON object text
    custom_id: str = ""  # a batch line's (stored only with a batch id)
    # what the request is, for an idempotent submit: short digests of its payload, queue,
    # endpoint and headers (:func:`fingerprint`); "" for none (a batch line: fenced instead)
    fingerprint: str = ""


FINGERPRINT_PARTS = ("payload", "queue", "endpoint", "headers")


def fingerprint(payload: str, queue: str, endpoint: str, headers: str) -> str:
    """``<payload>:<queue>:<endpoint>:<headers>``, each part 6 hex digits of its BLAKE2b: a
    live id submitted again with another of any of them is a conflict (submit.lua)."""
    parts = (payload, queue, endpoint, headers)
    return ":".join(blake2b(p.encode(), digest_size=3).hexdigest() for p in parts)


def differs(ours: str, theirs: str) -> list[str]:
    """The parts (:data:`FINGERPRINT_PARTS`) in which two fingerprints differ."""
    pairs = zip(FINGERPRINT_PARTS, ours.split(":"), theirs.split(":"), strict=False)
    return [name for name, a, b in pairs if a != b] or list(FINGERPRINT_PARTS)
