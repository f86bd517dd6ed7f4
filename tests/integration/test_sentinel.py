"""Redis Sentinel, against real ``redis-server`` processes the tests start on loopback (a master,
a replica, sentinels): the three URLs in Celery's list syntax with the one master-name setting,
script calls over thread connections that follow the master, WAIT for replicas after submit
and terminal writes, and reconnection after a failover."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from pipeline import ReplicationError
from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.config import MASTER_VAR, load_settings, parse_sentinel_url
from pipeline.errors import ConfigError
from pipeline.gates import GateEnv, build_gate
from pipeline.store import Keys, connect
from pipeline.store.scripts import Script
from pipeline.worker.bell import ReleaseBell
from tests.conftest import REDIS_URL as REDIS_URL_OF_SESSION
from tests.conftest import ROOT
from tests.redis_servers import MASTER_NAME, SentinelGroup, sentinel_group

INCR = "return redis.call('INCR', KEYS[1])"
URL_VARS = ("PIPELINE_REDIS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    with sentinel_group(tmp_path_factory.mktemp("sentinel"), replicas=1, sentinels=1) as g:
        yield g


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "CELERY_"))}
    env.update(extra)
    return env


def wait_count(server_client: redis.Redis) -> int:
    """WAIT commands the server has run (INFO commandstats)."""
    stats = server_client.info("commandstats")
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


# -- parsing ----------------------------------------------------------------------------
hosts = st.lists(
    st.tuples(st.from_regex(r"[a-z][a-z0-9-]{0,15}", fullmatch=True), st.integers(1, 65535)),
    min_size=1,
    max_size=4,
)


@given(hosts, st.integers(0, 15), st.none() | st.from_regex(r"[A-Za-z0-9]{1,12}", fullmatch=True))
def test_a_sentinel_list_parses_to_its_sentinels_db_and_password(
    sentinels: list[tuple[str, int]], db: int, password: str | None
) -> None:
    auth = f":{password}@" if password else ""
    url = ";".join(f"sentinel://{auth}{h}:{p}/{db}" for h, p in sentinels)
    parsed = parse_sentinel_url(url)
    assert list(parsed.sentinels) == sentinels
    assert (parsed.db, parsed.password) == (db, password)


def test_each_url_with_sentinels_needs_the_master_name() -> None:
    url = "sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380/2"
    assert parse_sentinel_url("sentinel://h").sentinels == (("h", 26379),)
    for var in URL_VARS:
        with pytest.raises(ConfigError, match=f"{var} names sentinels.*{MASTER_VAR}"):
            load_settings(clean_env(**{var: url}))
        settings = load_settings(clean_env(**{var: url, MASTER_VAR: "mymaster"}))
        assert settings.redis_sentinel_master == "mymaster"
    for bad, field in (
        ("sentinel://h:26379;redis://h:6379", "sentinel #2"),
        ("sentinel://h:notaport", "sentinel #1"),
        ("sentinel://h:26379/x", "database"),
    ):
        with pytest.raises(ConfigError, match=f"PIPELINE_REDIS_URL.*{field}"):
            load_settings(clean_env(PIPELINE_REDIS_URL=bad, **{MASTER_VAR: "m"}))
    for var, value in (
        ("PIPELINE_REDIS_MIN_REPLICAS", "-1"),
        ("PIPELINE_REDIS_WAIT_TIMEOUT_MS", "0"),
    ):
        with pytest.raises(ConfigError, match=var):
            load_settings(clean_env(**{var: value}))


# -- connecting -------------------------------------------------------------------------
def test_script_calls_reach_the_master_the_sentinels_name(group: SentinelGroup) -> None:
    client = connect(group.url(db=3), sentinel_master=MASTER_NAME)
    key = f"test:sentinel:{uuid.uuid4().hex}"
    # the call went to the master the sentinels name (not to the default host and port,
    # localhost:6379, where another Redis answers)
    assert Script(client, INCR)(keys=[key]) == 1
    master = redis.Redis(port=group.master.port, db=3, decode_responses=True)
    assert master.get(key) == "1"
    master.delete(key)


def test_the_three_urls_use_the_one_master_name(group: SentinelGroup) -> None:
    """The pipeline's Redis, the Celery broker and the result backend, each a sentinel list
    (on databases 4, 5, 6 to tell them apart), all reach the master named by the one setting:
    each writes a key, read back on the master's database."""
    tag = uuid.uuid4().hex[:8]
    env = clean_env(
        PIPELINE_REDIS_URL=group.url(db=4),
        CELERY_BROKER_URL=group.url(db=5),
        CELERY_RESULT_BACKEND=group.url(db=6),
        **{MASTER_VAR: MASTER_NAME},
    )
    code = f"""
import json
from redis.sentinel import SentinelConnectionPool
from tasks.app import app
from pipeline.store import Store
from pipeline.config import load_settings
store = Store(load_settings())
store.client.set("pl-{tag}", "1")
backend = app.backend
backend.set("be-{tag}", "1")
with app.connection_for_write() as conn:
    conn.default_channel.client.set("br-{tag}", "1")
    broker = conn.default_channel.client.connection_pool
    options = dict(conn.transport_options)
print(json.dumps({{
    "backend": type(backend).__name__,
    "backend_options": app.conf.result_backend_transport_options,
    "broker_options": options,
    "pools": [isinstance(p, SentinelConnectionPool) for p in (store.client.connection_pool,
              backend.client.connection_pool, broker)],
}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    facts: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["backend"] == "PipelineSentinelBackend"
    assert facts["backend_options"]["master_name"] == MASTER_NAME
    assert facts["broker_options"]["master_name"] == MASTER_NAME
    assert facts["pools"] == [True] * 3  # each follows the master (the pipeline's: blocking)
    for db, key in ((4, f"pl-{tag}"), (5, f"br-{tag}"), (6, f"be-{tag}")):
        master = redis.Redis(port=group.master.port, db=db, decode_responses=True)
        assert master.get(key) == "1", (db, key)
        master.delete(key)


def test_a_gate_naming_its_own_redis_through_sentinels(group: SentinelGroup) -> None:
    key = f"test:budget:{uuid.uuid4().hex}"
    master = redis.Redis(port=group.master.port, db=2, decode_responses=True)
    master.set(key, "0.25")
    local = connect(REDIS_URL_OF_SESSION)  # the pipeline's own Redis is another server here
    env = GateEnv(local, Keys(f"t{uuid.uuid4().hex[:8]}:"))
    params = {"address": group.url(db=2), "master_name": MASTER_NAME, "budget_key": key}
    gate = build_gate("redis", params, name="q", env=env)
    try:
        assert gate.budget() == 0.25  # read on the master the sentinels name
    finally:
        gate.close()
        local.close()
        master.delete(key)


# -- WAIT for replicas ------------------------------------------------------------------
def pipeline_on(
    group: SentinelGroup, tmp: Path, replicas: int, wait_ms: int, prefix: str | None = None
) -> Pipeline:
    qfile = tmp / f"queues-{uuid.uuid4().hex[:6]}.json"
    qfile.write_text(json.dumps([{"queue_name": "default", "igw_base_url": "http://127.0.0.1:9"}]))
    env = clean_env(
        PIPELINE_REDIS_URL=group.url(db=7),
        PIPELINE_QUEUES=str(qfile),
        PIPELINE_KEY_PREFIX=prefix or f"plsent{uuid.uuid4().hex[:6]}:",
        PIPELINE_REDIS_MIN_REPLICAS=str(replicas),
        PIPELINE_REDIS_WAIT_TIMEOUT_MS=str(wait_ms),
        **{MASTER_VAR: MASTER_NAME},
    )
    return Pipeline(load_settings(env))


def test_submit_waits_for_replicas_and_says_when_they_are_missing(
    group: SentinelGroup, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    master = group.master.client()
    ok = pipeline_on(group, tmp_path, replicas=1, wait_ms=5000)
    first = ok.submit({"prompt": "first"}, timeout=600)  # loads the script on this server
    before = wait_count(master)
    req = ok.submit({"prompt": "x"}, timeout=600)
    assert wait_count(master) == before + 1  # one WAIT, on the connection that wrote
    replica = redis.Redis(port=group.replicas[0].port, db=7, decode_responses=True)
    assert replica.hget(ok.store.keys.request(req.id), "state") == "queued"

    # two replicas asked for, one exists: a clear error within the timeout, not a hang
    short = pipeline_on(group, tmp_path, replicas=2, wait_ms=200)
    rid = f"rep-{uuid.uuid4().hex[:8]}"
    with pytest.raises(
        ReplicationError, match="1 of the 2 replica.*PIPELINE_REDIS_MIN_REPLICAS"
    ) as exc:
        short.submit_many([{"payload": {"prompt": "y"}, "id": rid, "timeout": 600}])
    assert exc.value.ids == [rid] and (exc.value.wanted, exc.value.acked) == (2, 1)
    # it stands on the master: submitting the id again is safe (the live request comes back)
    again = pipeline_on(group, tmp_path, 1, 5000, prefix=short.settings.key_prefix)
    assert again.submit({"prompt": "y"}, id=rid, timeout=600).created is False

    # a terminal write (cancel) waits too, and warns instead of failing the caller
    with caplog.at_level(logging.WARNING, logger="pipeline.store"):
        assert short.cancel(rid) is True
    assert any("cancel" in r.message and "1 of 2 replica" in r.message for r in caplog.records)
    assert ok.cancel(req.id) is True and ok.cancel(first.id) is True


def test_a_dispatch_tick_waits_for_the_replicas(group: SentinelGroup, tmp_path: Path) -> None:
    """A tick may write terminal results (here a malformed queue entry reported as
    INVALID_REQUEST): every tick waits for the replica, in the tick's round trip."""
    master = group.master.client()
    p = pipeline_on(group, tmp_path, replicas=1, wait_ms=5000)
    q = p.settings.queues["default"]
    p.store.tick(q, [q], 1.0, -1, 10)  # loads the script on this server
    before = wait_count(master)
    p.store.client.zadd(p.store.keys.pending("default"), {"garbage": 0})
    assert p.store.tick(q, [q], 1.0, -1, 10).rejected == {"default": ["garbage"]}
    assert wait_count(master) == before + 1


