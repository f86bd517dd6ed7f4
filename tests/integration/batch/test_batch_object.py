"""The batch object in Redis: exact counts kept by the scripts that finish requests, the
completion window as every line's deadline, cancel, validation, and bounded state. Real
Redis, a real worker node and the simulator; every test ends with the leak check (``pl``)."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

from pipeline.batch import Batches, UnknownBatch
from pipeline.batch.config import BatchSettings
from pipeline.batch.files import Files
from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.sim import SimServer
from tests.conftest import assert_idle, held, local_limit
from tests.observability import isolated, start_node


def chat(cid: str, text: str = "hi", **extra: Any) -> dict[str, Any]:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": text}]}
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body,
            **extra}  # fmt: skip


def test_a_batch_runs_every_line_once_with_exact_counts(served: Pipeline, sim: SimServer) -> None:
    b = Batches(served)
    bad = {"x-sim-fail-first": "9", "x-sim-fail-status": "400"}
    retry = {"x-sim-fail-first": "1", "x-sim-fail-status": "503"}
    lines = [chat(f"c{i}", f"n{i}") for i in range(40)]
    lines[3]["headers"] = bad
    lines[7]["headers"] = retry
    batch = b.submit_batch(lines, completion_window="1h", metadata={"team": "a"})
    assert batch.status == "in_progress" and batch.request_counts.total == 40
    assert batch.expires_at - batch.created_at == pytest.approx(3600, abs=0.001)
    done = batch.wait(timeout=60)
    assert done.status == "completed", done
    c = done.request_counts
    assert (c.total, c.completed, c.failed) == (40, 39, 1)
    assert done.completed_at and done.finalizing_at and done.in_progress_at
    assert done.metadata == {"team": "a"}
    assert done.model == "sim-model"
    by_cid = {line.custom_id: line for line in b.lines(done)}
    assert len(by_cid) == 40
    assert by_cid["c3"].result is not None and by_cid["c3"].result.status_code == 400
    assert by_cid["c7"].result is not None and by_cid["c7"].result.attempts == 2
    # each line was sent exactly once (the retried one twice), carrying its request id
    attempts = sim.stats()["attempts_by_request_id"]
    assert attempts[done.request_id(8)] == 2  # line 8 is custom_id c7
    assert sum(attempts[done.request_id(n)] for n in range(1, 41)) == 41
    # the request record knows its batch and custom_id; its deadline is the batch's
    rec = served.record(done.request_id(1))
    assert rec["batch"] == done.id and rec["custom_id"] == "c0"
    assert float(rec["deadline"]) == pytest.approx(done.expires_at, abs=1e-6)
    # a closed batch is kept for its retention, then expires
    ttl = served.store.client.ttl(b.at(done.id).keys.batch(done.id))
    assert 0 < ttl <= b.settings.retention_s


def test_validation_fails_the_whole_batch_naming_each_bad_line(served: Pipeline) -> None:
    b = Batches(served)
    lines: list[Any] = [chat("a"), chat("a", "other"), "{not json", chat("b")]
    lines.append({"custom_id": "c", "method": "GET", "url": "/v1/chat/completions", "body": {}})
    lines.append({"custom_id": "d", "method": "POST", "url": "/v2/nothing", "body": {}})
    lines.append({"custom_id": "e", "method": "POST", "url": "/v1/completions", "body": [1]})
    batch = b.submit_batch(lines)
    assert batch.status == "failed" and batch.failed_at
    errors = {e["line"]: e for e in batch.errors or []}
    assert set(errors) == {2, 3, 5, 6, 7}
    assert errors[2]["code"] == "duplicate_custom_id" and "line 1" in errors[2]["message"]
    assert errors[3]["code"] == "invalid_json_line"
    assert errors[5]["code"] == "invalid_method"
    assert errors[6]["code"] == "invalid_url"
    assert errors[7]["code"] == "invalid_body"
    # nothing was submitted
    keys = served.store_of("default").keys
    assert not served.store.client.exists(keys.request(batch.request_id(1)))
    assert batch.request_counts.total == 0


def test_invalid_lines_go_to_the_error_file_when_asked(served: Pipeline) -> None:
    b = Batches(served)
    lines: list[Any] = [chat("a"), "[1, 2]", chat("b"), chat("b", "dup")]
    batch = b.submit_batch(lines, metadata={"invalid_lines": "error_file"}).wait(timeout=30)
    assert batch.status == "completed"
    c = batch.request_counts
    assert (c.total, c.completed, c.failed) == (4, 2, 2)
    out = list(b.lines(batch))
    assert [x.number for x in out] == [1, 2, 3, 4]
    assert out[1].invalid is not None and out[1].invalid["code"] == "invalid_json_line"
    assert out[3].invalid is not None and out[3].invalid["code"] == "duplicate_custom_id"


def test_cancel_cancels_what_has_not_started_and_in_flight_attempts_finish(
    env: dict[str, str], start_worker: Any, sim: SimServer, tmp_path: Path
) -> None:
    """Line 1 stalls at the simulator (in flight, holding the slot of a limit-1 gate) until
    its attempt times out; the other lines wait behind the gate. Cancel: the waiting lines
    end CANCELLED unsent, the attempt in flight is not interrupted, and when it comes back
    for a retry it gets none: the batch ends cancelled, the gate holds nothing. (No look-ahead
    here: the next test cancels an attempt parked at its worker for the slot.)"""
    sim.reset()
    iso = isolated(env, tmp_path, [{"queue_name": "lim", "igw_base_url": sim.url,
                                    **local_limit(1), "request_timeout_s": 2}],
                   PIPELINE_LOOKAHEAD="0")  # fmt: skip
    w, _ = start_node(start_worker, iso, concurrency=4)
    try:
        b = Batches(iso.pl)
        stall = {"x-sim-fail-first": "1", "x-sim-fail-mode": "stall"}
        lines = [chat("s", headers=stall)] + [chat(f"w{i}") for i in range(5)]
        batch = b.submit_batch(lines, queue=iso.queue("lim"))
        first = batch.request_id(1)
        wait_until(lambda: iso.pl.state(first) == "running", 15, "line 1 in flight")
        cancelled = batch.cancel()
        assert cancelled.status == "cancelling" and cancelled.cancelling_at
        done = b.wait(batch.id, timeout=30)
        assert done.status == "cancelled" and done.cancelled_at
        c = done.request_counts
        assert (c.total, c.completed, c.failed) == (6, 0, 6)
        results = {x.custom_id: x.result for x in b.lines(done)}
        assert all(r is not None and r.error_code == "CANCELLED" for r in results.values())
        assert results["s"] is not None and results["s"].attempts == 1  # it ran, only once
        attempts = sim.stats()["attempts_by_request_id"]
        assert attempts.get(first) == 1
        assert not any(done.request_id(n) in attempts for n in range(2, 7))
        assert_idle(iso.pl)
    finally:
        w.stop()


def test_cancel_ends_an_attempt_parked_for_the_slot_unsent(
    served: Pipeline, sim: SimServer
) -> None:
    """Look-ahead on (limit 1): one line holds the slot at the simulator until the test lets
    it go, the next is dispatched ahead and parked at the worker, started but unsent. Cancel:
    the parked one ends CANCELLED at once without reaching the model server, like the queued
    ones; only the holder ran. (Every line carries the hold: the two lines dispatched in one
    tick race for the slot, and either may win.)"""
    sim.reset()
    b = Batches(served)
    name = f"batch-hold-{uuid.uuid4().hex[:8]}"
    lines = [chat(f"w{i}", headers=held(name)) for i in range(5)]
    batch = b.submit_batch(lines, queue="lim1")
    sim.wait_held(name)
    ids = [batch.request_id(n) for n in range(1, 6)]
    (holder,) = sim.stats()["attempts_by_request_id"]  # the line that took the slot
    rest = [r for r in ids if r != holder]
    wait_until(lambda: any(served.state(r) == "running" for r in rest), 10, "a line parked ahead")
    (parked,) = [r for r in rest if served.state(r) == "running"]
    assert parked not in sim.stats()["attempts_by_request_id"]  # started, not sent
    assert batch.cancel().status == "cancelling"
    # the parked attempt ends at once, unsent, while the holder still holds the slot
    wait_until(lambda: served.state(parked) == "done", 10, "the parked line cancelled")
    assert served.state(holder) == "running"
    sim.release(name)
    done = b.wait(batch.id, timeout=30)
    assert done.status == "cancelled"
    c = done.request_counts
    assert (c.total, c.completed, c.failed) == (5, 1, 4)
    results = {x.custom_id: x.result for x in b.lines(done)}
    held_cid = f"w{ids.index(holder)}"
    assert results[held_cid] is not None and results[held_cid].ok
    for cid in {f"w{i}" for i in range(5)} - {held_cid}:
        r = results[cid]
        assert r is not None and r.error_code == "CANCELLED" and r.attempts == 0, (cid, r)
    assert set(sim.stats()["attempts_by_request_id"]) == {holder}
    assert_idle(served)


def test_cancel_of_a_batch_nobody_serves(pl: Pipeline) -> None:
    b = Batches(pl)
    batch = b.submit_batch([chat(f"q{i}") for i in range(30)], queue="solo")
    done = batch.cancel()
    assert done.status == "cancelled"
    assert done.request_counts.failed == 30
    assert b.cancel(batch.id).status == "cancelled"  # again: unchanged


def test_the_completion_window_is_every_lines_deadline(pl: Pipeline, worker: Any) -> None:
    """A batch on a queue no worker serves: when its window passes, a worker node's sweep
    ends every line DEADLINE_EXCEEDED unsent and the batch is expired."""
    b = Batches(pl)
    batch = b.submit_batch([chat(f"x{i}") for i in range(3)], queue="solo",
                           completion_window=1.5)  # fmt: skip
    assert batch.completion_window == "1.5s"
    # the session's node sweeps every queue (a second node on its pool would stay for the
    # rest of the session and double every per-node limit of the pool's queues)
    done = b.wait(batch.id, timeout=30)
    assert done.status == "expired" and done.expired_at
    assert done.request_counts.failed == 3
    for line in b.lines(done):
        assert line.result is not None and line.result.error_code == "DEADLINE_EXCEEDED"
        assert line.result.attempts == 0


def test_unknown_batch_and_bad_arguments(pl: Pipeline) -> None:
    b = Batches(pl)
    with pytest.raises(UnknownBatch):
        b.get("batch_nope")
    from pipeline.errors import InvalidRequest

    for kw, field in [
        ({"completion_window": "soon"}, "completion_window"),
        ({"queue": "nope"}, "queue"),
        ({"priority": 10}, "priority"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"batch_id": "bad id"}, "batch_id"),
    ]:
        with pytest.raises(InvalidRequest) as exc:
            b.submit_batch([chat("a")], **kw)
        assert exc.value.field == field


def test_everything_a_batch_leaves_expires_or_is_bounded(served: Pipeline) -> None:
    b = Batches(served)
    done = b.submit_batch([chat("a"), "oops"], metadata={"invalid_lines": "error_file"})
    done = done.wait(timeout=30)
    failed = b.submit_batch(["oops"])
    assert failed.status == "failed"
    client, k = served.store.client, b.at(done.id).keys  # its queue's pool's keys
    for key in (k.batch(done.id), k.batch_invalid(done.id), k.batch(failed.id)):
        assert client.ttl(key) > 0, key
    for name in (k.batches(), k.batches_expiry()):
        assert client.zscore(name, done.id) is not None
    assert not client.sismember(k.batches_active(), done.id)
    # an expired batch leaves the indexes at the next create (in its pool, as its slot's)
    client.delete(k.batch(done.id))
    client.zadd(k.batches_expiry(), {done.id: 1})
    b.submit_batch([chat("z")]).cancel()
    assert client.zscore(k.batches(), done.id) is None
    names = [x.id for x in b.list(limit=100)[0]]
    assert done.id not in names and failed.id in names
    assert re.match(r"^batch_[0-9a-f]{24}$", failed.id)
    json.dumps([x.to_openai() for x in b.list()[0]])


def test_a_listed_batch_cancelled_while_its_lines_are_stored_reads_every_line(
    pl: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines given in a list exist only while ``submit_batch`` runs: when a cancel stops it
    half-way, the lines never stored still come back from ``lines()`` (``batch_cancelled``, no
    custom_id: nothing kept it), one per counted line."""
    from pipeline.batch import ingest

    monkeypatch.setattr(ingest, "FIRST_CHUNK", 1)  # one line per store call: the enqueue
    monkeypatch.setattr(ingest, "MAX_CHUNK", 1)  # renews its lease after line 20
    b, other = Batches(pl), Batches(pl)
    renewers = 0
    real = b._renewer

    def renewer(batch_id: str) -> Any:
        nonlocal renewers
        renewers += 1
        inner = real(batch_id)
        if renewers == 1:
            return inner  # the validation scan's

        def renew() -> None:  # the enqueue's, after 20 lines: another client cancels (its
            inner()  # cancel of the stored lines waits for this enqueue's lease: run below)
            other.cancel(batch_id, lines=False)

        return renew

    monkeypatch.setattr(b, "_renewer", renewer)
    batch = b.submit_batch([chat(f"x{i}") for i in range(25)], queue="solo")
    assert batch.status == "cancelling"
    assert other.cancel_lines(batch.id) == 20
    done = b.wait(batch.id, timeout=30)
    assert done.status == "cancelled" and done.submitted == 20
    c = done.request_counts
    assert (c.total, c.completed, c.failed) == (25, 0, 25)
    out = list(b.lines(done))
    assert [x.number for x in out] == list(range(1, 26))
    assert [x.custom_id for x in out[:20]] == [f"x{i}" for i in range(20)]
    assert all(x.result is not None and x.result.error_code == "CANCELLED" for x in out[:20])
    assert all(x.custom_id is None and x.missing == "batch_cancelled" for x in out[20:])


