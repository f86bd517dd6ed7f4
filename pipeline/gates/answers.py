"""What an attempt's HTTP call showed of the server, as an :class:`~.base.Observation` for
the gates that learn from answers (``adaptive-concurrency``)."""

from __future__ import annotations

from ..http.classify import Outcome
from .base import Observation


def observation_of(outcome: Outcome, latency_s: float, retried: bool) -> Observation | None:
    """A 2xx (with its completion tokens), an overload (429, 503, a gateway's
    ``rejected-saturated``), a gateway's TTL or eviction drop, or an error (another 5xx, a
    transport error, a time-out, a 2xx that is not JSON). None for an answer that says
    nothing of the server's load (another 4xx, a redirect)."""
    reason = (outcome.dropped_reason or "").lower()
    retry_after = outcome.retry_after
    if not outcome.responded:
        return Observation("err", latency_s, retried=retried)
    code = outcome.status_code or 0
    if outcome.unreadable:  # a 2xx that is not JSON: the server (or a proxy) is failing
        return Observation("err", latency_s, retried=retried)
    if 200 <= code < 300:
        usage = outcome.usage
        return Observation("ok", latency_s, usage.completion if usage else 0, retried=retried)
    if "ttl" in reason:
        return Observation("ttl", latency_s, retry_after_s=retry_after, retried=retried)
    if reason.startswith("evict"):
        return Observation("evict", latency_s, retry_after_s=retry_after, retried=retried)
    if code in (429, 503) or "saturat" in reason:
        return Observation("over", latency_s, retry_after_s=retry_after, retried=retried)
    if code >= 500:
        return Observation("err", latency_s, retried=retried)
    return None
