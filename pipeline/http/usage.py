"""The ``usage`` object of an OpenAI-compatible response body: how many tokens a request
consumed. Read for ``pipeline_tokens_total{direction}`` (the reference's series, #401) and to
settle a token budget's charge (``redis-quota`` in ``tokens`` mode).

Rules (the reference's ``pkg/asyncworker/usage.go``): the body must be a JSON object whose
``usage`` is an object; ``prompt_tokens`` and ``completion_tokens`` are integers (a missing one
is 0, a negative one counts 0); any other type of either — a float, a string, a boolean —
makes the whole ``usage`` unreadable (None). ``total`` is their sum; when both are missing it is
``total_tokens`` (an integer, else unreadable)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# request paths whose answers the token counter reads (the reference's, slash-trimmed)
COUNTED_PATHS = ("v1/completions", "v1/chat/completions")


@dataclass(frozen=True)
class Usage:
    """Tokens one response reports: prompt (input), completion (output), and their total."""

    prompt: int
    completion: int
    total: int


def _count(value: Any) -> int | None:
    """A token count: an int (not a bool), negatives clamped to 0; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return max(0, value)


def parse_usage(body: str | bytes) -> Usage | None:
    """The ``usage`` of a response body, or None when the body has none that can be read."""
    try:
        data = json.loads(body)
    except (ValueError, TypeError):
        return None
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return None
    fields = ("prompt_tokens", "completion_tokens")
    present = [f for f in fields if f in usage]
    if not present:
        total = _count(usage.get("total_tokens"))
        return None if total is None else Usage(0, 0, total)
    counts = [_count(usage[f]) if f in usage else 0 for f in fields]
    prompt, completion = counts
    if prompt is None or completion is None:
        return None
    return Usage(prompt, completion, prompt + completion)


def counted_path(url: str) -> bool:
    """Whether answers from ``url`` count in ``pipeline_tokens_total``: its path, slashes
    trimmed, ends with ``v1/completions`` or ``v1/chat/completions`` (as the reference)."""
    path = urlsplit(url).path.strip("/")
    return any(path == p or path.endswith("/" + p) for p in COUNTED_PATHS)
