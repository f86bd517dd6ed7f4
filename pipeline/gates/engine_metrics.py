"""An engine's own ``/metrics`` read for the ``adaptive-concurrency`` gate: the requests it runs
and queues, its KV-cache use, its preemptions and its queue-time and latency histograms, under
vLLM's, SGLang's and llama.cpp's names (docs/gates.md, "adaptive-concurrency")."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families as text_to_families

# sample name -> what it is; the first name of a kind found on the page is the one read
NAMES: dict[str, tuple[str, ...]] = {
    "waiting": (
        "vllm:num_requests_waiting",
        "sglang:num_queue_reqs",
        "llamacpp:requests_deferred",
    ),
    "running": (
        "vllm:num_requests_running",
        "sglang:num_running_reqs",
        "llamacpp:requests_processing",
    ),
    "kv_usage": (
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
        "llamacpp:kv_cache_usage_ratio",
    ),
    "preemptions": (
        "vllm:num_preemptions_total",
        "vllm:num_preemptions",
        "sglang:num_retracted_reqs_total",
        "sglang:num_retracted_reqs",
    ),
    "queue_sum": ("vllm:request_queue_time_seconds_sum", "sglang:queue_time_seconds_sum"),
    "queue_count": ("vllm:request_queue_time_seconds_count", "sglang:queue_time_seconds_count"),
    "e2e_sum": ("vllm:e2e_request_latency_seconds_sum", "sglang:e2e_request_latency_seconds_sum"),
    "e2e_count": (
        "vllm:e2e_request_latency_seconds_count",
        "sglang:e2e_request_latency_seconds_count",
    ),
}
_WANTED = {name: kind for kind, names in NAMES.items() for name in names}


class NoEngineMetrics(ValueError):
    """The page has none of the names the gate reads."""


@dataclass(frozen=True)
class Reading:
    """One reading of the page; each value summed over its series (several models or engines
    behind one URL), None when the page has no series of that kind."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    preemptions: float | None = None
    histograms: tuple[float, float, float, float] | None = None  # queue sum, count, e2e ...


def parse(text: str) -> Reading:
    """The reading of a ``/metrics`` page; NoEngineMetrics when it names no waiting requests
    (the one series the gate cannot do without)."""
    sums: dict[str, dict[str, float]] = {}
    lines = [ln for ln in text.splitlines() if ln.split("{", 1)[0].split(" ", 1)[0] in _WANTED]
    for family in _families("\n".join(lines) + "\n"):
        for sample in family.samples:
            kind = _WANTED.get(sample.name)
            if kind is None or not math.isfinite(sample.value):
                continue
            per = sums.setdefault(kind, {})
            per[sample.name] = per.get(sample.name, 0.0) + float(sample.value)

    def first(kind: str) -> float | None:
        found = sums.get(kind, {})
        return next((found[n] for n in NAMES[kind] if n in found), None)

    waiting = first("waiting")
    if waiting is None:
        raise NoEngineMetrics(
            "no waiting-requests series (vllm:num_requests_waiting, sglang:num_queue_reqs or "
            "llamacpp:requests_deferred)"
        )
    parts = [first(k) for k in ("queue_sum", "queue_count", "e2e_sum", "e2e_count")]
    hist = None
    if all(p is not None for p in parts):
        hist = (parts[0] or 0.0, parts[1] or 0.0, parts[2] or 0.0, parts[3] or 0.0)
    return Reading(waiting, first("running"), first("kv_usage"), first("preemptions"), hist)


def _families(text: str) -> list[Metric]:
    """The families of ``text``, a line prometheus_client cannot parse skipped."""
    try:
        return list(text_to_families(text))
    except ValueError:
        out: list[Metric] = []
        for line in text.splitlines():
            try:
                out.extend(text_to_families(line + "\n"))
            except ValueError:
                continue
        return out
