"""Token budgets in the pipeline (``redis-quota``, ``mode: "tokens"``): a real worker node, the
simulator over HTTP (its ``usage``: a token per prompt word, ``max_tokens`` completion tokens)
and the real Redis. Queues ``tokens`` (1,000 tokens per minute per userid) and ``tokens1s``
(100 per second), see ``tests/conftest.py``. Every test ends in the ``pl`` leak check: no gate
holds a reservation; here also no charge is left unsettled."""

from __future__ import annotations

import json
import uuid
from typing import Any

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.sim import SimServer

from .conftest import held


def uid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def user() -> dict[str, str]:
    return {"userid": uid("u")}


def charges(pl: Pipeline, userid: str, window: str = "60") -> dict[str, str]:
    """The user's charges in the budget of that window: holder → "e<n>" (an estimate still
    open) or "<n>" (settled)."""
    key = f"{pl.store.keys.prefix}gate:quota:tokens:{window}:charges:userid:{userid}"
    return dict(pl.store.client.hgetall(key))


def open_charges(pl: Pipeline) -> list[str]:
    """Charges of any token budget still open (an estimate nobody settled)."""
    out = []
    pattern = f"{pl.store.keys.prefix}gate:*:tokens:*:charges:*"
    for key in pl.store.client.scan_iter(pattern, count=10_000):
        out += [h for h, v in pl.store.client.hgetall(key).items() if v.startswith("e")]
    return out


def by_request(found: dict[str, str]) -> dict[str, str]:
    """Charges keyed by request id (a holder is ``<request id>:<attempt token>``)."""
    return {h.rpartition(":")[0]: v for h, v in found.items()}


def body(words: int, max_tokens: int) -> dict[str, Any]:
    """A completion request of ``words`` 4-letter words: estimate ceil(5w / 4) + max_tokens,
    simulator usage w + max_tokens."""
    return {"model": "sim-model", "prompt": " ".join(["word"] * words), "max_tokens": max_tokens}


def test_a_success_settles_its_charge_to_the_usage(served: Pipeline, sim: SimServer) -> None:
    u = user()
    rid = served.submit(body(8, 20), queue="tokens", metadata=u, timeout=30).id
    res = served.wait(rid, 20)
    assert res.ok
    usage = json.loads(res.payload)["usage"]
    assert usage["total_tokens"] == 8 + 20  # the estimate was ceil(39 / 4) + 20 = 30
    assert by_request(charges(served, u["userid"])) == {rid: "28"}


def test_a_request_larger_than_the_whole_budget_is_dropped_unsent(
    served: Pipeline, sim: SimServer
) -> None:
    u = user()
    rid = served.submit(body(4, 996), queue="tokens", metadata=u, timeout=30).id  # 5 + 996
    res = served.wait(rid, 20)
    assert res.error_code == "GATE_DROPPED"
    assert res.error_message is not None
    assert "token estimate 1001 exceeds the whole budget of 1000 tokens per 60 s" in (
        res.error_message
    )
    assert res.attempts == 0
    assert sim.stats()["attempts_by_request_id"].get(rid) is None  # never sent
    assert charges(served, u["userid"]) == {}


def test_a_failed_attempt_is_refunded_and_its_retry_charged_its_usage(
    served: Pipeline, sim: SimServer
) -> None:
    u = user()
    fail = {"x-sim-fail-first": "1", "x-sim-fail-status": "503"}
    rid = served.submit(body(2, 30), queue="tokens", metadata=u, timeout=30, headers=fail).id
    res = served.wait(rid, 20)
    assert res.ok and res.attempts == 2
    # the 503's charge was refunded; the retry's settled to its usage (2 + 30)
    found = charges(served, u["userid"])
    assert by_request(found) == {rid: "32"} and len(found) == 1


def test_over_the_budget_a_request_waits_for_the_window_not_in_a_loop(
    served: Pipeline, sim: SimServer
) -> None:
    """tokens1s: 100 tokens per second. The first request (61 tokens) is held at the simulator;
    the second (61) is refused back to the queue, asks again once the first one's charge can
    have expired, and reaches the simulator a window after the first."""
    u = user()
    hold = uid("hold")
    first = served.submit(body(1, 60), queue="tokens1s", metadata=u, timeout=30, headers=held(hold))
    sim.wait_held(hold)
    second = served.submit(body(1, 60), queue="tokens1s", metadata=u, timeout=30)
    wait_until(lambda: served.state(second.id) == "retry_wait", 10, "the second refused")
    sim.release(hold)
    assert served.wait(first.id, 20).ok and served.wait(second.id, 20).ok
    arrivals = {rid: at for at, _, _, rid in sim.tokens()}
    assert arrivals[second.id] - arrivals[first.id] >= 0.9  # the window (1 s), less jitter
    # a refusal is not an attempt, and it was not retried in a loop: a few dispatches at most
    record = served.record(second.id)
    assert int(record["attempts"]) == 1
    assert int(record["dispatches"]) <= 4


def test_every_outcome_settles_or_refunds_and_no_gate_holds_a_reservation(
    served: Pipeline, sim: SimServer
) -> None:
    """Success, a terminal 4xx, a 503 then success, a 429 with Retry-After, a drop: afterwards
    (the ``pl`` fixture) every queue is idle and no gate holds a reservation; no charge is
    left open, the 4xx was refunded, the successes hold their usage."""
    u = user()
    sub: dict[str, Any] = {"queue": "tokens", "metadata": u, "timeout": 30}
    ok = served.submit(body(3, 10), **sub).id
    bad = served.submit(
        body(3, 10), headers={"x-sim-fail-first": "9", "x-sim-fail-status": "422"}, **sub
    ).id
    retried = served.submit(
        body(3, 10), headers={"x-sim-fail-first": "1", "x-sim-fail-status": "503"}, **sub
    ).id
    shed = served.submit(
        body(3, 10),
        headers={
            "x-sim-fail-first": "1",
            "x-sim-fail-status": "429",
            "x-sim-retry-after": "0.1",
        },
        **sub,
    ).id
    dropped = served.submit(body(3, 5000), **sub).id
    results = {rid: served.wait(rid, 20) for rid in (ok, bad, retried, shed, dropped)}
    assert results[ok].ok and results[retried].ok and results[shed].ok
    assert results[bad].status_code == 422
    assert results[dropped].error_code == "GATE_DROPPED"
    assert open_charges(served) == []
    settled = charges(served, u["userid"])
    assert by_request(settled) == {rid: "13" for rid in (ok, retried, shed)}
    assert len(settled) == 3


def test_a_request_the_window_cannot_fit_before_its_deadline_ends_deadline_exceeded(
    served: Pipeline, sim: SimServer
) -> None:
    """The budget is spent for the next minute: a request refused with that long a delay
    still ends at its deadline, unsent (it waits in the delayed set, which the deadline sweep
    covers)."""
    u = user()
    first = served.submit(body(1, 990), queue="tokens", metadata=u, timeout=30).id
    assert served.wait(first, 20).ok  # 991 of 1,000 tokens charged for a minute
    late = served.submit(body(1, 60), queue="tokens", metadata=u, timeout=3).id
    res = served.wait(late, 20)
    assert res.error_code == "DEADLINE_EXCEEDED" and res.attempts == 0
    assert sim.stats()["attempts_by_request_id"].get(late) is None
