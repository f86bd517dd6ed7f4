"""A request's prefix key, computed once at submit (docs/scheduling.md, "Prefix grouping"):
requests with the same key share the start of their prompt, which an engine's prefix cache
keeps, so the dispatcher may send them together. The key is a hash of, in this order:

- the body field the queue's ``prefix_field`` names (its text, or its JSON), when present;
- a chat request's first system message (its whole content);
- else the prompt's first :data:`PREFIX_CHARS` characters (a chat request: its first
  message's), at least :data:`MIN_CHARS` of them: a shorter start fills no cache block worth
  sending together for."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..config import QueueConfig

PREFIX_CHARS = 2048  # ~512 tokens' worth of characters (4 a token)
MIN_CHARS = 256  # ~64 tokens: four blocks of vLLM's 16


def prefix_key(payload: Any, queue: QueueConfig) -> str:
    """The key of request body ``payload`` (parsed JSON) in ``queue``, "" for none (the queue
    does not group, or the body has no prefix worth one)."""
    if not queue.group_prefixes or not isinstance(payload, dict):
        return ""
    if queue.prefix_field is not None and queue.prefix_field in payload:
        value = payload[queue.prefix_field]
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return _digest("f:" + text) if text else ""
    messages = payload.get("messages")
    if isinstance(messages, list) and messages:
        for m in messages:
            if isinstance(m, dict) and m.get("role") == "system":
                text = _text(m.get("content"))
                return _digest("s:" + text) if len(text) >= MIN_CHARS else ""
        first = messages[0]
        text = _text(first.get("content")) if isinstance(first, dict) else ""
    else:
        text = _text(payload.get("prompt"))
    text = text[:PREFIX_CHARS]
    return _digest("p:" + text) if len(text) >= MIN_CHARS else ""


def _text(content: Any) -> str:
    """A prompt's or a message content's text: a string, or its parts' text joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(p.get("text")) if isinstance(p, dict) else _text(p) for p in content)
    return ""


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
