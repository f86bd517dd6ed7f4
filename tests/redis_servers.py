"""Real ``redis-server`` processes started by a test on free loopback ports: a lone server with
chosen settings, or a Sentinel group (a master, its replicas, sentinels monitoring it). The
tests fail — never skip — when ``redis-server`` is missing."""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from pipeline.cli.services import free_port, wait_until

MASTER_NAME = "mymaster"


def redis_server() -> str:
    found = shutil.which("redis-server")
    if not found:  # never skip: these tests need a real server
        pytest.fail("redis-server is required on PATH (apt-get install redis-server)")
    return found


@dataclass
class Server:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    password: str | None = None  # requirepass, when it has one

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(
            port=self.port, password=self.password, socket_timeout=5, decode_responses=True
        )

    def kill(self) -> None:
        """SIGKILL: nothing is flushed, replicated or handed over."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_server(
    tmp: Path,
    name: str,
    *args: str,
    conf: str | None = None,
    binary: str | None = None,
    password: str | None = None,
    port: int | None = None,
) -> Server:
    """A ``redis-server`` (``binary``, else the one on PATH) on a free loopback port (or
    ``port``: a server started again in another's place) with ``args`` (or a written config
    file ``conf`` and ``--sentinel``), answering PING when this returns; with ``password``,
    it requires it (``requirepass``)."""
    if password is not None:
        args = (*args, "--requirepass", password)
    port = port or free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp / f"{name}.log"
    if conf is not None:
        path = tmp / f"{name}.conf"
        path.write_text(f"port {port}\nbind 127.0.0.1\ndir {tmp}\nlogfile {log}\n{conf}")
        argv = [redis_server(), str(path), "--sentinel"]
    else:
        argv = [
            binary or redis_server(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp),
            "--logfile",
            str(log),
            *args,
        ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Server(port, proc, log, password)

    def answers() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"redis-server {name} exited: {log.read_text()[-2000:]}")
        try:
            return bool(server.client().ping())
        except redis.RedisError:
            return False

    wait_until(answers, 15, f"redis-server {name} on port {port}")
    return server


@contextmanager
def lone_server(
    tmp: Path, *args: str, binary: str | None = None, password: str | None = None
) -> Iterator[Server]:
    server = start_server(tmp, f"redis-{free_port()}", *args, binary=binary, password=password)
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def one_node_cluster(tmp: Path, *args: str, password: str | None = None) -> Iterator[Server]:
    """A Redis Cluster of one primary holding every slot (``redis+cluster://127.0.0.1:<port>``),
    with ``password`` required when given: enough for a client's view of a cluster."""
    name = f"cluster1-{free_port()}"
    server = start_server(
        tmp,
        name,
        *("--cluster-enabled", "yes", "--cluster-config-file", f"{name}-nodes.conf"),
        *("--cluster-port", str(free_port())),  # its bus port (port + 10000 may pass 65535)
        *args,
        password=password,
    )
    try:
        server.client().execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        wait_until(
            lambda: server.client().cluster("info")["cluster_state"] == "ok",
            30,
            "the one-node cluster to report cluster_state:ok",
        )
        yield server
    finally:
        server.stop()


@dataclass
class SentinelGroup:
    """A master, its replicas and the sentinels that monitor it (quorum 2 of 3)."""

    master: Server
    replicas: list[Server]
    sentinels: list[Server]
    all: list[Server] = field(default_factory=list)

    def url(self, db: int = 0) -> str:
        """Celery's Sentinel list syntax for the group."""
        return ";".join(f"sentinel://127.0.0.1:{s.port}/{db}" for s in self.sentinels)

    def master_port(self) -> int:
        """The master's port as the first sentinel that answers sees it now."""
        for s in self.sentinels:
            try:
                _, port = s.client().sentinel_get_master_addr_by_name(MASTER_NAME)
                return int(port)
            except (redis.RedisError, TypeError):
                continue
        raise AssertionError("no sentinel answers")

    def settled(self) -> bool:
        """Every sentinel sees all replicas and the other sentinels (failover can happen)."""
        for s in self.sentinels:
            state = s.client().sentinel_master(MASTER_NAME)
            if (
                int(state["num-slaves"]) < len(self.replicas)
                or int(state["num-other-sentinels"]) < len(self.sentinels) - 1
            ):
                return False
        return True

    def server(self, port: int) -> Server:
        return next(s for s in [self.master, *self.replicas] if s.port == port)

    def stop(self) -> None:
        for s in reversed(self.all):
            s.stop()


@contextmanager
def sentinel_group(
    tmp: Path, replicas: int = 2, sentinels: int = 3, down_after_ms: int = 1000
) -> Iterator[SentinelGroup]:
    """Start the group and wait until it is settled. Failover: ``down_after_ms`` after the
    master stops answering, a quorum of 2 (1 with a lone sentinel) agrees and a replica is
    promoted."""
    started: list[Server] = []
    group: SentinelGroup | None = None
    try:
        master = start_server(tmp, "master", "--repl-diskless-sync-delay", "0")
        started.append(master)
        reps = []
        for i in range(replicas):
            rep = start_server(tmp, f"replica{i}", "--replicaof", "127.0.0.1", str(master.port))
            started.append(rep)
            reps.append(rep)
        conf = (
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master.port} {min(2, sentinels)}\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {down_after_ms}\n"
            f"sentinel failover-timeout {MASTER_NAME} 5000\n"
            f"sentinel parallel-syncs {MASTER_NAME} {replicas}\n"
        )
        sents = []
        for i in range(sentinels):
            s = start_server(tmp, f"sentinel{i}", conf=conf)
            started.append(s)
            sents.append(s)
        group = SentinelGroup(master, reps, sents, started)
        wait_until(lambda: all(r.client().info("replication").get("master_link_status") == "up"
                        for r in reps), 20, "replicas in sync")  # fmt: skip
        wait_until(group.settled, 30, "sentinels to see the replicas and each other")
        yield group
    finally:
        for s in reversed(started):
            s.stop()


@contextmanager
def redis_cluster(tmp: Path, primaries: int = 3, replicas: int = 1) -> Iterator[list[Server]]:
    """A real Redis Cluster on loopback ports (``--cluster-enabled yes``, then ``redis-cli
    --cluster create``): ``primaries`` primaries with ``replicas`` replicas each, the primaries
    first; every node reports ``cluster_state:ok`` when this yields."""
    cli = shutil.which("redis-cli")
    if not cli:  # never skip: these tests need a real cluster
        pytest.fail("redis-cli is required on PATH (apt-get install redis-tools)")
    nodes: list[Server] = []
    try:
        for i in range(primaries * (1 + replicas)):
            conf = f"cluster{i}-nodes.conf"  # in tmp, beside its log
            nodes.append(
                start_server(
                    tmp,
                    f"cluster{i}",
                    *("--cluster-enabled", "yes", "--cluster-config-file", conf),
                    *("--cluster-node-timeout", "2000"),
                    # its bus port, else port + 10000 (past 65535 for a high free port)
                    *("--cluster-port", str(free_port())),
                )
            )
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        create = [cli, "--cluster", "create", *addresses, "--cluster-replicas", str(replicas)]
        create.append("--cluster-yes")  # no prompt
        done = subprocess.run(create, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_until(
            lambda: all(n.client().cluster("info")["cluster_state"] == "ok" for n in nodes),
            30,
            "every cluster node to report cluster_state:ok",
        )
        yield nodes
    finally:
        for n in reversed(nodes):
            n.stop()
