"""What the pipeline writes in Celery's own formats: the task messages the dispatch script
pushes itself (they must be what ``apply_async`` would send), the result backend that stores a
state in one round trip (a late RETRY never hides a final state), and the task results an
attempt's own finish / requeue script writes (what Celery would store; Celery then skips its
write)."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import uuid
from dataclasses import replace
from typing import Any

import pytest
import redis
from celery import states
from celery.app.task import Context
from celery.result import AsyncResult
from kombu import Consumer, Queue
from kombu.message import Message

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.config import load_settings
from pipeline.sim import SimServer
from pipeline.store import DirectPublish, sched
from tasks import compat
from tasks.app import app
from tasks.backend import PipelineRedisBackend
from tasks.inference import AttemptRetry, CeleryMirrors, RequestFailed, infer
from tasks.node import direct_publish
from tests.conftest import RESULTS_TAG, ROOT, held


def _decoded(raw: str) -> dict[str, Any]:
    msg: dict[str, Any] = json.loads(raw)
    body = msg["body"]
    if msg["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body).decode()
    msg["body"] = json.loads(body)
    return msg


@pytest.mark.parametrize("indexed", [False, True], ids=["plain", "tenant"])
def test_a_dispatched_message_is_the_one_apply_async_sends(
    pl: Pipeline, redis_url: str, indexed: bool
) -> None:
    """Also for a request of an indexed queue (a quota per userid), whose message names its
    tenant (kwarg ``tenant``) for the worker to send its quota acquire with its start."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ours_list, ref_list = f"{RESULTS_TAG}-wire-ours", f"{RESULTS_TAG}-wire-ref"
    # no worker serves its pool: the message stays put
    q = replace(pl.settings.queues["crash"], queue_name="wire", worker_pool_id="nobody")
    p = Pipeline(replace(pl.settings, queues={**pl.settings.queues, "wire": q}))
    user = f"u-{uuid.uuid4().hex[:6]}"
    if indexed:
        store = p.store
        sched.setup(store.client, store.scripts, store.keys, "wire", "nobody", "userid", False)
    rid = p.submit({"p": 1}, id=f"wire-{uuid.uuid4().hex[:8]}", queue="wire", priority=3,
                   metadata={"userid": user}).id  # fmt: skip
    try:
        publish = DirectPublish(ours_list, infer.name, "test-origin")
        moved = p.store.tick(q, [q], 1.0, -1, 10, publish=publish).moved
        assert [m.id for m in moved] == [rid]
        d = moved[0]
        kwargs: dict[str, Any] = {"queue": d.queue, "priority": d.priority, "attempt": 1}
        if indexed:
            assert d.tenant == {"userid": user}
            kwargs["tenant"] = d.tenant
        else:
            assert d.tenant is None
        with app.connection_for_write(redis_url) as conn:
            infer.apply_async(
                args=(d.id, d.token), kwargs=kwargs, task_id=d.id, queue=ref_list, connection=conn
            )
        (ours_raw,) = client.lrange(ours_list, 0, -1)
        (ref_raw,) = client.lrange(ref_list, 0, -1)
        ours, ref = _decoded(ours_raw), _decoded(ref_raw)

        assert ours["body"] == ref["body"]
        assert ours["body"][1] == kwargs
        for field in ("content-type", "content-encoding"):
            assert ours[field] == ref[field]
        assert set(ours["headers"]) == set(ref["headers"])
        differ = {k for k in ref["headers"] if ours["headers"][k] != ref["headers"][k]}
        assert differ == {"origin"}, differ
        assert ours["headers"]["origin"] == "test-origin"
        # kombu adds reply_to (unused by a Redis result backend) and base64 body encoding
        assert set(ours["properties"]) == set(ref["properties"]) - {"reply_to", "body_encoding"}
        for field in ("correlation_id", "delivery_mode", "priority"):
            assert ours["properties"][field] == ref["properties"][field]
        assert ours["properties"]["delivery_info"] == {"exchange": "", "routing_key": ours_list}
        assert ours["properties"]["delivery_tag"] != ref["properties"]["delivery_tag"]
    finally:
        p.cancel(rid)
        if indexed:
            sched.teardown(p.store.client, p.store.keys, "wire")
        client.delete(ours_list, ref_list)
        for key in client.scan_iter(f"_kombu.binding*{ref_list}*", count=10_000):
            client.delete(key)


