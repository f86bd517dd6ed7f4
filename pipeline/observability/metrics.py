"""Prometheus metrics of a worker node: the series, the node's multiprocess setup (pool
children's counters, docs/observability.md "Prefork") and the dispatcher's hooks; the
attempt's hooks are ``pipeline.worker.observe``, scrape-time series :mod:`.collectors`."""

from __future__ import annotations

import atexit
import glob
import logging
import os
import re
import shutil
import tempfile
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from prometheus_client import values as prom_values

from ..config import QueueConfig
from . import tracing

log = logging.getLogger("pipeline.metrics")

PREFIX = "pipeline_"
LABELS = ("queue_id", "queue_name", "pool_name")
GATE_REASONS = ("gate_closed", "quota_exhausted", "dropped", "error")
TOKEN_DIRECTIONS = ("input", "output")
# ms; the reference's ranges: 10 ms … 120 s and 0.5 s … 24 h
LATENCY_BUCKETS_MS = (10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000,
                      120_000)  # fmt: skip
RESIDENCE_BUCKETS_MS = (500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 300_000, 900_000,
                        1_800_000, 3_600_000, 7_200_000, 21_600_000, 43_200_000,
                        86_400_000)  # fmt: skip
# ms of time left before the deadline; the reference's bounds (0 = already expired)
PROXIMITY_BUCKETS_MS = (0, 1_000, 5_000, 15_000, 30_000, 60_000, 120_000, 300_000, 600_000,
                        1_800_000, 3_600_000, 7_200_000, 21_600_000, 86_400_000)  # fmt: skip
DEFAULT_PORT = 9808
DEFAULT_HOST = "127.0.0.1"
GATE_EVENTS = {  # Flower task events, by gate verdict
    "refuse": "task-gate-refused",
    "wait": "task-gate-waiting",
    "drop": "task-gate-dropped",
}


def queue_labels(q: QueueConfig) -> tuple[str, str, str]:
    return (q.queue_id, q.queue_name, q.worker_pool_id)


