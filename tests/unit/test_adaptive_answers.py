"""What an answer tells the adaptive gate (pipeline/gates/answers.py) and what a Flower gate
event of an adaptive gate carries (pipeline/worker/observe.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pipeline.config import QueueConfig
from pipeline.gates import Decision, Verdict, observation_of
from pipeline.http.classify import Kind, Outcome
from pipeline.worker import observe

USAGE = json.dumps({"usage": {"prompt_tokens": 5, "completion_tokens": 42}})


@pytest.mark.parametrize(
    ("outcome", "kind", "tokens"),
    [
        (Outcome(Kind.SUCCESS, 200, USAGE), "ok", 42),
        (Outcome(Kind.SUCCESS, 200, "{}"), "ok", 0),
        (Outcome(Kind.RETRY, 429, "", retry_after=2.0), "over", 0),
        (Outcome(Kind.RETRY, 503, ""), "over", 0),
        (Outcome(Kind.RETRY, 429, "", dropped_reason="rejected-saturated"), "over", 0),
        (Outcome(Kind.RETRY, 429, "", dropped_reason="rejected-ttl-expired"), "ttl", 0),
        (Outcome(Kind.RETRY, 503, "", dropped_reason="evicted-queue-pressure"), "evict", 0),
        (Outcome(Kind.RETRY, 500, ""), "err", 0),
        (Outcome(Kind.RETRY, error="timed out", category="TIMEOUT"), "err", 0),
    ],
)
def test_an_answer_is_an_observation_of_its_kind(outcome: Outcome, kind: str, tokens: int) -> None:
    o = observation_of(outcome, 1.5, retried=True)
    assert o is not None and (o.kind, o.tokens, o.latency_s, o.retried) == (kind, tokens, 1.5, True)
    if outcome.retry_after is not None:
        assert o.retry_after_s == outcome.retry_after


@pytest.mark.parametrize("status", [400, 404, 422, 307])
def test_an_answer_that_says_nothing_of_load_is_not_observed(status: int) -> None:
    assert observation_of(Outcome(Kind.FATAL, status, ""), 0.1, retried=False) is None


class FakeAttempt:
    id = "r1"
    token = "t1"
    queue = QueueConfig("q", "http://x", gate_type="adaptive-concurrency")

    def adaptive_view(self) -> dict[str, Any] | None:
        return {"limit": 7, "signal": "engine-metrics", "reason": "engine queue: 3 waiting"}


def test_a_flower_gate_event_of_an_adaptive_gate_carries_its_limit_signal_and_reason() -> None:
    sent: list[tuple[str, dict[str, Any]]] = []
    refused = Decision(Verdict.REFUSE, reason="gate_closed", wake_on_release=True)
    observe.gate_decision(FakeAttempt(), refused, lambda e, **kw: sent.append((e, kw)))  # type: ignore[arg-type]
    assert sent == [
        (
            "task-gate-refused",
            {"request_id": "r1", "queue": "q", "reason": "gate_closed", "attempt": "t1",
             "gate": "adaptive-concurrency", "limit": 7, "signal": "engine-metrics",
             "why": "engine queue: 3 waiting"},
        )
    ]  # fmt: skip
