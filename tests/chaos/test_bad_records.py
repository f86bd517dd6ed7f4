"""Chaos: records another producer wrote badly, among good ones, while a node dispatches by
itself (``PIPELINE_DIRECT_PUBLISH=0``: the dispatcher reads each tick's reply and publishes)
(issue 48, item 6). Before, one non-integer ``priority`` made the whole tick's reply unreadable:
nothing of it was published and its good neighbours ended ``DEADLINE_EXCEEDED`` unsent. Now the
bad record ends ``INVALID_REQUEST`` alone; every good one is served; every id has one terminal
result; the server never holds more than the limit; no gate holds a reservation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.config import load_settings
from pipeline.sim import SimServer
from tests.conftest import ROOT, assert_idle, give_up_after, held, stop_processes
from tests.redis_servers import start_server

LIMIT = 4
GOOD, BAD = 40, 8


def test_bad_records_end_alone_and_their_ticks_are_sent(sim: SimServer, tmp_path: Path) -> None:
    server = start_server(tmp_path / "redis", "badrec")
    qfile = tmp_path / "queues.json"
    qfile.write_text(json.dumps([{
        "queue_name": "default", "igw_base_url": sim.url, "request_timeout_s": 60,
        "gate_type": "global-max-concurrency", "gate_params": {"limit": LIMIT},
    }]))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "CELERY_"))}
    env.update(
        PIPELINE_REDIS_URL=server.url,
        PIPELINE_QUEUES=str(qfile),
        PIPELINE_DIRECT_PUBLISH="0",
        PIPELINE_METRICS_PORT="0",
    )
    log = tmp_path / "worker.log"
    with open(log, "wb") as fh:
        worker = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "worker", "-c", "8", "-n", "badrec@test"],
            env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
    pl = Pipeline(load_settings(env))
    tag = f"badrec-{uuid.uuid4().hex[:6]}"
    try:
        nodes = pl.store.keys.pool_nodes("default")
        wait_until(lambda: pl.store.client.zcard(nodes) > 0, 90, "the worker node")
        sim.reset()
        # the gate full of held calls: what follows waits in the queue, where it is corrupted
        blockers = [pl.submit({"b": i}, headers=held(tag), timeout=300).id for i in range(LIMIT)]
        sim.wait_held(tag, LIMIT)
        # short deadlines: a good request lost with a tick would end DEADLINE_EXCEEDED unsent
        # (the dispatch lease, 120 s, is far longer)
        items: list[dict[str, Any]] = [
            {"payload": {"i": i}, "id": f"{tag}-{i}", "timeout": 30, "priority": i % 3,
             "headers": {"x-sim-latency-ms": "20"}}
            for i in range(GOOD + BAD)
        ]  # fmt: skip
        ids = [r.id for r in pl.submit_many(items)]
        bad = set(ids[:: (GOOD + BAD) // BAD][:BAD])  # spread over the ticks to come
        for rid in bad:  # another producer's write: a priority that is not an integer
            pl.store.client.hset(pl.store.keys.request(rid), "priority", "urgent")
        sim.release(tag)

        results = {r.id: r for r in pl.iter_results(ids, on_poll=give_up_after(90, "results"))}
        assert set(results) == set(ids)
        for rid, r in results.items():
            if rid in bad:
                assert r.error_code == "INVALID_REQUEST", r
            else:
                assert r.ok, r
        assert all(pl.wait(b, timeout=30).ok for b in blockers)
        key = pl.store.keys.result_list(pl.settings.queues["default"])
        pushed = Counter(json.loads(x)["id"] for x in pl.store.client.lrange(key, 0, -1))
        assert all(pushed[rid] == 1 for rid in [*ids, *blockers]), pushed
        assert sim.stats()["max_concurrency_observed"] <= LIMIT
        assert_idle(pl)
        assert "Traceback" not in log.read_text()
    finally:
        sim.release_all()
        stop_processes([worker])
        server.stop()