def test_direct_publish_only_when_the_broker_is_the_pipelines_redis(
    env: dict[str, str],
) -> None:
    settings = replace(load_settings(env), redis_url=str(app.conf.broker_url))
    if settings.redis_url.startswith("redis"):
        got = direct_publish(settings, ["default"], "me")
        assert got["default"].list_key.endswith("default")
        assert got["default"].task == infer.name
    assert direct_publish(replace(settings, direct_publish=False), ["default"], "me") == {}
    other = replace(settings, redis_url="redis://127.0.0.1:6379/15")
    assert direct_publish(other, ["default"], "me") == {}
    assert load_settings({**env, "PIPELINE_DIRECT_PUBLISH": "0"}).direct_publish is False


def test_the_result_backend_keeps_a_final_state_over_a_late_retry() -> None:
    backend = app.backend
    assert isinstance(backend, PipelineRedisBackend)
    task_id = f"{RESULTS_TAG}-backend-{uuid.uuid4().hex[:8]}"
    try:
        backend.mark_as_retry(task_id, RuntimeError("first attempt"))
        assert AsyncResult(task_id, app=app).state == states.RETRY
        backend.mark_as_done(task_id, {"status_code": 200})
        backend.mark_as_retry(task_id, RuntimeError("a late retry of an earlier attempt"))
        res = AsyncResult(task_id, app=app)
        assert res.state == states.SUCCESS
        assert res.get(timeout=5) == {"status_code": 200}
        assert backend.client.ttl(backend.get_key_for_task(task_id)) > 0
    finally:
        backend.forget(task_id)


def _meta(backend: PipelineRedisBackend, task_id: str) -> dict[str, Any]:
    raw = backend.client.get(backend.get_key_for_task(task_id))
    assert raw is not None, f"no Celery result for {task_id}"
    meta: dict[str, Any] = json.loads(raw)
    return meta


def _as_celery_stores(
    backend: PipelineRedisBackend, task_id: str, state: str, result: Any, traceback: Any
) -> dict[str, Any]:
    """The meta Celery's own ``store_result`` writes for ``task_id`` (run by a worker: a
    request context), read back from a scratch key (date_done and task_id differ)."""
    scratch = f"{RESULTS_TAG}-ref-{uuid.uuid4().hex[:8]}"
    try:
        backend.store_result(scratch, result, state, traceback, request=Context())
        return {**_meta(backend, scratch), "task_id": task_id}
    finally:
        backend.forget(scratch)


def test_an_attempt_writes_its_tasks_celery_result_in_its_own_script(pl: Pipeline) -> None:
    """Finish and requeue write the task's SUCCESS / FAILURE / RETRY meta — the very meta
    Celery's backend would write — in the same script as the outcome, and Celery's own write
    of that state is skipped (``CeleryMirrors.written``)."""
    backend = app.backend
    assert isinstance(backend, PipelineRedisBackend)
    rids = [
        pl.submit({"p": i}, id=f"mirror-{uuid.uuid4().hex[:8]}", queue="crash").id for i in range(3)
    ]
    q = pl.settings.queues["crash"]  # no worker serves its pool: the test plays the attempt
    try:
        moved = {d.id: d for d in pl.store.tick(q, [q], 1.0, -1, 10).moved}
        ok, failed, retried = (moved[r] for r in rids)
        for d in moved.values():
            assert pl.store.start(d.id, d.token, "crash", "me") is not None

        m = backend.mirror(ok.id, states.SUCCESS, embed=True)
        res = pl.store.finish(
            ok.id, ok.token, attempted=True, status_code=200, payload="yes", mirror=m
        )
        assert res is not None
        got = _meta(backend, ok.id)
        want = _as_celery_stores(backend, ok.id, states.SUCCESS, json.loads(res), None)
        assert got["date_done"] and want["date_done"]
        assert {**got, "date_done": 0} == {**want, "date_done": 0}
        assert got["task_id"] == ok.id and got["result"]["payload"] == "yes"
        assert backend.client.ttl(backend.get_key_for_task(ok.id)) > 0

        exc = RequestFailed("HTTP 400: no")
        brief = "tasks.inference.RequestFailed: HTTP 400: no\n"
        m = backend.mirror(failed.id, states.FAILURE, result=exc, traceback=brief)
        assert pl.store.finish(
            failed.id, failed.token, attempted=True, status_code=400, payload="no", mirror=m
        )
        got = _meta(backend, failed.id)
        want = _as_celery_stores(backend, failed.id, states.FAILURE, exc, brief)
        assert {**got, "date_done": 0} == {**want, "date_done": 0}
        res_f = AsyncResult(failed.id, app=app)
        assert res_f.state == states.FAILURE and isinstance(res_f.result, RequestFailed)
        assert res_f.traceback == brief

        brief = "tasks.inference.AttemptRetry: HTTP 503\n"
        m = backend.mirror(retried.id, states.RETRY, traceback=brief)
        assert pl.store.requeue(retried.id, retried.token, delay=0, attempted=True, mirror=m)
        got = _meta(backend, retried.id)
        assert got == _as_celery_stores(backend, retried.id, states.RETRY, None, brief)
        assert AsyncResult(retried.id, app=app).state == states.RETRY

        # a fenced-off attempt writes nothing; a RETRY never replaces a final state
        stale = backend.mirror(ok.id, states.RETRY, traceback="late")
        assert not pl.store.requeue(ok.id, ok.token, delay=0, attempted=True, mirror=stale)
        assert AsyncResult(ok.id, app=app).state == states.SUCCESS

        # Celery's own write of the state the attempt mirrored is skipped; of another, not
        CeleryMirrors(backend, ok.id).written(states.SUCCESS)  # as the attempt tells it
        backend.store_result(ok.id, {"other": 1}, states.SUCCESS)
        assert AsyncResult(ok.id, app=app).result["payload"] == "yes"
        backend.store_result(ok.id, AttemptRetry("x"), states.FAILURE)
        assert AsyncResult(ok.id, app=app).state == states.FAILURE
    finally:
        for rid in rids:
            pl.cancel(rid)
            backend.forget(rid)


