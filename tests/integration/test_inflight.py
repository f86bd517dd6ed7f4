"""A node that holds hundreds of attempts in flight (issue 46): ``pipeline worker -c 512`` with
300 requests held at the simulator. Every request is sent once, the node's Redis connections
stay bounded (``CLIENT LIST``: at most 64, whatever ``-c`` is) and its log has no error; once
released, every request has one terminal result and no reservation is held. And a pool's
``workers`` against the slots its nodes offer: left out, the pool takes them all; set below
them, the node says so at its start and ``pipeline status`` flags it."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from bench.common import node_redis_connections
from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.observability.status import StatusView, status_snapshot
from pipeline.sim import SimServer
from tests.conftest import WorkerProc, assert_idle, give_up_after, held
from tests.observability import Isolated, isolated, start_node

WIDE = 512  # the node's slots
IN_FLIGHT = 300  # requests held at the simulator at once
MAX_CONNECTIONS = 64  # a node's Redis connections, whatever its slots
LEASE_S = 3  # the test environment's PIPELINE_LEASE_S
ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback \(most recent call last\)")


def error_lines(w: WorkerProc) -> list[str]:
    return [ln for ln in w.log.read_text(errors="replace").splitlines() if ERROR_LINE.search(ln)]


def submit_held(pl: Pipeline, queue: str, n: int, name: str, **extra: Any) -> list[str]:
    items = [
        {
            "payload": {"i": i},
            "id": f"{name}-{i}",
            "queue": queue,
            "timeout": 600,
            "headers": {**held(name), **extra},
        }
        for i in range(n)
    ]
    return [r.id for r in pl.submit_many(items)]


@pytest.fixture
def wide(
    env: dict[str, str], tmp_path: Path, sim: SimServer, start_worker: Any
) -> Iterator[tuple[Isolated, WorkerProc]]:
    """A queue behind a global limit of 400, served by one node of 512 slots."""
    gate = {"gate_type": "global-max-concurrency", "gate_params": {"limit": 400}}
    iso = isolated(env, tmp_path, [{"queue_name": "wide", "igw_base_url": sim.url, **gate}])
    w, _ = start_node(start_worker, iso, concurrency=WIDE)
    sim.reset()
    try:
        yield iso, w
    finally:
        sim.release_all()
        w.stop()


def test_a_node_at_c512_holds_300_in_flight_on_a_few_redis_connections(
    wide: tuple[Isolated, WorkerProc], sim: SimServer
) -> None:
    iso, w = wide
    name = f"wide-{uuid.uuid4().hex[:6]}"
    ids = submit_held(iso.pl, iso.queue("wide"), IN_FLIGHT, name)
    sim.wait_held(name, IN_FLIGHT, timeout_s=120)
    connections = node_redis_connections(iso.pl.store.client, w.proc.pid)
    assert 0 < connections <= MAX_CONNECTIONS, f"{connections} Redis connections"
    # every lease is renewed while they are held (the heartbeat renews them all)
    client, active = iso.pl.store.client, iso.pl.store.keys.active(iso.queue("wide"))
    now = client.time()[0]

    def renewed() -> bool:
        leases = client.zrange(active, 0, -1, withscores=True)
        return len(leases) == IN_FLIGHT and min(s for _, s in leases) > now + LEASE_S + 1

    wait_until(renewed, 30, "every lease renewed")
    sim.release(name)
    results = list(iso.pl.iter_results(ids, on_poll=give_up_after(120, "300 results")))
    assert len(results) == IN_FLIGHT and all(r.ok and r.attempts == 1 for r in results)
    sent = sim.stats()["attempts_by_request_id"]
    assert sorted(sent) == sorted(ids) and set(sent.values()) == {1}  # each sent once
    assert_idle(iso.pl)
    assert error_lines(w) == []
    assert node_redis_connections(iso.pl.store.client, w.proc.pid) <= MAX_CONNECTIONS


def test_a_pool_without_workers_takes_every_slot_its_nodes_offer(
    env: dict[str, str], tmp_path: Path, sim: SimServer, start_worker: Any
) -> None:
    """A pools file naming the pool without ``workers``: a node at -c 80 runs 80 at once (the
    pool was capped at 64 without a word)."""
    queue = [{"queue_name": "slots", "igw_base_url": sim.url}]
    iso = isolated(env, tmp_path, queue, pools=[{"id": "p"}])
    w, _ = start_node(start_worker, iso, concurrency=80)
    name = f"slots-{uuid.uuid4().hex[:6]}"
    try:
        ids = submit_held(iso.pl, iso.queue("slots"), 80, name)
        sim.wait_held(name, 80, timeout_s=60)
        sim.release(name)
        results = list(iso.pl.iter_results(ids, on_poll=give_up_after(60, "80 results")))
        assert all(r.ok for r in results)
        assert_idle(iso.pl)
    finally:
        sim.release_all()
        w.stop()
    assert "caps the attempts" not in w.log.read_text()


def test_a_workers_cap_below_the_slots_is_said_at_start_and_in_status(
    env: dict[str, str], tmp_path: Path, sim: SimServer, start_worker: Any
) -> None:
    queue = [{"queue_name": "slots", "igw_base_url": sim.url}]
    iso = isolated(env, tmp_path, queue, pools=[{"id": "p", "workers": 6}])
    w, _ = start_node(start_worker, iso, concurrency=16)
    name = f"capped-{uuid.uuid4().hex[:6]}"
    try:
        warned = [ln for ln in w.log.read_text().splitlines() if "caps the attempts" in ln]
        assert len(warned) == 1 and "WARNING" in warned[0]
        assert "offer 16 slots" in warned[0] and "at 6 across all nodes" in warned[0]
        assert "workers in PIPELINE_POOLS" in warned[0]
        ids = submit_held(iso.pl, iso.queue("slots"), 10, name)
        sim.wait_held(name, 6, timeout_s=60)
        snap = status_snapshot(iso.pl)[iso.queue("slots")]
        assert snap["slots"] == {
            "nodes": 1, "offered": 16, "workers": 6, "cap": 6, "capped": True
        }  # fmt: skip
        console = Console(width=120, record=True)
        console.print(StatusView(status_snapshot(iso.pl)))
        text = console.export_text()
        assert "capped by workers" in text and "10 slots offered stay idle" in text
        assert sim.held(name) == 6  # never more than workers at once
        sim.release(name)
        list(iso.pl.iter_results(ids, on_poll=give_up_after(60, "10 results")))
        assert_idle(iso.pl)
    finally:
        sim.release_all()
        w.stop()
