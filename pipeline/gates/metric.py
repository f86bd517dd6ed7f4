"""Gates whose budget is read from metrics: the shared machinery (a cached, fail-closed
reading) and the Prometheus gates. Formulas and params: docs/gates.md."""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlencode, urlsplit

import httptools

from ..config import redirect_origins
from ..http.call import CallTimeout, Response, request
from ..redact import redact_url
from .base import Budgeted, GateEnv, note_problem
from .params import Params

log = logging.getLogger(__name__)

DEFAULT_CACHE_TTL_S = 5.0
DEFAULT_TIMEOUT_S = 5.0
MAX_TIMEOUT_S = 10.0


class MetricUnavailable(Exception):
    pass


@dataclass(frozen=True)
class _Reading:
    at: float  # time.monotonic() of the reading
    value: float | None
    error: str | None


def finite(value: Any, what: str) -> float:
    """``value`` as a finite float, else MetricUnavailable."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise MetricUnavailable(f"{what} is {value!r}, not a number") from None
    if not math.isfinite(number):
        raise MetricUnavailable(f"{what} is {number}")
    return number


EPSILON = 1e-9  # a value this close to the threshold counts as at it (1 - 0.8 != 0.2 in floats)


class MetricGate(Budgeted):
    """Base of the metric gates: caching, fail-closed fallback, gauges, binary acquire."""

    closing_threshold: float  # D at or below which the gate is closed
    fallback_budget: float  # the budget while the metric cannot be read

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        p = self.p = Params(self.type_name, name, params)
        self.cache_ttl_s = p.get_float("cache_ttl_s", DEFAULT_CACHE_TTL_S, lo=0.0)
        self.timeout_s = p.get_float(
            "timeout_s", DEFAULT_TIMEOUT_S, lo=0.0, lo_open=True, hi=MAX_TIMEOUT_S
        )
        self.last_value: float | None = None
        self.threshold: float | None = None
        self.source_available = False
        self._lock = threading.Lock()
        self._reading: _Reading | None = None
        self.follow_redirects = (
            p.get_choice("follow_redirects", ("false", "true"), "false") == "true"
        )
        # where a followed redirect may go besides the URL's own origin (as a queue's)
        where = f"{self.type_name} gate {name!r}: param 'redirect_origins'"
        self.redirect_origins = redirect_origins(
            p.raw("redirect_origins") or (), where, self.follow_redirects
        )
        self._last_error: str | None = None

    def read(self) -> float:
        """One fresh reading of D (budget space). Raises on any failure."""
        raise NotImplementedError

    def get(self, url: str, **params: str) -> Response:
        """``GET url`` with query ``params``: a 200 response, else MetricUnavailable."""
        where = redact_url(url)
        if params:
            url += ("&" if "?" in url else "?") + urlencode(params)
        parts, headers = urlsplit(url), {}
        if parts.username is not None:  # user:password@ in the URL is HTTP basic auth
            login = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            headers["Authorization"] = "Basic " + base64.b64encode(login.encode()).decode()
        try:
            resp = request(
                "GET",
                url,
                b"",
                headers,
                self.timeout_s,
                follow_redirects=self.follow_redirects,
                redirect_origins=self.redirect_origins,
            )
        except (OSError, ValueError, CallTimeout, httptools.HttpParserError) as exc:
            error = str(exc).replace(url, redact_url(url))  # an unsupported URL names itself
            raise MetricUnavailable(f"GET {where}: {type(exc).__name__}: {error}") from None
        if resp.status != 200:
            raise MetricUnavailable(f"GET {where}: HTTP {resp.status}")
        return resp

    def budget(self) -> float:
        """min(1, D − threshold) when D is above the threshold, else 0; the fallback when D
        cannot be read."""
        value, threshold = self.observed().value, self.closing_threshold
        if value is None:
            return min(1.0, max(0.0, self.fallback_budget))
        return min(1.0, value - threshold) if value > threshold + EPSILON else 0.0

    def observed(self) -> _Reading:
        """The cached reading (a value or an error), or a new one when it is too old; its value
        and the closing threshold set as the gauges; a failure that starts or ends is logged
        once."""
        with self._lock:
            cached = self._reading
            if cached is None or time.monotonic() - cached.at >= self.cache_ttl_s:
                try:
                    cached = _Reading(time.monotonic(), self.read(), None)
                except Exception as exc:  # noqa: BLE001 - every failure is "unavailable"
                    cached = _Reading(time.monotonic(), None, str(exc) or type(exc).__name__)
                self._reading = cached
        self.threshold, self.last_value = self.closing_threshold, cached.value
        self.source_available = cached.value is not None
        error = None if cached.value is not None else cached.error or "no value"
        effect = f"using fallback budget {self.fallback_budget:.3g}"
        self._last_error = note_problem(self, self._last_error, error, effect)
        return cached

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "value": self.last_value,
            "threshold": self.threshold,
            "source_available": self.source_available,
        }


def promql_selector(metric: str, labels: dict[str, str]) -> str:
    """``metric{a="x",b="y"}`` with sorted, quoted label matchers (the reference's form)."""
    if not labels:
        return metric
    matchers = ",".join(f"{k}={json.dumps(labels[k])}" for k in sorted(labels))
    return f"{metric}{{{matchers}}}"


class PrometheusGate(MetricGate):
    """A metric gate that asks a Prometheus-compatible HTTP API (instant queries)."""

    queries: list[str]  # the sources of D, in order: the first with a sample is read

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        url = self.p.opt_str("url") or os.environ.get("PROMETHEUS_URL") or ""
        if not url.startswith(("http://", "https://")):
            raise self.p.error(
                "url", "must be the http(s) base of a Prometheus API (or set PROMETHEUS_URL)"
            )
        self.url = url.rstrip("/")
        self.fallback_budget = self.p.get_float("fallback", 0.0, lo=0.0, hi=1.0)
        self.source_index: int | None = None  # the query read last

    def query(self, promql: str) -> float | None:
        """The first sample of an instant query, or None when the result is empty."""
        where = redact_url(self.url)
        resp = self.get(f"{self.url}/api/v1/query", query=promql)
        try:
            body = json.loads(resp.body)
            if body.get("status") != "success":
                raise MetricUnavailable(f"{where}: {body.get('error') or body.get('status')}")
            data = body["data"]
            result = data["result"]
            if data.get("resultType") == "scalar":
                return finite(result[1], promql)
            if data.get("resultType") not in ("vector", None):
                raise MetricUnavailable(f"{where}: result type {data.get('resultType')!r}")
            if not result:
                return None
            return finite(result[0]["value"][1], promql)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise MetricUnavailable(f"{where}: malformed response ({exc!r})") from None

    def read(self) -> float:
        """The first of :attr:`queries` with a sample (its index: ``source_index``)."""
        self.source_index = None
        problems = []
        for i, promql in enumerate(self.queries):
            try:
                value = self.query(promql)
            except MetricUnavailable as exc:
                problems.append(f"[{i}] {exc}")
                continue
            if value is not None:
                self.source_index = i
                return value
            problems.append(f"[{i}] no sample for {promql}")
        raise MetricUnavailable("; ".join(problems))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "url": redact_url(self.url)}


