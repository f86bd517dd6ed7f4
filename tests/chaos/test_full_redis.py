"""Chaos: Redis at its ``maxmemory`` with ``noeviction`` (issue 48, item 5). ``submit_many``
stores in chunks, each all or nothing, and a full Redis raises ``StoreFull`` saying which ids
were stored and which not (never a raw ``OutOfMemoryError``, never a chunk half stored). Starts
that cannot write give their request back at once instead of leaving it ``dispatched`` until
its dispatch lease lapses: once memory is freed every stored request ends, one result each,
long before that lease, and no gate holds a reservation."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import redis

from pipeline import StoreFull
from pipeline.cli.services import wait_until
from pipeline.sim import SimServer
from tests.chaos.private_node import start_node
from tests.conftest import assert_idle, give_up_after, held, stop_processes
from tests.redis_servers import start_server

DISPATCH_LEASE_S = 120  # a request stuck "dispatched" would come back only after this
ROOM = 1_500_000  # bytes of maxmemory above what Redis uses when the test fills it


def oom_errors(client: redis.Redis) -> int:
    """How many commands the server refused for memory so far (INFO errorstats)."""
    stat = client.info("errorstats").get("errorstat_OOM") or {}
    return int(stat.get("count", 0)) if isinstance(stat, dict) else 0


def test_full_redis_stores_whole_chunks_and_gives_starts_back(
    sim: SimServer, tmp_path: Path
) -> None:
    server = start_server(tmp_path, "full", "--maxmemory-policy", "noeviction")
    queue = {
        "igw_base_url": sim.url, "retry_base_delay_s": 0.1, "retry_max_delay_s": 1,
        "request_timeout_s": 60,
        "gate_type": "global-max-concurrency", "gate_params": {"limit": 4},
    }  # fmt: skip
    node = start_node(
        tmp_path, server.url, queue, slots=4, name="full@test", PIPELINE_LEASE_S="3",
        PIPELINE_DISPATCH_LEASE_S=str(DISPATCH_LEASE_S), PIPELINE_REAPER_PERIOD_S="0.5",
    )  # fmt: skip
    log = node.log
    admin = server.client()
    try:
        pl = node.pipeline()
        sim.reset()
        # the first four hold the gate's slots at the server while Redis fills up
        first = [r.id for r in pl.submit_many([
            {"payload": {"first": i}, "timeout": 600, "headers": held("full")}
            for i in range(4)
        ])]  # fmt: skip
        sim.wait_held("full", 4)
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory", used + ROOM)
        items = [
            {"payload": {"i": i, "pad": "x" * 1000}, "id": f"full-{uuid.uuid4().hex[:10]}",
             "timeout": 600, "headers": held("full")}
            for i in range(20_000)
        ]  # fmt: skip
        ids = [i["id"] for i in items]
        try:
            pl.submit_many(items)
            raise AssertionError("submit_many stored 20,000 requests in a full Redis")
        except StoreFull as exc:
            full = exc
        assert full.stored + full.not_stored == ids  # in order: whole chunks, then the rest
        assert full.stored, "nothing fitted"
        c = pl.store.client
        with c.pipeline(transaction=False) as p:
            for rid in ids:
                p.exists(pl.store.keys.request(rid))
            there = p.execute()
        assert [rid for rid, n in zip(ids, there, strict=True) if n] == full.stored

        # the first four freed, the next attempts cannot start in the full Redis: each gives
        # its request back at once
        refused = oom_errors(admin)
        sim.release("full")
        # Redis refuses writes of the attempts that follow (their starts among them)
        wait_until(lambda: oom_errors(admin) >= refused + 20, 60, "starts refused for memory")
        admin.config_set("maxmemory", 0)
        freed = time.monotonic()
        results = {
            r.id: r
            for r in pl.iter_results(
                first + full.stored,
                on_poll=give_up_after(DISPATCH_LEASE_S / 2, "every stored request"),
            )
        }
        assert time.monotonic() - freed < DISPATCH_LEASE_S / 2
        assert set(results) == set(first + full.stored)
        assert all(r.ok for r in results.values())
        pushed = [json.loads(x)["id"] for x in c.lrange(
            pl.store.keys.result_list(pl.settings.queues["default"]), 0, -1)]  # fmt: skip
        assert sorted(pushed) == sorted(first + full.stored)  # one terminal result each
        assert sim.stats()["max_concurrency_observed"] <= 4
        assert "start refused: Redis is at its maxmemory" in log.read_text()
        assert_idle(pl)
    finally:
        sim.release_all()
        stop_processes([node.proc])
        server.stop()
