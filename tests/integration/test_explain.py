"""``Request.explain()`` and ``pipeline explain``: where a request is and why — its place in
its queue by priority (and its tenant's turn), its tenant's quota use and holders, its gate
decisions and retries in the decision log, its terminal state — with real Redis, real worker
nodes and the simulator; plus the decision log's own rules (text round-trips, the cap)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.cli.services import wait_until
from pipeline.client import Explanation, Pipeline
from pipeline.errors import UnknownRequest
from pipeline.sim import SimServer
from pipeline.store import Dispatched, sched
from pipeline.store.journal import MAX_TEXT, Journal
from tests.conftest import held

from .test_cli import run_cli


def uid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def events(e: Explanation) -> list[str]:
    return [x.event for x in e.log]


def test_a_waiting_request_counts_who_is_ahead_by_priority(pl: Pipeline) -> None:
    """``solo`` has no worker: the requests wait, in priority then deadline order."""
    base = time.time() + 600
    items: list[dict[str, Any]] = [
        {"payload": {"p": 9}, "queue": "solo", "priority": 9, "deadline": base + 50},
        {"payload": {"p": 9}, "queue": "solo", "priority": 9, "deadline": base + 60},
        {"payload": {"p": 7}, "queue": "solo", "priority": 7, "deadline": base + 70},
        *[
            {"payload": {"p": 5}, "queue": "solo", "priority": 5, "deadline": base + i}
            for i in range(3)
        ],
        {"payload": {"me": 1}, "queue": "solo", "priority": 5, "deadline": base + 10},
        {"payload": {"p": 5}, "queue": "solo", "priority": 5, "deadline": base + 20},  # behind
        {"payload": {"p": 1}, "queue": "solo", "priority": 1, "deadline": base},  # behind
    ]
    reqs = pl.submit_many(items)
    me = reqs[6]
    e = me.explain()
    assert e.state == "queued" and e.queue == "solo" and e.priority == 5
    p = e.position
    assert p is not None and not p.indexed
    assert p.ahead == 6
    assert p.higher == {9: 2, 7: 1}
    assert p.same_priority_ahead == 3
    assert e.deadline == pytest.approx(base + 10)
    assert e.deadline_slack_s == pytest.approx(base + 10 - e.server_now, abs=1e-3)
    assert 500 < e.deadline_slack_s < 700
    assert e.attempts == 0 and e.dispatches == 0 and e.log == []
    text = e.to_text()
    order = "(priority, deadline, submission)"
    assert (
        f"6 before it in the queue {order}: 2 at priority 9, 1 at priority 7, 3 at its own" in text
    )
    assert pl.explain(reqs[0].id).position.ahead == 0  # type: ignore[union-attr]
    for r in reqs:
        assert r.cancel(by="ops@example")
    # a cancelled request: its terminal state, and the log says who ended it, when and how
    done = me.explain()
    assert done.state == "done" and done.position is None
    assert done.result is not None and done.result["error_code"] == "CANCELLED"
    assert events(done) == ["cancelled", "done"] and done.log[1].fields["outcome"] == "CANCELLED"
    asked = done.log[0]
    assert asked.fields == {"was": "queued", "running": "finish", "by": "ops@example"}
    assert asked.t == pytest.approx(done.server_now, abs=5)
    assert "cancelled  asked by ops@example while queued" in done.to_text()


def test_in_a_fair_share_queue_it_names_its_tenants_turn(pl: Pipeline) -> None:
    """``fairq`` (fair share, no worker in this test): tenant B's request waits behind one
    of tenant A's turns, not behind all of A's requests."""
    keys, client = pl.store.keys, pl.store.client
    sched.setup(client, pl.store.scripts, keys, "fairq", "fairq", "userid", True)
    a, b = {"userid": uid("A")}, {"userid": uid("B")}
    first = [pl.submit({"a": i}, queue="fairq", timeout=600, metadata=a) for i in range(3)]
    mine = pl.submit({"b": 1}, queue="fairq", timeout=600, metadata=b)
    try:
        p = mine.explain().position
        assert p is not None and p.indexed and p.fair_share
        assert p.tenant == b["userid"] and p.tenant_ahead == 0 and p.tenant_waiting == 1
        assert p.held_back_by is None
        assert p.tenants_ahead == 1 and p.tenants_ready == 2  # A's turn comes first
        assert p.ahead == 3  # in the pending set's own order, all of A's are before it
        third = first[2].explain()
        assert third.tenant == a["userid"]
        assert third.position is not None and third.position.tenant_ahead == 2
        text = third.to_text()
        assert f"tenant {a['userid']!r} (fair share): 2 of its 3 waiting before it" in text
    finally:
        for r in [*first, mine]:
            r.cancel()


def test_a_tenant_at_its_quota_shows_the_key_its_use_and_holders(
    served: Pipeline, sim: SimServer
) -> None:
    """quota1 (one in flight per user): the first request holds the user's slot at the
    simulator; the second is sent past the limit (look-ahead) and parks at the worker for the
    key; the third is held back by the dispatcher. Each explains itself."""
    user = {"userid": uid("u")}
    key = f"quota:userid:{user['userid']}"
    first = served.submit({"n": 1}, id=uid("first"), queue="quota1", timeout=60, metadata=user,
                          headers=held("q-" + user["userid"]))  # fmt: skip
    sim.wait_held("q-" + user["userid"])
    second = served.submit({"n": 2}, id=uid("second"), queue="quota1", timeout=60, metadata=user)
    wait_until(lambda: "parked" in events(second.explain()), 10, "the park noted")
    third = served.submit({"n": 3}, id=uid("third"), queue="quota1", timeout=60, metadata=user)

    def held_back() -> Explanation | None:
        e = third.explain()
        return e if e.position is not None and e.position.held_back_by == key else None

    e = wait_until(held_back, 10, "the third held back")
    assert events(e) == ["held"] and e.log[-1].fields == {"key": key}  # once, not per recheck
    (q,) = e.quotas
    assert q.key == key and q.limit == 1
    assert q.dispatched == 2  # the holder and the look-ahead attempt parked for the key
    assert q.leases == 1 and q.in_use == 2
    (h,) = q.holders
    # PIPELINE_LEASE_S, the lease's end rounded up to a whole second (lib.lua lease_score)
    assert h.request_id == first.id and 0 < h.lease_left_s <= 3 + 1
    assert set(q.requests) == {first.id, second.id}
    assert q.tenants_held_back == 1
    text = e.to_text()
    assert f"held back: its tenant is at quota key {key}" in text
    assert f"{key} 2/1 in use (2 dispatched, 1 leased); holders: {first.id}#" in text

    s = second.explain()
    assert s.state == "running" and s.worker and s.attempt
    assert s.gate is not None and not s.gate["holds_slot"]
    dispatched = next(x for x in s.log if x.event == "dispatched")
    assert dispatched.fields["ahead"] == key  # sent past the key's limit, to park for it
    parked = s.log[-1]
    assert parked.event == "parked" and parked.fields["gate"] == "redis-quota"
    assert parked.fields["reason"] == "quota_exhausted" and parked.fields["key"] == key
    assert s.quotas[0].holders[0].request_id == first.id

    f = first.explain()
    assert f.state == "running" and f.gate is not None and f.gate["holds_slot"]
    assert events(f) == ["dispatched"]  # its admission is logged with its outcome

    sim.release("q-" + user["userid"])
    for r in (first, second, third):
        assert r.result(timeout=30).ok
    s = second.explain()
    admitted = [x for x in s.log if x.event == "admitted"]
    assert admitted and admitted[-1].fields["waited"] > 0
    assert s.state == "done" and s.log[-1].event == "done"
    assert s.log[-1].fields == {"outcome": "ok", "status": 200}
    times = [x.t for x in s.log]
    assert times == sorted(times)


def test_a_refused_request_names_the_gate_and_the_quota_it_waits_for(
    pl: Pipeline, sim: SimServer, start_worker: Any
) -> None:
    """qrefuse with PIPELINE_PARK_S=0.3: the look-ahead attempt parks, is refused by the
    quota and goes back to the queue; the log says by which gate, why and for which key."""
    worker = start_worker(pools="qrefuse", concurrency=4, extra_env={"PIPELINE_PARK_S": "0.3"})
    try:
        user = {"userid": uid("u")}
        key = f"quota:userid:{user['userid']}"
        first = pl.submit({"n": 1}, id=uid("holder"), queue="qrefuse", timeout=60,
                          metadata=user, headers=held("r-" + user["userid"]))  # fmt: skip
        sim.wait_held("r-" + user["userid"])
        second = pl.submit({"n": 2}, id=uid("refused"), queue="qrefuse", timeout=60,
                           metadata=user)  # fmt: skip
        e = wait_until(
            lambda: (x := second.explain()) and "refused" in events(x) and x,
            15,
            "a refusal in the log",
        )
        refused = next(x for x in e.log if x.event == "refused")
        assert refused.fields["gate"] == "redis-quota"
        assert refused.fields["reason"] == "quota_exhausted"
        assert refused.fields["key"] == key
        assert 0.2 <= refused.fields["delay"] <= 1.0  # REFUSE_DELAY_S
        assert e.attempts == 0  # a refusal is not an attempt
        (q,) = e.quotas
        assert q.key == key and q.limit == 1 and q.in_use >= 1
        assert first.id in [h.request_id for h in q.holders]
        assert "refused" in e.to_text() and "by redis-quota (quota_exhausted)" in e.to_text()
        sim.release("r-" + user["userid"])
        assert first.result(timeout=30).ok and second.result(timeout=30).ok
    finally:
        worker.stop()


def test_a_retried_request_shows_each_status_and_backoff(served: Pipeline) -> None:
    """Two 503s, then success; and a 429 with Retry-After: the log has each retry's status and
    backoff, then the terminal state."""
    fail = {"x-sim-fail-first": "2", "x-sim-fail-status": "503"}
    r503 = served.submit({"r": 503}, id=uid("r503"), timeout=60, headers=fail)
    slow = {"x-sim-fail-first": "1", "x-sim-fail-status": "429", "x-sim-retry-after": "1"}
    r429 = served.submit({"r": 429}, id=uid("r429"), timeout=60, headers=slow)
    assert r503.result(timeout=30).ok and r429.result(timeout=30).ok
    e = r503.explain()
    assert e.state == "done" and e.result == {"status_code": 200}
    assert e.attempts == 3 and e.dispatches == 3
    retries = [x for x in e.log if x.event == "retry"]
    assert [x.fields["status"] for x in retries] == [503, 503]
    assert [x.fields["attempt"] for x in retries] == [1, 2]
    assert all(0 < x.fields["delay"] <= 0.4 for x in retries)  # retry_max_delay_s
    assert events(e) == ["dispatched", "admitted", "retry"] * 2 + ["dispatched", "admitted", "done"]
    assert e.log[-1].fields == {"outcome": "ok", "status": 200}
    text = e.to_text()
    assert "attempt 1: HTTP 503; backoff" in text and "done: HTTP 200" in text
    (r,) = [x for x in r429.explain().log if x.event == "retry"]
    assert r.fields["status"] == 429 and r.fields["retry_after"] == 1
    assert r.fields["delay"] >= 1  # a larger Retry-After is honoured


def test_the_command_prints_text_and_json_and_names_an_unknown_id(
    env: dict[str, str], pl: Pipeline
) -> None:
    r = pl.submit({"cli": 1}, id=uid("cli"), queue="solo", priority=3, timeout=600)
    try:
        proc = run_cli(["explain", r.id], env)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].split() == ["request", r.id]
        assert lines[1].startswith("state     queued in queue solo (pool solo), priority 3")
        assert any(line.startswith("deadline  in ") for line in lines)
        assert any(line.startswith("position  0 before it in the queue") for line in lines)
        proc = run_cli(["explain", r.id, "--json"], env)
        assert proc.returncode == 0, proc.stderr
        data = json.loads(proc.stdout)
        assert data["id"] == r.id and data["state"] == "queued" and data["priority"] == 3
        assert data["position"]["ahead"] == 0 and data["position"]["same_priority_ahead"] == 0
        assert 500 < data["deadline_slack_s"] <= 600
        assert data["log"] == []
    finally:
        assert r.cancel()
    data = json.loads(run_cli(["explain", r.id, "--json"], env).stdout)
    assert data["state"] == "done" and data["result"]["error_code"] == "CANCELLED"
    assert data["log"][-1]["event"] == "done" and data["log"][-1]["outcome"] == "CANCELLED"
    gone = uid("never")
    proc = run_cli(["explain", gone], env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"unknown request id {gone!r}" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(UnknownRequest):
        pl.explain(gone)


@pytest.fixture
def running(pl: Pipeline) -> Any:
    """A request of ``solo`` dispatched and started by hand (no worker): the fenced note
    script writes to its log; cancelled afterwards."""
    r = pl.submit({"x": 1}, id=uid("note"), queue="solo", timeout=600)
    q = pl.settings.queues["solo"]
    (d,) = [m for m in pl.store.tick(q, [q], 1.0, -1, 1).moved if m.id == r.id]
    assert pl.store.start(d.id, d.token, "solo", "w-test") is not None
    yield d
    assert pl.store.requeue(d.id, d.token, delay=0, attempted=False)
    assert r.cancel()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(reason=st.text(max_size=400), number=st.floats(allow_nan=False, allow_infinity=False))
def test_journal_text_reaches_the_log_intact(
    pl: Pipeline, running: Dispatched, reason: str, number: float
) -> None:
    """Whatever a reason holds (tabs, newlines, quotes, any Unicode), the entry the script
    stamps is the one the worker noted, cut to MAX_TEXT characters; its time is the server's."""
    j = Journal()
    j.add("requeued", reason=reason, x=number)
    assert pl.store.note(running.id, running.token, j)
    last = pl.explain(running.id).log[-1]
    assert last.event == "requeued"
    assert last.fields.get("reason", "") == reason[:MAX_TEXT]
    assert last.fields["x"] == pytest.approx(number, rel=1e-12, abs=0)


def test_the_log_keeps_its_last_fifty_entries_and_fences_stale_notes(
    pl: Pipeline, running: Dispatched
) -> None:
    j = Journal()
    for i in range(60):
        j.add("requeued", reason=f"n{i}")
    assert pl.store.note(running.id, running.token, j)
    log = pl.explain(running.id).log
    assert len(log) == 50
    assert [x.fields["reason"] for x in log] == [f"n{i}" for i in range(10, 60)]
    stale = Journal()
    stale.add("requeued", reason="stale")
    assert not pl.store.note(running.id, "not-its-token", stale)
    assert pl.explain(running.id).log[-1].fields["reason"] == "n59"