def test_a_line_whose_id_is_live_with_other_content_is_an_error_line(
    served: Pipeline, sim: SimServer, tmp_path: Path
) -> None:
    """A batch's line ids are ``<batch id>-<line>``, and a batch id may be chosen: a request
    submitted by that id and still live (held at the simulator here) with another payload
    makes its line an error line (``idempotency_conflict``, naming the id and what differs)
    counted failed when the line is stored. The batch completes with every other line; the
    live request is left alone, counted in no batch, and its result is its own."""
    name = f"batch-live-{uuid.uuid4().hex[:8]}"
    bid = f"batch_conflict_{uuid.uuid4().hex[:8]}"
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "mine"}]}
    live = served.submit(body, id=f"{bid}-2", endpoint="/v1/chat/completions",
                         headers=held(name), timeout=60)  # fmt: skip
    sim.wait_held(name)
    files = Files(served.store, BatchSettings(files_dir=str(tmp_path / "files")))
    b = Batches(served, files=files)
    lines = [chat("a"), chat("b", "theirs", headers=held(name)), chat("c")]
    done = b.submit_batch(lines, batch_id=bid).wait(timeout=30)
    assert done.status == "completed", done
    c = done.request_counts
    assert (c.total, c.completed, c.failed) == (3, 2, 1)
    out = list(b.lines(done))
    assert [x.number for x in out] == [1, 2, 3] and out[0].ok and out[2].ok
    conflict = out[1]
    assert conflict.custom_id == "b" and conflict.result is None
    assert conflict.invalid is not None and conflict.invalid["code"] == "idempotency_conflict"
    assert f"{bid}-2" in conflict.invalid["message"] and "payload" in conflict.invalid["message"]
    assert conflict.error()[0] == "IDEMPOTENCY_CONFLICT"
    _, err_id = b.write_files(done)
    assert err_id is not None
    with files.blobs.open(err_id) as fh:
        (err,) = [json.loads(x) for x in fh]
    assert err["id"] == f"{bid}-2" and err["custom_id"] == "b" and err["response"] is None
    assert err["error"]["code"] == "idempotency_conflict"
    assert err["error"]["message"] == conflict.invalid["message"]
    # the live request was not touched: still held, no batch of its own; its result its own
    assert served.state(live.id) == "running" and "batch" not in served.record(live.id)
    sim.release(name)
    res = live.result(15)
    assert res.ok and json.loads(served.record(live.id)["payload"]) == body
    after = b.get(bid).request_counts
    assert (after.total, after.completed, after.failed) == (3, 2, 1)
    again = list(b.lines(b.get(bid)))[1]  # the record by its id now has a result: not the line's
    assert again.result is None and again.invalid == conflict.invalid
    assert sim.stats()["attempts_by_request_id"][live.id] == 1
    assert_idle(served)


