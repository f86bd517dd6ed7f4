"""Chaos: Redis (append-only persistence) restarted mid-run. No accepted request is lost;
workers and the dispatcher reconnect by themselves, also a worker that acks its broker messages
(``PIPELINE_BROKER_ACKS=1``: the restore guard in ``tasks/compat.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pipeline.cli.services import free_port, redis_reachable, wait_until
from pipeline.client import Pipeline
from pipeline.config import load_settings
from pipeline.sim import SimServer
from tests.conftest import ROOT, give_up_after


@pytest.mark.parametrize("broker_acks", ["0", "1"])
def test_redis_restart_loses_nothing(sim: SimServer, tmp_path: Path, broker_acks: str) -> None:
    server = shutil.which("redis-server")
    assert server, "redis-server is required"
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    argv = [
        server,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--save",
        "",
        "--dir",
        str(tmp_path),
    ]

    def start_redis() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: redis_reachable(url, 0.3), 15, "redis-server")
        return proc

    redis_proc = start_redis()
    qfile = tmp_path / "queues.json"
    qfile.write_text(
        json.dumps(
            [
                {
                    "queue_name": "default",
                    "igw_base_url": sim.url,
                    "retry_base_delay_s": 0.1,
                    "retry_max_delay_s": 1,
                    "request_timeout_s": 5,
                }
            ]
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "CELERY_"))}
    env.update(
        PIPELINE_REDIS_URL=url,
        PIPELINE_QUEUES=str(qfile),
        PIPELINE_LEASE_S="2",
        PIPELINE_DISPATCH_LEASE_S="5",
        PIPELINE_REAPER_PERIOD_S="0.5",
        PIPELINE_BROKER_ACKS=broker_acks,
    )
    log = tmp_path / "worker.log"
    with open(log, "wb") as fh:
        worker = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "worker", "-c", "8"],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    pl = Pipeline(load_settings(env))
    try:
        items = [
            {
                "payload": {"i": i},
                "id": f"rr-{uuid.uuid4().hex[:8]}",
                "timeout": 300,
                "headers": {"x-sim-latency-ms": "50"},
            }
            for i in range(300)
        ]
        ids = [r.id for r in pl.submit_many(items)]
        wait_until(
            lambda: pl.store.client.zcard(pl.store.keys.recent("default")) >= 30,
            30,
            "the run under way",
        )
        redis_proc.terminate()  # SIGTERM: Redis flushes its append-only file and exits
        redis_proc.wait(15)
        redis_proc = start_redis()
        bounded = give_up_after(120, "all results (else requests were lost)")
        results = {r.id: r for r in pl.iter_results(ids, on_poll=bounded)}
        assert set(results) == set(ids)
        assert all(r.ok for r in results.values())
        pushed = [
            json.loads(x)["id"]
            for x in pl.store.client.lrange(
                pl.store.keys.result_list(pl.settings.queues["default"]), 0, -1
            )
        ]
        assert sorted(pushed) == sorted(ids)  # exactly one terminal result each
        assert worker.poll() is None, "the worker reconnected and kept running"
    finally:
        worker.terminate()
        worker.wait(30)
        redis_proc.terminate()
        redis_proc.wait(15)
