"""Chaos on a Redis Cluster: a primary SIGKILLed, and a pool's slot moved to another primary,
each in the middle of a run.

Real processes on loopback: a cluster of 3 primaries with a replica each
(``cluster-node-timeout`` 2000 ms), a standalone ``redis-server`` as the Celery broker, the
simulator, and two worker nodes (``pipeline worker --pools a,b,c``) whose pipeline Redis is the
cluster (``redis+cluster://``) with ``PIPELINE_REDIS_MIN_REPLICAS=1``. Three pools whose slots
are on three different primaries, each queue behind a gate. After the fault every request ends
with exactly one terminal result (none lost; the simulator answered each to completion once),
never more at the server than the gates allow, and no gate holds a reservation.

Like the other chaos tests these run in ``make test`` (about 20 s each) and in
``make test-chaos-long``; they have no longer variant. The failover run prints what it measured
(promotion after the kill, the pool's first dispatch after the promotion).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from pipeline.batch.service import Batches
from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.config import load_settings
from pipeline.sim import SimConfig, SimServer
from pipeline.store import connect
from pipeline.store.scripts import node_client
from tests.conftest import NODE_START_S, ROOT, stop_processes
from tests.integration.test_scheduling_e2e import sim_arrivals
from tests.redis_servers import Server, lone_server, redis_cluster

LEASE_S = 8.0  # longer than a failover (node timeout 2 s + election): no lease lapses in it
# the gates: global limits count over both nodes, a local one per node
GATES = {
    "qa": ("global-max-concurrency", 4),
    "qb": ("local-max-concurrency", 2),
    "qc": ("global-max-concurrency", 4),
}
NODES = 2
LIMIT_SUM = sum(n * (NODES if g.startswith("local") else 1) for g, n in GATES.values())
RECOVERY_S = 10.0  # the killed pool's first dispatch after its replica's promotion


@dataclass
class Run:
    cluster: list[Server]
    env: dict[str, str]
    pools: dict[str, str]  # queue -> pool
    pl: Pipeline
    sim: SimServer
    workers: list[subprocess.Popen[bytes]]
    tmp: Path

    @property
    def prefix(self) -> str:
        return self.env["PIPELINE_KEY_PREFIX"]

    def alive(self) -> list[Server]:
        return [n for n in self.cluster if n.proc.poll() is None]

    def primaries(self) -> list[Server]:
        return [n for n in self.alive() if n.client().info("replication")["role"] == "master"]

    def owner(self, slot: int) -> Server:
        """The primary serving ``slot`` as a live node's ``CLUSTER SLOTS`` says now."""
        for lo, hi, (_, port, *_), *_ in (
            self.alive()[0].client().execute_command("CLUSTER", "SLOTS")
        ):
            if lo <= slot <= hi:
                return next(n for n in self.cluster if n.port == int(port))
        raise AssertionError(f"slot {slot} is not served")

    def check_workers(self) -> None:
        for i, w in enumerate(self.workers):
            assert w.poll() is None, (self.tmp / f"worker{i}.log").read_text()[-3000:]

    def done(self) -> int:
        """Requests finished so far, over every pool (their recent sets)."""
        total = 0
        for q, pool in self.pools.items():
            total += self.pl.store.client.zcard(self.pl.store.for_pool(pool).keys.recent(q))
        return total

    def items(self, n: int) -> list[dict[str, Any]]:
        queues = list(self.pools)
        return [
            {
                "payload": {"prompt": f"p{i}"},
                "id": f"cf-{uuid.uuid4().hex[:12]}",
                "queue": queues[i % len(queues)],
                "timeout": 300,
            }
            for i in range(n)
        ]

    def check_outcome(self, ids: list[str], by_queue: dict[str, str]) -> None:
        """Each request ended once (a 200), once in its queue's result list, answered to
        completion once by the simulator; never over the gates; no reservation left."""
        results = {}
        end = time.monotonic() + 60
        for rid in ids:
            self.check_workers()
            try:
                results[rid] = self.pl.get(rid).result(timeout=max(1.0, end - time.monotonic()))
            except TimeoutError:
                raise AssertionError(
                    f"{rid} not done: {self.pl.record(rid)}; {self.pl.inspect()}"
                ) from None
        bad = [r.to_dict() for r in results.values() if r.status_code != 200]
        assert not bad, bad[:3]
        for q, pool in self.pools.items():
            store = self.pl.store.for_pool(pool)
            key = store.keys.result_list(self.pl.settings.queues[q])
            pushed = [json.loads(x)["id"] for x in self.pl.store.client.lrange(key, 0, -1)]
            mine = sorted(i for i in ids if by_queue[i] == q)
            assert sorted(pushed) == mine, f"{q}: {Counter(pushed).most_common(3)}"
        stats = self.sim.stats()
        # a 200 the simulator wrote out in full, per request (a hung-up one is not recorded)
        answered = Counter(rid for _, _, rid in sim_arrivals(self.sim))
        assert set(answered) >= set(ids), set(ids) - set(answered)
        twice = {rid: n for rid, n in answered.items() if n > 1}
        assert not twice, f"completed more than once: {twice}, attempts {stats['by_status']}"
        assert stats["max_concurrency_observed"] <= LIMIT_SUM, stats
        wait_until(
            lambda: all(
                q["pending"] == q["retry_wait"] == q["running"] == q["gate"]["in_flight"] == 0
                for q in self.pl.inspect().values()
            ),
            LEASE_S + 15,
            f"idle queues and gates: {self.pl.inspect()}",
        )
        holders = [
            k
            for n in self.primaries()
            for k in n.client().scan_iter(f"{self.prefix}*gate*:holders", count=10_000)
            if n.client().zcard(k)
        ]
        assert not holders, f"gates still hold slots: {holders}"
        self.check_workers()


