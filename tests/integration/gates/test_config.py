"""build_gate: every gate type validates its params without touching Redis or the network."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest
import redis

from pipeline.errors import ConfigError
from pipeline.gates import GATE_TYPES, build_gate

PROM = "http://127.0.0.1:9"
LOCAL = {"gate_type": "local-max-concurrency", "gate_params": {"limit": 2}}

BAD: list[tuple[str, dict[str, Any], str]] = [
    ("local-max-concurrency", {}, "limit"),
    ("local-max-concurrency", {"limit": 0}, "limit"),
    ("local-max-concurrency", {"limit": "two"}, "limit"),
    ("local-max-concurrency", {"limit": 1.5}, "limit"),
    ("local-max-concurrency", {"limit": True}, "limit"),
    ("local-max-concurrency", {"limit": 2, "gating_mode": "eager"}, "gating_mode"),
    ("global-max-concurrency", {}, "limit"),
    ("global-max-concurrency", {"limit": -1}, "limit"),
    ("adaptive-concurrency", {"max": 0}, "max"),
    ("adaptive-concurrency", {"initial": "x"}, "initial"),
    ("redis", {"address": "http://example.com"}, "address"),
    ("redis", {"address": "host:port"}, "address"),
    ("redis", {"address": "sentinel://s1:26379;sentinel://s2:26379/0"}, "master_name"),
    ("redis", {"address": "sentinel://s1:26379;redis://s2", "master_name": "m"}, "address"),
    ("redis-quota", {}, "limit"),
    ("redis-quota", {"limit": -1}, "limit"),
    ("redis-quota", {"limit": 5, "mode": "bytes"}, "mode"),
    ("redis-quota", {"limit": 5, "mode": "tokens"}, "window"),
    ("redis-quota", {"limit": 0, "mode": "tokens", "window": "1m"}, "limit"),
    ("redis-quota", {"limit": 5, "gating_mode": "lenient"}, "gating_mode"),
    ("redis-quota", {"limit": 5, "window": "soon"}, "window"),
    ("redis-quota", {"limit": 5, "window": "0s"}, "window"),
    ("redis-quota", {"limit": 5, "window": -3}, "window"),
    ("redis-quota", {"limit": 5, "address": "ftp://x"}, "address"),
    ("redis-leased-rate", {"pool_id": "p"}, "control_key"),
    ("redis-leased-rate", {"control_key": "ctrl"}, "pool_id"),
    ("redis-leased-rate", {"control_key": "ctrl", "pool_id": "p", "burst_seconds": 0}, "burst"),
    ("redis-leased-rate", {"control_key": "c", "pool_id": "p", "burst_seconds": "inf"}, "burst"),
    ("redis-leased-rate", {"control_key": "c", "pool_id": "p", "address": "ftp://x"}, "address"),
    ("composite", {}, "gates"),
    ("composite", {"gates": []}, "gates"),
    ("composite", {"gates": "[not json"}, "gates"),
    ("composite", {"gates": [{"gate_params": {}}]}, "gates[0]"),
    ("composite", {"gates": [LOCAL, {"gate_type": "nope"}]}, "gates[1]"),
    ("composite", {"gates": [{"gate_type": "local-max-concurrency"}]}, "limit"),
    ("wait-on-refuse", {}, "gate"),
    ("wait-on-refuse", {"gate": {"gate_type": "redis-quota", "gate_params": {}}}, "limit"),
    ("tier-priority-admission", {}, "saturation_gate"),
    ("tier-priority-admission", {"saturation_gate": "bogus"}, "saturation_gate"),
    (
        "tier-priority-admission",
        {"saturation_gate": "local-max-concurrency", "saturation_gate_params": "{bad"},
        "saturation_gate_params",
    ),
    ("endpoint-scrape", {"metric": "m"}, "url"),
    ("endpoint-scrape", {"url": "http://h/metrics"}, "metric"),
    ("endpoint-scrape", {"url": "h/metrics", "metric": "m"}, "url"),
    ("endpoint-scrape", {"url": PROM, "metric": "m", "max_count_per_pod": -1}, "max_count"),
    ("endpoint-scrape", {"url": PROM, "metric": "m", "baseline": 1}, "baseline"),
    ("endpoint-scrape", {"url": PROM, "metric": "m", "fallback": 2}, "fallback"),
    ("endpoint-scrape", {"url": PROM, "metric": "m", "labels": "[1]"}, "labels"),
    ("endpoint-scrape", {"url": PROM, "metric": "m", "pods_url": PROM}, "pods_metric"),
    ("endpoint-scrape", {"url": PROM, "metric": "m", "cache_ttl_s": -1}, "cache_ttl_s"),
    ("endpoint-scrape", {"url": PROM, "metric": "m", "timeout_s": 30}, "timeout_s"),
    ("endpoint-scrape", {"url": PROM, "metric": "m", "absent_value": "none"}, "absent_value"),
    ("endpoint-scrape", {"url": PROM, "metric": "m", "admission": "eager"}, "admission"),
    ("endpoint-scrape", {"url": PROM, "metric": "m", "admission": "counted"}, "max_count"),
    (
        "endpoint-scrape",
        {
            "url": PROM,
            "metric": "m",
            "admission": "counted",
            "max_count_per_pod": 4,
            "baseline": 0.1,
        },
        "baseline",
    ),  # fmt: skip
    (
        "endpoint-scrape",
        {"url": PROM, "metric": "m", "admission": "counted", "max_count_per_pod": 4, "fallback": 0},
        "fallback",
    ),  # fmt: skip
    ("prometheus-query", {"url": PROM}, "query"),
    ("prometheus-query", {"url": PROM, "query": "up", "fallback": "x"}, "fallback"),
    ("prometheus-query", {"url": "localhost:9090", "query": "up"}, "url"),
    ("prometheus-saturation", {"url": PROM}, "pool"),
    ("prometheus-saturation", {"url": PROM, "pool": "p", "threshold": 0}, "threshold"),
    ("prometheus-saturation", {"url": PROM, "pool": "p", "threshold": 1.5}, "threshold"),
    ("prometheus-saturation", {"url": PROM, "pool": "p", "fallback": -0.1}, "fallback"),
    ("prometheus-budget", {"url": PROM}, "pool"),
    ("prometheus-budget", {"url": PROM, "pool": "p", "max_concurrency": 0}, "max_concurrency"),
    ("prometheus-budget", {"url": PROM, "pool": "p", "baseline": 1.0}, "baseline"),
    ("prometheus-budget", {"url": PROM, "pool": "p", "baseline": -0.1}, "baseline"),
    ("prometheus-budget", {"url": PROM, "pool": "p", "fallback": "nan"}, "fallback"),
    ("prometheus-budget", {"url": PROM, "pool": "p", "ready_pods_aggregation": "avg"}, "ready_"),
]


@pytest.mark.parametrize(("gate_type", "params", "param"), BAD)
def test_bad_params_raise_config_error_naming_the_param(
    gate_type: str, params: dict[str, Any], param: str
) -> None:
    with pytest.raises(ConfigError) as info:
        build_gate(gate_type, params, name="q")
    assert param in str(info.value)


def test_unknown_gate_type_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown gate_type 'nope'"):
        build_gate("nope", {}, name="q")


def test_missing_prometheus_url_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_URL", raising=False)
    with pytest.raises(ConfigError, match="'url'"):
        build_gate("prometheus-query", {"query": "up"}, name="q")
    monkeypatch.setenv("PROMETHEUS_URL", "http://prom:9090/")
    gate = build_gate("prometheus-query", {"query": "up"}, name="q")
    assert gate.url == "http://prom:9090"


GOOD: list[tuple[str, dict[str, Any]]] = [
    ("constant", {}),
    ("local-max-concurrency", {"limit": "3", "gating_mode": "blocking"}),
    ("global-max-concurrency", {"limit": 16}),
    ("adaptive-concurrency", {}),
    (
        "adaptive-concurrency",
        {
            "min": "2",
            "max": 64,
            "initial": 4,
            "metrics_url": "http://vllm:8000/metrics",
            "controller": "aimd-baseline",
            "priority_headroom": 0,
            "window_min": "100ms",
        },
    ),  # fmt: skip
    ("redis", {"address": "localhost:6379", "budget_key": "k"}),
    ("redis-quota", {"limit": 2, "address": "sentinel://s1;sentinel://s2/1", "master_name": "m"}),
    ("redis-quota", {"mode": "tokens", "limit": "4000", "window": "1m", "default_max_tokens": 64}),
    ("redis-quota", {"limit": "5", "window": "1m30s", "attribute": "metadata.userid"}),
    ("redis-quota", {"limit": 5.0, "window": 0.5, "mode": "concurrency"}),
    ("redis-leased-rate", {"control_key": "ctrl:pool", "pool_id": "p", "burst_seconds": "2"}),
    ("composite", {"gates": json.dumps([LOCAL, {"gate_type": "constant"}])}),
    ("wait-on-refuse", {"gate": json.dumps(LOCAL)}),
    (
        "tier-priority-admission",
        {"saturation_gate": "local-max-concurrency", "saturation_gate_params": '{"limit": 1}'},
    ),
    ("endpoint-scrape", {"url": PROM, "metric": "m", "labels": '{"a": "b"}', "baseline": "0.1"}),
    (
        "endpoint-scrape",
        {
            "url": PROM,
            "metric": "m",
            "admission": "counted",
            "max_count_per_pod": 8,
            "absent_value": "0",
        },
    ),  # fmt: skip
    ("prometheus-query", {"url": PROM, "query": "up", "fallback": "0.5"}),
    ("prometheus-saturation", {"url": PROM, "pool": "p", "threshold": "0.7"}),
    ("prometheus-budget", {"url": PROM, "pool": "p", "max_concurrency": "10"}),
]


@pytest.mark.parametrize(("gate_type", "params"), GOOD)
def test_valid_params_build_without_env(gate_type: str, params: dict[str, Any]) -> None:
    gate = build_gate(gate_type, params, name="q")
    assert gate.type_name == gate_type
    gate.close()


def test_every_registered_type_is_covered() -> None:
    assert {t for t, _ in GOOD} == set(GATE_TYPES)


def test_leased_rate_pool_id_defaults_to_the_pool_of_a_pool_gate() -> None:
    inner = {"gate_type": "redis-leased-rate", "gate_params": {"control_key": "ctrl"}}
    gate = build_gate("wait-on-refuse", {"gate": inner}, name="pool.batch")
    assert gate.inner.pool_id == "batch"
    comp = build_gate("composite", {"gates": [inner]}, name="pool.gpu-a")
    assert comp.gates[0].pool_id == "gpu-a"


def test_params_json_string_and_coercion() -> None:
    gate = build_gate("redis-quota", '{"limit": "4", "window": "500ms"}', name="q")
    assert gate.limit == 4
    assert gate.window_s == pytest.approx(0.5)
    assert gate.attribute == "userid"


def test_local_gate_is_per_node_and_wrappers_follow() -> None:
    local = build_gate("local-max-concurrency", {"limit": 2}, name="q")
    assert local.per_node and local.capacity() == 2
    wrapped = build_gate("wait-on-refuse", {"gate": LOCAL}, name="q")
    assert wrapped.per_node and wrapped.capacity() == 2
    quota = {"gate_type": "redis-quota", "gate_params": {"limit": 1}}
    comp = build_gate("composite", {"gates": [quota, LOCAL]}, name="q")
    assert comp.per_node and comp.capacity() == 2
    assert not build_gate("redis-quota", {"limit": 1}, name="q").per_node


@pytest.mark.parametrize(("gate_type", "params"), GOOD)
def test_validation_touches_no_redis_and_no_network(
    monkeypatch: pytest.MonkeyPatch, gate_type: str, params: dict[str, Any]
) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a client was created while only validating")

    monkeypatch.setattr(redis.Redis, "__init__", forbidden)
    monkeypatch.setattr(httpx.Client, "__init__", forbidden)
    monkeypatch.setattr(socket, "create_connection", forbidden)
    build_gate(gate_type, params, name="q").close()