class _Series:
    """The node's counters, histograms and gauges (created on first use)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, LABELS + extra, registry=registry)

        self.requests = counter("request_total", "Requests started (first attempt only).")
        self.dispatched = counter(
            "dispatched_requests_total", "HTTP attempts sent to the model server (retries too)."
        )
        self.retries = counter("request_retries_total", "Backoff retries scheduled.")
        self.successes = counter("successful_requests_total", "Requests ended with HTTP 2xx.")
        self.failures = counter(
            "failed_requests_total", "Requests ended by a fatal error (4xx, inference, drop)."
        )
        self.deadlines = counter(
            "exceeded_deadline_requests_total", "Requests ended by their deadline."
        )
        self.shed = counter("shedded_requests_total", "HTTP 429 answers (load shed).")
        self.gate_decisions = counter(
            "gate_decisions_total", "Attempts refused, parked or dropped by a gate.", ("reason",)
        )
        self.reclaims = counter(
            "lease_reclaims_total", "Expired leases reclaimed by the reaper.", ("kind",)
        )
        self.lease_aborts = counter(
            "lease_lapse_aborts_total",
            "Attempts stopped because their lease could lapse (renewals not taken by Redis).",
        )
        self.tokens = counter(
            "tokens_total",
            "Tokens in the usage of 2xx answers: direction input (prompt) or output (completion).",
            ("direction",),
        )
        self.latency = Histogram(
            PREFIX + "inference_latency_time_millis",
            "Duration of each HTTP call to the model server (ms).",
            LABELS,
            buckets=LATENCY_BUCKETS_MS,
            registry=registry,
        )
        self.residence = Histogram(
            PREFIX + "queue_residence_time_millis",
            "Time from submission to the first attempt's start (ms).",
            LABELS,
            buckets=RESIDENCE_BUCKETS_MS,
            registry=registry,
        )
        self.inflight = Gauge(
            PREFIX + "inflight_requests",
            "HTTP calls in progress on this node.",
            LABELS,
            registry=registry,
            multiprocess_mode="livesum",
        )
        # the reference's queue-config reload series (no queue labels)
        self.config_reloads = Counter(
            PREFIX + "queue_config_reloads_total",
            "Queue and pool config reloads by result (success, error); an unchanged file "
            "counts as neither.",
            ("result",),
            registry=registry,
        )
        self.config_success = Gauge(
            PREFIX + "queue_config_last_success_timestamp_seconds",
            "Unix time the node last applied its queue config (at start, or a reload).",
            registry=registry,
            multiprocess_mode="max",
        )
        # the store epoch (docs/production.md, "A wiped Redis"; no queue labels)
        self.state_lost = Counter(
            PREFIX + "store_state_lost_total",
            "Times this node found the Redis store epoch gone or changed: Redis lost its "
            "state (restarted without persistence, flushed) and the requests accepted before.",
            registry=registry,
        )
        self.state_lost_at = Gauge(
            PREFIX + "store_state_lost_timestamp_seconds",
            "Unix time (Redis server clock) the latest loss of the Redis state was noticed.",
            registry=registry,
            multiprocess_mode="max",
        )
        self._initialised: set[tuple[str, str, str]] = set()

    def init_queue(self, labels: tuple[str, str, str]) -> None:
        """Create a queue's series at 0 (so rates exist before the first event). Idempotent:
        two threads that both do it create the same children."""
        if labels in self._initialised:
            return
        for c in (self.requests, self.dispatched, self.retries, self.successes, self.failures,
                  self.deadlines, self.shed, self.lease_aborts):  # fmt: skip
            c.labels(*labels)
        for reason in GATE_REASONS:
            self.gate_decisions.labels(*labels, reason)
        for kind in ("attempt", "gate"):
            self.reclaims.labels(*labels, kind)
        for direction in TOKEN_DIRECTIONS:
            self.tokens.labels(*labels, direction)
        self.inflight.labels(*labels)
        self._initialised.add(labels)


registry = CollectorRegistry(auto_describe=True)  # this process's series (single-process mode)
_series: _Series | None = None
_series_lock = threading.Lock()
multiproc_dir: str | None = None  # the directory of multiprocess mode (setup_node), or None


def series() -> _Series:
    global _series
    if _series is None:
        with _series_lock:
            if _series is None:
                _series = _Series(registry)
    return _series


def count(metric: Counter, q: QueueConfig, *extra: str, n: float = 1.0) -> None:
    labels = queue_labels(q)
    series().init_queue(labels)
    metric.labels(*labels, *extra).inc(n)


# -- node setup -------------------------------------------------------------------------
def port_from_env() -> int:
    """``PIPELINE_METRICS_PORT`` (default 9808; 0 = no metrics server)."""
    raw = os.environ.get("PIPELINE_METRICS_PORT", "")
    try:
        return int(raw) if raw.strip() else DEFAULT_PORT
    except ValueError:
        log.warning("PIPELINE_METRICS_PORT=%r is not a port; using %d", raw, DEFAULT_PORT)
        return DEFAULT_PORT


def private_dir(prefix: str) -> str:
    """A fresh temporary directory, removed at exit by the process that made it (never by a
    forked child)."""
    path = tempfile.mkdtemp(prefix=prefix)
    owner = os.getpid()

    def cleanup() -> None:
        if os.getpid() == owner:
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(cleanup)
    return path


def setup_node(node: str | None = None) -> str | None:
    """Switch this (worker main) process to multiprocess mode before the pool forks; the
    directory, or None when metrics are off or values were already recorded in memory."""
    global multiproc_dir
    if port_from_env() == 0:
        return None
    if multiproc_dir is not None:
        return multiproc_dir
    if _series is not None and _series._initialised:
        log.warning("metrics already recorded in memory: not switching to multiprocess mode")
        return None
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", node or "node")[:64]
        path = os.environ["PROMETHEUS_MULTIPROC_DIR"] = private_dir(f"pipeline-metrics-{safe}-")
    os.makedirs(path, exist_ok=True)
    prom_values.ValueClass = prom_values.get_value_class()
    multiproc_dir = path
    from celery.signals import worker_process_shutdown

    worker_process_shutdown.connect(_on_child_exit, weak=False)
    return path


def _on_child_exit(pid: int | None = None, **_: Any) -> None:
    """A pool child exits: drop its live gauges, flush its spans."""
    tracing.shutdown()
    if multiproc_dir is not None:
        multiprocess.mark_process_dead(pid or os.getpid(), multiproc_dir)


def prune_dead(path: str) -> None:
    """Forget live gauges of processes that died without saying so (SIGKILL)."""
    for f in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        m = re.search(r"_(\d+)\.db$", f)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            multiprocess.mark_process_dead(pid, path)
        except PermissionError:
            pass


# -- hooks in the dispatcher (worker main process) -------------------------------------------
def deadline_expired(q: QueueConfig, n: int) -> None:
    """``n`` waiting requests of ``q`` reached their deadline (DEADLINE_EXCEEDED results)."""
    if n > 0:
        count(series().deadlines, q, n=n)


def config_applied(at: float, reload: bool) -> None:
    """The node applied its queue config at Unix time ``at``: at start (``reload`` False:
    the counters start at 0) or by a reload (counted as a success)."""
    s = series()
    for result in ("success", "error"):
        s.config_reloads.labels(result)
    if reload:
        s.config_reloads.labels("success").inc()
    s.config_success.set(at)


def state_lost(noticed_at: float | None) -> None:
    """The node found its Redis's store epoch gone or changed (noticed at Unix ``noticed_at``
    by the server's clock, when the epoch says)."""
    s = series()
    s.state_lost.inc()
    if noticed_at is not None:
        s.state_lost_at.set(noticed_at)