def pools_on_three_primaries(cluster_url: str) -> list[str]:
    """Three pool names whose hash tags map to three different primaries."""
    client = connect(cluster_url)
    names = ["fa"]
    owners = [node_client(client, "{p:fa}")]
    for i in range(300):
        name = f"fb{i}"
        owner = node_client(client, f"{{p:{name}}}")
        if all(owner is not o for o in owners):
            names.append(name)
            owners.append(owner)
            if len(names) == 3:
                client.close()
                return names
    raise AssertionError("no three pool names on three primaries")


@contextmanager
def cluster_run(tmp: Path) -> Iterator[Run]:
    """The cluster, the broker, the simulator and two worker nodes, registered."""
    with (
        redis_cluster(tmp / "cluster", primaries=3, replicas=1) as cluster,
        lone_server(tmp / "broker") as broker,
        SimServer(SimConfig(latency_ms=20, record_arrivals=True)).start_in_thread() as sim,
    ):

        def replicas_online() -> bool:
            links = [n.client().info("replication") for n in cluster[:3]]
            return all(i.get("slave0", {}).get("state") == "online" for i in links)

        wait_until(replicas_online, 30, "every primary's replica to be in sync")
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in cluster)
        names = pools_on_three_primaries(url)
        pools = dict(zip(GATES, names, strict=True))
        queues = [
            {
                "queue_name": q,
                "igw_base_url": sim.url,
                "worker_pool_id": pools[q],
                "gate_type": gate,
                "gate_params": {"limit": limit},
                "retry_base_delay_s": 0.1,
                "retry_max_delay_s": 0.5,
                "request_timeout_s": 10,
            }
            for q, (gate, limit) in GATES.items()
        ]
        qfile = tmp / "queues.json"
        qfile.write_text(json.dumps(queues))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "CELERY_"))}
        env.update(
            PIPELINE_REDIS_URL=url,
            CELERY_BROKER_URL=broker.url,
            PIPELINE_QUEUES=str(qfile),
            PIPELINE_KEY_PREFIX=f"cf{uuid.uuid4().hex[:6]}:",
            PIPELINE_REDIS_MIN_REPLICAS="1",
            # the promoted replica has no replica of its own: each finish on it waits this out
            # (and holds its gate's hand-over meanwhile), so the default 1 s caps the pool at
            # limit/s after the failover
            PIPELINE_REDIS_WAIT_TIMEOUT_MS="200",
            PIPELINE_LEASE_S=str(LEASE_S),
            PIPELINE_DISPATCH_LEASE_S="4",
            PIPELINE_REAPER_PERIOD_S="0.3",
            PIPELINE_METRICS_PORT="0",
        )
        pl = Pipeline(load_settings(env))
        workers = []
        try:
            for i in range(NODES):
                with open(tmp / f"worker{i}.log", "wb") as fh:
                    workers.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "pipeline", "worker", "--pools",
                             ",".join(names), "-c", "8", "-n", f"cf{i}@test",
                             "--loglevel", "INFO"],
                            env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                        )
                    )  # fmt: skip
            run = Run(cluster, env, pools, pl, sim, workers, tmp)

            def registered() -> bool:
                run.check_workers()
                store = pl.store.for_pool(names[0])
                return pl.store.client.zcard(store.keys.pool_nodes(names[0])) == NODES

            wait_until(registered, NODE_START_S, "two worker nodes")
            sim.reset()
            yield run
        finally:
            stop_processes(workers)


