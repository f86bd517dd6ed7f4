"""Retry delays: equal-jitter backoff, Retry-After, and the deadline bound (property tests)."""

from __future__ import annotations

import email.utils
import random

from hypothesis import given
from hypothesis import strategies as st

from pipeline.http.backoff import backoff_delay, parse_retry_after, retry_delay

seconds = st.floats(0.001, 10_000, allow_nan=False)


@given(st.integers(0, 80), seconds, st.floats(0.01, 10), st.floats(0.1, 600), st.integers())
def test_backoff_equal_jitter_bounds(
    retry: int, left: float, base: float, cap: float, seed: int
) -> None:
    d = backoff_delay(retry, left, base, cap, random.Random(seed))
    t = min(cap, left, 2 * base * 2.0**retry)
    assert t / 2 <= d < t or d == t / 2 == t


def test_first_retries_double() -> None:
    rng = random.Random(1)
    for retry, (lo, hi) in enumerate([(2, 4), (4, 8), (8, 16), (16, 32), (30, 60), (30, 60)]):
        for _ in range(50):
            d = backoff_delay(retry, 10_000, 2.0, 60.0, rng)
            assert lo <= d < hi


@given(st.integers(0, 40), seconds, st.none() | st.floats(0, 100_000), st.integers())
def test_retry_never_past_the_deadline(
    retry: int, left: float, ra: float | None, seed: int
) -> None:
    d = retry_delay(retry, left, ra, 2.0, 60.0, random.Random(seed))
    if d is not None:
        assert 0 < d < left


@given(st.floats(10, 1000), st.floats(0, 5000), st.integers())
def test_retry_after_honoured_and_clamped(left: float, ra: float, seed: int) -> None:
    rng = random.Random(seed)
    backoff = backoff_delay(0, left, 2.0, 60.0, random.Random(seed))
    d = retry_delay(0, left, ra, 2.0, 60.0, rng)
    assert d is not None
    if ra > 60 and ra <= left / 2:
        assert d >= ra  # a larger Retry-After is never cut short...
    assert d <= max(backoff, min(ra, left / 2) * 1.25)  # ...but at most half the time left


def test_no_retry_without_time() -> None:
    assert retry_delay(0, 0.0) is None
    assert retry_delay(0, -3.0) is None
    assert backoff_delay(3, 0.0) == 0.0


def test_parse_retry_after() -> None:
    assert parse_retry_after("30") == 30.0
    assert parse_retry_after("0") == 0.0
    now = 1_700_000_000.0
    assert parse_retry_after(email.utils.formatdate(now + 120, usegmt=True), now) == 120.0
    assert parse_retry_after(email.utils.formatdate(now - 120, usegmt=True), now) == 0.0
    assert parse_retry_after("34.249831") == 34.249831  # as LiteLLM's proxy sends it
    assert parse_retry_after(" 0.5 ") == 0.5
    for bad in (None, "", "-1", "soon", "-0.5", ".5", "1.", "1e3", "inf", "nan", "1,5", "٣"):
        assert parse_retry_after(bad) is None


@given(st.decimals(min_value=0, max_value=10**6, places=6, allow_nan=False, allow_infinity=False))
def test_every_non_negative_decimal_is_read_as_its_seconds(value: object) -> None:
    text = format(value, "f")
    assert parse_retry_after(text) == float(text)
