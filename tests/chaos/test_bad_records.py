"""Chaos: records another producer wrote badly, among good ones, while a node dispatches by
itself (``PIPELINE_DIRECT_PUBLISH=0``: the dispatcher reads each tick's reply and publishes)
(issue 48, item 6). Before, one non-integer ``priority`` made the whole tick's reply unreadable:
nothing of it was published and its good neighbours ended ``DEADLINE_EXCEEDED`` unsent. Now the
bad record ends ``INVALID_REQUEST`` alone; every good one is served; every id has one terminal
result; the server never holds more than the limit; no gate holds a reservation."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline.sim import SimServer
from tests.chaos.private_node import start_node
from tests.conftest import assert_idle, give_up_after, held, stop_processes
from tests.redis_servers import start_server

LIMIT = 4
GOOD, BAD = 40, 8


def test_bad_records_end_alone_and_their_ticks_are_sent(sim: SimServer, tmp_path: Path) -> None:
    server = start_server(tmp_path / "redis", "badrec")
    queue = {
        "igw_base_url": sim.url, "request_timeout_s": 60,
        "gate_type": "global-max-concurrency", "gate_params": {"limit": LIMIT},
    }  # fmt: skip
    node = start_node(
        tmp_path, server.url, queue, slots=8, name="badrec@test", PIPELINE_DIRECT_PUBLISH="0"
    )
    tag = f"badrec-{uuid.uuid4().hex[:6]}"
    try:
        pl = node.pipeline()
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
        assert "Traceback" not in node.log.read_text()
    finally:
        sim.release_all()
        stop_processes([node.proc])
        server.stop()
