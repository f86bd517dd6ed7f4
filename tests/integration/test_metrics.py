"""Prometheus metrics, health endpoints and the status view, against real worker nodes (each
with its own ``/metrics`` port), a real Redis and the simulator over real HTTP.

Each test runs an isolated pipeline (own key prefix and pools, see ``tests/observability``),
submits a known workload, and asserts the scraped counts, summed over the nodes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from pipeline.cli.services import wait_until
from pipeline.config import load_settings
from pipeline.observability.collectors import scrape_registry
from pipeline.observability.health import NodeServer
from pipeline.observability.status import StatusView, status_snapshot
from pipeline.sim import SimServer
from tests.conftest import ROOT, WorkerProc, assert_idle, held, quota
from tests.observability import (
    Isolated,
    Samples,
    free_port,
    isolated,
    scrape,
    series,
    total,
    wait_ready,
)

REASONS = {"gate_closed", "quota_exhausted", "dropped", "error"}
# a look-ahead attempt over its quota parks 0.2 s, then is refused (counted) and goes back:
# the workload's second request of user u1 is refused while the first one runs
PARK_SHORT = {"PIPELINE_PARK_S": "0.2"}
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "pipeline.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
KEDA = ROOT / "deploy" / "keda" / "scaledobject.yaml"
DRAIN_LIMIT_SERIES = {
    "pipeline_drain_limit_rps",
    "pipeline_drain_limit_lease_valid",
    "pipeline_drain_limit_valid_until_seconds",
}
ADAPTIVE_SERIES = {
    "pipeline_gate_adaptive_limit",
    "pipeline_gate_adaptive_moved_seconds",
    "pipeline_gate_adaptive_windows",
}


def fail_first(n: int, status: int = 503) -> dict[str, str]:
    return {"x-sim-fail-first": str(n), "x-sim-fail-status": str(status)}


def wait_done(iso: Isolated, ids: list[str], timeout: float = 20.0) -> None:
    for rid in ids:
        iso.pl.wait(rid, timeout=timeout)


def scrape_all(ports: list[int]) -> Samples:
    return [s for p in ports for s in scrape(p)]


@pytest.fixture
def workload_iso(env: dict[str, str], sim: SimServer, tmp_path: Path) -> Isolated:
    return isolated(
        env,
        tmp_path,
        [
            {"queue_name": "m", "igw_base_url": sim.url},
            {"queue_name": "quota", "igw_base_url": sim.url, **quota(1)},
            # no worker serves this pool: its requests can only expire while waiting
            {"queue_name": "orphan", "igw_base_url": sim.url, "worker_pool_id": "none"},
        ],
    )


def submit_workload(iso: Isolated, sim: SimServer) -> tuple[list[str], str]:
    """11 successes (3 after 503s, 1 after a 429), 1 fatal 400, 2 gated requests of one user
    on a concurrency-1 quota, 1 request that expires while queued. Returns (ids, expired)."""
    pl, m = iso.pl, iso.queue("m")
    # the second request of user u1 arrives while the first holds the user's only slot
    user = {"queue": iso.queue("quota"), "metadata": {"userid": "u1"}}
    first = pl.submit({"prompt": "q1"}, headers=held(iso.tag), **user)
    sim.wait_held(iso.tag)
    second = pl.submit({"prompt": "q2"}, **user)
    # refused, so dispatched again (before the other queue's work competes for the slots)
    wait_until(lambda: int(pl.record(second.id).get("dispatches", 0)) >= 2, 10, "a refusal")
    sim.release(iso.tag)
    ids = [first.id, second.id]
    ids += [pl.submit({"prompt": f"ok {i}"}, queue=m).id for i in range(6)]
    ids += [pl.submit({"prompt": "r"}, queue=m, headers=fail_first(2)).id for _ in range(2)]
    ids.append(pl.submit({"prompt": "shed"}, queue=m, headers=fail_first(1, 429)).id)
    ids.append(pl.submit({"prompt": "bad"}, queue=m, headers=fail_first(1, 400)).id)
    expired = pl.submit({"prompt": "late"}, queue=iso.queue("orphan"), timeout=0.3).id
    return ids, expired


def assert_workload_counts(samples: Samples, iso: Isolated) -> None:
    m = {"queue_name": iso.queue("m")}
    q = {"queue_name": iso.queue("quota")}
    orphan = {"queue_name": iso.queue("orphan")}
    assert total(samples, "pipeline_request_total", **m) == 10
    assert total(samples, "pipeline_request_total", **q) == 2
    # every HTTP attempt, retries included: 6 + 2×3 + 2 + 1 on m, 2 on quota
    assert total(samples, "pipeline_dispatched_requests_total", **m) == 15
    assert total(samples, "pipeline_dispatched_requests_total", **q) == 2
    assert total(samples, "pipeline_successful_requests_total", **m) == 9
    assert total(samples, "pipeline_successful_requests_total", **q) == 2
    assert total(samples, "pipeline_failed_requests_total", **m) == 1
    assert total(samples, "pipeline_request_retries_total", **m) == 5
    assert total(samples, "pipeline_shedded_requests_total", **m) == 1
    assert total(samples, "pipeline_exceeded_deadline_requests_total", **orphan) == 1
    assert total(samples, "pipeline_exceeded_deadline_requests_total", **m) == 0
    # one histogram observation per HTTP call: 6 + 2×3 + 2 + 1 on m, 2 on quota
    assert total(samples, "pipeline_inference_latency_time_millis_count", **m) == 15
    assert total(samples, "pipeline_inference_latency_time_millis_count", **q) == 2
    assert total(samples, "pipeline_queue_residence_time_millis_count", **m) == 10
    assert total(samples, "pipeline_inflight_requests", **m) == 0
    # the usage of the 2xx answers (simulator: a token per prompt word, 16 completion tokens
    # without max_tokens): "ok i" x 6 (2 words), "r" x 2 and "shed" (1 word); the 503s, the
    # 429 and the 400 count nothing
    assert total(samples, "pipeline_tokens_total", direction="input", **m) == 6 * 2 + 3
    assert total(samples, "pipeline_tokens_total", direction="output", **m) == 9 * 16
    assert total(samples, "pipeline_tokens_total", direction="input", **q) == 2
    assert total(samples, "pipeline_tokens_total", direction="output", **q) == 2 * 16
    # the second request of user u1 was refused while the first held the quota
    assert total(samples, "pipeline_gate_decisions_total", reason="quota_exhausted", **q) >= 1
    assert total(samples, "pipeline_gate_decisions_total", **m) == 0
    assert {s["reason"] for s in series(samples, "pipeline_gate_decisions_total", **m)} == REASONS
    labels = series(samples, "pipeline_request_total", **m)[0]
    assert labels == {"queue_id": iso.queue("m"), "queue_name": iso.queue("m"),
                      "pool_name": iso.pool()}  # fmt: skip


def test_counts_with_two_thread_nodes(
    workload_iso: Isolated, nodes: Callable[..., tuple[WorkerProc, int]], sim: SimServer
) -> None:
    iso = workload_iso
    sim.reset()
    started = [nodes(iso, concurrency=2, wait=False, extra_env=PARK_SHORT) for _ in range(2)]
    for w, port in started:
        wait_ready(w, port)
    ports = [p for _, p in started]
    ids, expired = submit_workload(iso, sim)
    wait_done(iso, [*ids, expired])
    assert iso.pl.wait(expired, 1).error_code == "DEADLINE_EXCEEDED"
    assert_idle(iso.pl)
    samples = scrape_all(ports)
    assert_workload_counts(samples, iso)
    # both nodes did work (4 slots, prefetch 1 per slot): the sums above span two nodes
    for port in ports:
        assert total(scrape(port), "pipeline_request_total") > 0
    # read from Redis at scrape time: the same on every node
    for port in ports:
        one = scrape(port)
        assert total(one, "pipeline_queue_depth", queue_name=iso.queue("m")) == 0
        assert total(one, "pipeline_gate_in_flight", queue_name=iso.queue("quota")) == 0
        # a per-user quota has no overall limit
        assert not series(one, "pipeline_gate_limit", queue_name=iso.queue("quota"))
        assert total(one, "pipeline_redis_up") == 1
        assert total(one, "pipeline_dispatch_budget", queue_name=iso.queue("m")) == 1.0
        assert total(one, "pipeline_pool_worker_limit", pool_name=iso.pool()) == 4
        assert total(one, "pipeline_queue_wedged", queue_name=iso.queue("m")) == 0
    # every series the dashboard, the alert rules and the metrics page of the docs name is served
    text = httpx.get(f"http://127.0.0.1:{ports[0]}/metrics", timeout=5).text
    served = set(re.findall(r"^(?:# TYPE )?(pipeline_[a-z_]+)", text, re.M))
    docs = (ROOT / "docs" / "observability.md").read_text()
    for source in (DASHBOARD.read_text(), ALERTS.read_text(), KEDA.read_text(), docs):
        named = set(re.findall(r"\bpipeline_[a-z_]+[a-z]", source))
        # served only beside a redis-leased-rate gate (checked in
        # tests/integration/gates/test_leased_rate.py) or an adaptive-concurrency gate
        # (tests/integration/test_adaptive_gate.py)
        named -= DRAIN_LIMIT_SERIES | ADAPTIVE_SERIES
        assert named and named <= served, sorted(named - served)


def test_counts_with_a_prefork_node(
    workload_iso: Isolated, nodes: Callable[..., tuple[WorkerProc, int]], sim: SimServer
) -> None:
    """Attempts run in pool children; the main process serves their counts (multiprocess
    mode), including those of a child that was replaced (max-tasks-per-child 3)."""
    iso = workload_iso
    sim.reset()
    _, port = nodes(
        iso,
        concurrency=2,
        pool_impl="prefork",
        celery_args=["--max-tasks-per-child", "3"],
        extra_env=PARK_SHORT,
    )
    ids, expired = submit_workload(iso, sim)
    wait_done(iso, [*ids, expired], timeout=30)
    assert_idle(iso.pl)
    assert_workload_counts(scrape(port), iso)


def test_queue_depth_gate_in_flight_and_wedge(
    env: dict[str, str],
    sim: SimServer,
    tmp_path: Path,
    nodes: Callable[..., tuple[WorkerProc, int]],
) -> None:
    """While a held attempt holds a limit-1 gate and others wait, the scrape shows them (from
    Redis) and the wedge detector fires; when it is released all of it clears."""
    iso = isolated(
        env,
        tmp_path,
        [
            {
                "queue_name": "w",
                "igw_base_url": sim.url,
                "gate_type": "local-max-concurrency",
                "gate_params": {"limit": 1},
            }
        ],  # fmt: skip
        PIPELINE_WEDGE_AFTER_S="0.5",
    )
    sim.reset()
    _, port = nodes(iso, concurrency=4)
    q = iso.queue("w")
    first = iso.pl.submit({"prompt": "held"}, queue=q, headers=held(iso.tag))
    sim.wait_held(iso.tag)
    rest = [iso.pl.submit({"prompt": f"w{i}"}, queue=q).id for i in range(3)]

    def wedged() -> Samples | None:
        s = scrape(port)
        depth = (
            total(s, "pipeline_queue_depth", queue_name=q, state="pending"),
            total(s, "pipeline_queue_depth", queue_name=q, state="running"),
        )
        # one of the three waits dispatched ahead, parked at the worker for the slot
        # (look-ahead 1): 2 pending, 2 running
        return (
            s if total(s, "pipeline_queue_wedged", queue_name=q) == 1 and depth == (2, 2) else None
        )

    s = wait_until(wedged, 10, "the wedge gauge", interval=0.1)
    assert total(s, "pipeline_gate_in_flight", queue_name=q) == 1
    assert total(s, "pipeline_gate_limit", queue_name=q, gate_type="local-max-concurrency") == 1
    assert total(s, "pipeline_inflight_requests", queue_name=q) == 1
    assert total(s, "pipeline_dispatch_budget", queue_name=q) == 0.0
    sim.release(iso.tag)
    for rid in [first.id, *rest]:
        assert iso.pl.wait(rid, timeout=20).ok
    assert_idle(iso.pl)
    # the detector re-checks on its next reaper pass
    s = wait_until(
        lambda: (s := scrape(port)) and not total(s, "pipeline_queue_wedged", queue_name=q) and s,
        5,
        "the wedge to clear",
    )
    assert total(s, "pipeline_gate_in_flight", queue_name=q) == 0
    assert total(s, "pipeline_request_retries_total", queue_name=q) == 0
    assert total(s, "pipeline_successful_requests_total", queue_name=q) == 4


def test_healthz_and_readyz(env: dict[str, str], tmp_path: Path) -> None:
    """``/healthz`` answers while the process serves; ``/readyz`` is 503 with the reason when
    Redis does not answer (here: nothing listens on the discard port) or a check fails."""
    dead = load_settings({**env, "PIPELINE_REDIS_URL": "redis://127.0.0.1:9/0"})
    live = load_settings(env)
    reasons: list[str | None] = ["dispatcher not running"]
    servers = [
        NodeServer(dead, "127.0.0.1", free_port()).start(),
        NodeServer(live, "127.0.0.1", free_port(), checks=[lambda: reasons[0]]).start(),
    ]
    try:
        urls = [f"http://127.0.0.1:{s.address[1]}" for s in servers]
        for url in urls:
            r = httpx.get(url + "/healthz", timeout=5)
            assert (r.status_code, r.json()) == (200, {"status": "ok"})
        r = httpx.get(urls[0] + "/readyz", timeout=10)
        assert r.status_code == 503 and "redis unreachable" in r.json()["reason"]
        r = httpx.get(urls[1] + "/readyz", timeout=5)
        assert (r.status_code, r.json()["reason"]) == (503, "dispatcher not running")
        reasons[0] = None
        assert httpx.get(urls[1] + "/readyz", timeout=5).status_code == 200
        r = httpx.get(urls[0] + "/metrics", timeout=10)
        assert r.status_code == 200 and "pipeline_redis_up 0.0" in r.text
        servers[1].stopping.set()  # what SIGTERM does
        r = httpx.get(urls[1] + "/readyz", timeout=5)
        assert (r.status_code, r.json()["reason"]) == (503, "shutting down")
    finally:
        for s in servers:
            s.stop()


def test_status_view_shows_oldest_waiting_and_holders(
    env: dict[str, str],
    sim: SimServer,
    tmp_path: Path,
    nodes: Callable[..., tuple[WorkerProc, int]],
) -> None:
    iso = isolated(
        env,
        tmp_path,
        [
            {
                "queue_name": "held",
                "igw_base_url": sim.url,
                "gate_type": "local-max-concurrency",
                "gate_params": {"limit": 1},
            },
            {"queue_name": "idle", "igw_base_url": sim.url, "worker_pool_id": "none"},
        ],  # fmt: skip
    )
    held_queue, idle = iso.queue("held"), iso.queue("idle")
    # the oldest is not the head of the queue: the newer one has a higher priority
    waiting = [iso.pl.submit({"prompt": "s0"}, queue=idle, timeout=600, priority=0).id]
    nodes(iso, concurrency=2)  # (takes a second or more: the two are far apart)
    waiting.append(iso.pl.submit({"prompt": "s1"}, queue=idle, timeout=600, priority=1).id)
    submitted = [float(iso.pl.record(rid)["submitted_at"]) for rid in waiting]
    assert submitted[1] - submitted[0] > 0.5
    holder = iso.pl.submit({"prompt": "h"}, queue=held_queue, headers=held(iso.tag))
    sim.wait_held(iso.tag)
    out = subprocess.run(
        [sys.executable, "-m", "pipeline", "status", "--json"],
        env=iso.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    data: dict[str, Any] = json.loads(out.stdout)
    assert data[idle]["pending"] == 2 and data[idle]["oldest_pending_age_s"] > 0
    assert data[held_queue]["gate"]["holders"][0]["request_id"] == holder.id
    before = time.time()
    snap = status_snapshot(iso.pl)
    after = time.time()
    age = snap[idle]["oldest_pending_age_s"]
    assert before - submitted[0] - 0.002 <= age <= after - submitted[0] + 0.002
    slack = snap[idle]["min_deadline_slack_s"]  # of the first submitted (timeout 600 s)
    assert 600 - (after - submitted[0]) - 0.002 <= slack <= 600 - (before - submitted[0]) + 0.002
    assert snap[idle]["pending"] == 2 and snap[held_queue]["oldest_pending_age_s"] is None
    gate = snap[held_queue]["gate"]
    assert gate["in_flight"] == 1 and gate["limit"] == 1
    assert [h["request_id"] for h in gate["holders"]] == [holder.id]
    console = Console(width=250, record=True)
    console.print(StatusView(snap))
    text = console.export_text()
    assert holder.id in text and "1 / 1" in text and "oldest" in text
    for rid in waiting:
        assert iso.pl.cancel(rid)
    sim.release(iso.tag)
    assert iso.pl.wait(holder.id, timeout=15).ok
    assert_idle(iso.pl)


def test_deadline_proximity_histogram_is_read_from_the_sorted_sets(
    env: dict[str, str], sim: SimServer, tmp_path: Path
) -> None:
    """Waiting requests by time left before their deadline, read from Redis at scrape time
    (no worker serves these queues, so nothing sweeps them): cumulative buckets, ``le="0.0"``
    for those already past their deadline, ``+Inf`` for all of them."""
    iso = isolated(
        env,
        tmp_path,
        [
            {"queue_name": "wait", "igw_base_url": sim.url},
            {"queue_name": "empty", "igw_base_url": sim.url},
        ],
    )
    q = iso.queue("wait")
    late = iso.pl.submit({"prompt": "late"}, queue=q, timeout=0.05)
    for timeout in (10, 10, 10, 100, 100, 2 * 86_400):
        iso.pl.submit({"prompt": "w"}, queue=q, timeout=timeout)
    deadline = float(iso.pl.record(late.id)["deadline"])
    wait_until(lambda: time.time() > deadline + 0.01, 5, "the first deadline to pass")
    text = generate_latest(scrape_registry(iso.settings)).decode()
    samples = [
        (s.name, dict(s.labels), float(s.value))
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    ]
    name = "pipeline_deadline_proximity_millis_bucket"
    buckets = {lab["le"]: v for n, lab, v in samples if n == name and lab["queue_name"] == q}
    assert buckets["0.0"] == 1  # past its deadline, still waiting
    assert buckets["1000.0"] == buckets["5000.0"] == 1
    assert buckets["15000.0"] == buckets["60000.0"] == 4
    assert buckets["120000.0"] == buckets["8.64e+07"] == 6  # 24 h, as Go formats it
    assert buckets["+Inf"] == 7  # the 2-day one counts in the total only
    assert total(samples, "pipeline_deadline_proximity_millis_count", queue_name=q) == 7
    # sum estimated at the buckets' midpoints: 3 × 10 s, 2 × 90 s, 1 × 24 h (the last bound)
    estimate = 3 * 10_000 + 2 * 90_000 + 86_400_000
    assert total(samples, "pipeline_deadline_proximity_millis_sum", queue_name=q) == estimate
    empty = {lab["le"]: v for n, lab, v in samples
             if n == name and lab["queue_name"] == iso.queue("empty")}  # fmt: skip
    assert len(empty) == 15 and set(empty.values()) == {0.0}  # every bucket, even at 0
    for rid in [late.id]:
        assert iso.pl.cancel(rid)
    for key in iso.pl.store.client.scan_iter(
        iso.env["PIPELINE_KEY_PREFIX"] + "req:*", count=10_000
    ):
        iso.pl.cancel(key.split(":")[-1])
    assert_idle(iso.pl)


def test_gateway_drop_reason_and_attempts_are_counted(
    env: dict[str, str], sim: SimServer, tmp_path: Path,
    nodes: Callable[..., tuple[WorkerProc, int]],
) -> None:  # fmt: skip
    """A 429 whose gateway said why it shed the request is a gate decision with that reason;
    both HTTP attempts count in ``dispatched_requests_total``, the request once."""
    iso = isolated(env, tmp_path, [{"queue_name": "g", "igw_base_url": sim.url}])
    _, port = nodes(iso, concurrency=2)
    q = iso.queue("g")
    headers = {**fail_first(1, 429), "x-sim-dropped-reason": "rejected-saturated"}
    assert iso.pl.submit({"prompt": "x"}, queue=q, headers=headers).result(timeout=20).ok
    s = scrape(port)
    assert total(s, "pipeline_gate_decisions_total", queue_name=q, reason="rejected-saturated") == 1
    assert total(s, "pipeline_dispatched_requests_total", queue_name=q) == 2
    assert total(s, "pipeline_request_total", queue_name=q) == 1
    assert total(s, "pipeline_shedded_requests_total", queue_name=q) == 1
    assert_idle(iso.pl)


def test_keda_scaled_object_scales_on_pending_depth_and_deadline_proximity() -> None:
    """The example parses as a KEDA ScaledObject whose Prometheus triggers query the pipeline's
    pending depth and deadline proximity (that these series are served is checked above)."""
    import yaml

    obj = yaml.safe_load(KEDA.read_text())
    assert (obj["apiVersion"], obj["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    spec = obj["spec"]
    assert (
        spec["scaleTargetRef"]["name"] and 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    )
    triggers = spec["triggers"]
    assert {t["type"] for t in triggers} == {"prometheus"}
    queries = " ".join(t["metadata"]["query"] for t in triggers)
    assert 'pipeline_queue_depth{state="pending"}' in queries
    assert "pipeline_deadline_proximity_millis_bucket" in queries
    for t in triggers:
        assert float(t["metadata"]["threshold"]) > 0
        assert t["metadata"]["serverAddress"].startswith("http")
