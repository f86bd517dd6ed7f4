"""Prometheus metrics of a worker node, and the hooks the attempt path calls.

Series (prefix ``pipeline_``; labels ``queue_id``, ``queue_name``, ``pool_name`` as in the
reference's ``async_*`` series — see the README's table):

*Counted where they happen, per node* (Prometheus sums over nodes):
``request_total`` (a request's first attempt), ``request_retries_total`` (each scheduled
backoff retry), ``successful_requests_total``, ``failed_requests_total`` (fatal HTTP 4xx,
``INFERENCE_ERROR``, ``GATE_DROPPED``), ``exceeded_deadline_requests_total`` (every deadline
path: expired while waiting, or retries exhausted by the deadline), ``shedded_requests_total``
(each 429 answer), ``gate_decisions_total{reason}`` (an attempt refused, parked or dropped by
its gate; reasons ``gate_closed``, ``quota_exhausted``, ``dropped``, ``error``, all initialised
to 0), ``lease_reclaims_total{kind}`` (``attempt``: an attempt whose lease expired was requeued;
``gate``: an expired gate reservation was freed), the histograms
``inference_latency_time_millis`` (each HTTP call, ms) and ``queue_residence_time_millis``
(submission → first attempt start, ms), and the gauge ``inflight_requests`` (HTTP calls in
progress on this node).

*Read at scrape time* (from Redis: the same cluster-wide value on every node, so aggregate
with ``max``, not ``sum``): ``queue_depth{state=pending|retry_wait|running}``,
``gate_in_flight`` / ``gate_limit`` (per gate, label ``gate_type``; pool gates have empty queue
labels), ``queue_wedged`` (1 while the wedge detector flags the queue), ``redis_up``. *From
this node's dispatcher*: ``dispatch_budget`` (the queue gate's budget at scrape time, 0..1),
``pool_worker_limit{pool_name}`` and ``gate_metric_value`` / ``_threshold`` /
``_source_available`` (metric gates, label ``inference_pool``).

Prefork: attempts run in pool children, whose in-memory counters the main process (which
serves ``/metrics``) cannot see. A worker node therefore runs prometheus_client's
*multiprocess mode*: :func:`setup_node` (from ``celeryd_init``, before the pool forks) points
``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory of its own, every process of the node writes
its values to memory-mapped files there, and the scrape sums them (counters of children that
exited keep counting; the in-flight gauge drops dead processes). The same mode is used under
the threads pool, where everything happens in the main process anyway.
"""

from __future__ import annotations

import atexit
import contextvars
import glob
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import values as prom_values
from prometheus_client.core import GaugeMetricFamily, Metric

from . import tracing

if TYPE_CHECKING:  # imported lazily: pipeline.store imports this module
    from .config import QueueConfig, Settings
    from .gates import Decision, Gate
    from .inference import Outcome
    from .worker import Attempt, Report

log = logging.getLogger("pipeline.metrics")

PREFIX = "pipeline_"
LABELS = ("queue_id", "queue_name", "pool_name")
GATE_REASONS = ("gate_closed", "quota_exhausted", "dropped", "error")
# ms; the reference's ranges: 10 ms … 120 s and 0.5 s … 24 h
LATENCY_BUCKETS_MS = (10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000,
                      120_000)  # fmt: skip
RESIDENCE_BUCKETS_MS = (500, 1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 300_000, 900_000,
                        1_800_000, 3_600_000, 7_200_000, 21_600_000, 43_200_000,
                        86_400_000)  # fmt: skip
DEFAULT_PORT = 9808
DEFAULT_HOST = "127.0.0.1"
GATE_EVENTS = {  # Flower task events, by gate verdict
    "refuse": "task-gate-refused",
    "wait": "task-gate-waiting",
    "drop": "task-gate-dropped",
}


def queue_labels(q: QueueConfig) -> tuple[str, str, str]:
    """(queue_id, queue_name, pool_name) of a queue."""
    return (q.queue_id, q.queue_name, q.worker_pool_id)


