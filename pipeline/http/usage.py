"""The ``usage`` of an OpenAI-compatible response body, read as the reference's
``pkg/asyncworker/usage.go`` does (docs/observability.md, "Prometheus"): for
``pipeline_tokens_total`` and a token budget's charge (``redis-quota`` in ``tokens`` mode)."""

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
    """The ``usage`` of a response body, or None when the body has none that can be read
    (not JSON, or nested deeper than the parser goes: ``RecursionError`` is not an escape)."""
    try:
        data = json.loads(body)
    except (ValueError, TypeError, RecursionError):
        return None
    return usage_of(data)


def usage_of(data: Any) -> Usage | None:
    """The ``usage`` of a response body already parsed, or None when it has none."""
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return None
    if "prompt_tokens" not in usage and "completion_tokens" not in usage:
        total = _count(usage.get("total_tokens"))
        return None if total is None else Usage(0, 0, total)
    prompt = _count(usage.get("prompt_tokens", 0))
    completion = _count(usage.get("completion_tokens", 0))
    if prompt is None or completion is None:
        return None
    return Usage(prompt, completion, prompt + completion)


def counted_path(url: str) -> bool:
    """Whether answers from ``url`` count in ``pipeline_tokens_total`` (as the reference)."""
    path = urlsplit(url).path.strip("/")
    return any(path == p or path.endswith("/" + p) for p in COUNTED_PATHS)
