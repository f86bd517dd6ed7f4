"""``endpoint-scrape``: the budget from a model server's own ``/metrics`` text; with
``admission: counted``, at most floor(headroom) admissions per reading (docs/gates.md)."""

from __future__ import annotations

import math
import threading
from typing import Any

from prometheus_client.parser import text_string_to_metric_families as text_to_families

from ..redact import redact_url
from .base import CONTINUE, AcquireContext, Decision, GateEnv, Verdict
from .metric import MetricGate, MetricUnavailable, finite
from .params import Params


def first_sample(text: str, metric: str, labels: dict[str, str]) -> float | None:
    """The value of the first sample of ``metric`` whose labels include ``labels`` (None: no
    such sample; a line prometheus_client cannot parse is skipped)."""
    for line in text.splitlines():
        if not line.strip().startswith(metric):  # a comment starts with '#'
            continue
        try:
            samples = [s for family in text_to_families(line) for s in family.samples]
        except ValueError:
            continue
        for sample in samples:
            if sample.name == metric and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


class EndpointScrapeGate(MetricGate):
    type_name = "endpoint-scrape"

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        p = self.p
        self.url = _http_url(p.get_str("url", required=True), p, "url")
        self.metric = p.get_str("metric", required=True)
        self.labels = p.get_str_map("labels")
        self.max_count_per_pod = p.get_float("max_count_per_pod", 0.0, lo=0.0)
        self.baseline = p.get_float("baseline", 0.0, lo=0.0, hi=1.0, hi_open=True)
        fallback = p.get_float("fallback", 1.0, lo=0.0, hi=1.0)
        pods_url, pods_metric = p.opt_str("pods_url"), p.opt_str("pods_metric")
        if (pods_url is None) != (pods_metric is None):
            missing = "pods_metric" if pods_metric is None else "pods_url"
            raise p.error(missing, "is required when the other of pods_url/pods_metric is set")
        if pods_url is not None and self.max_count_per_pod <= 0:
            raise p.error("max_count_per_pod", "must be > 0 when pods_url counts pods")
        self.pods_url = _http_url(pods_url, p, "pods_url") if pods_url else None
        self.pods_metric = pods_metric
        self.pods_labels = p.get_str_map("pods_labels")
        self.pods: float | None = None
        self.absent_value = p.get_float("absent_value") if p.has("absent_value") else None
        self.admission = p.get_choice("admission", ("budget", "counted"), "budget")
        # what the normalised value is: a saturation (budget = 1 - it) or a budget already
        self.value_type = p.get_choice("value_type", ("saturation", "budget"), "saturation")
        if self.admission == "counted":
            if self.value_type != "saturation":
                raise p.error("value_type", "must be 'saturation' with admission 'counted'")
            if self.max_count_per_pod <= 0:
                raise p.error("max_count_per_pod", "must be > 0 with admission 'counted'")
            if self.baseline != 0:
                raise p.error("baseline", "must be 0 with admission 'counted'")
            if p.has("fallback"):
                raise p.error("fallback", "is not used with admission 'counted' (a failed "
                              "reading admits nothing)")  # fmt: skip
        self.closing_threshold = self.baseline  # 0 when counted
        self.fallback_budget = max(0.0, 1.0 - fallback - self.baseline)  # 0 when counted
        self._counted_lock = threading.Lock()
        self._counted_reading: object = None  # the reading the count below belongs to
        self._counted_admitted = 0

    def _scrape(
        self, url: str, metric: str, labels: dict[str, str], absent: float | None = None
    ) -> float:
        value = first_sample(self.get(url).text, metric, labels)
        if value is None:
            if absent is not None:
                return absent
            raise MetricUnavailable(f"{metric} {labels or ''} not found at {redact_url(url)}")
        return finite(value, metric)

    def read(self) -> float:
        value = self._scrape(self.url, self.metric, self.labels, self.absent_value)
        max_count = self.max_count_per_pod
        if self.pods_url is not None and self.pods_metric is not None:
            pods = self._scrape(self.pods_url, self.pods_metric, self.pods_labels)
            if not pods > 0:
                raise MetricUnavailable(f"ready pods is {pods:g}; cannot size capacity")
            self.pods = pods
            max_count = pods * self.max_count_per_pod
        if self.admission == "counted":
            if value < 0:
                raise MetricUnavailable(f"{self.metric} is negative ({value:g})")
            return max(0.0, max_count - value)  # headroom: admissions this reading allows
        normalised = min(1.0, max(0.0, value / max_count if max_count > 0 else value))
        return normalised if self.value_type == "budget" else 1.0 - normalised

    def _claim(self, take: bool) -> bool:
        """Whether the current reading allows one more admission (``take``: count it); a new
        reading starts the count again. Sets the gauges (value = headroom, threshold 0)."""
        reading = self.observed()
        if reading.value is None:
            return False
        with self._counted_lock:
            if reading is not self._counted_reading:
                self._counted_reading, self._counted_admitted = reading, 0
            if self._counted_admitted >= math.floor(reading.value):
                return False
            if take:
                self._counted_admitted += 1
            return True

    def budget(self) -> float:
        if self.admission != "counted":
            return super().budget()
        return 1.0 if self._claim(take=False) else 0.0

    def acquire(self, ctx: AcquireContext) -> Decision:
        if self.admission != "counted":
            return super().acquire(ctx)
        if self._claim(take=True):
            return CONTINUE
        return Decision(Verdict.REFUSE, reason="gate_closed")

    def describe(self) -> dict[str, Any]:
        out = {**super().describe(), "url": redact_url(self.url), "metric": self.metric}
        if self.admission == "counted":
            out["admission"] = "counted"
            out["admitted_this_reading"] = self._counted_admitted
        return out


def _http_url(url: str, p: Params, key: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise p.error(key, f"must be an http(s) URL, not {redact_url(url)!r}")
    return url
