"""What ``/metrics`` serves: the series every process of a node wrote (multiprocess mode) or
this process's, plus the series read from Redis and this node's dispatcher at scrape time."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, multiprocess
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from ..config import Settings
from ..gates import Gate, GateEnv, pool_gate, queue_gate
from ..gates.adaptive import AdaptiveConcurrencyGate
from ..gates.base import walk
from ..gates.leased_rate import RedisLeasedRateGate
from ..gates.metric import MetricGate
from ..store import Store, primaries, shard_load
from ..store.scripts import node_client, register
from . import metrics
from .metrics import LABELS, PREFIX, PROXIMITY_BUCKETS_MS, queue_labels

log = logging.getLogger("pipeline.metrics")


class ClusterCollector:
    """Series read from Redis (and this node's dispatcher) when ``/metrics`` is scraped."""

    def __init__(self, settings: Settings, dispatchers: list[Any] | None = None) -> None:
        self.dispatchers = dispatchers or []
        self.store = Store(settings)
        self._proximity = register(self.store.client, "deadline_proximity")
        self._bind(settings)

    def _bind(self, settings: Settings) -> None:
        """Report ``settings``' queues and gates (again after a config reload)."""

        def env(pool: str) -> GateEnv:
            store = self.store.for_pool(pool)
            return GateEnv(store.client, store.keys, node="metrics")

        gates: list[tuple[tuple[str, str, str], Gate]] = []
        for q in settings.queues.values():
            metrics.series().init_queue(queue_labels(q))
            gate = queue_gate(settings, q.queue_name, env(q.worker_pool_id))
            gates.append((queue_labels(q), gate))
        for pool in sorted(settings.pools()):
            pg = pool_gate(settings, pool, env(pool))
            if pg is not None:
                gates.append((("", "", pool), pg))
        self.settings, self.gates = settings, gates

    def collect(self) -> Iterable[Metric]:
        current = getattr(next(iter(self.dispatchers), None), "settings", None)
        if isinstance(current, Settings) and current is not self.settings:
            self._bind(current)  # the node reloaded its config
        yield from self._redis()
        yield from self._shards()
        yield from self._dispatcher()
        yield from self._drain_limits()

    def _drain_limits(self) -> Iterator[Metric]:
        """The planner's lease of every ``redis-leased-rate`` gate, read from Redis now."""
        by_pool: dict[str, RedisLeasedRateGate] = {}
        for _, gate in self.gates:
            for g in walk(gate):
                if isinstance(g, RedisLeasedRateGate):
                    by_pool.setdefault(g.pool_id, g)
        if not by_pool:
            return
        rps = GaugeMetricFamily(
            PREFIX + "drain_limit_rps",
            "Admission rate leased by the planner (redis-leased-rate), req/s; 0 when invalid.",
            labels=["pool_name"],
        )
        valid = GaugeMetricFamily(
            PREFIX + "drain_limit_lease_valid",
            "1 while the planner's lease is valid (also while paused at rate 0), else 0.",
            labels=["pool_name"],
        )
        until = GaugeMetricFamily(
            PREFIX + "drain_limit_valid_until_seconds",
            "When the planner's lease ends (Unix s); 0 when invalid.",
            labels=["pool_name"],
        )
        for pool, g in sorted(by_pool.items()):
            g.budget()  # reads the lease (never raises; an error reads as invalid)
            rps.add_metric([pool], g.limit_rps)
            valid.add_metric([pool], g.lease_valid)
            until.add_metric([pool], g.valid_until_s)
        yield from (rps, valid, until)

    def _redis(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(PREFIX + "redis_up", "1 when Redis answered this scrape.")
        names = list(self.settings.queues)
        by_pool: dict[str, list[str]] = {}  # one proximity call per pool's slot on a cluster
        for name in names:
            by_pool.setdefault(self.settings.queues[name].worker_pool_id, []).append(name)
        keys = {n: self.store.for_pool(p).keys for p, ns in by_pool.items() for n in ns}
        try:
            with self.store.client.pipeline(transaction=False) as p:
                for name in names:
                    p.zcard(keys[name].pending(name))
                    p.zcard(keys[name].delayed(name))
                    p.zcard(keys[name].active(name))
                for name in names:
                    p.hexists(keys[name].wedged(), name)
                replies = p.execute()
            counts, wedged = replies[: 3 * len(names)], replies[3 * len(names) :]
            proximity = [
                count
                for ns in by_pool.values()
                for count in self._proximity(
                    keys=[keys[n].expiry(n) for n in ns], args=list(PROXIMITY_BUCKETS_MS)
                )
            ]
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
            wedge.add_metric(labels, 1 if wedged[i] else 0)
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
        yield from self._adaptive()
        ordered = [n for ns in by_pool.values() for n in ns]  # as proximity reads them
        yield self._proximity_histogram(ordered, [int(c) for c in proximity])

    def _adaptive(self) -> Iterator[Metric]:
        """Each adaptive-concurrency gate's limit, labelled with the signal it follows and the
        code of why it last moved, and when it last moved (read from Redis now)."""
        found = [
            (labels3, g)
            for labels3, gate in self.gates
            for g in walk(gate)
            if isinstance(g, AdaptiveConcurrencyGate)
        ]
        if not found:
            return
        limit = GaugeMetricFamily(
            PREFIX + "gate_adaptive_limit",
            "An adaptive gate's current limit, with the signal it acts on and why it last moved.",
            labels=[*LABELS, "signal", "reason"],
        )
        moved = GaugeMetricFamily(
            PREFIX + "gate_adaptive_moved_seconds",
            "When an adaptive gate's limit last moved (Unix s); 0 before its first move.",
            labels=LABELS,
        )
        windows = CounterMetricFamily(
            PREFIX + "gate_adaptive_windows",
            "Windows an adaptive gate's controller closed (each one a decision).",
            labels=LABELS,
        )
        for labels3, g in found:
            try:
                view = g.controller_view()
            except Exception as exc:  # noqa: BLE001 - a scrape reports what it can read
                log.warning("metrics: adaptive gate %s: %s", g.name, exc)
                continue
            labels = list(labels3)
            limit.add_metric([*labels, view["signal"], view["reason_code"]], view["limit"])
            moved.add_metric(labels, view["moved_at"] or 0.0)
            windows.add_metric(labels, view["windows"])
        yield from (limit, moved, windows)

    def _proximity_histogram(self, names: list[str], counts: list[int]) -> Metric:
        """A snapshot per queue (docs/observability.md); ``_sum`` from bucket midpoints, those
        beyond the last bound at that bound."""
        hist = HistogramMetricFamily(
            PREFIX + "deadline_proximity_millis",
            "Waiting requests by time left before their deadline (ms), read from Redis now.",
            labels=LABELS,
        )
        width = len(PROXIMITY_BUCKETS_MS) + 1
        for i, name in enumerate(names):
            row = counts[width * i : width * (i + 1)]
            cumulative, total = row[:-1], row[-1]
            buckets = [
                (floatToGoString(b), c)
                for b, c in zip(PROXIMITY_BUCKETS_MS, cumulative, strict=True)
            ]
            buckets.append(("+Inf", total))
            estimate, previous, lo = 0.0, cumulative[0], 0.0
            for bound, c in zip(PROXIMITY_BUCKETS_MS[1:], cumulative[1:], strict=True):
                estimate += (c - previous) * (lo + bound) / 2
                previous, lo = c, float(bound)
            estimate += (total - previous) * lo
            hist.add_metric(list(queue_labels(self.settings.queues[name])), buckets, estimate)
        return hist

    def _shards(self) -> Iterator[Metric]:
        """Each Redis server holding the pipeline's keys (every primary of a Redis Cluster):
        its pools, ops/s, script time and memory, so a hot shard shows."""
        client = self.store.client
        owner = {
            pool: node_client(client, self.store.for_pool(pool).keys.wake(pool))
            for pool in sorted(self.settings.pools())
        }
        held = GaugeMetricFamily(
            PREFIX + "redis_shard_pool", "1 for each pool whose keys the shard holds.",
            labels=["shard", "pool_name"],
        )  # fmt: skip
        ops = GaugeMetricFamily(
            PREFIX + "redis_shard_ops_per_second", "The shard's commands per second (INFO).",
            labels=["shard"],
        )  # fmt: skip
        script = CounterMetricFamily(
            PREFIX + "redis_shard_script_seconds", "Time the shard spent in scripts.",
            labels=["shard"],
        )  # fmt: skip
        memory = GaugeMetricFamily(
            PREFIX + "redis_shard_memory_bytes", "The shard's used memory.", labels=["shard"]
        )
        for name, node in primaries(client):
            try:
                load = shard_load(node)
            except Exception as exc:  # noqa: BLE001 - a scrape reports what it can read
                log.warning("metrics: cannot read Redis %s: %s", name, exc)
                continue
            for pool, pool_node in owner.items():
                if pool_node is node:
                    held.add_metric([name, pool], 1)
            if load.ops_per_sec is not None:
                ops.add_metric([name], load.ops_per_sec)
            if load.script_seconds is not None:
                script.add_metric([name], load.script_seconds)
            if load.used_memory is not None:
                memory.add_metric([name], load.used_memory)
        yield from (held, ops, script, memory)

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
        # the gates this node dispatches through
        gates: dict[str, Gate] = {n: g for d in self.dispatchers for n, g in d.gates.items()}
        for name, gate in list(gates.items()):
            if (q := self.settings.queues.get(name)) is None:
                continue  # a reload is binding the dispatcher's new settings
            labels = list(queue_labels(q))
            budget.add_metric(labels, gate.budget())
            for mg in walk(gate):
                if not isinstance(mg, MetricGate) or mg.threshold is None:
                    continue
                pool = str(mg.params.get("pool", "") or "")
                if mg.last_value is not None:
                    value.add_metric([*labels, pool], mg.last_value)
                threshold.add_metric([*labels, pool], mg.threshold)
                available.add_metric([*labels, pool], 1 if mg.source_available else 0)
        yield from (budget, value, threshold, available)
        caps = {p: c for d in self.dispatchers for p, c in d.pool_cap.items()}
        if self.dispatchers:
            limit = GaugeMetricFamily(
                PREFIX + "pool_worker_limit",
                "Worker slots the dispatcher fills for a pool, across its live nodes.",
                labels=["pool_name"],
            )
            for pool, cap in sorted(caps.items()):
                limit.add_metric([pool], cap)
            yield limit


class _MultiProcessCollector(multiprocess.MultiProcessCollector):
    """Every process's values, once the gauges of processes killed unannounced are dropped."""

    def __init__(self, path: str) -> None:
        super().__init__(None, path=path)
        self.path = path

    def collect(self) -> Iterable[Metric]:
        metrics.prune_dead(self.path)
        return super().collect()


def scrape_registry(settings: Settings, dispatchers: list[Any] | None = None) -> CollectorRegistry:
    """This node's series (the multiprocess files, or this process's memory) and the
    scrape-time collector."""
    reg = CollectorRegistry(auto_describe=False)
    path = metrics.multiproc_dir
    reg.register(metrics.registry if path is None else _MultiProcessCollector(path))
    reg.register(ClusterCollector(settings, dispatchers))
    return reg
