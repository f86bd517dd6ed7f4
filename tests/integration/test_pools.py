"""Worker pools (``PIPELINE_POOLS``, the reference's pool config): a pool caps its slots
across nodes and its gate is acquired with the queue's, all-or-nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.config import load_settings
from pipeline.errors import ConfigError
from pipeline.gates import check_gates
from pipeline.sim import SimServer
from tests.conftest import NODE_START_S, ROOT, assert_idle, held


def write_config(tmp_path: Path, sim_url: str, redis_url: str) -> dict[str, str]:
    queues = [
        {
            "queue_name": "pooled",
            "igw_base_url": sim_url,
            "worker_pool_id": "gp",
        },
        {"queue_name": "pooled2", "igw_base_url": sim_url, "worker_pool_id": "gp"},
    ]
    pools = [
        {
            "id": "gp",
            "workers": 3,
            "gate_type": "local-max-concurrency",
            "gate_params": {"limit": 2},
        }
    ]
    (tmp_path / "q.json").write_text(json.dumps(queues))
    (tmp_path / "p.json").write_text(json.dumps(pools))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "CELERY_"))}
    env.update(
        PIPELINE_REDIS_URL=redis_url,
        PIPELINE_KEY_PREFIX=f"pools{uuid.uuid4().hex[:6]}:",
        PIPELINE_QUEUES=str(tmp_path / "q.json"),
        PIPELINE_POOLS=str(tmp_path / "p.json"),
    )
    return env


def test_pool_gate_and_worker_cap(tmp_path: Path, env: dict[str, str], sim: SimServer) -> None:
    penv = write_config(tmp_path, sim.url, env["PIPELINE_REDIS_URL"])
    settings = load_settings(penv)
    assert settings.pool_configs["gp"].workers == 3
    pl = Pipeline(settings)
    log = tmp_path / "worker.log"
    with open(log, "wb") as fh:
        worker = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "worker", "--pools", "gp", "-c", "8"],
            env=penv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    try:
        sim.reset()
        hold = f"pools-{uuid.uuid4().hex[:6]}"
        reqs = [
            pl.submit({"i": i}, queue=q, timeout=60, headers=held(hold))
            for i in range(6)
            for q in ("pooled", "pooled2")
        ]
        seen_running = 0

        def running() -> int:
            nonlocal seen_running
            info = pl.inspect()
            now = info["pooled"]["running"] + info["pooled2"]["running"]
            seen_running = max(seen_running, now)
            return now

        # the pool gate's limit is at the server (once the node, not waited for, has started)
        sim.wait_held(hold, 2, timeout_s=NODE_START_S)
        wait_until(lambda: running() >= 2, 10, "the held requests counted as running")
        sim.release(hold)

        def done() -> bool:
            running()  # keeps sampling the count until the end
            return all(pl.state(r.id) == "done" for r in reqs)

        wait_until(done, 60, "all pooled requests", interval=0.05)
        assert all(r.result(1).ok for r in reqs)
        # the pool gate (limit 2 on the node) bounds what reaches the server, across queues
        assert sim.stats()["max_concurrency_observed"] == 2
        # the pool's `workers` (3) caps dispatched + running, though the node has 8 slots
        assert 2 <= seen_running <= 3
        assert_idle(pl)
    finally:
        worker.terminate()
        worker.wait(30)
        for key in pl.store.client.scan_iter(settings.key_prefix + "*", count=10_000):
            pl.store.client.delete(key)
    assert "Traceback" not in log.read_text(errors="replace")


def test_pools_file_must_name_every_queue_pool(
    tmp_path: Path, sim: SimServer, redis_url: str
) -> None:
    penv = write_config(tmp_path, sim.url, redis_url)
    (tmp_path / "p.json").write_text(json.dumps([{"id": "other", "workers": 2}]))
    with pytest.raises(ConfigError, match="worker_pool_id 'gp'"):
        load_settings(penv)
    (tmp_path / "p.json").write_text(json.dumps([{"id": "gp", "workers": 0}]))
    with pytest.raises(ConfigError, match="workers must be a positive int"):
        load_settings(penv)
    (tmp_path / "p.json").write_text(json.dumps([{"id": "gp", "gate_type": "nope"}]))
    with pytest.raises(ConfigError, match="pool 'gp': unknown gate_type"):
        check_gates(load_settings(penv))
