"""The token estimate a ``redis-quota`` in tokens mode charges at admission: prompt
characters / 4 plus the completion budget (the rule: docs/scheduling.md#token-budgets). The
response's ``usage`` settles it."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

CHARS_PER_TOKEN = 4
DEFAULT_MAX_TOKENS = 256
MESSAGE_OVERHEAD = 4  # tokens per chat message (role markers of the chat template)


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def completion_budget(body: Mapping[str, Any], default_max_tokens: int) -> int:
    """The most completion tokens the body allows (see the module's rule)."""
    given = [_count(body.get(k)) for k in ("max_completion_tokens", "max_tokens")]
    limits = [c for c in given if c is not None]
    budget = max(limits) if limits else default_max_tokens
    n = _count(body.get("n"))
    return budget * (n if n else 1)


def _text_chars(value: Any) -> tuple[int, int]:
    """(characters of text, token ids) in a prompt or a message content."""
    if isinstance(value, str):
        return len(value), 0
    if isinstance(value, list):
        chars = ids = 0
        for item in value:
            if isinstance(item, bool):
                continue
            if isinstance(item, int):
                ids += 1
            elif isinstance(item, dict):
                text = item.get("text")
                chars += len(text) if isinstance(text, str) else 0
            else:
                c, i = _text_chars(item)
                chars, ids = chars + c, ids + i
        return chars, ids
    return 0, 0


def prompt_estimate(body: Mapping[str, Any]) -> int:
    """Tokens of the prompt, estimated (see the module's rule)."""
    chars, ids = _text_chars(body.get("prompt"))
    messages = body.get("messages")
    overhead = 0
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                c, i = _text_chars(message.get("content"))
                chars, ids, overhead = chars + c, ids + i, overhead + MESSAGE_OVERHEAD
    return math.ceil(chars / CHARS_PER_TOKEN) + ids + overhead


def estimate_tokens(payload: str | Mapping[str, Any], default_max_tokens: int) -> int:
    """The charge of one request at admission: prompt estimate + completion budget.
    ``payload``: the JSON body as sent (text) or already parsed."""
    body: Any = payload
    if isinstance(payload, str | bytes):
        try:
            body = json.loads(payload)
        except ValueError:
            body = None
    if not isinstance(body, Mapping):
        return default_max_tokens
    return prompt_estimate(body) + completion_budget(body, default_max_tokens)
