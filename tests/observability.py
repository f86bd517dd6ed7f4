"""Helpers for the observability tests (metrics, Flower, tracing): an isolated pipeline —
its own key prefix and its own worker pools, hence its own Celery queues — so that no other
worker (of this session or of a suite running next to it on the same Redis) takes its work,
and scrapes of its worker nodes count exactly the workload a test submitted."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.config import Settings, load_settings
from tests.conftest import HELD_S, ISOLATED, NODE_START_S, WorkerProc

FAST = {"retry_base_delay_s": 0.05, "retry_max_delay_s": 0.2, "request_timeout_s": HELD_S}


@dataclass
class Isolated:
    env: dict[str, str]
    settings: Settings
    pl: Pipeline
    tag: str

    def queue(self, name: str) -> str:
        return f"{name}-{self.tag}"

    def pool(self, name: str = "p") -> str:
        return f"{name}-{self.tag}"


def isolated(
    env: dict[str, str],
    tmp: Path,
    queues: list[dict[str, Any]],
    pools: list[dict[str, Any]] | None = None,
    **extra: str,
) -> Isolated:
    """A pipeline whose queue and pool names carry a fresh tag (``name-<tag>``): each entry's
    ``queue_name`` and ``worker_pool_id`` (default ``p``) get the tag appended, and so does
    each ``id`` of ``pools``, written as its pools file (``PIPELINE_POOLS``)."""
    tag = uuid.uuid4().hex[:8]
    entries = []
    for q in queues:
        e = {**FAST, **q}
        e["queue_name"] = f"{q['queue_name']}-{tag}"
        e["worker_pool_id"] = f"{q.get('worker_pool_id', 'p')}-{tag}"
        entries.append(e)
    qfile = tmp / f"queues-{tag}.json"
    qfile.write_text(json.dumps(entries))
    e = {
        **env,
        "PIPELINE_KEY_PREFIX": f"plobs{tag}:",
        "PIPELINE_QUEUES": str(qfile),
        "PIPELINE_METRICS_PORT": "0",
        **extra,
    }
    if pools is not None:
        pfile = tmp / f"pools-{tag}.json"
        pfile.write_text(json.dumps([{**p, "id": f"{p['id']}-{tag}"} for p in pools]))
        e["PIPELINE_POOLS"] = str(pfile)
    settings = load_settings(e)
    ISOLATED.append(f"plobs{tag}:")  # its keys are deleted after the test
    return Isolated(e, settings, Pipeline(settings), tag)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_node(
    start_worker: Callable[..., WorkerProc],
    iso: Isolated,
    *,
    pools: str = "p",
    concurrency: int = 4,
    pool_impl: str = "threads",
    extra_env: dict[str, str] | None = None,
    celery_args: list[str] | None = None,
    wait: bool = True,
) -> tuple[WorkerProc, int]:
    """A worker node of ``iso`` with its metrics endpoint on a free port; with ``wait``,
    returns once ``/readyz`` answers 200 (dispatcher running, consumer connected)."""
    port = free_port()
    names = ",".join(iso.pool(p) for p in pools.split(","))
    w = start_worker(
        pools=names,
        concurrency=concurrency,
        pool_impl=pool_impl,
        extra_env={**iso.env, "PIPELINE_METRICS_PORT": str(port), **(extra_env or {})},
        celery_args=celery_args,
        wait=False,
    )
    if wait:
        try:
            wait_ready(w, port)
        except (AssertionError, TimeoutError):
            w.stop()  # never leave a late node behind to serve a later test's queue
            raise
    return w, port


def wait_ready(w: WorkerProc, port: int, timeout: float = NODE_START_S) -> None:
    def ready() -> bool:
        if w.proc.poll() is not None:
            raise AssertionError(f"worker exited: {w.log.read_text()[-3000:]}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, timeout, f"/readyz of {w.name} on port {port}", interval=0.1)


Samples = list[tuple[str, dict[str, str], float]]


def scrape(port: int) -> Samples:
    """Every sample of a node's ``/metrics``: (name, labels, value)."""
    resp = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert resp.status_code == 200, resp.text
    return [
        (s.name, dict(s.labels), float(s.value))
        for fam in text_string_to_metric_families(resp.text)
        for s in fam.samples
    ]


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(
        v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())
    )


def series(samples: Samples, name: str, **labels: str) -> list[dict[str, str]]:
    return [
        lab
        for n, lab, _ in samples
        if n == name and all(lab.get(k) == x for k, x in labels.items())
    ]
