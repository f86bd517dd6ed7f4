"""The pipeline's state on a real Redis Cluster (3 primaries, 1 replica each): each pool's
keys carry its hash tag, so every script call stays in one slot, on that slot's primary, and a
client finds a request by id in whichever pool holds it (docs/production.md, "Redis
Cluster")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot
from rich.console import Console

from pipeline.batch.service import Batches
from pipeline.cli.services import wait_until
from pipeline.client.api import Pipeline
from pipeline.config import QueueConfig, Settings, load_settings
from pipeline.observability.collectors import scrape_registry
from pipeline.observability.status import render, status_snapshot
from pipeline.sim import SimConfig, SimServer
from pipeline.store import connect
from pipeline.store.keys import pool_keys
from pipeline.store.scripts import node_client
from tests.redis_servers import Server, redis_cluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    with redis_cluster(tmp_path_factory.mktemp("cluster"), primaries=3, replicas=1) as nodes:

        def replicas_online() -> bool:
            links = [n.client().info("replication") for n in nodes[:3]]
            return all(i.get("slave0", {}).get("state") == "online" for i in links)

        wait_until(replicas_online, 30, "every primary's replica to be in sync")
        yield nodes


def url(nodes: list[Server]) -> str:
    return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes[:2])


def pools_on_two_primaries(nodes: list[Server]) -> tuple[str, str]:
    """Two pool names whose hash tags map to different primaries."""
    client = connect(url(nodes))
    first = "alpha"
    owner = node_client(client, "{p:alpha}")
    for i in range(100):
        other = f"beta{i}"
        if node_client(client, f"{{p:{other}}}") is not owner:
            return first, other
    raise AssertionError("every pool name hashed to one primary")


def settings(nodes: list[Server], pools: tuple[str, str], **kw: object) -> Settings:
    queues = {
        name: QueueConfig(queue_name=name, igw_base_url="http://127.0.0.1:9", worker_pool_id=p)
        for name, p in (("qa", pools[0]), ("qb", pools[1]))
    }
    prefix = f"t{uuid.uuid4().hex[:6]}:"
    return Settings(
        redis_url=url(nodes), broker_url="amqp://", key_prefix=prefix, queues=queues, **kw
    )  # type: ignore[arg-type]


def test_each_pools_requests_live_in_its_slot_and_are_found_by_id(cluster: list[Server]) -> None:
    pools = pools_on_two_primaries(cluster)
    p = Pipeline(settings(cluster, pools))
    reqs = p.submit_many(
        [{"payload": {"prompt": f"p{i}"}, "queue": "qa" if i % 2 else "qb"} for i in range(20)]
    )
    assert all(r.created for r in reqs)
    client = p.store.client
    for r in reqs:
        pool = pools[0] if p.record(r.id)["queue"] == "qa" else pools[1]
        key = p.store.for_pool(pool).keys.request(r.id)
        assert key_slot(key.encode()) == key_slot(f"{{p:{pool}}}".encode())
        assert client.exists(key) == 1
        assert p.state(r.id) == "queued"
    # the same id again is the live request, in its pool
    again = p.submit({"prompt": "p0"}, queue="qb", id=reqs[0].id)
    assert not again.created
    # cancel and wait, by id alone, wherever the request lives
    for r in reqs[:4]:
        assert p.cancel(r.id)
        assert p.wait(r.id, timeout=10).error_code == "CANCELLED"
    explained = p.explain(reqs[5].id)
    assert explained.state == "queued"
    done = {res.id for res in p.iter_results([r.id for r in reqs[:4]])}
    assert done == {r.id for r in reqs[:4]}


def test_scripts_reload_on_a_primary_that_lost_them(cluster: list[Server]) -> None:
    pools = pools_on_two_primaries(cluster)
    p = Pipeline(settings(cluster, pools))
    first = p.submit({"prompt": "x"}, queue="qa")
    for node in cluster:
        node.client().script_flush()
    second = p.submit({"prompt": "y"}, queue="qb")
    assert first.created and second.created
    assert p.cancel(first.id) and p.cancel(second.id)


def test_a_submit_waits_for_the_slots_replica(cluster: list[Server]) -> None:
    """With PIPELINE_REDIS_MIN_REPLICAS=1 the WAIT goes to the primary that took the write."""
    pools = pools_on_two_primaries(cluster)
    p = Pipeline(settings(cluster, pools, redis_min_replicas=1))
    reqs = p.submit_many([{"payload": {"prompt": "z"}, "queue": q} for q in ("qa", "qb")])
    assert all(r.created for r in reqs)


def worker_env(
    nodes: list[Server], broker: str, tmp: Path, queues: list[dict[str, Any]]
) -> dict[str, str]:
    qfile = tmp / "queues.json"
    qfile.write_text(json.dumps(queues))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "CELERY_"))}
    env.update(
        PIPELINE_REDIS_URL=url(nodes),
        CELERY_BROKER_URL=broker,
        PIPELINE_QUEUES=str(qfile),
        PIPELINE_KEY_PREFIX=f"tc{uuid.uuid4().hex[:6]}:",
        PIPELINE_LEASE_S="3",
        PIPELINE_REAPER_PERIOD_S="0.5",
        PIPELINE_METRICS_PORT="0",
    )
    return env


def test_a_worker_serves_two_pools_on_the_cluster_and_releases_every_slot(
    cluster: list[Server], redis_url: str, tmp_path: Path
) -> None:
    """End to end on the cluster, a standalone Redis the broker: one worker node serves two
    pools whose slots are on different primaries, each queue behind its gate; every request
    ends once, never more than the gates allow at the server, no gate holds a reservation."""
    pools = pools_on_two_primaries(cluster)
    limits = {"qa": 3, "qb": 2}
    with SimServer(SimConfig(latency_ms=20)).start_in_thread() as sim:
        queues = [
            {"queue_name": "qa", "igw_base_url": sim.url, "worker_pool_id": pools[0],
             "gate_type": "global-max-concurrency", "gate_params": {"limit": limits["qa"]}},
            {"queue_name": "qb", "igw_base_url": sim.url, "worker_pool_id": pools[1],
             "gate_type": "local-max-concurrency", "gate_params": {"limit": limits["qb"]}},
        ]  # fmt: skip
        env = worker_env(cluster, redis_url, tmp_path, queues)
        log = tmp_path / "worker.log"
        argv = [sys.executable, "-m", "pipeline", "worker", "--pools", ",".join(pools)]
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [*argv, "-c", "8", "--loglevel", "INFO"],
                env=env,
                cwd=ROOT,
                stdout=fh,
                stderr=subprocess.STDOUT,
            )
        try:
            p = Pipeline(load_settings(env))
            reqs = p.submit_many(
                [{"payload": {"prompt": f"{i}"}, "queue": "qa" if i % 2 else "qb"}
                 for i in range(60)]
            )  # fmt: skip
            results = {}
            for r in reqs:
                assert proc.poll() is None, log.read_text()[-3000:]
                results[r.id] = r.result(timeout=60)
            assert all(res.status_code == 200 for res in results.values()), results
            assert sim.stats()["max_concurrency_observed"] <= sum(limits.values())
            assert max(sim.stats()["attempts_by_request_id"].values()) == 1
            wait_until(lambda: all(q["running"] == 0 for q in p.inspect().values()), 20, "idle")
            prefix = env["PIPELINE_KEY_PREFIX"]
            holders = [
                k
                for n in cluster[:3]
                for k in n.client().scan_iter(f"{prefix}*gate*:holders", count=10_000)
                if n.client().zcard(k)
            ]
            assert not holders, f"gates still hold slots: {holders}"
            # no Celery result backend on a cluster: the pipeline's record is the result
            metas = [k for n in cluster for k in n.client().scan_iter("celery-task-meta-*")]
            assert not metas, metas[:3]
            # the release bell listens on each pool's channel in the pool's shard (SSUBSCRIBE)
            for pool in pools:
                channel = pool_keys(prefix, pool).freed_channel()
                subs = [
                    n.client().execute_command("PUBSUB", "SHARDNUMSUB", channel)[1] for n in cluster
                ]
                assert sum(subs) >= 1, (channel, subs)
        finally:
            proc.terminate()
            proc.wait(30)


def test_status_shows_each_primary_with_its_pools(cluster: list[Server]) -> None:
    pools = pools_on_two_primaries(cluster)
    p = Pipeline(settings(cluster, pools))
    p.submit({"prompt": "s"}, queue="qa")
    console = Console(width=200, record=True)
    console.print(render(p))
    text = console.export_text()
    rows = [line for line in text.splitlines() if "│ pools " in line]
    assert len(rows) == 3, text  # one per primary
    assert [sum(pool in r for r in rows) for pool in pools] == [1, 1], text
    assert not any(pools[0] in r and pools[1] in r for r in rows), text  # two primaries
    assert status_snapshot(p)["qa"]["pending"] == 1


def test_a_batch_lives_in_its_queues_pool_and_is_found_by_id(cluster: list[Server]) -> None:
    """A batch and its lines stay in its queue's pool (its slot): a line naming a queue of
    another pool is an error line; lookups by id and the list (newest first, paged) span
    every pool."""
    pools = pools_on_two_primaries(cluster)
    p = Pipeline(settings(cluster, pools))
    b = Batches(p)
    line = {"url": "/v1/completions", "body": {"model": "m", "prompt": "x"}}
    made = []
    for i, queue in enumerate(["qa", "qb", "qa"]):
        lines = [{**line, "custom_id": f"{i}-{n}"} for n in range(3)]
        made.append(b.submit_batch(lines, queue=queue))
    assert [batch.status for batch in made] == ["in_progress"] * 3
    for batch, pool in zip(made, [pools[0], pools[1], pools[0]], strict=True):
        key = b.records_of(pool).keys.batch(batch.id)
        assert p.store.client.exists(key) and b.get(batch.id).id == batch.id
        assert p.state(batch.request_id(1)) == "queued"
    # newest first over both pools, and the same order page by page
    listed, more = b.list(limit=10)
    assert [x.id for x in listed][:3] == [x.id for x in reversed(made)] and not more
    first, more = b.list(limit=2)
    rest, _ = b.list(after=first[-1].id, limit=10)
    assert more and [x.id for x in first + rest][:3] == [x.id for x in reversed(made)]
    crossing = [{**line, "custom_id": "a"}, {**line, "custom_id": "b", "queue": "qb"}]
    failed = b.submit_batch(crossing, queue="qa")
    assert failed.status == "failed" and "give that queue's lines a batch" in str(failed.errors)
    for batch in made:
        b.cancel(batch.id)
    assert {b.get(x.id).status for x in made} <= {"cancelling", "cancelled"}


def test_metrics_show_each_primary_its_pools_and_its_load(cluster: list[Server]) -> None:
    pools = pools_on_two_primaries(cluster)
    p = Pipeline(settings(cluster, pools))
    p.submit_many([{"payload": {"prompt": "m"}, "queue": q} for q in ("qa", "qb")])
    families = {f.name: f for f in scrape_registry(p.settings).collect()}
    held = {s.labels["pool_name"]: s.labels["shard"] for s in families[
        "pipeline_redis_shard_pool"].samples}  # fmt: skip
    assert set(held) == set(pools) and held[pools[0]] != held[pools[1]]
    primaries = {f"127.0.0.1:{n.port}" for n in cluster[:3]}
    for name in ("pipeline_redis_shard_memory_bytes", "pipeline_redis_shard_script_seconds"):
        shards = {s.labels["shard"] for s in families[name].samples}
        assert shards == primaries, (name, shards)
    scripts = {s.labels["shard"]: s.value for s in families[
        "pipeline_redis_shard_script_seconds"].samples if s.name.endswith("_total")}  # fmt: skip
    assert scripts[held[pools[0]]] > 0 and scripts[held[pools[1]]] > 0


def test_a_large_body_lives_in_its_pools_slot(cluster: list[Server]) -> None:
    """A large answer's body key (docs/internals.md, "Large answers") is in its pool's slot:
    stored, read back in ranges and deleted by a fenced-off finish there."""
    pools = pools_on_two_primaries(cluster)
    p = Pipeline(settings(cluster, pools))
    req = p.submit({"prompt": "x"}, queue="qa")
    store = p.store.for_pool(pools[0])
    text = "é" * 1_500_000  # two bytes each: over 2 MiB
    key = store.put_body(req.id, "stale", text)
    assert key_slot(key.encode()) == key_slot(f"{{p:{pools[0]}}}".encode())
    assert store.with_body({"id": req.id, "payload_ref": key})["payload"] == text
    late = store.finish(req.id, "stale", attempted=True, status_code=200, payload="", body_key=key)
    assert late is None and not store.client.exists(key)
    assert p.cancel(req.id)
