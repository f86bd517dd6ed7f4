"""The store epoch (docs/production.md, "A wiped Redis"), piece by piece against the session's
Redis under a key prefix of its own: a client tells a request lost with the state from an id
never submitted, a node's heartbeat says the loss once (metric, notice, a pause in dispatch),
and ``pipeline status`` shows it. The whole story with a real restart is
tests/chaos/test_wiped_redis.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from pipeline import StateLost, UnknownRequest
from pipeline.client import Pipeline
from pipeline.config import load_settings
from pipeline.dispatch.dispatcher import Dispatcher
from pipeline.observability import metrics
from pipeline.observability.status import render_state, store_state
from pipeline.store import LOST_NOTICE
from tests.conftest import drop_keys


@pytest.fixture
def own(env: dict[str, str], redis_url: str) -> Iterator[Pipeline]:
    """A client under a key prefix of its own (no node serves it), its keys dropped after."""
    prefix = f"plepoch{uuid.uuid4().hex[:6]}:"
    p = Pipeline(load_settings({**env, "PIPELINE_KEY_PREFIX": prefix}))
    yield p
    drop_keys(redis.Redis.from_url(redis_url), prefix)


def wipe(p: Pipeline) -> None:
    """Every key of the prefix gone, as after a restart without persistence."""
    c = p.store.client
    for key in list(c.scan_iter(p.store.keys.pattern(), count=10_000)):
        c.delete(key)


def test_a_client_tells_a_lost_request_from_an_unknown_one(own: Pipeline) -> None:
    assert render_state(store_state(own)) is not None  # no epoch yet: said so, dimly
    rid = own.submit({"p": 1}, timeout=60).id
    assert render_state(store_state(own)) is None  # written at the first submit, no loss
    with pytest.raises(UnknownRequest):
        own.get("never-" + uuid.uuid4().hex)
    wipe(own)
    with pytest.raises(StateLost) as lost:
        own.wait(rid, timeout=5)
    assert lost.value.ids == [rid] and lost.value.noticed_at is not None
    assert not isinstance(lost.value, UnknownRequest)
    for look in (own.get, own.state, own.explain, own.cancel):
        with pytest.raises(StateLost):
            look(rid)
    epoch = own.store.client.hgetall(own.store.keys.epoch())
    assert epoch["lost_by"].startswith("client ") and epoch["previous"] != epoch["id"]
    line = render_state(store_state(own))
    assert line is not None and "Redis lost its state: noticed at" in line.plain
    # a new submission stores under the new epoch: an id never submitted is unknown again
    own.submit({"p": 2}, timeout=60)
    with pytest.raises(UnknownRequest):
        own.get(rid)


def heard(listener: redis.client.PubSub, timeout: float = 5.0) -> str | None:
    """The first message published on the listener's channel within ``timeout`` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        message = listener.get_message(timeout=max(0.0, end - time.monotonic()))
        if message is not None and message["type"] == "message":
            return str(message["data"])
    return None


def test_a_node_says_the_loss_once_and_pauses_dispatch(own: Pipeline) -> None:
    node = Dispatcher(own.settings, ["default"], node="epoch-node", slots=2, send=lambda m: None)
    node._heartbeat()
    assert node.epoch.known is not None
    listener = own.store.client.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(own.store.keys.abort_channel())
    before = metrics.series().state_lost._value.get()
    try:
        wipe(own)
        node._heartbeat()
        assert node._quiet_until > time.monotonic()  # no dispatch while vanished holders stop
        assert metrics.series().state_lost._value.get() == before + 1
        assert heard(listener) == LOST_NOTICE
        node._heartbeat()  # the new epoch is known now: said once
        assert metrics.series().state_lost._value.get() == before + 1
        assert own.store.client.hget(own.store.keys.epoch(), "lost_by") == "epoch-node"
    finally:
        listener.close()
        node.stop()
