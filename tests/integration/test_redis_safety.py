"""Safe Redis settings, against real ``redis-server`` processes the tests start: a worker refuses
a Redis that may evict keys (``maxmemory-policy`` other than ``noeviction``) unless told to run
anyway, and a Redis Cluster node; the policy is read from INFO when CONFIG is disabled;
``pipeline status`` shows memory, ``maxmemory``, the policy and persistence."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
from rich.console import Console

from pipeline.cli.services import wait_until
from pipeline.errors import UnsafeRedis
from pipeline.observability.status import render_redis
from pipeline.store import check_redis, server_facts
from tests.conftest import ROOT
from tests.redis_servers import lone_server, redis_cluster


def worker_env(tmp: Path, url: str, **extra: str) -> dict[str, str]:
    qfile = tmp / "queues.json"
    qfile.write_text(json.dumps([{"queue_name": "default", "igw_base_url": "http://127.0.0.1:9"}]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "CELERY_"))}
    env.update(
        PIPELINE_REDIS_URL=url,
        PIPELINE_QUEUES=str(qfile),
        PIPELINE_KEY_PREFIX=f"plsafe{uuid.uuid4().hex[:6]}:",
        PIPELINE_METRICS_PORT="0",
        **extra,
    )
    return env


WORKER = [sys.executable, "-m", "pipeline", "worker", "-c", "2", "--loglevel", "INFO"]
CELERY = [sys.executable, "-m", "celery", "-A", "tasks", "worker", "-P", "threads", "-c", "2"]


def refusal(argv: list[str], env: dict[str, str], word: str) -> str:
    """Run a worker that must refuse to start: exit 2 and one clear line (the one with
    ``word``), no traceback; returns that line."""
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    lines = [line for line in out.splitlines() if word in line]
    assert len(lines) == 1 and "Traceback" not in out, out
    return lines[0]


@pytest.mark.parametrize("argv", [WORKER, CELERY], ids=["pipeline-worker", "celery-worker"])
def test_a_worker_refuses_a_redis_that_evicts(tmp_path: Path, argv: list[str]) -> None:
    with lone_server(tmp_path, "--maxmemory-policy", "allkeys-lru") as server:
        line = refusal(argv, worker_env(tmp_path, server.url), "maxmemory-policy")
        assert "allkeys-lru" in line and "noeviction" in line, line
        assert "PIPELINE_ALLOW_EVICTION=1" in line
        # it stopped before it registered or consumed anything
        assert not server.client().keys("plsafe*")


def test_a_worker_refuses_a_redis_cluster_node(tmp_path: Path) -> None:
    """A cluster node named as a standalone Redis: the worker stops at once (exit 2, one line
    naming the node and the fix, a redis+cluster:// URL), before it registers or consumes
    anything, instead of failing tick after tick with CROSSSLOT or MOVED."""
    with redis_cluster(tmp_path, primaries=3, replicas=0) as nodes:
        node = nodes[0]
        assert server_facts(node.client()).cluster_enabled is True
        line = refusal(WORKER, worker_env(tmp_path, node.url), "Redis Cluster")
        assert f"127.0.0.1:{node.port}" in line and "redis+cluster://" in line, line
        assert not any(n.client().keys("plsafe*") for n in nodes)
    with lone_server(tmp_path) as server:
        assert server_facts(server.client()).cluster_enabled is False


def test_allow_eviction_starts_the_worker_with_a_warning(tmp_path: Path) -> None:
    with lone_server(tmp_path, "--maxmemory-policy", "volatile-lru") as server:
        env = worker_env(tmp_path, server.url, PIPELINE_ALLOW_EVICTION="1")
        log = tmp_path / "worker.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(WORKER, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
        try:
            nodes = env["PIPELINE_KEY_PREFIX"] + "pool:default:nodes"

            def registered() -> bool:
                assert proc.poll() is None, log.read_text()
                return bool(server.client().zcard(nodes))

            wait_until(registered, 30, "the worker to start")
            text = log.read_text()
            assert "PIPELINE_ALLOW_EVICTION=1" in text and "volatile-lru" in text, text
            assert "WARNING" in text.split("volatile-lru")[0].splitlines()[-1]
        finally:
            proc.terminate()
            proc.wait(30)


def test_the_policy_is_read_from_info_when_config_is_disabled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with lone_server(
        tmp_path, "--maxmemory-policy", "allkeys-random", "--rename-command", "CONFIG", ""
    ) as server:
        client = server.client()
        with pytest.raises(redis.ResponseError):
            client.config_get("maxmemory-policy")
        with pytest.raises(UnsafeRedis, match="maxmemory-policy allkeys-random"):
            check_redis(client, server.url, allow=False)
        facts = server_facts(client)
        assert facts.maxmemory_policy == "allkeys-random" and facts.rdb_save is None
        assert facts.problem and "CONFIG GET refused" in facts.problem
    with lone_server(
        tmp_path, "--rename-command", "CONFIG", "", "--rename-command", "INFO", ""
    ) as server:
        with caplog.at_level(logging.WARNING, logger="pipeline.store"):
            facts_or_none = check_redis(server.client(), server.url, allow=False)
        assert facts_or_none is not None and facts_or_none.maxmemory_policy is None
        assert any("could not read maxmemory-policy" in r.message for r in caplog.records)


def test_status_shows_memory_policy_and_persistence(tmp_path: Path) -> None:
    with lone_server(
        tmp_path, "--maxmemory", "64mb", "--appendonly", "yes", "--save", "900 1"
    ) as server:
        client = server.client()
        client.set("x", "y" * 10_000)
        facts = server_facts(client)
        assert facts.maxmemory == 64 * 1024 * 1024 and facts.maxmemory_policy == "noeviction"
        assert facts.aof_enabled is True and facts.rdb_save == "900 1"
        assert facts.used_memory and facts.used_memory > 10_000
        console = Console(width=120, record=True)
        console.print(render_redis(facts))
        text = console.export_text()
        for fact in ("memory used", "MiB", "maxmemory", "64.0 MiB", "noeviction", "AOF", "on"):
            assert fact in text, text
        assert "save 900 1" in text and "last save" in text, text


def test_status_command_prints_the_redis_facts(env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "status"],
        env={**env, "COLUMNS": "160"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    for fact in ("memory used", "maxmemory", "maxmemory-policy", "AOF", "RDB", "noeviction"):
        assert fact in proc.stdout, proc.stdout
