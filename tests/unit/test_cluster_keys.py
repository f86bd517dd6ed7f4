"""Keys on a Redis Cluster: every key of a pool, and every family root its scripts derive keys
from, hashes to the pool's slot; standalone key names are unchanged; cluster URLs parse, or
fail naming what is wrong."""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import pytest
from redis.crc import key_slot

from pipeline.config import QueueConfig, Settings, load_settings, parse_cluster_url
from pipeline.errors import ConfigError
from pipeline.gates import check_gates
from pipeline.store.keys import Keys, pool_keys

SAMPLE = {"queue": "q1", "pool": "p", "gate": "g", "node": "n1", "request_id": "r1",
          "tenant_key": "t", "quota_key": "quota:userid:a", "batch_id": "b1", "file_id": "f1",
          "attribute_value": "v", "window_s": 1.0, "control_key": "c", "token": "t1"}  # fmt: skip


def every_key(keys: Keys) -> list[str]:
    out: list[str] = list(keys.families)
    for name, method in inspect.getmembers(keys, inspect.ismethod):
        if name.startswith("_") or name in ("pattern", "pool_nodes_pattern", "result_list"):
            continue
        args = [SAMPLE[p] for p in inspect.signature(method).parameters]
        value = method(*args)
        out.extend(value if isinstance(value, tuple) else [value])
    out.append(keys.result_list(QueueConfig(queue_name="q1", igw_base_url="http://x")))
    return out


@pytest.mark.parametrize("pool", ["default", "gpu-a", "p:7"])
def test_every_key_of_a_pool_is_in_the_pools_slot(pool: str) -> None:
    slot = key_slot(f"{{p:{pool}}}".encode())
    keys = every_key(pool_keys("pl:", pool))
    assert len(keys) > 40
    for key in keys:
        assert key_slot(key.encode()) == slot, key


def test_standalone_names_are_unchanged() -> None:
    k = Keys("pl:")
    assert k.request("r1") == "pl:req:r1"
    assert k.pending("q1") == "pl:q:q1:pending"
    assert "request-active:" in k.families and "request-cancel:" in k.families
    assert pool_keys("pl:", "a").request("r1") == "pl:{p:a}:req:r1"


def test_a_cluster_url_parses() -> None:
    c = parse_cluster_url("rediss+cluster://app:s%40cret@10.0.0.1:7000,10.0.0.2:7001/0")
    assert c.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001))
    assert (c.tls, c.username, c.password) == (True, "app", "s@cret")
    assert parse_cluster_url("redis+cluster://[::1]:7000").nodes == (("::1", 7000),)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://", "node #1"),
        ("redis+cluster://h:7000,h2", "node #2"),
        ("redis+cluster://h:7000/3", "only database 0"),
    ],
)
def test_a_bad_cluster_url_names_the_fault(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_cluster_url(url)


def test_a_cluster_needs_another_broker() -> None:
    env = {"PIPELINE_REDIS_URL": "redis+cluster://h:7000"}
    with pytest.raises(ConfigError, match="CELERY_BROKER_URL"):
        load_settings(env)
    settings = load_settings({**env, "CELERY_BROKER_URL": "amqp://guest@h//"})
    assert settings.redis_cluster


def cluster_settings(*queues: dict[str, Any]) -> Settings:
    return Settings(
        redis_url="redis+cluster://h:7000",
        broker_url="amqp://",
        queues={q["queue_name"]: QueueConfig(igw_base_url="http://x", **q) for q in queues},
    )


QUOTA = {"gate_type": "redis-quota", "gate_params": {"mode": "concurrency", "limit": 2}}


@pytest.mark.parametrize(
    ("queues", "says"),
    [
        ([{"queue_name": "q", "ingest": "llm-d-async"}], "ingest from llm-d-async"),
        ([{"queue_name": "q", "result_queue_name": "out"}], "put {p:default} in the name"),
        (
            [{"queue_name": "q1", "worker_pool_id": "a", **QUOTA},
             {"queue_name": "q2", "worker_pool_id": "b", **QUOTA}],
            "shared with pool 'a'",
        ),
        (
            [{"queue_name": "q", "worker_pool_id": "a", "gate_type": "redis-leased-rate",
              "gate_params": {"pool_id": "a", "control_key": "plan:a"}}],
            "control_key 'plan:a' must carry {p:a}",
        ),
    ],
)  # fmt: skip
def test_what_crosses_pools_is_refused_on_a_cluster(
    queues: list[dict[str, Any]], says: str
) -> None:
    settings = cluster_settings(*queues)
    with pytest.raises(ConfigError, match=re.escape(says)):
        check_gates(settings)
    check_gates(dataclasses.replace(settings, redis_url="redis://h:6379"))  # standalone: fine


def test_what_stays_in_a_pool_is_accepted_on_a_cluster() -> None:
    check_gates(
        cluster_settings(
            {"queue_name": "q1", "worker_pool_id": "a", **QUOTA},
            {"queue_name": "q2", "worker_pool_id": "a", **QUOTA},
            {"queue_name": "q3", "worker_pool_id": "b", "result_queue_name": "out{p:b}"},
            {
                "queue_name": "q4",
                "worker_pool_id": "a",
                "gate_type": "redis-leased-rate",
                "gate_params": {"pool_id": "a", "control_key": "plan:{p:a}"},
            },
        )  # fmt: skip
    )
