"""The request path end to end: real Redis, a real worker node, real HTTP to the simulator."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
from celery.result import AsyncResult

from pipeline import IdempotencyConflict, UnknownRequest
from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.sim import SimServer
from tests.conftest import held


def uid(tag: str = "r") -> str:
    return f"{tag}-{uuid.uuid4().hex[:10]}"


def arrivals(sim: SimServer, rid: str) -> list[float]:
    return [a for a, _f, r in sim.stats_arrivals() if r == rid]  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _arrivals_helper(sim: SimServer) -> None:
    def stats_arrivals() -> list[tuple[float, float, str | None]]:
        import httpx

        return [tuple(x) for x in httpx.get(f"{sim.url}/sim/arrivals").json()]

    sim.stats_arrivals = stats_arrivals  # type: ignore[attr-defined]


def test_success(served: Pipeline, sim: SimServer) -> None:
    req = served.submit({"model": "m", "prompt": "hello"}, timeout=30, id=uid())
    res = req.result(timeout=15)
    assert res.ok and res.status_code == 200 and res.error_code is None
    assert res.json()["object"] == "text_completion"
    assert res.attempts == 1 and res.queue == "default"
    assert res.submitted_at is not None and res.finished_at is not None
    assert res.finished_at >= res.submitted_at
    assert req.state() == "done"
    assert sim.stats()["attempts_by_request_id"][req.id] == 1
    assert wait_until(lambda: AsyncResult(req.id).state == "SUCCESS", 5, "Celery SUCCESS")


def test_terminal_400_is_not_retried(served: Pipeline, sim: SimServer) -> None:
    req = served.submit(
        {"prompt": "x"},
        id=uid(),
        timeout=30,
        headers={"x-sim-fail-first": "3", "x-sim-fail-status": "400"},
    )
    res = req.result(timeout=15)
    assert not res.ok and res.status_code == 400 and res.error_code is None
    assert "error" in res.json()
    assert res.attempts == 1
    assert sim.stats()["attempts_by_request_id"][req.id] == 1
    assert wait_until(lambda: AsyncResult(req.id).state == "FAILURE", 5, "Celery FAILURE")


def test_503_then_success(served: Pipeline, sim: SimServer) -> None:
    req = served.submit(
        {"prompt": "x"},
        id=uid(),
        timeout=30,
        headers={"x-sim-fail-first": "2", "x-sim-fail-status": "503"},
    )
    res = req.result(timeout=15)
    assert res.ok and res.attempts == 3
    times = arrivals(sim, req.id)
    assert len(times) == 3
    # first retry waits base..2*base (0.05..0.1 s), the second 2*base..4*base
    assert times[1] - times[0] >= 0.05 and times[2] - times[1] >= 0.1


def test_429_retry_after_is_honoured(served: Pipeline, sim: SimServer) -> None:
    req = served.submit(
        {"prompt": "x"},
        id=uid(),
        timeout=60,
        headers={"x-sim-fail-first": "1", "x-sim-fail-status": "429", "x-sim-retry-after": "1"},
    )
    res = req.result(timeout=15)
    assert res.ok and res.attempts == 2
    first, second = arrivals(sim, req.id)
    assert second - first >= 1.0  # not earlier than Retry-After, though the backoff is 0.05 s


def test_retry_state_is_visible_in_celery(served: Pipeline, sim: SimServer) -> None:
    rid = uid()
    fail_once = {"x-sim-fail-first": "1", "x-sim-fail-status": "503"}
    req = served.submit({"prompt": "x"}, id=rid, timeout=60, headers={**fail_once, **held(rid)})
    sim.wait_held(rid)  # the retry's attempt, held: the request's last Celery state is RETRY
    assert AsyncResult(req.id).state == "RETRY"
    assert sim.stats()["attempts_by_request_id"][rid] == 2
    sim.release(rid)
    assert req.result(timeout=15).ok
    assert wait_until(lambda: AsyncResult(req.id).state == "SUCCESS", 5, "Celery SUCCESS")


def test_deadline_exhausted_by_retries_keeps_last_http_status(
    served: Pipeline, sim: SimServer
) -> None:
    req = served.submit(
        {"prompt": "x"},
        id=uid(),
        timeout=1.0,
        headers={"x-sim-fail-first": "1000", "x-sim-fail-status": "503"},
    )
    res = req.result(timeout=15)
    assert not res.ok and res.status_code == 503 and res.error_code is None
    assert res.attempts >= 2
    assert res.attempts == sim.stats()["attempts_by_request_id"][req.id]
    assert res.finished_at is not None and res.finished_at <= time.time()


def test_transport_errors_retry_then_deadline_exceeded(served: Pipeline) -> None:
    # The "short" queue's 0.3 s per-attempt timeout fires on every stalled attempt.
    req = served.submit(
        {"prompt": "x"},
        id=uid(),
        queue="short",
        timeout=1.5,
        headers={"x-sim-fail-first": "1000", "x-sim-fail-mode": "stall"},
    )
    res = req.result(timeout=15)
    assert res.error_code == "DEADLINE_EXCEEDED" and res.status_code is None
    assert res.attempts >= 2
    assert "timed out" in (res.error_message or "")


def test_an_attempt_cut_short_by_the_deadline_keeps_the_error_before_it(
    served: Pipeline, sim: SimServer
) -> None:
    """The first attempt's connection is dropped; the retry is held at the simulator until the
    deadline cuts it off. The result names the dropped connection, not a time-out of 0.0 s."""
    rid = uid()
    sim.script_fault(rid, fail_first=1, mode="drop")
    res = served.submit({"prompt": "x"}, id=rid, timeout=1.5, headers=held(rid)).result(15)
    sim.release(rid)
    assert res.error_code == "DEADLINE_EXCEEDED" and res.attempts == 2, res
    assert (res.error_message or "").startswith("deadline exceeded (last error: "), res
    assert "timed out" not in (res.error_message or ""), res


def test_expiry_while_queued(pl: Pipeline, worker: Any, sim: SimServer) -> None:
    # nobody serves the "solo" pool: the request waits until its deadline passes
    req = pl.submit({"prompt": "x"}, id=uid(), queue="solo", timeout=0.5)
    res = req.result(timeout=10)
    assert res.error_code == "DEADLINE_EXCEEDED" and res.attempts == 0
    assert json.loads(res.payload) == {"error": "deadline exceeded"}
    assert req.id not in sim.stats()["attempts_by_request_id"]


def test_cancel_before_dispatch(pl: Pipeline, sim: SimServer) -> None:
    req = pl.submit({"prompt": "x"}, id=uid(), queue="solo", timeout=60)
    assert req.state() == "queued"
    assert req.cancel() is True
    res = req.result(timeout=5)
    assert res.error_code == "CANCELLED" and res.attempts == 0
    assert req.cancel() is False  # already finished: nothing to cancel
    assert req.id not in sim.stats()["attempts_by_request_id"]


def test_cancel_while_running_is_asked_of_the_attempt_and_gives_no_retry(pl: Pipeline) -> None:
    """A running attempt is not cancelled at once (it may be at the model server): it is
    marked, its own token reads the mark (an attempt parked for a slot then ends unsent), and
    when it comes back for a retry it gets none: CANCELLED, its HTTP attempt counted."""
    r = pl.submit({"prompt": "x"}, id=uid(), queue="solo", timeout=600)
    q, store = pl.settings.queues["solo"], pl.store_of("solo")
    (d,) = [m for m in store.tick(q, [q], 1.0, -1, 1).moved if m.id == r.id]
    assert store.cancel_asked(d.id, d.token) is None  # not cancelled yet
    assert store.start(d.id, d.token, "solo", "w-test") is not None
    assert r.cancel() is False and r.state() == "running"
    assert store.cancel_asked(d.id, d.token) == "cancelled"
    assert store.cancel_asked(d.id, "another-attempt") == "fenced off"  # not its request now
    assert store.requeue(d.id, d.token, delay=0, attempted=True) is not None
    res = r.result(timeout=5)
    assert res.error_code == "CANCELLED" and res.attempts == 1
    assert json.loads(res.payload) == {"error": "cancelled"}
    assert pl.inspect()["solo"]["pending"] == 0


def test_cancel_unknown_id_raises_as_get_does(pl: Pipeline) -> None:
    """Issue 45, item 16: it returned False, as for a request that had finished."""
    with pytest.raises(UnknownRequest):
        pl.cancel(uid("nobody"))


def test_idempotent_submit(pl: Pipeline) -> None:
    rid = uid()
    a = pl.submit({"prompt": "first"}, id=rid, queue="solo", timeout=60)
    b = pl.submit({"prompt": "first"}, id=rid, queue="solo", timeout=30, priority=5)
    assert a.created and not b.created and a == b  # the same content: the live request
    assert json.loads(pl.record(rid)["payload"]) == {"prompt": "first"}
    assert pl.inspect()["solo"]["pending"] == 1
    assert a.cancel()
    # a finished id may be submitted again, as a new request
    c = pl.submit({"prompt": "third"}, id=rid, queue="solo", timeout=60)
    assert c.created and c.state() == "queued"
    assert json.loads(pl.record(rid)["payload"]) == {"prompt": "third"}
    assert c.cancel()


def test_a_live_id_with_other_content_is_a_conflict(pl: Pipeline) -> None:
    """A live id submitted with another payload, queue, endpoint or headers raises
    IdempotencyConflict naming it and what differs, and stores nothing; in submit_many the
    other items are stored. The check rides in submit's own round trip (submit.lua)."""
    rid, other = uid(), uid()
    base = {"queue": "merge1", "headers": {"x-a": "1"}, "timeout": 60}
    a = pl.submit({"prompt": "x"}, id=rid, **base)
    changes: list[tuple[dict[str, Any], list[str]]] = [
        ({"payload": {"prompt": "y"}}, ["payload"]),
        ({"queue": "merge2"}, ["queue"]),  # the same pool
        ({"endpoint": "/v1/chat/completions"}, ["endpoint"]),
        ({"headers": {"x-a": "2"}}, ["headers"]),
        ({"payload": {"prompt": "y"}, "headers": {}}, ["payload", "headers"]),
    ]
    for change, differs in changes:
        kw = {"payload": {"prompt": "x"}, **base, **change}
        with pytest.raises(IdempotencyConflict) as exc:
            pl.submit(kw.pop("payload"), id=rid, **kw)
        assert isinstance(exc.value, ValueError)
        assert exc.value.request_id == rid and exc.value.differs == differs, exc.value
        assert rid in str(exc.value)
    assert json.loads(pl.record(rid)["payload"]) == {"prompt": "x"}  # nothing was stored
    assert pl.inspect()["merge2"]["pending"] == 0
    with pytest.raises(IdempotencyConflict) as exc:
        pl.submit_many([
            {"payload": {"prompt": "z"}, "id": other, **base},
            {"payload": {"prompt": "y"}, "id": rid, **base},
        ])  # fmt: skip
    assert exc.value.request_id == rid and exc.value.stored == [other]
    assert pl.state(other) == "queued"
    assert a.cancel() and pl.cancel(other)
    again = pl.submit({"prompt": "y"}, id=rid, **base)  # a finished id takes new content
    assert again.created and again.cancel()