class _Series:
    """The node's counters, histograms and gauges (created on first use)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, LABELS + extra, registry=registry)

        self.requests = counter("request_total", "Requests started (first attempt only).")
        self.retries = counter("request_retries_total", "Backoff retries scheduled.")
        self.successes = counter("successful_requests_total", "Requests ended with HTTP < 400.")
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
        self._initialised: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()

    def init_queue(self, labels: tuple[str, str, str]) -> None:
        """Create a queue's series at 0 (so rates exist before the first event)."""
        if labels in self._initialised:
            return
        with self._lock:
            if labels in self._initialised:
                return
            for c in (self.requests, self.retries, self.successes, self.failures,
                      self.deadlines, self.shed):  # fmt: skip
                c.labels(*labels)
            for reason in GATE_REASONS:
                self.gate_decisions.labels(*labels, reason)
            for kind in ("attempt", "gate"):
                self.reclaims.labels(*labels, kind)
            self.inflight.labels(*labels)
            self._initialised.add(labels)


_registry = CollectorRegistry(auto_describe=True)
_series: _Series | None = None
_series_lock = threading.Lock()
_multiproc_dir: str | None = None


def series() -> _Series:
    global _series
    if _series is None:
        with _series_lock:
            if _series is None:
                _series = _Series(_registry)
    return _series


def _count(metric: Counter, q: QueueConfig, *extra: str, n: float = 1.0) -> None:
    labels = queue_labels(q)
    series().init_queue(labels)
    metric.labels(*labels, *extra).inc(n)


# -- node setup -------------------------------------------------------------------------
def port_from_env(env: dict[str, str] | None = None) -> int:
    """``PIPELINE_METRICS_PORT`` (default 9808; 0 = no metrics server)."""
    raw = (env if env is not None else os.environ).get("PIPELINE_METRICS_PORT", "")
    try:
        return int(raw) if raw.strip() else DEFAULT_PORT
    except ValueError:
        log.warning("PIPELINE_METRICS_PORT=%r is not a port; using %d", raw, DEFAULT_PORT)
        return DEFAULT_PORT


def setup_node(node: str | None = None) -> str | None:
    """Switch this (worker main) process to multiprocess mode before the pool forks.

    Uses ``PROMETHEUS_MULTIPROC_DIR`` when set (it must be emptied between runs), else a
    fresh temporary directory removed at exit. Returns the directory, or None when metrics
    are off (``PIPELINE_METRICS_PORT=0``) or values were already recorded in memory."""
    global _multiproc_dir
    if port_from_env() == 0:
        return None
    if _multiproc_dir is not None:
        return _multiproc_dir
    if _series is not None and _series._initialised:
        log.warning("metrics already recorded in memory: not switching to multiprocess mode")
        return None
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", node or "node")[:64]
        path = tempfile.mkdtemp(prefix=f"pipeline-metrics-{safe}-")
        owner = os.getpid()

        def _cleanup() -> None:
            if os.getpid() == owner:
                shutil.rmtree(path, ignore_errors=True)

        atexit.register(_cleanup)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    os.makedirs(path, exist_ok=True)
    prom_values.ValueClass = prom_values.get_value_class()
    _multiproc_dir = path
    _connect_child_exit()
    return path


def _connect_child_exit() -> None:
    try:
        from celery.signals import worker_process_shutdown
    except ImportError:  # pragma: no cover - celery is a dependency
        return
    worker_process_shutdown.connect(_on_child_exit, weak=False)


def _on_child_exit(pid: int | None = None, **_: Any) -> None:
    """A pool child exits: drop its live gauges, flush its spans."""
    tracing.shutdown()
    if _multiproc_dir is not None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid or os.getpid(), _multiproc_dir)


def _prune_dead(path: str) -> None:
    """Forget live gauges of processes that died without saying so (SIGKILL)."""
    from prometheus_client import multiprocess

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


# -- hooks on the attempt path -------------------------------------------------------------
@dataclass
class _AttemptObs:
    outcome: Outcome | None = None
    http_calls: int = 0


_current: contextvars.ContextVar[_AttemptObs | None] = contextvars.ContextVar(
    "pipeline_attempt_obs", default=None
)


