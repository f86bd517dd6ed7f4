"""Metric gates against a stub Prometheus HTTP API, stub /metrics text and the simulator."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from pipeline.cli.services import wait_until
from pipeline.errors import ConfigError
from pipeline.gates import Gate, Verdict, build_gate
from pipeline.sim import SimConfig, SimServer

from .conftest import ctx


class Stub:
    """A tiny HTTP server: ``/api/v1/query`` answers like Prometheus, other paths serve
    ``texts[path]``. ``values`` maps a query substring to its sample (None = empty result,
    "error" = a Prometheus error body); ``default`` answers the rest; ``status`` forces a code.
    """

    def __init__(self) -> None:
        self.values: dict[str, str | None] = {}
        self.default: str | None = "0.3"
        self.status = 200
        self.texts: dict[str, str] = {}
        self.queries: list[str] = []
        self.auth: list[str | None] = []
        self.redirect_to: str | None = None  # set: every GET answers 307 to this base
        self.hits = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stub.hits += 1
                stub.auth.append(self.headers.get("Authorization"))
                parts = urlsplit(self.path)
                if stub.redirect_to:
                    self.send_response(307)
                    self.send_header("Location", stub.redirect_to + self.path)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if parts.path == "/api/v1/query":
                    query = parse_qs(parts.query)["query"][0]
                    stub.queries.append(query)
                    code, body, ctype = stub.prometheus(query)
                else:
                    text = stub.texts.get(parts.path)
                    code, body, ctype = (200, text, "text/plain") if text else (404, "", "")
                if stub.status != 200:
                    code = stub.status
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype or "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def prometheus(self, query: str) -> tuple[int, str, str]:
        value = next((v for k, v in self.values.items() if k in query), self.default)
        if value == "error":
            body = {"status": "error", "errorType": "bad_data", "error": "parse error"}
            return 400, json.dumps(body), "application/json"
        result = [] if value is None else [{"metric": {}, "value": [time.time(), value]}]
        body = {"status": "success", "data": {"resultType": "vector", "result": result}}
        return 200, json.dumps(body), "application/json"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.close()


@pytest.fixture
def gates() -> Iterator[Callable[..., Gate]]:
    built: list[Gate] = []

    def _build(gate_type: str, params: dict[str, Any]) -> Gate:
        gate = build_gate(gate_type, {"cache_ttl_s": 0, **params}, name="q")
        built.append(gate)
        return gate

    yield _build
    for g in built:
        g.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gauges(gate: Gate) -> tuple[Any, Any, Any]:
    return (
        gate.last_value,
        gate.threshold,
        gate.source_available,
    )


# -- prometheus-query ---------------------------------------------------------------------------
def test_prometheus_query_budget_is_the_value(stub: Stub, gates: Callable[..., Gate]) -> None:
    gate = gates("prometheus-query", {"url": stub.url, "query": 'my_budget{a="b"}'})
    assert gate.budget() == pytest.approx(0.3)
    assert stub.queries == ['my_budget{a="b"}']  # verbatim
    assert gauges(gate) == (pytest.approx(0.3), 0.0, True)
    assert gate.acquire(ctx()).admitted
    stub.default = "0"
    assert gate.budget() == 0.0
    d = gate.acquire(ctx())
    assert (d.verdict, d.reason) == (Verdict.REFUSE, "gate_closed")
    stub.default = "1.7"
    assert gate.budget() == 1.0
    stub.default = "-3"
    assert gate.budget() == 0.0
    stub.default = "0.6"
    assert gate.acquire(ctx()).admitted  # resumes
    assert gate.in_flight() == 0 and gate.capacity() is None


@pytest.mark.parametrize("answer", [None, "NaN", "+Inf", "error", "status500"])
def test_prometheus_query_bad_answers_fail_closed(
    stub: Stub, gates: Callable[..., Gate], answer: str | None
) -> None:
    if answer == "status500":
        stub.status = 500
    else:
        stub.default = answer
    gate = gates("prometheus-query", {"url": stub.url, "query": "q"})
    assert gate.budget() == 0.0
    assert gauges(gate)[0] is None and gauges(gate)[2] is False
    assert not gate.acquire(ctx()).admitted
    opened = gates("prometheus-query", {"url": stub.url, "query": "q", "fallback": "0.4"})
    assert opened.budget() == pytest.approx(0.4)


def test_connection_refused_fails_closed(
    gates: Callable[..., Gate], caplog: pytest.LogCaptureFixture
) -> None:
    url = f"http://user:pw-secret@127.0.0.1:{closed_port()}"
    cases = [
        ("prometheus-query", {"query": "up"}),
        ("prometheus-saturation", {"pool": "p"}),
        ("prometheus-budget", {"pool": "p"}),
    ]
    with caplog.at_level(logging.WARNING):
        for gate_type, params in cases:
            gate = gates(gate_type, {"url": url, **params})
            assert gate.budget() == 0.0, gate_type
            assert gate.source_available is False
            assert gate.acquire(ctx()).verdict is Verdict.REFUSE
        scrape = gates("endpoint-scrape", {"url": url + "/metrics", "metric": "m"})
        assert scrape.budget() == 0.0
    assert caplog.records
    assert all("pw-secret" not in r.getMessage() for r in caplog.records)


def test_redirects_are_followed_only_when_configured_and_keep_no_credentials(
    stub: Stub, gates: Callable[..., Gate]
) -> None:
    moved = Stub()
    try:
        moved.redirect_to = stub.url
        url = moved.url.replace("//", "//user:pw@")
        gate = gates("prometheus-query", {"url": url, "query": "q"})
        assert gate.budget() == 0.0 and stub.hits == 0  # a 307 is not followed by default
        assert moved.auth == ["Basic dXNlcjpwdw=="]  # user:pw@ is basic auth
        # followed only to the URL's own origin unless the gate lists the other (a redirect
        # to any host and port reached a Redis port: issue 45)
        same_only = gates("prometheus-query", {"url": url, "query": "q", "follow_redirects": True})
        assert same_only.budget() == 0.0 and stub.hits == 0
        assert "redirect to another origin" in (same_only.observed().error or "")
        params = {"follow_redirects": True, "redirect_origins": [stub.url]}
        follows = gates("prometheus-query", {"url": url, "query": "q", **params})
        assert follows.budget() == pytest.approx(0.3)
        assert stub.auth == [None]  # no credentials to another origin
    finally:
        moved.close()


def test_cache_ttl_is_honoured_for_values_and_errors(
    stub: Stub, gates: Callable[..., Gate]
) -> None:
    """A reading, value or error, serves every call until ``cache_ttl_s`` has passed (a TTL
    nobody reaches here: no race with the clock), and is read again once it has (never
    before: a lower bound only)."""
    params = {"url": stub.url, "query": "q"}
    cached = gates("prometheus-query", {**params, "cache_ttl_s": 600})
    assert cached.budget() == pytest.approx(0.3)
    stub.default = "0.9"
    assert cached.budget() == pytest.approx(0.3) and cached.acquire(ctx()).admitted
    assert stub.hits == 1  # one reading served all three calls
    failing = gates("prometheus-query", {**params, "cache_ttl_s": 600})
    stub.status = 500
    assert failing.budget() == 0.0
    hits = stub.hits
    stub.status = 200
    assert failing.budget() == 0.0 and stub.hits == hits  # the error is cached too

    short = gates("prometheus-query", {**params, "cache_ttl_s": 0.3})
    t0 = time.monotonic()
    assert short.budget() == pytest.approx(0.9)
    stub.default = "0.5"
    wait_until(
        lambda: short.budget() == pytest.approx(0.5), 10, "short.budget() == pytest.approx(0.5)"
    )
    assert time.monotonic() - t0 >= 0.29
    stub.status = 500
    wait_until(lambda: short.budget() == 0.0, 10, "short.budget() == 0.0")
    stub.status = 200
    wait_until(
        lambda: short.budget() == pytest.approx(0.5), 10, "short.budget() == pytest.approx(0.5)"
    )  # errors expire too


def test_cache_ttl_zero_reads_every_time(stub: Stub, gates: Callable[..., Gate]) -> None:
    gate = gates("prometheus-query", {"url": stub.url, "query": "q"})
    for _ in range(3):
        gate.budget()
    assert stub.hits == 3


# -- prometheus-saturation ----------------------------------------------------------------------
def test_prometheus_saturation(stub: Stub, gates: Callable[..., Gate]) -> None:
    gate = gates(
        "prometheus-saturation",
        {"url": stub.url, "pool": "pool-a", "namespace": "ns", "threshold": "0.8"},
    )
    stub.default = "0.5"  # D = 1 - saturation 0.5
    assert gate.budget() == pytest.approx(0.3)  # 0.5 - (1 - 0.8)
    assert stub.queries[-1] == (
        '1 - llm_d_epp_flow_control_pool_saturation{inference_pool="pool-a",namespace="ns"}'
    )
    assert gate.describe()["source_metric"] == "llm_d_epp_flow_control_pool_saturation"
    assert gate.threshold == pytest.approx(0.2)
    stub.default = "0.2"  # saturation 0.8: at the threshold
    assert gate.budget() == 0.0 and not gate.acquire(ctx()).admitted
    stub.default = "0.25"
    assert gate.budget() == pytest.approx(0.05) and gate.acquire(ctx()).admitted


def test_prometheus_saturation_falls_back_to_the_old_metric_name(
    stub: Stub, gates: Callable[..., Gate]
) -> None:
    """An EPP of an older release exports only the old name: the gate reads that one (the
    reference, since #445, would see no data); with neither, the fallback applies."""
    gate = gates("prometheus-saturation", {"url": stub.url, "pool": "p"})
    stub.values = {"llm_d_epp_": None, "inference_extension_flow_control": "0.5"}
    assert gate.budget() == pytest.approx(0.3)
    assert stub.queries == [
        '1 - llm_d_epp_flow_control_pool_saturation{inference_pool="p"}',
        '1 - inference_extension_flow_control_pool_saturation{inference_pool="p"}',
    ]
    assert gate.describe()["source_metric"] == "inference_extension_flow_control_pool_saturation"
    stub.values = {"llm_d_epp_": "0.9", "inference_extension_flow_control": "0.1"}
    assert gate.budget() == pytest.approx(0.7)  # the current name wins when both exist
    stub.values = {"llm_d_epp_": None, "inference_extension_flow_control": None}
    assert gate.budget() == 0.0 and gate.source_available is False
    assert gate.describe()["source_metric"] is None


# -- prometheus-budget --------------------------------------------------------------------------
def test_prometheus_budget_cascade(stub: Stub, gates: Callable[..., Gate]) -> None:
    gate = gates(
        "prometheus-budget",
        {"url": stub.url, "pool": "p", "max_concurrency": 10, "baseline": 0.1},
    )
    stub.values = {"flow_control_queue_size": None, "per_pod_queue_size": "0.6"}
    assert gate.budget() == pytest.approx(0.5)  # D 0.6 from the per-pod source, minus B 0.1
    assert gate.source_index == 2
    ready = 'on() (max(inference_pool_ready_pods{name="p"}) * 10))'
    assert stub.queries == [  # the flow-control queue by its current name, then the older one
        "1 - (sum by(inference_pool)(llm_d_epp_flow_control_queue_size"
        f'{{inference_pool="p"}}) / {ready}',
        "1 - (sum by(inference_pool)(inference_extension_flow_control_queue_size"
        f'{{inference_pool="p"}}) / {ready}',
        '1 - (avg by(name)(inference_pool_per_pod_queue_size{name="p"}) / 10)',
    ]
    stub.values = {"llm_d_epp_flow_control_queue_size": "0.9", "inference_extension": "0.5"}
    assert gate.budget() == pytest.approx(0.8) and gate.source_index == 0  # the current name
    stub.values = {"llm_d_epp_flow_control_queue_size": None, "inference_extension": "0.5"}
    assert gate.budget() == pytest.approx(0.4) and gate.source_index == 1  # an older EPP
    stub.values = {"flow_control": None, "per_pod": None, "num_requests_running": "0.05"}
    assert gate.budget() == 0.0  # D 0.05 <= B 0.1: closed
    assert gate.source_index == 3
    assert stub.queries[-1] == (
        '1 - (sum(vllm:num_requests_running{inference_pool="p"}) / on() '
        '(max(inference_pool_ready_pods{name="p"}) * 10))'
    )
    stub.values = {"flow_control": None, "per_pod": None, "num_requests_running": None}
    assert gate.budget() == 0.0 and gate.source_available is False
    stub.values = {"flow_control": "error", "per_pod": "0.7"}
    assert gate.budget() == pytest.approx(0.6)  # an erroring source falls through too


def test_prometheus_budget_namespace_scopes_every_source(
    stub: Stub, gates: Callable[..., Gate]
) -> None:
    gate = gates("prometheus-budget", {"url": stub.url, "pool": "p", "namespace": "n"})
    stub.default = None
    gate.budget()
    assert len(stub.queries) == 4  # the flow-control queue under two names, then two more
    assert all('namespace="n"' in q for q in stub.queries)


# -- endpoint-scrape ----------------------------------------------------------------------------
METRICS = """\
# HELP vllm:num_requests_waiting Requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="other"} 9
vllm:num_requests_waiting{model_name="m",pod="a"} 3 1700000000000
vllm:num_requests_waiting_total 100
sat_ratio 0.25
"""


def test_endpoint_scrape_label_filter_and_saturation(
    stub: Stub, gates: Callable[..., Gate]
) -> None:
    stub.texts["/metrics"] = METRICS
    gate = gates(
        "endpoint-scrape",
        {
            "url": stub.url + "/metrics",
            "metric": "vllm:num_requests_waiting",
            "labels": '{"model_name": "m"}',
            "max_count_per_pod": 4,
        },
    )
    assert gate.budget() == pytest.approx(0.25)  # 1 - 3/4
    assert gate.last_value == pytest.approx(0.25)
    direct = gates(
        "endpoint-scrape", {"url": stub.url + "/metrics", "metric": "sat_ratio", "baseline": 0.5}
    )
    assert direct.budget() == pytest.approx(0.25)  # (1 - 0.25) - 0.5
    first = gates(
        "endpoint-scrape",
        {
            "url": stub.url + "/metrics",
            "metric": "vllm:num_requests_waiting",
            "max_count_per_pod": 4,
        },
    )
    assert first.budget() == 0.0  # first sample (9) saturates: clamped
    assert not first.acquire(ctx()).admitted


def test_endpoint_scrape_value_type_budget_reads_the_value_as_the_budget(
    stub: Stub, gates: Callable[..., Gate]
) -> None:
    """``value_type: budget``: the normalised value is the budget itself (a router that
    exports headroom), not 1 − it; counted admission needs a saturation."""
    stub.texts["/metrics"] = METRICS
    base = {"url": stub.url + "/metrics", "metric": "sat_ratio"}
    assert gates("endpoint-scrape", {**base, "value_type": "budget"}).budget() == pytest.approx(
        0.25
    )
    assert gates("endpoint-scrape", base).budget() == pytest.approx(0.75)  # a saturation
    waiting = {"url": stub.url + "/metrics", "metric": "vllm:num_requests_waiting",
               "labels": '{"model_name": "m"}', "max_count_per_pod": 4}  # fmt: skip
    budget = gates("endpoint-scrape", {**waiting, "value_type": "budget", "baseline": 0.5})
    assert budget.budget() == pytest.approx(0.25)  # 3/4, minus the baseline
    with pytest.raises(ConfigError, match="value_type"):
        gates("endpoint-scrape", {**waiting, "admission": "counted", "value_type": "budget"})
    with pytest.raises(ConfigError, match="value_type"):
        gates("endpoint-scrape", {**base, "value_type": "headroom"})


def test_endpoint_scrape_dynamic_pods(stub: Stub, gates: Callable[..., Gate]) -> None:
    stub.texts["/metrics"] = METRICS
    stub.texts["/pods"] = (
        'inference_pool_ready_pods{name="x"} 1\ninference_pool_ready_pods{name="p"} 3\n'
    )
    params = {
        "url": stub.url + "/metrics",
        "metric": "vllm:num_requests_waiting",
        "labels": {"model_name": "m"},
        "max_count_per_pod": 2,
        "pods_url": stub.url + "/pods",
        "pods_metric": "inference_pool_ready_pods",
        "pods_labels": {"name": "p"},
    }
    gate = gates("endpoint-scrape", params)
    assert gate.budget() == pytest.approx(0.5)  # 1 - 3 / (3 pods x 2)
    stub.texts["/pods"] = 'inference_pool_ready_pods{name="p"} 0\n'
    assert gate.budget() == 0.0 and gate.source_available is False


def test_endpoint_scrape_missing_metric_uses_fallback(
    stub: Stub, gates: Callable[..., Gate]
) -> None:
    stub.texts["/metrics"] = METRICS
    base = {"url": stub.url + "/metrics", "metric": "absent_metric"}
    assert gates("endpoint-scrape", base).budget() == 0.0  # fallback saturation 1.0
    assert gates("endpoint-scrape", {**base, "fallback": 0.25}).budget() == pytest.approx(0.75)
    stub.texts["/metrics"] = "m NaN\n"
    assert gates("endpoint-scrape", {**base, "metric": "m"}).budget() == 0.0


def test_endpoint_scrape_against_the_simulator(gates: Callable[..., Gate]) -> None:
    sim = SimServer(SimConfig(max_concurrency=1, overload="queue")).start_in_thread()
    try:
        gate = gates(
            "endpoint-scrape",
            {
                "url": sim.url + "/metrics",
                "metric": "vllm:num_requests_waiting",
                "max_count_per_pod": 2,
            },
        )
        assert gate.budget() == 1.0 and gate.acquire(ctx()).admitted
        body = {"prompt": "hi", "max_tokens": 2}
        hold = {"x-sim-hold": "h"}  # the first keeps the only slot until released
        with ThreadPoolExecutor(3) as pool:
            futures = [
                pool.submit(
                    httpx.post, sim.url + "/v1/completions", json=body, headers=hold, timeout=30
                )
                for _ in range(3)
            ]
            wait_until(lambda: gate.budget() == 0.0, 10, "gate.budget() == 0.0")  # 2 waiting of 2
            assert not gate.acquire(ctx()).admitted
            assert sim.release("h") == 1
            assert [f.result().status_code for f in futures] == [200, 200, 200]
        wait_until(lambda: gate.budget() == 1.0, 5, "gate.budget() == 1.0")
        assert gate.acquire(ctx()).admitted
    finally:
        sim.stop()


# -- prometheus-budget with several EPP replicas --------------------------------------------
class EppReplicas(Stub):
    """A Prometheus API over the series of several EPP replicas of one pool, which evaluates
    the three budget queries the way Prometheus does: ``X / on() (<ready> * N)`` needs exactly
    one series on the right, so with one ``inference_pool_ready_pods`` series per replica an
    unaggregated right side is an execution error (HTTP 422), as in Prometheus; ``max(...)``
    and ``sum(...)`` aggregate the replicas first."""

    def __init__(self, ready: list[float], flow_queue: list[float] | None) -> None:
        super().__init__()
        self.ready = ready  # one series per replica
        self.flow_queue = flow_queue  # one series per replica; None: not exported

    def prometheus(self, query: str) -> tuple[int, str, str]:
        m = re.search(
            r"on\(\) \((?:(max|sum)\()?inference_pool_ready_pods\{[^}]*\}\)? \* (\d+)", query
        )
        if "flow_control_queue_size" not in query or m is None:
            return super().prometheus(query) if "flow_control" not in query else self._empty()
        if self.flow_queue is None:
            return self._empty()
        agg, max_c = m.group(1), float(m.group(2))
        if agg is None and len(self.ready) > 1:
            err = {
                "status": "error",
                "errorType": "execution",
                "error": "found duplicate series for the match group {} on the right hand-side "
                "of the operation; many-to-many matching not allowed: matching labels must be "
                "unique on one side",
            }
            return 422, json.dumps(err), "application/json"
        pods = sum(self.ready) if agg == "sum" else max(self.ready)
        value = 1 - sum(self.flow_queue) / (pods * max_c)
        body = {
            "status": "success",
            "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, str(value)]}]},
        }
        return 200, json.dumps(body), "application/json"

    def _empty(self) -> tuple[int, str, str]:
        body = {"status": "success", "data": {"resultType": "vector", "result": []}}
        return 200, json.dumps(body), "application/json"


def test_prometheus_budget_reads_the_flow_control_source_behind_several_epp_replicas(
    gates: Callable[..., Gate],
) -> None:
    """Two EPP replicas each export the pool's 4 ready pods and their own queue (6 + 2): the
    ready count is aggregated before the division, so source [0] answers: D = 1 − 8 / (4 × 10).
    Without the aggregation (the reference before #489) that query is an error in Prometheus
    and the cascade falls through."""
    prom = EppReplicas(ready=[4, 4], flow_queue=[6, 2])
    try:
        prom.default = None  # the other two sources have no data
        gate = gates("prometheus-budget", {"url": prom.url, "pool": "p", "max_concurrency": 10,
                                           "baseline": 0.1})  # fmt: skip
        assert gate.budget() == pytest.approx(0.7)  # D 0.8 − B 0.1
        assert gate.source_index == 0 and gate.source_available
        # replicas that each see a disjoint share of the pool: sum them
        prom.ready = [2, 2]
        summed = gates("prometheus-budget", {"url": prom.url, "pool": "p", "max_concurrency": 10,
                                             "baseline": 0.1,
                                             "ready_pods_aggregation": "sum"})  # fmt: skip
        assert summed.budget() == pytest.approx(0.7) and summed.source_index == 0
        # what the reference's unaggregated query got from the same Prometheus
        old = prom.prometheus(
            "1 - (sum by(inference_pool)(inference_extension_flow_control_queue_size"
            '{inference_pool="p"}) / on() (inference_pool_ready_pods{name="p"} * 10))'
        )
        assert old[0] == 422
        # one replica: both forms agree
        prom.ready, prom.flow_queue = [4], [8]
        assert gate.budget() == pytest.approx(0.7)
    finally:
        prom.close()


# -- endpoint-scrape: absent_value and admission "counted" ----------------------------------
def test_endpoint_scrape_absent_value_reads_a_vanished_gauge_as_the_given_value(
    stub: Stub, gates: Callable[..., Gate], sim: SimServer
) -> None:
    stub.texts["/metrics"] = METRICS
    base = {"url": stub.url + "/metrics", "metric": "absent_metric", "max_count_per_pod": 4}
    assert gates("endpoint-scrape", base).budget() == 0.0  # absent: fallback (closed)
    gate = gates("endpoint-scrape", {**base, "absent_value": 0})
    assert gate.budget() == 1.0 and gate.source_available  # absent = idle, not an error
    assert gates("endpoint-scrape", {**base, "absent_value": 3}).budget() == pytest.approx(0.25)
    stub.texts["/metrics"] = "absent_metric 2\n"  # present again: the sample wins
    assert gate.budget() == pytest.approx(0.5)
    stub.status = 500  # an unreadable page is still an error, absent_value or not
    assert gate.budget() == 0.0 and not gate.source_available
    # the simulator's page: a series for another model is absent for this gate
    on_sim = gates(
        "endpoint-scrape",
        {"url": sim.url + "/metrics", "metric": "vllm:num_requests_waiting",
         "labels": {"model_name": "another-model"}, "max_count_per_pod": 2,
         "absent_value": 0},
    )  # fmt: skip
    assert on_sim.budget() == 1.0 and on_sim.last_value == 1.0


def test_endpoint_scrape_absent_value_is_not_applied_to_the_pods_metric(
    stub: Stub, gates: Callable[..., Gate]
) -> None:
    stub.texts["/metrics"] = "waiting 1\n"
    stub.texts["/pods"] = "other_metric 3\n"
    gate = gates(
        "endpoint-scrape",
        {"url": stub.url + "/metrics", "metric": "waiting", "max_count_per_pod": 2,
         "pods_url": stub.url + "/pods", "pods_metric": "ready_pods", "absent_value": 0},
    )  # fmt: skip
    assert gate.budget() == 0.0 and gate.source_available is False


@pytest.fixture
def sim() -> Iterator[SimServer]:
    server = SimServer(SimConfig()).start_in_thread()
    yield server
    server.stop()


def test_endpoint_scrape_counted_admits_the_headroom_of_each_reading(
    gates: Callable[..., Gate], sim: SimServer
) -> None:
    """Three requests run at the simulator: with room for 5, one reading admits exactly 2
    attempts and refuses the third (and the budget reads 0); a new reading counts afresh."""
    gate = gates(
        "endpoint-scrape",
        {"url": sim.url + "/metrics", "metric": "vllm:num_requests_running",
         "max_count_per_pod": 5, "admission": "counted", "cache_ttl_s": 600},
    )  # fmt: skip
    body = {"prompt": "hold", "max_tokens": 1}
    hold = {"x-sim-hold": "running"}  # in flight until the simulator stops
    with ThreadPoolExecutor(3) as pool:
        for _ in range(3):
            pool.submit(
                httpx.post, sim.url + "/v1/completions", json=body, headers=hold, timeout=60
            )
        sim.wait_held("running", 3)
        assert gate.budget() == 1.0
        decisions = [gate.acquire(ctx()) for _ in range(3)]
        assert [d.verdict for d in decisions] == [Verdict.CONTINUE] * 2 + [Verdict.REFUSE]
        assert decisions[2].reason == "gate_closed"
        assert gate.budget() == 0.0
        assert (gate.last_value, gate.threshold, gate.source_available) == (2.0, 0.0, True)
        assert gate.describe()["admitted_this_reading"] == 2
        assert gate.release(ctx().holder) is False  # nothing to refund
        gate.cache_ttl_s = 0  # the next call takes a new reading: its headroom counts again
        assert gate.acquire(ctx()).admitted
        gate.cache_ttl_s = 600
        assert gate.acquire(ctx()).admitted and not gate.acquire(ctx()).admitted
        sim.stop()  # requests end with the server; the page is gone: a failed reading
    gate.cache_ttl_s = 0
    assert not gate.acquire(ctx()).admitted and gate.budget() == 0.0
    assert gate.source_available is False


def test_endpoint_scrape_counted_with_fractional_and_negative_readings(
    stub: Stub, gates: Callable[..., Gate]
) -> None:
    params = {"url": stub.url + "/metrics", "metric": "running", "max_count_per_pod": 4,
              "admission": "counted"}  # fmt: skip
    gate = gates("endpoint-scrape", params)  # cache_ttl_s 0: every call is a reading
    stub.texts["/metrics"] = "running 3.5\n"  # headroom 0.5: floor is 0
    assert not gate.acquire(ctx()).admitted and gate.budget() == 0.0
    stub.texts["/metrics"] = "running 9\n"  # over capacity: headroom 0, not negative
    assert not gate.acquire(ctx()).admitted and gate.last_value == 0.0
    stub.texts["/metrics"] = "running -1\n"  # not a count: a failed reading
    assert not gate.acquire(ctx()).admitted and gate.source_available is False
    stub.texts["/metrics"] = "running 2.5\n"  # headroom 1.5 per reading: one each
    assert gate.acquire(ctx()).admitted and gate.acquire(ctx()).admitted
    cached = gates("endpoint-scrape", {**params, "cache_ttl_s": 600})
    assert cached.acquire(ctx()).admitted and not cached.acquire(ctx()).admitted
