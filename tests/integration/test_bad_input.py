"""Bad messages and records (the submit() cases are in front_doors/test_python.py): each gets
a terminal INVALID_REQUEST result or is rejected, the worker keeps running, nothing is lost.

What reaches a worker goes to the in-process node (``in_process``: pytest-celery's session
worker serving the ``inproc`` queue), whose Celery queue the test writes to directly; a
batch file goes through ``pipeline run`` and the session's subprocess node."""

from __future__ import annotations

import json
import os
import pickle
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Exchange, Producer

from pipeline import IdempotencyConflict
from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from tasks.app import celery_queue


def uid(tag: str = "bad") -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


NODE_QUEUE = "inproc"  # the queue (and pool) the in-process node serves


def worker_still_serves(pl: Pipeline) -> None:
    """A request sent after the bad input is served, so the node took the bad input first
    (a Celery queue is FIFO): on a Redis broker nothing is left in it."""
    rid = pl.submit({"p": "after"}, id=uid("alive"), queue=NODE_QUEUE, timeout=30).id
    assert pl.wait(rid, 15).ok
    if pl.settings.redis_url == os.environ.get("CELERY_BROKER_URL"):
        assert pl.store.client.llen(celery_queue(NODE_QUEUE)) == 0


def default_results(pl: Pipeline, queue: str) -> list[dict[str, Any]]:
    key = pl.store.keys.result_list(pl.settings.queues[queue])
    return [json.loads(x) for x in pl.store.client.lrange(key, 0, -1)]


# -- garbage written into a queue's sorted set by hand ---------------------------------------
@pytest.mark.parametrize("member", ["garbage", "000000000000001|no-such-request", "|", "12|"])
def test_garbage_in_the_sorted_set(in_process: Pipeline, member: str) -> None:
    served = in_process
    served.store.client.zadd(served.store.keys.pending(NODE_QUEUE), {member: 1.0})
    expected_id = member.split("|", 1)[1] if "|" in member and member.split("|", 1)[1] else member

    def reported() -> bool:
        return any(
            r["id"] == expected_id and r.get("error_code") == "INVALID_REQUEST"
            for r in default_results(served, NODE_QUEUE)
        )

    wait_until(reported, 10, "INVALID_REQUEST result for the garbage entry")
    assert served.inspect()[NODE_QUEUE]["pending"] == 0
    worker_still_serves(served)


# -- records corrupted by hand ---------------------------------------------------------------
CORRUPTIONS: list[tuple[str, Callable[[Any, str], None]]] = [
    ("deadline-not-a-number", lambda c, k: c.hset(k, "deadline", "soon")),
    ("metadata-not-json", lambda c, k: c.hset(k, "metadata", "{oops")),
    ("metadata-not-strings", lambda c, k: c.hset(k, "metadata", '{"userid": 7}')),
    ("headers-a-list", lambda c, k: c.hset(k, "headers", '["x"]')),
    ("labels-not-json", lambda c, k: c.hset(k, "labels", "\xff")),
    ("payload-missing", lambda c, k: c.hdel(k, "payload")),
    ("priority-not-an-integer", lambda c, k: c.hset(k, "priority", "high")),
    ("priority-missing", lambda c, k: c.hdel(k, "priority")),
]