def attempt_started(attempt: Attempt, send_event: Callable[..., Any] | None = None) -> None:
    """After the gate was asked in ``before_start``: count a request's first attempt (and its
    queue residence), count a refusal / wait / drop by reason and tell Flower about it as a
    ``task-gate-refused`` / ``task-gate-waiting`` / ``task-gate-dropped`` task event."""
    q = attempt.queue
    s = series()
    try:
        if attempt.record.get("dispatches") == "1":
            _count(s.requests, q)
            started = float(attempt.record.get("started_at") or time.time())
            submitted = float(attempt.record.get("submitted_at") or started)
            s.residence.labels(*queue_labels(q)).observe(max(0.0, started - submitted) * 1000)
        decision = attempt.decision
        if decision is not None and not decision.admitted and not attempt.parks_on(decision):
            # a refusal the attempt parks through counts only if the park ends refused
            gate_decision(attempt, decision, send_event)
    except Exception as exc:  # noqa: BLE001 - observability never breaks an attempt
        log.warning("metrics for %s failed: %s", attempt.id, exc)


def gate_reason(decision: Decision) -> str:
    if decision.verdict.value == "drop":
        return "dropped"
    return decision.reason if decision.reason in GATE_REASONS else "gate_closed"


def gate_decision(
    attempt: Attempt, decision: Decision, send_event: Callable[..., Any] | None = None
) -> None:
    reason = gate_reason(decision)
    _count(series().gate_decisions, attempt.queue, reason)
    event = GATE_EVENTS.get(decision.verdict.value)
    if send_event is None or event is None:
        return
    try:
        send_event(
            event,
            request_id=attempt.id,
            queue=attempt.queue.queue_name,
            reason=decision.reason or reason,
            attempt=attempt.token,
            gate=attempt.queue.gate_type,
        )
    except Exception as exc:  # noqa: BLE001 - a lost monitoring event is only logged
        log.warning("could not send %s for %s: %s", event, attempt.id, exc)


def observed_run(attempt: Attempt) -> Report:
    """``attempt.run()`` inside its ``process-request`` span, then count its outcome."""
    obs = _AttemptObs()
    token = _current.set(obs)
    q = attempt.queue
    try:
        with tracing.attempt_span(
            attempt.id,
            q.queue_id,
            q.queue_name,
            int(attempt.record.get("attempts") or 0),
            attempt.metadata,
        ) as span:
            report = attempt.run()
            _annotate(span, attempt, report, obs)
    finally:
        _current.reset(token)
    try:
        record_report(attempt, report)
    except Exception as exc:  # noqa: BLE001 - observability never breaks an attempt
        log.warning("metrics for %s failed: %s", attempt.id, exc)
    return report


def _is_deadline(result: dict[str, Any]) -> bool:
    """A terminal result reached through the deadline: DEADLINE_EXCEEDED, or the last 429/5xx
    answer kept when no retry fitted (those codes are otherwise always retried)."""
    if result.get("error_code") == "DEADLINE_EXCEEDED":
        return True
    code = result.get("status_code")
    return not result.get("error_code") and isinstance(code, int) and (code == 429 or code >= 500)


def record_report(attempt: Attempt, report: Report) -> None:
    """Count one attempt's outcome (success / failure / deadline / retry)."""
    from .worker import Status

    s = series()
    q = attempt.queue
    if report.status is Status.SUCCESS:
        _count(s.successes, q)
    elif report.status is Status.FAILED:
        dropped = attempt.decision is not None and attempt.decision.verdict.value == "drop"
        if not dropped and _is_deadline(report.result or {}):
            _count(s.deadlines, q)
        else:
            _count(s.failures, q)
    elif report.status is Status.RETRY:
        _count(s.retries, q)


def _annotate(
    span: tracing.AttemptSpan, attempt: Attempt, report: Report, obs: _AttemptObs
) -> None:
    if span.span is None:
        return
    from .worker import Status

    result = report.result or {}
    category = ""
    if obs.outcome is not None and obs.outcome.kind.value != "success":
        category = obs.outcome.category
    elif result.get("error_code"):
        category = str(result["error_code"])
    elif report.status is Status.REQUEUED and attempt.decision is not None:
        category = f"GATE_{attempt.decision.verdict.name}"
    if category:
        span.set("error.category", category)
    span.set("pipeline.outcome", report.status.value)
    if result.get("status_code") is not None:
        span.set("http.response.status_code", result["status_code"])
    if report.status is Status.FAILED:
        span.fail(str(result.get("error_code") or f"HTTP {result.get('status_code')}"))


