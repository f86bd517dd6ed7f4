"""What the pipeline writes in Celery's own formats: the task messages the dispatch script
pushes itself (they must be what ``apply_async`` would send), and the result backend that
stores a state in one round trip (a late RETRY never hides a final state)."""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import replace
from typing import Any

import redis
from celery import states
from celery.result import AsyncResult
from kombu import Consumer, Queue
from kombu.message import Message

from pipeline.client import Pipeline
from pipeline.config import load_settings
from pipeline.store import DirectPublish
from tasks.app import app
from tasks.backend import PipelineRedisBackend
from tasks.inference import infer
from tasks.node import direct_publish

from .conftest import RESULTS_TAG, wait_for


def _decoded(raw: str) -> dict[str, Any]:
    msg: dict[str, Any] = json.loads(raw)
    body = msg["body"]
    if msg["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body).decode()
    msg["body"] = json.loads(body)
    return msg


def test_a_dispatched_message_is_the_one_apply_async_sends(pl: Pipeline, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ours_list, ref_list = f"{RESULTS_TAG}-wire-ours", f"{RESULTS_TAG}-wire-ref"
    q = pl.settings.queues["crash"]  # no worker serves its pool: the message stays put
    rid = pl.submit({"p": 1}, id=f"wire-{uuid.uuid4().hex[:8]}", queue="crash", priority=3).id
    try:
        publish = DirectPublish(ours_list, infer.name, "test-origin")
        moved = pl.store.tick(q, [q], 1.0, -1, 10, publish=publish).moved
        assert [m.id for m in moved] == [rid]
        d = moved[0]
        with app.connection_for_write(redis_url) as conn:
            infer.apply_async(
                args=(d.id, d.token),
                kwargs={"queue": d.queue, "priority": d.priority, "attempt": d.dispatch_no},
                task_id=d.id,
                queue=ref_list,
                connection=conn,
            )
        (ours_raw,) = client.lrange(ours_list, 0, -1)
        (ref_raw,) = client.lrange(ref_list, 0, -1)
        ours, ref = _decoded(ours_raw), _decoded(ref_raw)

        assert ours["body"] == ref["body"]
        assert ours["body"][1] == {"queue": "crash", "priority": 3, "attempt": 1}
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
        pl.cancel(rid)
        client.delete(ours_list, ref_list)
        for key in client.scan_iter(f"_kombu.binding*{ref_list}*"):
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


def _unacked(client: redis.Redis, rid: str) -> bool:
    """Whether kombu's Redis transport holds a message of ``rid`` for redelivery."""
    return any(rid in str(v) for v in client.hvals("unacked"))


def test_a_redis_broker_is_consumed_without_kombus_unacked_bookkeeping(
    pl: Pipeline, redis_url: str, start_worker: Any
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
            rid = pl.submit(
                {"p": acks},
                id=f"acks{acks}-{uuid.uuid4().hex[:8]}",
                queue="parked",
                timeout=60,
                headers={"x-sim-latency-ms": "1500"},
            ).id
            wait_for(lambda r=rid: pl.state(r) == "running", 10, what="the attempt running")
            assert _unacked(client, rid) is expect_unacked
            assert pl.wait(rid, 20).ok
            wait_for(lambda r=rid: not _unacked(client, r), 10, what="nothing left unacked")
        finally:
            worker.stop()


def test_an_ack_of_a_no_ack_message_is_not_sent_to_the_broker(redis_url: str) -> None:
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
