"""Retry delays: exponential backoff with equal jitter, Retry-After, deadline bounds.

Times are in seconds. ``retry`` counts the retries already scheduled (0 before the first).
"""

from __future__ import annotations

import email.utils
import random
import re
import time

# the error code of a request whose queue's max_attempts ran out (a poison request: the
# verdict ``explain`` gives it)
MAX_ATTEMPTS_EXCEEDED = "MAX_ATTEMPTS_EXCEEDED"
# delay-seconds, with the decimal fraction real proxies send (LiteLLM: 34.249831)
_SECONDS = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def backoff_delay(
    retry: int,
    seconds_left: float,
    base: float = 2.0,
    cap: float = 60.0,
    rng: random.Random | None = None,
) -> float:
    """Delay before retry number ``retry + 1``: equal jitter in ``[t/2, t)`` where
    ``t = min(cap, seconds_left, 2·base·2^retry)``. So the first retry waits base..2·base, the
    next 2·base..4·base, and so on. Returns 0 when no time is left."""
    if seconds_left <= 0:
        return 0.0
    t = min(cap, seconds_left, 2.0 * base * (2.0 ** min(retry, 62)))
    r = (rng or random).random()
    return t / 2.0 + r * t / 2.0


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Retry-After as seconds: a number ≥ 0 (a decimal fraction too, as the official OpenAI
    client accepts) or an HTTP date (a past date gives 0). None when missing or invalid."""
    value = (value or "").strip()
    if not value:
        return None
    if _SECONDS.fullmatch(value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    now = time.time() if now is None else now
    return max(0.0, when.timestamp() - now)


def retry_delay(
    retry: int,
    seconds_left: float,
    retry_after: float | None = None,
    base: float = 2.0,
    cap: float = 60.0,
    rng: random.Random | None = None,
) -> float | None:
    """The delay before the next attempt, or None when no retry fits before the deadline.

    A Retry-After larger than the backoff is honoured, clamped to half the time left and
    spread by up to 25 % (the reference's formula); the result is always < ``seconds_left``.
    """
    if seconds_left <= 0:
        return None
    delay = backoff_delay(retry, seconds_left, base, cap, rng)
    if retry_after is not None and retry_after > delay:
        spread = 1.0 + (rng or random).random() / 4.0
        delay = max(delay, min(retry_after, seconds_left / 2.0) * spread)
    if delay >= seconds_left:
        return None
    return delay