# -- failover ---------------------------------------------------------------------------
def test_connections_follow_a_failover(tmp_path: Path) -> None:
    """Kill -9 the master: the sentinels promote the replica; script calls, commands and the
    release bell's subscription all reconnect to the new master."""
    with sentinel_group(tmp_path, replicas=1, sentinels=1) as g:
        client = connect(g.url(), sentinel_master=MASTER_NAME)
        incr = Script(client, INCR)
        key = f"test:failover:{uuid.uuid4().hex}"
        assert incr(keys=[key]) == 1
        assert client.wait(1, 5000) == 1  # on the replica before the kill
        bell = ReleaseBell(client, ["test-failover-bell"])
        try:
            gen = bell.generation("q")
            woke: list[bool] = []

            def park() -> None:
                ticket = bell.park("q", gen, 60)
                woke.append(ticket is None or ticket.rang)

            t = threading.Thread(target=park, daemon=True)
            t.start()
            wait_until(lambda: bell.waiting("q") == 1, 5, "a parked waiter")
            old = g.master.port
            g.master.kill()
            wait_until(lambda: g.master_port() != old, 30, "the sentinels to promote")

            def incr_answers() -> Any:
                try:
                    return incr(keys=[key])
                except redis.ConnectionError:
                    return None

            assert wait_until(incr_answers, 15, "a script call on the new master") == 2
            assert incr(keys=[key]) == 3
            new = redis.Redis(port=g.master_port(), decode_responses=True)
            assert new.get(key) == "3" and g.master_port() != old
            # the bell lost its subscription: it woke its waiter to ask again, and listens
            # on the new master
            wait_until(lambda: woke == [True], 15, "the bell's waiter woken by the loss")
            gen = bell.generation("q")
            wait_until(
                lambda: bool(client.pubsub_numsub("test-failover-bell")[0][1]),
                15,
                "the bell subscribed on the new master",
            )
            client.publish("test-failover-bell", "q")
            wait_until(lambda: bell.generation("q") > gen, 10, "a ring over the new master")
        finally:
            bell.stop()
