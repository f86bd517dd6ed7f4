"""The lease guard's arithmetic and its log: an attempt stops before its lease can lapse, with
a margin for the clocks' rates and one check period; one ERROR per episode."""

from __future__ import annotations

import logging
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.worker.guard import RATE_MARGIN, LeaseGuard


@given(st.floats(min_value=1.0, max_value=3600.0))
def test_the_budget_ends_before_the_lease_less_its_margins(lease: float) -> None:
    guard = LeaseGuard(lease)
    assert 0 < guard.budget() <= lease * (1 - RATE_MARGIN) - guard.period()
    assert guard.period() <= lease / 10
    assert guard.budget() / 2 > lease / 3  # a heartbeat every third of a lease stays fresh


def test_late_and_fresh_count_from_the_proof() -> None:
    guard = LeaseGuard(10.0)
    now = time.monotonic()
    assert not guard.late(now, now + guard.budget() - 0.01)
    assert guard.late(now, now + guard.budget())
    assert guard.fresh(now) and not guard.fresh(now - guard.budget())


def test_one_error_per_episode(caplog: pytest.LogCaptureFixture) -> None:
    guard = LeaseGuard(10.0)
    with caplog.at_level(logging.INFO, logger="pipeline.worker"):
        guard.lapse(3)
        guard.lapse(2)
        assert guard.episodes == 1
        guard.renewed()
        guard.lapse(1)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and guard.episodes == 2
    assert "lease renewal overdue" in errors[0].getMessage()
    assert any("succeeded again" in r.getMessage() for r in caplog.records)