@pytest.mark.parametrize(("name", "corrupt"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corrupted_record_ends_invalid(
    in_process: Pipeline, name: str, corrupt: Callable[[Any, str], None]
) -> None:
    import tasks

    served = in_process
    q = served.settings.queues["crash"]  # no worker serves it: dispatch by hand
    rid = served.submit({"p": 1}, id=uid(name), queue="crash", timeout=30).id
    corrupt(served.store.client, served.store.keys.request(rid))
    moved = served.store.tick(q, [q], 1.0, -1, 10).moved  # the dispatcher may end it here
    for d in moved:  # ... or the worker does, when it starts the attempt
        tasks.infer.apply_async(
            args=(rid, d.token),
            kwargs={"queue": "crash"},
            task_id=rid,
            queue=celery_queue(NODE_QUEUE),
        )
    res = served.wait(rid, 15)
    assert res.error_code == "INVALID_REQUEST" and "unreadable" in (res.error_message or "")
    assert [r["id"] for r in default_results(served, "crash")].count(rid) == 1
    worker_still_serves(served)


def test_a_bad_record_ends_alone_its_neighbours_are_sent(in_process: Pipeline) -> None:
    """One record of a tick with a priority another producer wrote as a word (the dispatcher
    publishing itself: PIPELINE_DIRECT_PUBLISH=0) ends INVALID_REQUEST; the tick still moves
    the others, which are served (before: the tick's reply could not be read, and nothing of
    it was published)."""
    import tasks

    served = in_process
    q = served.settings.queues["crash"]  # no worker serves it: dispatch by hand
    ids = [
        served.submit({"p": i}, id=uid(f"tick{i}"), queue="crash", timeout=30).id for i in range(5)
    ]
    bad = ids[2]
    served.store.client.hset(served.store.keys.request(bad), "priority", "urgent")
    moved = served.store.tick(q, [q], 1.0, -1, 10).moved
    assert sorted(d.id for d in moved) == sorted(set(ids) - {bad})
    for d in moved:
        tasks.infer.apply_async(
            args=(d.id, d.token),
            kwargs={"queue": "crash", "priority": d.priority},
            task_id=d.id,
            queue=celery_queue(NODE_QUEUE),
        )
    res = served.wait(bad, 5)
    assert res.error_code == "INVALID_REQUEST", res
    assert res.error_message == "unreadable request record: priority is not an integer"
    assert all(served.wait(rid, 15).ok for rid in ids if rid != bad)
    assert [r["id"] for r in default_results(served, "crash")].count(bad) == 1
    worker_still_serves(served)


# -- malformed Celery messages -----------------------------------------------------------------
MESSAGES: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("no-args", (), {}),
    ("no-token", ("only-an-id",), {}),
    ("wrong-types", (12345, None), {}),
    ("unknown-request", ("nobody-" + uuid.uuid4().hex, "tok"), {"queue": "default"}),
    ("unknown-queue", ("nobody-" + uuid.uuid4().hex, "tok"), {"queue": "no-such-queue"}),
    ("huge-id", ("x" * 10_000, "tok"), {}),
]


@pytest.mark.parametrize(("name", "args", "kwargs"), MESSAGES, ids=[m[0] for m in MESSAGES])
def test_malformed_task_message(
    in_process: Pipeline, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    import tasks

    tasks.infer.apply_async(
        args=args, kwargs=kwargs, task_id=uid(name), queue=celery_queue(NODE_QUEUE)
    )
    worker_still_serves(in_process)


def test_a_live_request_with_a_stale_token_is_not_run_twice(in_process: Pipeline) -> None:
    import tasks

    served = in_process
    rid = served.submit({"p": 1}, id=uid("stale"), queue=NODE_QUEUE, timeout=30).id
    assert served.wait(rid, 15).ok
    tasks.infer.apply_async(
        args=(rid, "old-token"),
        kwargs={"queue": NODE_QUEUE},
        task_id=rid,
        queue=celery_queue(NODE_QUEUE),
    )
    worker_still_serves(served)
    assert served.wait(rid, 1).attempts == 1
    assert [r["id"] for r in default_results(served, NODE_QUEUE)].count(rid) == 1


def test_pickled_message_is_rejected(in_process: Pipeline, env: dict[str, str]) -> None:
    """JSON only on the wire: a pickle-serialised message is refused, never executed."""
    served = in_process
    rid = served.submit({"p": 1}, id=uid("pickle"), queue="solo", timeout=30).id
    body = pickle.dumps(((rid, "tok"), {"queue": "solo"}, {}))
    with Connection(env["CELERY_BROKER_URL"]) as conn:
        producer = Producer(conn)
        producer.publish(
            body,
            routing_key=celery_queue(NODE_QUEUE),
            exchange=Exchange(celery_queue(NODE_QUEUE), type="direct"),
            content_type="application/x-python-serialize",
            content_encoding="binary",
            headers={
                "task": "pipeline.infer",
                "id": rid,
                "lang": "py",
                "argsrepr": "",
                "kwargsrepr": "",
            },
        )
    worker_still_serves(served)
    assert served.state(rid) == "queued"  # untouched
    assert served.cancel(rid)


def test_duplicate_ids_in_one_batch(served: Pipeline) -> None:
    """One id twice in a submit_many: the same content is one request; other content is a
    conflict (the first stored, the second not)."""
    rid, other = uid("dup"), uid("dup")
    reqs = served.submit_many([{"payload": {"n": 1}, "id": rid, "timeout": 30}] * 2)
    assert [r.created for r in reqs] == [True, False]
    with pytest.raises(IdempotencyConflict) as exc:
        served.submit_many([
            {"payload": {"n": 1}, "id": other, "timeout": 30},
            {"payload": {"n": 2}, "id": other, "timeout": 30},
        ])  # fmt: skip
    assert exc.value.differs == ["payload"] and exc.value.stored == [other]
    for r in (rid, other):
        res = served.wait(r, 15)
        assert res.ok and json.loads(served.record(r)["payload"]) == {"n": 1}
    wait_until(lambda: served.inspect()["default"]["running"] == 0, 10, "idle")
    results = [r["id"] for r in default_results(served, "default")]
    assert results.count(rid) == 1 and results.count(other) == 1


def test_non_utf8_and_nested_lines_in_a_batch_file(
    tmp_path: Path, env: dict[str, str], served: Pipeline
) -> None:
    from .test_cli import run_cli

    good = {"id": uid("ok"), "payload": {"p": 1}, "timeout": 30}
    src = tmp_path / "in.jsonl"
    src.write_bytes(
        json.dumps(good).encode()
        + b"\n"
        + b'{"payload": "\xff\xfe"}\n'
        + b'{"payload": '
        + b"[" * 5000
        + b"]" * 5000
        + b"}\n"
        + b'{"payload": {"p": 1}, "timeout": -1}\n'
    )
    out = tmp_path / "out.jsonl"
    proc = run_cli(["run", str(src), "-o", str(out), "--no-progress", "--timeout", "60"], env)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 4
    assert sum(r.get("error_code") == "INVALID_REQUEST" for r in rows) == 3
    assert any("UTF-8" in (r.get("error_message") or "") for r in rows)
    assert [r for r in rows if r["id"] == good["id"]][0]["status_code"] == 200
