"""Poison answers and poison requests (issue 48: 4, 7, 8): a 200 whose body no parser reads,
a 200 that is not JSON, a request that fails every attempt, an exception out of an attempt.
Each is the attempt's outcome — counted, backed off, bounded by the queue's ``max_attempts``
— never a requeue with no delay; each test ends (through ``pl``) with no reservation held.

The ``poison`` queue (tests/conftest.py) allows 3 attempts; the others the default 10."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from pipeline.client import Pipeline
from pipeline.sim import SimServer
from pipeline.sim.server import NESTING
from pipeline.worker import AttemptId, Runtime, attempt
from tests.conftest import moved_to_pool

from .test_release_paths import finished, gate_in_flight


def uid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def bad_first(n: int, mode: str) -> dict[str, str]:
    """The first ``n`` attempts answer a 200 whose body is not JSON (the simulator's
    ``nested``, ``truncated`` or ``html``), or fail as ``status`` / ``drop`` say."""
    return {"x-sim-fail-first": str(n), "x-sim-fail-mode": mode}


def sim_attempts(sim: SimServer, rid: str) -> int:
    return int(sim.stats()["attempts_by_request_id"].get(rid, 0))


def retries_logged(pl: Pipeline, rid: str) -> list[dict[str, Any]]:
    return [x.fields for x in pl.explain(rid).log if x.event == "retry"]


# -- 4: a body nested deeper than the parser goes ----------------------------------------------
def test_a_deeply_nested_200_is_a_counted_attempt_with_backoff(
    served: Pipeline, sim: SimServer
) -> None:
    """Two answers of JSON nested 100,000 deep, then a good one: three attempts, counted,
    the two retries backed off (before: RecursionError escaped, the request went straight
    back to its queue uncounted: thousands of calls a minute)."""
    rid = served.submit({"p": 1}, id=uid("nest"), queue="lim2", headers=bad_first(2, "nested")).id
    res = finished(served, "lim2", rid)
    assert res.ok and res.attempts == 3 and sim_attempts(sim, rid) == 3, res
    retries = retries_logged(served, rid)
    assert [r["attempt"] for r in retries] == [1, 2]
    assert all(r["delay"] > 0 for r in retries)  # a backoff, not an immediate requeue
    assert all(r["error"] == "HTTP 200 (not JSON)" and r["status"] == 200 for r in retries)
    assert "attempt 1: HTTP 200 (not JSON); backoff" in served.explain(rid).to_text()


def test_a_poison_answer_ends_after_max_attempts(served: Pipeline, sim: SimServer) -> None:
    """Every answer nested past the parser: 3 attempts (the queue's ``max_attempts``), then
    ``MAX_ATTEMPTS_EXCEEDED`` keeping the last answer; the server saw exactly 3 calls."""
    rid = uid("nestpoison")
    served.submit({"p": 1}, id=rid, queue="poison", timeout=60, headers=bad_first(99, "nested"))
    res = finished(served, "poison", rid)
    assert res.error_code == "MAX_ATTEMPTS_EXCEEDED" and not res.ok, res
    assert res.attempts == 3 and sim_attempts(sim, rid) == 3
    assert res.status_code == 200 and len(res.payload) == 2 * NESTING
    assert "last: HTTP 200 (not JSON)" in (res.error_message or "")


# -- 8: a 200 that is not JSON -----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["html", "truncated"])
def test_a_200_that_is_not_json_ends_invalid_response(
    served: Pipeline, sim: SimServer, mode: str
) -> None:
    """Retried like a 5xx until the deadline (1.2 s: fewer than the 10 attempts the queue
    allows, whatever the jitter); the result is ``INVALID_RESPONSE``, not ok, with the body
    as it came — never an ok result whose ``json()`` raises."""
    rid = uid(mode)
    served.submit({"p": 1}, id=rid, queue="lim2", timeout=1.2, headers=bad_first(99, mode))
    res = finished(served, "lim2", rid)
    assert res.error_code == "INVALID_RESPONSE" and not res.ok, res
    assert res.status_code == 200 and res.attempts == sim_attempts(sim, rid) >= 1
    assert "answer is not JSON" in (res.error_message or "")
    if mode == "html":
        assert res.payload.startswith("<html>") and "text/html" in (res.error_message or "")
    with pytest.raises(ValueError):
        res.json()  # the body as it came: the error code says so before anyone parses it


def test_a_200_that_is_not_json_once_is_retried_to_success(
    served: Pipeline, sim: SimServer
) -> None:
    rid = served.submit({"p": 1}, id=uid("html1"), queue="lim2", headers=bad_first(1, "html")).id
    res = finished(served, "lim2", rid)
    assert res.ok and res.attempts == 2 and sim_attempts(sim, rid) == 2
    assert isinstance(res.json(), dict)


# -- 7: a request that fails every attempt -----------------------------------------------------
@pytest.mark.parametrize("mode", ["drop", "status"])
def test_a_request_that_fails_every_attempt_is_poison(
    served: Pipeline, sim: SimServer, mode: str
) -> None:
    """The server drops the connection (a crash) or answers 503 on every attempt: after the
    queue's 3 attempts the request ends ``MAX_ATTEMPTS_EXCEEDED`` long before its deadline,
    and ``explain`` calls it poison. A request behind it is served meanwhile."""
    rid = uid(f"poison-{mode}")
    served.submit({"p": 1}, id=rid, queue="poison", timeout=600, headers=bad_first(99, mode))
    other = served.submit({"p": 2}, id=uid("neighbour"), queue="poison").id
    res = finished(served, "poison", rid)
    assert res.error_code == "MAX_ATTEMPTS_EXCEEDED" and res.attempts == 3, res
    assert sim_attempts(sim, rid) == 3
    if mode == "status":
        assert res.status_code == 503 and "last: HTTP 503" in (res.error_message or "")
        assert json.loads(res.payload)["error"]["code"] == 503  # the last answer, kept
    else:
        assert res.status_code is None and "TRANSPORT" in (res.error_message or "")
    assert finished(served, "poison", other).ok
    e = served.explain(rid)
    assert e.verdict == "poison" and e.max_attempts == 3
    text = e.to_text()
    assert "3 HTTP attempts (at most 3)" in text
    assert "verdict   poison: all 3 attempts its queue allows (max_attempts) failed" in text
    assert [x.event for x in e.log][-2:] == ["poison", "done"]
    assert e.to_dict()["verdict"] == "poison"
    assert served.explain(other).verdict is None


@pytest.mark.parametrize(
    "busy",
    [{"x-sim-fail-status": "429"}, {"x-sim-fail-status": "503", "x-sim-retry-after": "0"}],
    ids=["429", "503-retry-after"],
)
def test_a_busy_server_is_waited_out_past_max_attempts(
    served: Pipeline, sim: SimServer, busy: dict[str, str]
) -> None:
    """Five answers saying the server is busy (a 429, a 503 with Retry-After), then a good
    one: overload is not the request's fault, so the queue's 3 attempts do not end it."""
    rid = uid("busy")
    headers = {**bad_first(5, "status"), **busy}
    served.submit({"p": 1}, id=rid, queue="poison", timeout=60, headers=headers)
    res = finished(served, "poison", rid)
    assert res.ok and res.attempts == 6 and sim_attempts(sim, rid) == 6, res
    assert served.explain(rid).verdict is None


# -- 4: any exception out of an attempt ---------------------------------------------------------
@pytest.fixture
def unserved(pl: Pipeline) -> Iterator[tuple[Pipeline, Runtime, str]]:
    """A client and an in-process runtime for a limit-2 queue no node serves (3 attempts at
    most): the test plays each attempt itself."""
    q = moved_to_pool(pl.settings.queues["poison"], "poisonhand", "nobody")
    settings = replace(pl.settings, queues={**pl.settings.queues, "poisonhand": q})
    client, rt = Pipeline(settings), Runtime(settings)
    yield client, rt, "poisonhand"
    rt.stop()


def start(p: Pipeline, rt: Runtime, queue: str, rid: str) -> attempt.Attempt:
    q = p.settings.queues[queue]
    (d,) = p.store_of(queue).tick(q, [q], 1.0, -1, 10).moved
    a = rt.begin(AttemptId(d.id, d.token, queue), "w")
    assert a is not None and d.id == rid
    return a


def test_an_exception_out_of_an_attempt_is_a_counted_retry(
    unserved: tuple[Pipeline, Runtime, str], sim: SimServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception the attempt's rules did not foresee (here after the answer came) is its
    outcome: a retry after the backoff, counted, its slot released — and at ``max_attempts``
    the end of the request (before: the exception escaped; Celery's ``after_return``
    requeued the request with no delay and no count)."""
    p, rt, queue = unserved

    def broken(outcome: Any) -> int:
        raise RuntimeError("a rule nobody foresaw")

    monkeypatch.setattr(attempt, "served_tokens", broken)
    rid = p.submit({"p": 1}, id=uid("raise"), queue=queue, timeout=600).id
    for n in (1, 2):
        a = start(p, rt, queue, rid)
        report = a.run()
        assert report.status.value == "retry" and report.due is not None, report
        assert a.closed and gate_in_flight(p, queue) == 0
        assert int(p.record(rid)["attempts"]) == n and p.state(rid) == "retry_wait"
        retry = retries_logged(p, rid)[-1]
        assert retry["delay"] > 0 and retry["error"].startswith("ESCAPED: RuntimeError")
        p.store_of(queue).client.zadd(p.store_of(queue).keys.delayed(queue), {rid: 0})  # due now
    a = start(p, rt, queue, rid)
    assert a.run().status.value == "failed"
    res = p.wait(rid, 5)
    assert res.error_code == "MAX_ATTEMPTS_EXCEEDED" and res.attempts == 3, res
    assert "ESCAPED: RuntimeError: a rule nobody foresaw" in (res.error_message or "")
    assert sim_attempts(sim, rid) == 3 and gate_in_flight(p, queue) == 0
    assert p.explain(rid).verdict == "poison"
