"""A worker node's start-up: a failure in any of its steps (the Redis check, the metrics
directory, the dispatcher...) stops the node — a non-zero exit status and one line naming the
step — instead of a node that logs the exception and reports ready without the step
(issue 45, item 3). Each case is a real ``pipeline worker`` process."""

from __future__ import annotations

import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.cli.services import free_port, wait_until
from pipeline.sim import SimServer
from tests.conftest import NODE_START_S
from tests.observability import Isolated, isolated
from tests.redis_servers import lone_server, one_node_cluster

PIPELINE = str(Path(sys.executable).parent / "pipeline")
PASSWORD = "s3cret-" + uuid.uuid4().hex[:8]


@dataclass
class Stopped:
    code: int
    log: str

    def problems(self) -> list[str]:
        """The node's ERROR and CRITICAL lines."""
        return [x for x in self.log.splitlines() if " ERROR " in x or " CRITICAL " in x]


def start_and_watch(iso: Isolated, env: dict[str, str], log: Path) -> Stopped:
    """Start a node of ``iso`` with ``env`` and wait until it exits or reports ready (then it
    is stopped, and its status is whatever a SIGTERM gives)."""
    name = f"startup-{iso.tag}@test"
    with open(log, "wb") as fh:
        node = subprocess.Popen(
            [PIPELINE, "worker", "--pools", iso.pool(), "-c", "1", "-n", name],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(
            lambda: node.poll() is not None or f"{name} ready." in log.read_text(),
            NODE_START_S,
            f"node {name} to stop or be ready",
        )
    finally:
        if node.poll() is None:
            node.terminate()
        node.wait(30)
    return Stopped(node.returncode, log.read_text(errors="replace"))


def test_a_failed_start_up_step_stops_the_node(
    tmp_path: Path, env: dict[str, str], sim: SimServer
) -> None:
    """The metrics directory cannot be made (it would be under a file): the node exits 3 with
    one ERROR line naming the step, and never reports ready."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    iso = isolated(env, tmp_path, [{"queue_name": "q", "igw_base_url": sim.url}])
    node_env = {
        **iso.env,
        "PIPELINE_METRICS_PORT": str(free_port()),
        "PROMETHEUS_MULTIPROC_DIR": str(blocker / "metrics"),
    }
    stopped = start_and_watch(iso, node_env, tmp_path / "node.log")
    assert stopped.code == 3, stopped.log[-3000:]
    assert "ready." not in stopped.log
    [line] = stopped.problems()
    assert "ERROR pipeline.node: node start-up failed at the metrics setup: " in line, line
    assert "NotADirectoryError" in line and "Traceback" not in stopped.log
    assert not iso.pl.store.client.exists(iso.pl.store.keys.pool_nodes(iso.pool()))


def test_a_pipeline_redis_that_refuses_connections_stops_the_node(
    tmp_path: Path, env: dict[str, str], sim: SimServer
) -> None:
    """The broker answers, the pipeline's Redis does not: the dispatcher cannot start, so the
    node stops (it used to report ready with no dispatcher, serving nothing)."""
    iso = isolated(env, tmp_path, [{"queue_name": "q", "igw_base_url": sim.url}])
    down = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"
    stopped = start_and_watch(iso, {**iso.env, "PIPELINE_REDIS_URL": down}, tmp_path / "n.log")
    assert stopped.code == 3, stopped.log[-3000:]
    assert "ready." not in stopped.log
    [line] = stopped.problems()
    failed = "node start-up failed at starting the dispatcher: RedisUnavailable: no Redis answers"
    assert failed in line and "`pipeline up`" in line, line  # the typed error, naming the fix
    assert PASSWORD not in stopped.log


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
def test_a_password_protected_cluster_is_checked_like_any_redis(
    tmp_path: Path, env: dict[str, str], sim: SimServer, policy: str
) -> None:
    """A Redis Cluster URL with a password (a documented form) used to make the node's Redis
    check raise while redacting the URL: the check was skipped and the node reported ready on
    a cluster that evicts keys. Now a cluster that may evict stops the node (exit 2, naming
    maxmemory-policy); one that does not is served. Neither prints the password."""
    iso = isolated(env, tmp_path, [{"queue_name": "q", "igw_base_url": sim.url}])
    with one_node_cluster(
        tmp_path / "cluster", "--maxmemory-policy", policy, password=PASSWORD
    ) as n:
        url = f"redis+cluster://:{PASSWORD}@127.0.0.1:{n.port},localhost:{n.port}"
        stopped = start_and_watch(iso, {**iso.env, "PIPELINE_REDIS_URL": url}, tmp_path / "n.log")
    assert PASSWORD not in stopped.log
    if policy == "noeviction":
        assert f"startup-{iso.tag}@test ready." in stopped.log, stopped.log[-3000:]
        assert "pipeline dispatcher started" in stopped.log and not stopped.problems()
        return
    assert stopped.code == 2, stopped.log[-3000:]
    assert "ready." not in stopped.log
    [line] = stopped.problems()
    assert "CRITICAL pipeline.node: refusing to start: the Redis at " in line, line
    assert f"redis+cluster://***@127.0.0.1:{n.port},localhost:{n.port}" in line, line
    assert "maxmemory-policy allkeys-lru" in line


def test_a_password_in_the_query_reaches_the_broker_too(
    tmp_path: Path, env: dict[str, str], sim: SimServer
) -> None:
    """``redis://host/0?password=...`` is a documented form (redis-py reads it), and the broker
    and result backend default to the pipeline's Redis: kombu's URL parser raised on it
    (``dict() got multiple values for keyword argument 'password'``) and the node never
    started. Celery now gets the password in the userinfo; nothing prints it."""
    iso = isolated(env, tmp_path, [{"queue_name": "q", "igw_base_url": sim.url}])
    with lone_server(tmp_path / "redis", password=PASSWORD) as server:
        url = f"redis://127.0.0.1:{server.port}/0?password={PASSWORD}"
        node_env = {**iso.env, "PIPELINE_REDIS_URL": url}
        for inherited in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
            node_env.pop(inherited, None)  # both default to the pipeline's Redis
        stopped = start_and_watch(iso, node_env, tmp_path / "n.log")
    assert f"startup-{iso.tag}@test ready." in stopped.log, stopped.log[-3000:]
    assert not stopped.problems(), stopped.problems()
    assert PASSWORD not in stopped.log