class PrometheusQueryGate(PrometheusGate):
    type_name = "prometheus-query"

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        self.queries = [self.p.get_str("query", required=True)]
        self.closing_threshold = 0.0


# the EPP's pool saturation gauge: the name current llm-d routers export, then the older one
SATURATION_METRICS = (
    "llm_d_epp_flow_control_pool_saturation",
    "inference_extension_flow_control_pool_saturation",
)


# the EPP's flow-control queue size: current llm-d routers' name, then the one the reference's
# cascade still queries (its issue #460), for an EPP of an older release
FLOW_QUEUE_METRICS = (
    "llm_d_epp_flow_control_queue_size",
    "inference_extension_flow_control_queue_size",
)


class PrometheusSaturationGate(PrometheusGate):
    type_name = "prometheus-saturation"

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        pool = self.p.get_str("pool", required=True)
        namespace = self.p.opt_str("namespace")
        saturation_threshold = self.p.get_float("threshold", 0.8, lo=0.0, lo_open=True, hi=1.0)
        self.closing_threshold = 1.0 - saturation_threshold
        labels = {"inference_pool": pool}
        if namespace:
            labels["namespace"] = namespace
        # the current metric's value, else the old name's (an EPP of an older release)
        self.queries = ["1 - " + promql_selector(name, labels) for name in SATURATION_METRICS]

    def describe(self) -> dict[str, Any]:
        i = self.source_index
        return {**super().describe(), "source_metric": None if i is None else SATURATION_METRICS[i]}


class PrometheusBudgetGate(PrometheusGate):
    type_name = "prometheus-budget"

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        pool = self.p.get_str("pool", required=True)
        namespace = self.p.opt_str("namespace")
        self.max_concurrency = self.p.get_float("max_concurrency", 100.0, lo=0.0, lo_open=True)
        self.baseline = self.p.get_float("baseline", 0.05, lo=0.0, hi=1.0, hi_open=True)
        self.aggregation = self.p.get_choice("ready_pods_aggregation", ("max", "sum"), "max")
        self.queries = budget_queries(pool, namespace, self.max_concurrency, self.aggregation)
        self.closing_threshold = self.baseline
        log.info(
            "prometheus-budget gate %s: pool %s closes at %.4g load per ready pod; sources: %s",
            name,
            pool,
            self.max_concurrency * (1 - self.baseline),
            " | ".join(self.queries),
        )

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "source_index": self.source_index}


def budget_queries(
    pool: str, namespace: str | None, max_concurrency: float, aggregation: str = "max"
) -> list[str]:
    """The PromQL sources of D for ``prometheus-budget``, in order: the reference's three,
    the flow-control queue size under its current name first (:data:`FLOW_QUEUE_METRICS`).
    Ready pods are aggregated over EPP replicas before they divide (several series fail: the
    reference's #489)."""
    by_pool = {"inference_pool": pool}
    by_name = {"name": pool}
    if namespace:
        by_pool["namespace"] = namespace
        by_name["namespace"] = namespace
    ready = f"{aggregation}({promql_selector('inference_pool_ready_pods', by_name)})"
    max_c = f"{max_concurrency:g}"
    flows = [promql_selector(name, by_pool) for name in FLOW_QUEUE_METRICS]
    per_pod = promql_selector("inference_pool_per_pod_queue_size", by_name)
    running = promql_selector("vllm:num_requests_running", by_pool)
    return [
        *(f"1 - (sum by(inference_pool)({flow}) / on() ({ready} * {max_c}))" for flow in flows),
        f"1 - (avg by(name)({per_pod}) / {max_c})",
        f"1 - (sum({running}) / on() ({ready} * {max_c}))",
    ]