def test_celery_shows_each_attempts_outcome(
    in_process: Pipeline, sim: SimServer, celery_session_worker: Any
) -> None:
    """Through a Celery worker (the in-process node: its dispatcher pushes the messages, its
    consumer runs them): RETRY with the reason as a one-line traceback (not Celery's tracer
    frames), then SUCCESS with the pipeline's result; a failed request's FAILURE names its
    status."""
    pl = in_process
    rid = f"celery-{uuid.uuid4().hex[:8]}"
    fail_once = {"x-sim-fail-first": "1", "x-sim-fail-status": "503"}
    retried = pl.submit(
        {"prompt": "x"}, id=rid, timeout=60, queue="inproc", headers={**fail_once, **held(rid)}
    )
    failed = pl.submit(
        {"prompt": "x"},
        id=f"celery-{uuid.uuid4().hex[:8]}",
        queue="inproc",
        headers={"x-sim-fail-first": "1", "x-sim-fail-status": "400"},
    )
    sim.wait_held(rid)  # the second attempt: the first one's RETRY is the task's state now
    assert AsyncResult(retried.id, app=app).state == states.RETRY
    assert AsyncResult(retried.id, app=app).traceback == "tasks.inference.AttemptRetry: HTTP 503\n"
    sim.release(rid)
    assert retried.result(timeout=15).ok
    assert wait_until(
        lambda: AsyncResult(retried.id, app=app).state == states.SUCCESS, 5, "SUCCESS"
    )
    stored = pl.store.client.hget(pl.store.keys.request(retried.id), "result")
    assert AsyncResult(retried.id, app=app).result == json.loads(stored)
    assert failed.result(timeout=15).status_code == 400
    assert wait_until(lambda: AsyncResult(failed.id, app=app).state == states.FAILURE, 5, "FAILURE")
    err = AsyncResult(failed.id, app=app)
    # the status, not the response body (user data: PIPELINE_LOG_BODIES=1 shows it)
    assert isinstance(err.result, RequestFailed)
    assert re.fullmatch(r"HTTP 400 \(\d+-byte response body\)", str(err.result))
    assert err.traceback == f"tasks.inference.RequestFailed: {err.result}\n"
    ran_on = {pl.record(r.id)["worker"] for r in (retried, failed)}
    assert ran_on == {celery_session_worker.hostname}


def _unacked(client: redis.Redis, rid: str) -> bool:
    """Whether kombu's Redis transport holds a message of ``rid`` for redelivery."""
    return any(rid in str(v) for v in client.hvals("unacked"))