def observed_send(
    attempt: Attempt,
    send: Callable[[str, str, dict[str, str], float], Outcome],
    url: str,
    body: str,
    headers: dict[str, str],
    timeout_s: float,
) -> Outcome:
    """``send(url, body, headers, timeout_s)`` counted (in flight, latency in ms, 429s) and
    traced (an ``http-request`` span whose context goes out in ``traceparent``)."""
    labels = queue_labels(attempt.queue)
    s = series()
    s.init_queue(labels)
    inflight = s.inflight.labels(*labels)
    inflight.inc()
    start = time.perf_counter()
    try:
        with tracing.http_span(url, headers) as span:
            outcome = send(url, body, headers, timeout_s)
            span.set("http.response.status_code", outcome.status_code)
            if outcome.kind.value != "success":
                span.set("error.type", outcome.category or "error")
    finally:
        inflight.dec()
        s.latency.labels(*labels).observe((time.perf_counter() - start) * 1000)
    if outcome.status_code == 429:
        s.shed.labels(*labels).inc()
    obs = _current.get()
    if obs is not None:
        obs.outcome = outcome
        obs.http_calls += 1
    return outcome


# -- hooks in the dispatcher (worker main process) -------------------------------------------
_budgets: dict[str, tuple[QueueConfig, Gate]] = {}


def dispatch_budget(q: QueueConfig, gate: Gate) -> None:
    """Record that this node dispatches queue ``q`` through ``gate`` (its budget is read at
    scrape time)."""
    _budgets[q.queue_name] = (q, gate)


def deadline_expired(q: QueueConfig, n: int) -> None:
    """``n`` waiting requests of ``q`` reached their deadline (DEADLINE_EXCEEDED results)."""
    if n > 0:
        _count(series().deadlines, q, n=n)


def lease_reclaimed(q: QueueConfig, kind: str, n: int = 1) -> None:
    """The reaper reclaimed ``n`` expired leases of ``kind`` ``attempt`` or ``gate``."""
    if n > 0:
        _count(series().reclaims, q, kind, n=n)


# -- scrape-time collectors --------------------------------------------------------------
def _metric_gates(gate: Gate) -> Iterator[Gate]:
    """``gate`` and the gates inside it that expose metric readings."""
    if hasattr(gate, "source_available"):
        yield gate
    for inner in getattr(gate, "gates", None) or []:
        yield from _metric_gates(inner)
    inner = getattr(gate, "inner", None)
    if inner is not None:
        yield from _metric_gates(inner)


