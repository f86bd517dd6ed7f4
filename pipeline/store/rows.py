"""A request as ``submit.lua`` stores it: one named row, sent as a JSON array in this order
(``lua/submit.lua``'s header names the same fields; tests/integration/test_key_schema.py
checks the two agree)."""

from __future__ import annotations

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
    prefix: str = ""  # its prompt prefix's key, "" for none (pipeline/client/prefix.py)


# what a live request and a submission of its id must share, or it is a conflict (submit.lua)
CONTENT = ("payload", "queue", "endpoint", "headers")