def test_submit_many_sends_a_small_head_then_doubling_chunks(
    pl: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One round trip per chunk: 32 rows first (the dispatcher starts on them at once), then
    twice as many each time up to 500; the batch keeps its order across chunks."""
    sizes: list[int] = []
    original = pl.store.scripts.submit

    def counting(keys: list[str], args: list[Any]) -> Any:
        sizes.append(len(json.loads(args[-1])))
        return original(keys=keys, args=args)

    monkeypatch.setitem(pl.store.scripts._scripts, "submit", counting)
    items = [{"payload": {"prompt": f"p{i}"}, "queue": "solo", "timeout": 60} for i in range(1000)]
    reqs = pl.submit_many(items)
    monkeypatch.undo()
    assert sizes == [32, 64, 128, 256, 500, 20]
    assert len({r.id for r in reqs}) == 1000 and all(r.created for r in reqs)
    members = [str(pl.record(r.id)["member"]) for r in reqs]
    assert members == sorted(members)  # the sequence part breaks ties in submission order
    assert pl.inspect()["solo"]["pending"] == 1000
    assert all(pl.cancel(r.id) for r in reqs)


def test_submitted_text_is_stored_byte_for_byte(pl: Pipeline) -> None:
    """A submission travels to Redis as one JSON argument per chunk: non-ASCII, characters
    outside the BMP, escaped control characters, quotes and backslashes arrive unchanged."""
    text = 'héllo wörld 🚀 \u2028 "q" \\ \x00 \t end'
    meta = {"userid": "ünïcode-🙂", "tag": 'a"b\\c'}
    headers = {"x-note": "ascii only"}
    reqs = pl.submit_many(
        [
            {
                "payload": {"prompt": text, "n": i},
                "metadata": meta,
                "headers": headers,
                "queue": "solo",
            }  # no worker serves it: the cancel below always finds it queued
            for i in range(3)
        ]
    )
    for i, req in enumerate(reqs):
        record = pl.record(req.id)
        assert json.loads(record["payload"]) == {"prompt": text, "n": i}
        assert json.loads(record["metadata"]) == meta
        assert json.loads(record["headers"]) == headers
        assert record["priority"] == "0" and float(record["deadline"]) > time.time()
        assert pl.cancel(req.id)


def test_submit_many_runs_to_completion(served: Pipeline) -> None:
    reqs = served.submit_many([{"payload": {"prompt": f"p{i}"}, "timeout": 30} for i in range(60)])
    results = {r.id: r for r in served.iter_results([r.id for r in reqs])}
    assert set(results) == {r.id for r in reqs}
    assert all(r.ok for r in results.values())


def test_result_list_uses_reference_field_names(served: Pipeline) -> None:
    client = served.store.client
    results_key = served.store.keys.result_list(served.settings.queues["slowretry"])
    client.delete(results_key)  # this session's list: drop earlier tests' results
    ok = served.submit({"prompt": "x"}, id=uid(), queue="slowretry", timeout=30)
    bad = served.submit(
        {"prompt": "x"},
        id=uid(),
        queue="slowretry",
        timeout=30,
        headers={"x-sim-fail-first": "1", "x-sim-fail-status": "404"},
    )
    ok.result(timeout=15)
    bad.result(timeout=15)
    pushed = {}
    for _ in range(2):
        raw = client.rpop(results_key)
        assert raw is not None
        item = json.loads(raw)
        pushed[item["id"]] = item
    good = pushed[ok.id]
    assert good["status_code"] == 200 and isinstance(good["payload"], str)
    assert "error_code" not in good and "error_message" not in good
    assert pushed[bad.id]["status_code"] == 404
    cancelled = served.submit({"prompt": "x"}, id=uid(), queue="solo", timeout=30)
    cancelled.cancel()
    item = json.loads(client.lpop(served.store_of("solo").keys.default_result_list("solo")) or "{}")
    assert item["id"] == cancelled.id and "status_code" not in item
    assert item["error_code"] == "CANCELLED" and item["error_message"]
    assert json.loads(item["payload"]) == {"error": "cancelled"}


def test_request_headers_and_endpoint(served: Pipeline, sim: SimServer) -> None:
    req = served.submit(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        id=uid(),
        timeout=30,
        endpoint="/v1/chat/completions",
    )
    res = req.result(timeout=15)
    assert res.ok and res.json()["object"] == "chat.completion"


def test_get_and_unknown(pl: Pipeline) -> None:
    from pipeline.errors import UnknownRequest

    req = pl.submit({"prompt": "x"}, id=uid(), queue="solo", timeout=30)
    assert pl.get(req.id) == req
    with pytest.raises(UnknownRequest):
        pl.get(uid("missing"))
    with pytest.raises(TimeoutError):
        req.result(timeout=0.2)
    req.cancel()


DROPPED = {"x-sim-fail-status": "429", "x-sim-dropped-reason": "rejected-saturated"}


def test_gateway_drop_reason_is_kept_in_the_retry_reason_and_the_result(
    served: Pipeline,
) -> None:
    """A 429 with ``x-llm-d-request-dropped-reason`` (an llm-d gateway's flow control shed
    it): the Celery RETRY reason and, when the deadline ends the retries, the result's
    ``error_message`` name the reason."""
    req = served.submit(
        {"prompt": "x"},
        id=uid(),
        timeout=60,
        queue="slowretry",
        headers={"x-sim-fail-first": "1", "x-sim-retry-after": "2", **DROPPED},
    )
    wait_until(lambda: AsyncResult(req.id).state == "RETRY", 10, "Celery RETRY")
    assert "HTTP 429 (dropped: rejected-saturated)" in str(AsyncResult(req.id).traceback)
    res = req.result(timeout=15)
    assert res.ok and res.error_message is None
    shed = served.submit(
        {"prompt": "x"}, id=uid(), timeout=1.0, headers={"x-sim-fail-first": "1000", **DROPPED}
    )
    res = shed.result(timeout=15)
    assert (res.status_code, res.error_code) == (429, None)
    assert res.error_message == "HTTP 429 (dropped: rejected-saturated)"
    assert res.to_dict()["error_message"] == res.error_message
    # the record's result (what the result list also carries) keeps it too
    assert json.loads(served.record(shed.id)["result"])["error_message"] == res.error_message
