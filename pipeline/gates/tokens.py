"""The token estimate a ``redis-quota`` in tokens mode charges at admission: prompt
characters / 4 plus the completion budget (the rule: docs/scheduling.md#token-budgets). The
response's ``usage`` settles it.

With ``estimate_correction: usage`` the prompt part is corrected by a straight line learned
from the answers (real prompt tokens ≈ slope × estimate + overhead: a chat template adds a
constant, a tokenizer scales): :class:`Learned` is the rule, which ``gate_tokens_settle.lua``
applies in Redis and ``gate_tokens_acquire.lua`` reads back (:meth:`Learned.charge`); the
Python here is the reference the tests hold both to."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4
DEFAULT_MAX_TOKENS = 256
MESSAGE_OVERHEAD = 4  # tokens per chat message (role markers of the chat template)

# the learned correction (estimate_correction: usage), see Learned: a sample's real prompt
# tokens count as at most SLOPE_MAX × its estimate + OVERHEAD_MAX; the means are plain over the
# first LEARN_WEIGHT samples, then moving averages giving each new sample 1 / LEARN_WEIGHT
SLOPE_MAX = 16.0
OVERHEAD_MAX = 1024.0
LEARN_WEIGHT = 32
# once LEARN_WEIGHT answers are in, a sample's y is first brought within CLIP_SPREADS spreads
# plus CLIP_TOKENS of the line learned so far: one wrong usage moves little, a real change is
# followed as the spread it raises widens the reach
CLIP_SPREADS = 3.0
CLIP_TOKENS = 8.0
LEARN_TTL_S = 7 * 24 * 3600  # what no answer updated for this long is forgotten


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


def estimate_parts(payload: str | Mapping[str, Any], default_max_tokens: int) -> tuple[int, int]:
    """(prompt estimate, completion budget) of one request; ``payload``: the JSON body as sent
    (text) or already parsed. A body that cannot be read: (0, ``default_max_tokens``)."""
    body: Any = payload
    if isinstance(payload, str | bytes):
        try:
            body = json.loads(payload)
        except ValueError:
            body = None
    if not isinstance(body, Mapping):
        return 0, default_max_tokens
    return prompt_estimate(body), completion_budget(body, default_max_tokens)


def estimate_tokens(payload: str | Mapping[str, Any], default_max_tokens: int) -> int:
    """The charge of one request at admission: prompt estimate + completion budget.
    ``payload``: the JSON body as sent (text) or already parsed."""
    return sum(estimate_parts(payload, default_max_tokens))


@dataclass(frozen=True)
class Learned:
    """What a queue learned of its server's prompt tokens from the answers' usage: the means
    of x (the prompt estimate), y (the real prompt tokens), x², xy and y² over its samples;
    the straight line through them, y ≈ ``slope`` × x + ``overhead`` (least squares, its slope
    shrunk toward 1 by a variance of mx² / 1000, as if the estimate were right about the text
    and the server only added a constant: prompts that all have one size learn that constant;
    the slope within [0, :data:`SLOPE_MAX`]); and
    ``spread``, the standard deviation of y around that line. Before any answer: the plain
    estimate (slope 1, overhead 0, spread 0)."""

    n: int = 0  # samples, counted up to LEARN_WEIGHT
    mx: float = 0.0
    my: float = 0.0
    mxx: float = 0.0
    mxy: float = 0.0
    myy: float = 0.0
    slope: float = 1.0
    overhead: float = 0.0
    spread: float = 0.0

    def learn(self, real: int, estimate: int) -> Learned:
        """After one answer whose usage says ``real`` prompt tokens for a prompt estimated at
        ``estimate``. No sample when either is 0 (an answer with only ``total_tokens`` reads
        as 0 prompt tokens). The first LEARN_WEIGHT samples weigh the same; after them one
        answer moves each mean by 1 / LEARN_WEIGHT of its distance to it, y capped at
        SLOPE_MAX × x + OVERHEAD_MAX and brought within CLIP_SPREADS × spread + CLIP_TOKENS
        of the line (an outlier's reach is bounded)."""
        if real <= 0 or estimate <= 0:
            return self
        x, y = estimate, min(real, SLOPE_MAX * estimate + OVERHEAD_MAX)
        if self.n >= LEARN_WEIGHT:
            line, reach = self.slope * x + self.overhead, CLIP_SPREADS * self.spread + CLIP_TOKENS
            y = min(max(y, line - reach), line + reach)
        k = min(self.n + 1, LEARN_WEIGHT)
        mx = self.mx + (x - self.mx) / k
        my = self.my + (y - self.my) / k
        mxx = self.mxx + (x * x - self.mxx) / k
        mxy = self.mxy + (x * y - self.mxy) / k
        myy = self.myy + (y * y - self.myy) / k
        var, cov, shrink = mxx - mx * mx, mxy - mx * my, mx * mx / 1000
        a = min(SLOPE_MAX, max(0.0, (cov + shrink) / (var + shrink)))
        residual = (myy - my * my) - 2 * a * cov + a * a * var
        return Learned(k, mx, my, mxx, mxy, myy, a, my - a * mx, math.sqrt(max(0.0, residual)))

    def charge(self, prompt: int) -> int:
        """The prompt estimate charged: the line at ``prompt`` plus its spread, rounded up
        (less a millionth of a token, so 14 × 16/14 is 16, not 17 by a rounding error), never
        below the plain estimate; a prompt estimated at 0 is charged 0. The spread: the line's
        errors are 0 on average, but the errors of the requests in flight add up."""
        if prompt <= 0:
            return prompt
        line = self.slope * prompt + self.overhead + self.spread
        return max(prompt, math.ceil(line - 1e-6))