def test_a_line_whose_id_is_live_with_the_same_content_takes_that_request(
    served: Pipeline, sim: SimServer
) -> None:
    """The same payload, queue, endpoint and headers: the line takes the live request as its
    own (as a submit of that id returns it), is counted when it ends, and its result is the
    line's; it ran once."""
    name = f"batch-same-{uuid.uuid4().hex[:8]}"
    bid = f"batch_same_{uuid.uuid4().hex[:8]}"
    line = chat("b", "shared", headers=held(name))
    live = served.submit(line["body"], id=f"{bid}-2", endpoint=line["url"],
                         headers=held(name), timeout=60)  # fmt: skip
    sim.wait_held(name)
    b = Batches(served)
    batch = b.submit_batch([chat("a"), line, chat("c")], batch_id=bid)
    assert batch.status == "in_progress"
    wait_until(lambda: b.get(bid).request_counts.completed == 2, 15, "the other lines done")
    assert b.get(bid).status == "in_progress"  # the taken request is a line of it: awaited
    assert served.record(live.id)["batch"] == bid
    (joined,) = [x for x in live.explain().log if x.event == "joined"]
    assert joined.fields == {"batch": bid, "line": 2}
    sim.release(name)
    done = b.wait(bid, timeout=30)
    assert done.status == "completed"
    c = done.request_counts
    assert (c.total, c.completed, c.failed) == (3, 3, 0)
    out = list(b.lines(done))
    assert out[1].custom_id == "b" and out[1].result is not None and out[1].ok
    assert out[1].result == live.result(5)
    assert sim.stats()["attempts_by_request_id"][live.id] == 1
    assert_idle(served)


def test_a_batch_cancel_leaves_a_live_request_of_a_conflicting_line(pl: Pipeline) -> None:
    """Cancelling a batch cancels its own lines only: the live request that a line's id
    conflicted with is not one of them."""
    bid = f"batch_keep_{uuid.uuid4().hex[:8]}"
    live = pl.submit({"prompt": "mine"}, id=f"{bid}-1", queue="solo", timeout=60)
    b = Batches(pl)
    batch = b.submit_batch([chat(f"q{i}") for i in range(3)], queue="solo", batch_id=bid)
    c = batch.request_counts
    assert batch.status == "in_progress" and (c.total, c.failed) == (3, 1)
    done = batch.cancel()
    assert done.status == "cancelled"
    c = done.request_counts
    assert (c.total, c.completed, c.failed) == (3, 0, 3)
    assert pl.state(live.id) == "queued"
    assert live.cancel()