def test_a_primary_killed_mid_run_loses_nothing(tmp_path: Path) -> None:
    """A 1,000-request batch over three pools (on a cluster a batch lives in its queue's pool:
    one batch per pool, 334 + 333 + 333 lines); the primary of one pool's slot SIGKILLed once
    some finished; its replica is promoted; the pool's dispatch resumes within 10 s of that;
    every batch completes with every line answered once."""
    with cluster_run(tmp_path) as run:
        batches = Batches(run.pl)
        made = {}
        for q, n in zip(run.pools, (334, 333, 333), strict=True):
            lines = [
                {"custom_id": f"{q}-{i}", "url": "/v1/completions",
                 "body": {"model": "m", "prompt": f"p{i}"}}
                for i in range(n)
            ]  # fmt: skip
            made[q] = batches.submit_batch(lines, queue=q)
        by_queue = {
            batch.request_id(i): q for q, batch in made.items() for i in range(1, batch.lines + 1)
        }
        ids = list(by_queue)
        assert len(ids) == 1000
        wait_until(lambda: run.done() >= 150, 60, "some requests finished")
        victim_q = "qc"
        slot = key_slot(f"{{p:{run.pools[victim_q]}}}".encode())
        old = run.owner(slot)
        killed_at = time.monotonic()
        old.kill()  # SIGKILL: attempts of every pool are running

        def promoted() -> bool:
            try:
                return (
                    all(n.client().cluster("info")["cluster_state"] == "ok" for n in run.alive())
                    and run.owner(slot) is not old
                )
            except redis.RedisError:
                return False

        wait_until(promoted, 30, "the replica promoted", interval=0.02)
        promoted_at = time.monotonic()
        mid = run.done()
        run.check_outcome(ids, by_queue)
        victim = {i for i in ids if by_queue[i] == victim_q}
        arrivals = sorted(a for a, _, rid in sim_arrivals(run.sim) if rid in victim)
        after = [a for a in arrivals if a > promoted_at]
        assert after, "no request of the killed pool was dispatched after the promotion"
        recovery = after[0] - promoted_at
        gap = max(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
        print(
            f"\nfailover: promoted {promoted_at - killed_at:.2f} s after the kill "
            f"({mid} of 1000 done then); the pool's first dispatch {recovery:.2f} s after "
            f"the promotion (its longest pause at the server {gap:.2f} s); all done "
            f"{time.monotonic() - killed_at:.1f} s after the kill"
        )
        assert recovery <= RECOVERY_S, recovery
        for q, batch in made.items():
            done = batches.wait(batch.id, timeout=60)
            counts = done.request_counts
            assert done.status == "completed", (q, done.status, done.errors)
            assert (counts.total, counts.completed, counts.failed) == (batch.lines, batch.lines, 0)


def move_slot(src: Server, dst: Server, others: list[Server], slot: int, batch: int) -> int:
    """What ``redis-cli --cluster reshard`` does for one slot: IMPORTING on the target,
    MIGRATING on the source, MIGRATE the keys ``batch`` at a time, then SETSLOT NODE
    everywhere. Returns the keys moved."""
    s, d = src.client(), dst.client()
    src_id, dst_id = s.cluster("myid"), d.cluster("myid")
    d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    moved = 0
    while keys := s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
        s.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "REPLACE", "KEYS", *keys)
        moved += len(keys)
    for n in (dst, src, *others):
        n.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    return moved


def test_a_pools_slot_moved_mid_run_loses_nothing(tmp_path: Path) -> None:
    """500 requests over three pools; one pool's slot migrated to another primary (keys moved
    one at a time, as ``redis-cli --cluster reshard --cluster-pipeline 1`` does: the longest
    window in which a script of the pool meets TRYAGAIN or ASK) while they run."""
    with cluster_run(tmp_path) as run:
        items = run.items(500)
        by_queue = {x["id"]: x["queue"] for x in items}
        ids = [r.id for r in run.pl.submit_many(items)]
        wait_until(lambda: run.done() >= 60, 60, "some requests finished")
        slot = key_slot(f"{{p:{run.pools['qc']}}}".encode())
        src = run.owner(slot)
        dst = run.owner(key_slot(f"{{p:{run.pools['qa']}}}".encode()))
        others = [n for n in run.primaries() if n not in (src, dst)]
        began = time.monotonic()
        moved = move_slot(src, dst, others, slot, 1)
        took = time.monotonic() - began
        assert run.owner(slot) is dst
        print(f"\nslot {slot}: {moved} keys moved in {took:.2f} s")
        run.check_outcome(ids, by_queue)
