"""Chaos: the Redis master SIGKILLed in the middle of a 500-request batch, with Sentinel.

Real processes on loopback: a master, two replicas, three sentinels (quorum 2), two worker
nodes (``pipeline worker`` subprocesses) whose pipeline Redis, Celery broker and result backend
are all the sentinels' list URL, and ``PIPELINE_REDIS_MIN_REPLICAS=1``. The master is killed
once a part of the batch is done and the rest of it is submitted after the promotion: every
request ends with exactly one terminal result, none lost, every worker still runs, and the
gate (``local-max-concurrency``) holds nothing afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import redis

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.config import MASTER_VAR, load_settings
from pipeline.sim import SimServer
from tests.conftest import ROOT, give_up_after, stop_processes
from tests.redis_servers import MASTER_NAME, sentinel_group

REQUESTS = 500
BEFORE_KILL = 300  # submitted before the kill; the rest after the promotion
LEASE_S = 2.0


def node(env: dict[str, str], tmp: Path, n: int) -> subprocess.Popen[bytes]:
    log = tmp / f"worker{n}.log"
    with open(log, "wb") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline", "worker", "-c", "8", "-n", f"fo{n}@test"],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )


def answers(pl: Pipeline) -> bool:
    try:
        return bool(pl.store.client.ping())
    except redis.ConnectionError:
        return False


def test_master_killed_mid_batch_loses_nothing(sim: SimServer, tmp_path: Path) -> None:
    with sentinel_group(tmp_path / "redis", replicas=2, sentinels=3) as group:
        url = group.url()
        qfile = tmp_path / "queues.json"
        qfile.write_text(
            json.dumps(
                [
                    {
                        "queue_name": "default",
                        "igw_base_url": sim.url,
                        "gate_type": "local-max-concurrency",
                        "gate_params": {"limit": 4},
                        "retry_base_delay_s": 0.1,
                        "retry_max_delay_s": 0.5,
                        "request_timeout_s": 5,
                    }
                ]
            )
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "CELERY_"))}
        env.update(
            PIPELINE_REDIS_URL=url,
            CELERY_BROKER_URL=url,
            CELERY_RESULT_BACKEND=url,
            PIPELINE_QUEUES=str(qfile),
            PIPELINE_KEY_PREFIX=f"plfo{uuid.uuid4().hex[:6]}:",
            PIPELINE_REDIS_MIN_REPLICAS="1",
            PIPELINE_LEASE_S=str(LEASE_S),
            PIPELINE_DISPATCH_LEASE_S="4",
            PIPELINE_REAPER_PERIOD_S="0.3",
            PIPELINE_METRICS_PORT="0",
            **{MASTER_VAR: MASTER_NAME},
        )
        pl = Pipeline(load_settings(env))
        workers = [node(env, tmp_path, n) for n in range(2)]
        try:
            nodes_key = pl.store.keys.pool_nodes("default")

            def registered() -> bool:
                for w in workers:
                    assert w.poll() is None, (tmp_path / "worker0.log").read_text()[-3000:]
                return pl.store.client.zcard(nodes_key) == len(workers)

            wait_until(registered, 30, "two worker nodes")
            sim.reset()

            def items(n: int) -> list[dict[str, Any]]:
                return [
                    {
                        "payload": {"i": i},
                        "id": f"fo-{uuid.uuid4().hex[:10]}",
                        "timeout": 300,
                        "headers": {"x-sim-latency-ms": "100"},
                    }
                    for i in range(n)
                ]

            ids = [r.id for r in pl.submit_many(items(BEFORE_KILL))]
            recent = pl.store.keys.recent("default")
            wait_until(lambda: pl.store.client.zcard(recent) >= 100, 30, "a third done")
            old = group.master.port
            group.master.kill()  # SIGKILL, mid-batch: attempts are running on both nodes
            wait_until(lambda: group.master_port() != old, 30, "a replica promoted")
            wait_until(lambda: answers(pl), 15, "the client on the new master")
            ids += [r.id for r in pl.submit_many(items(REQUESTS - BEFORE_KILL))]

            bounded = give_up_after(45, lambda: f"all results: {pl.inspect()}")
            results = {r.id: r for r in pl.iter_results(ids, on_poll=bounded)}
            assert set(results) == set(ids)
            assert all(r.ok for r in results.values()), [
                r.to_dict() for r in results.values() if not r.ok
            ][:3]
            pushed = [
                json.loads(x)["id"]
                for x in pl.store.client.lrange(
                    pl.store.keys.result_list(pl.settings.queues["default"]), 0, -1
                )
            ]
            assert sorted(pushed) == sorted(ids)  # exactly one terminal result each
            # the gate's reservations: none left once the queue is drained (the lost ones of
            # the dead master's last moments lapse with their lease)
            wait_until(
                lambda: all(
                    q["pending"] == q["retry_wait"] == q["running"] == q["gate"]["in_flight"] == 0
                    for q in pl.inspect().values()
                ),
                LEASE_S + 10,
                f"idle queue and gate: {pl.inspect()}",
            )
            holders = [
                k
                for k in pl.store.client.scan_iter(
                    pl.store.keys.prefix + "gate:*:holders", count=10_000
                )
                if pl.store.client.zcard(k)
            ]
            assert not holders, holders
            assert all(w.poll() is None for w in workers), "the nodes reconnected and ran on"
        finally:
            stop_processes(workers)
