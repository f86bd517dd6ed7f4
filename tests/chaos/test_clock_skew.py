"""Chaos: worker nodes whose clocks are two minutes off, in both directions (libfaketime),
share one ``global-max-concurrency`` limit. Only the Redis server's clock decides what has
expired, so the model server never sees more than the limit, no request runs twice, no live
attempt is reaped, and the fast node does not think every deadline has passed."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.sim import SimServer
from tests.conftest import ROOT, give_up_after

LIMIT = 4  # the "skew" queue: global-max-concurrency 4
SKEW_S = 120
REQUESTS = 120


def libfaketime() -> str:
    """Where libfaketime.so.1 is (installed by .ci/system-deps, which `make test` runs)."""
    out = subprocess.run(
        [str(ROOT / ".ci" / "system-deps"), "--print-libfaketime"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, f"libfaketime is required: {out.stderr.strip()}"
    return out.stdout.strip()


def skewed(seconds: int) -> dict[str, str]:
    """Environment for a process whose wall clock is ``seconds`` off (monotonic untouched)."""
    return {
        "LD_PRELOAD": libfaketime(),
        "FAKETIME": f"{seconds:+d}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


def test_nodes_two_minutes_apart_never_over_admit_or_run_twice(
    pl: Pipeline, sim: SimServer, start_worker: Any
) -> None:
    fast = start_worker(pools="skew", concurrency=8, extra_env=skewed(+SKEW_S))
    slow = start_worker(pools="skew", concurrency=8, extra_env=skewed(-SKEW_S))
    sim.reset()
    items = [
        {
            "payload": {"i": i},
            "id": f"skew-{uuid.uuid4().hex[:10]}",
            "queue": "skew",
            # most with an hour to go; a sixth with a minute, far inside the skew: a node that
            # read its own clock would call them expired (or the slow one send them late)
            "timeout": 60 if i % 6 == 0 else 3600,
            "headers": {"x-sim-latency-ms": "150"},
        }
        for i in range(REQUESTS)
    ]
    ids = [r.id for r in pl.submit_many(items)]
    give_up = give_up_after(90, "the skewed nodes to finish")
    results = {r.id: r for r in pl.iter_results(ids, on_poll=give_up)}
    assert all(r.ok and r.attempts == 1 for r in results.values()), [
        (r.error_code, r.status_code) for r in results.values() if not r.ok
    ]
    stats = sim.stats()
    assert stats["max_concurrency_observed"] <= LIMIT
    arrivals = httpx.get(f"{sim.url}/sim/arrivals", timeout=10).json()
    calls = Counter(rid for _, _, rid in arrivals)
    assert sorted(calls) == sorted(ids) and set(calls.values()) == {1}  # each one ran once
    for node in (fast, slow):
        log = Path(node.log).read_text()
        assert "reaped request" not in log and "freed expired reservation" not in log
    # both nodes served: the skewed clocks did not keep either out
    workers = {pl.store.record(rid).get("worker", "") for rid in ids}
    assert any(fast.name in w for w in workers) and any(slow.name in w for w in workers)
    wait_until(
        lambda: pl.inspect()["skew"]["gate"]["in_flight"] == 0,
        10,
        'pl.inspect()["skew"]["gate"]["in_flight"] == 0',
    )


def test_a_relative_timeout_is_a_deadline_by_the_servers_clock(
    pl: Pipeline, env: dict[str, str]
) -> None:
    """A client whose clock is 5 minutes slow submits ``timeout=100``: the deadline is 100 s
    after the server stored it, not 100 s after the client's idea of now."""
    script = (
        "from pipeline.client import Pipeline\n"
        "p = Pipeline()\n"
        "r = p.submit({'x': 1}, queue='solo', timeout=100)\n"
        "print(r.id)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**env, **skewed(-300)},
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip().splitlines()[-1]
    sec, usec = pl.store.client.time()
    record = pl.store.record(rid)
    submitted, deadline = float(record["submitted_at"]), float(record["deadline"])
    assert abs(submitted - (sec + usec / 1e6)) < 30  # the server's clock, not 5 min ago
    assert deadline - submitted == pytest.approx(100.0, abs=0.01)
    assert pl.cancel(rid)