class ClusterCollector:
    """Series read from Redis (and this node's dispatcher) when ``/metrics`` is scraped."""

    def __init__(self, settings: Settings, dispatcher: Any = None) -> None:
        from .gates import GateEnv
        from .gating import pool_gate, queue_gate
        from .store import Store

        self.settings = settings
        self.dispatcher = dispatcher
        self.store = Store(settings)
        env = GateEnv(self.store.client, settings.keys, node="metrics")
        self.gates: list[tuple[tuple[str, str, str], Gate]] = [
            (queue_labels(q), queue_gate(settings, q.queue_name, env))
            for q in settings.queues.values()
        ]
        for pool in sorted(settings.pools()):
            pg = pool_gate(settings, pool, env)
            if pg is not None:
                self.gates.append((("", "", pool), pg))

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        yield from self._redis()
        yield from self._dispatcher()

    def _redis(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(PREFIX + "redis_up", "1 when Redis answered this scrape.")
        k = self.settings.keys
        names = list(self.settings.queues)
        try:
            with self.store.client.pipeline(transaction=False) as p:
                for name in names:
                    p.zcard(k.pending(name))
                    p.zcard(k.delayed(name))
                    p.zcard(k.active(name))
                p.hgetall(k.wedged())
                *counts, wedged = p.execute()
            gates = [(labels, g, g.in_flight(), g.capacity()) for labels, g in self.gates]
        except Exception as exc:  # noqa: BLE001 - a scrape reports Redis down, it never fails
            log.warning("metrics: cannot read Redis: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        depth = GaugeMetricFamily(
            PREFIX + "queue_depth",
            "Requests waiting (pending, retry_wait) or dispatched/running, cluster-wide.",
            labels=[*LABELS, "state"],
        )
        wedge = GaugeMetricFamily(
            PREFIX + "queue_wedged", "1 while the wedge detector flags the queue.", labels=LABELS
        )
        for i, name in enumerate(names):
            labels = list(queue_labels(self.settings.queues[name]))
            for j, state in enumerate(("pending", "retry_wait", "running")):
                depth.add_metric([*labels, state], counts[3 * i + j])
            wedge.add_metric(labels, 1 if name in wedged else 0)
        inflight = GaugeMetricFamily(
            PREFIX + "gate_in_flight",
            "Reservations a gate holds now, cluster-wide.",
            labels=[*LABELS, "gate_type"],
        )
        limit = GaugeMetricFamily(
            PREFIX + "gate_limit",
            "Most reservations a gate grants at once (per node for local gates).",
            labels=[*LABELS, "gate_type"],
        )
        for labels3, g, n, cap in gates:
            labels = [*labels3, g.type_name]
            inflight.add_metric(labels, n)
            if cap is not None:
                limit.add_metric(labels, cap)
        yield from (depth, wedge, inflight, limit)

    def _dispatcher(self) -> Iterator[Metric]:
        budget = GaugeMetricFamily(
            PREFIX + "dispatch_budget",
            "The queue gate's budget (0..1) at this node's last dispatch tick.",
            labels=LABELS,
        )
        value = GaugeMetricFamily(
            PREFIX + "gate_metric_value",
            "A metric gate's last reading (budget space: 1 idle, lower busier).",
            labels=[*LABELS, "inference_pool"],
        )
        threshold = GaugeMetricFamily(
            PREFIX + "gate_metric_threshold",
            "The reading at or below which the metric gate is closed.",
            labels=[*LABELS, "inference_pool"],
        )
        available = GaugeMetricFamily(
            PREFIX + "gate_metric_source_available",
            "1 when the metric gate's last reading succeeded (0: fallback used).",
            labels=[*LABELS, "inference_pool"],
        )
        for q, gate in list(_budgets.values()):
            labels = list(queue_labels(q))
            budget.add_metric(labels, gate.budget())
            for mg in _metric_gates(gate):
                if getattr(mg, "threshold", None) is None:
                    continue
                pool = str(getattr(mg, "params", {}).get("pool", "") or "")
                if getattr(mg, "last_value", None) is not None:
                    value.add_metric([*labels, pool], float(mg.last_value))  # type: ignore[attr-defined]
                threshold.add_metric([*labels, pool], float(mg.threshold))  # type: ignore[attr-defined]
                available.add_metric([*labels, pool], 1 if mg.source_available else 0)  # type: ignore[attr-defined]
        yield from (budget, value, threshold, available)
        caps = getattr(self.dispatcher, "pool_cap", None)
        if isinstance(caps, dict):
            limit = GaugeMetricFamily(
                PREFIX + "pool_worker_limit",
                "Worker slots the dispatcher fills for a pool, across its live nodes.",
                labels=["pool_name"],
            )
            for pool, cap in sorted(caps.items()):
                limit.add_metric([pool], cap)
            yield limit


class _MultiProcessCollector:
    """The values every process of this node wrote (multiprocess mode)."""

    def __init__(self, path: str) -> None:
        from prometheus_client import multiprocess

        self.path = path
        self.inner = multiprocess.MultiProcessCollector(None, path=path)

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        _prune_dead(self.path)
        return self.inner.collect()


class _ProcessCollector:
    """This process's in-memory series (single-process mode)."""

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        return _registry.collect()


def scrape_registry(settings: Settings, dispatcher: Any = None) -> CollectorRegistry:
    """A registry serving this node's series: the multiprocess files when
    :func:`setup_node` switched to that mode, else this process's memory; plus the
    scrape-time collector. Every configured queue's series start at 0."""
    for q in settings.queues.values():
        series().init_queue(queue_labels(q))
    reg = CollectorRegistry(auto_describe=False)
    if _multiproc_dir is not None:
        reg.register(_MultiProcessCollector(_multiproc_dir))
    else:
        reg.register(_ProcessCollector())
    reg.register(ClusterCollector(settings, dispatcher))
    return reg