def test_a_redis_broker_is_consumed_without_kombus_unacked_bookkeeping(
    pl: Pipeline, redis_url: str, start_worker: Any, sim: SimServer
) -> None:
    """Two Redis round trips per message in the consumer's thread (record, then delete on
    ack) buy a redelivery the pipeline does not use: its reaper requeues a lost attempt's
    request. ``PIPELINE_BROKER_ACKS=1`` keeps them."""
    if not str(app.conf.broker_url).startswith("redis"):
        raise AssertionError("this test needs the Redis broker (PIPELINE_TEST_BROKER_URL unset)")
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    for acks, expect_unacked in (("0", False), ("1", True)):
        worker = start_worker(
            pools="parked", concurrency=2, extra_env={"PIPELINE_BROKER_ACKS": acks}
        )
        try:
            rid = f"acks{acks}-{uuid.uuid4().hex[:8]}"
            pl.submit({"p": acks}, id=rid, queue="parked", timeout=60, headers=held(rid))
            sim.wait_held(rid)  # the attempt runs: its message was delivered, not yet acked
            assert _unacked(client, rid) is expect_unacked
            sim.release(rid)
            assert pl.wait(rid, 20).ok
            wait_until(lambda r=rid: not _unacked(client, r), 10, "nothing left unacked")
        finally:
            worker.stop()


def test_an_ack_of_a_no_ack_message_is_not_sent_to_the_broker(redis_url: str) -> None:
    compat.install()  # as a worker node does at worker_init (tasks/node.py)
    name = f"{RESULTS_TAG}-noack-{uuid.uuid4().hex[:6]}"
    acked: list[Any] = []
    with app.connection_for_write(redis_url) as conn:
        queue = Queue(name, no_ack=True)
        with conn.Producer() as producer:
            producer.publish({"n": 1}, routing_key=name, declare=[queue], serializer="json")
        channel = conn.channel()
        qos_ack = channel.qos.ack
        channel.qos.ack = lambda tag: (acked.append(tag), qos_ack(tag))
        got: list[Message] = []
        with Consumer(channel, [queue], callbacks=[lambda body, m: got.append(m)]):
            conn.drain_events(timeout=5)
        (message,) = got
        assert message.payload == {"n": 1}
        message.ack()  # what Celery does when the task ends
        assert acked == []
        channel.close()


def test_a_tick_answers_every_ring_of_its_pool_and_still_counts_the_pool(pl: Pipeline) -> None:
    """The dispatcher's first tick of a pool empties the pool's doorbell (each ring would
    otherwise wake one more tick, finding nothing more to move); the pool's other queues'
    active sets still count against the pool's capacity."""
    q, other = pl.settings.queues["crash"], pl.settings.queues["solo"]
    bell = pl.store.keys.wake(q.worker_pool_id)
    client = pl.store.client
    busy = pl.store.keys.active(other.queue_name)
    rids = [
        pl.submit({"p": i}, id=f"bell-{uuid.uuid4().hex[:8]}", queue="crash").id for i in range(3)
    ]
    try:
        client.rpush(bell, "1", "1", "1")
        client.zadd(busy, {"someone-else": 9e9})  # one slot of the pool is taken elsewhere
        moved = pl.store.tick(q, [q, other], 1.0, -1, 3, doorbell=bell).moved
        assert len(moved) == 2  # 3 pool slots, 1 busy in the other queue
        assert client.llen(bell) == 0
        client.rpush(bell, "1")
        assert pl.store.tick(q, [q, other], 1.0, -1, 3).moved == []  # full; without a doorbell
        assert client.llen(bell) == 1  # ... the rings stay
    finally:
        client.zrem(busy, "someone-else")
        client.delete(bell)
        for rid in rids:
            pl.cancel(rid)


FREEZE_CHECK = """
import gc
from celery.signals import worker_ready
import tasks  # the node's signal handlers
gc.unfreeze()
worker_ready.send(sender=None)
frozen = gc.get_freeze_count()
cycle = []
cycle.append(cycle)
del cycle
print(frozen, gc.collect(), gc.get_freeze_count())
"""


def test_a_ready_node_freezes_its_startup_heap(env: dict[str, str]) -> None:
    """At worker_ready the node moves its startup heap out of the collector's reach (a full
    collection of it stalled every hand-off ~50 ms); cycles made later are still collected.
    In a process of its own: the freeze is process-wide, and threads of this one (the
    simulator, the in-process node) free frozen objects while it counts."""
    out = subprocess.run(
        [sys.executable, "-c", FREEZE_CHECK],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    frozen, collected, after = (int(x) for x in out.stdout.split()[-3:])
    assert frozen > 0 and collected >= 1
    assert after == frozen  # the collection left the frozen heap alone
