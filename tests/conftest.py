"""Shared fixtures: a real Redis (fail, never skip, when it is missing), the simulator, real
worker nodes — in a subprocess (``start_worker``, ``worker``) or in this process (``in_process``:
pytest-celery's session worker, threads pool) — and a client bound to an isolated key prefix.

Every test that uses ``pl`` ends with the leak check: all queues drain and no gate holds a
reservation.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.app.trace import setup_worker_optimizations
from celery.contrib.testing.worker import TestWorkController
from celery.signals import worker_ready
from hypothesis import settings as hypothesis_settings

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.config import QueueConfig, load_settings
from pipeline.sim import SimConfig, SimServer
from pipeline.store import Keys, Store
from pipeline.store.keys import celery_queue, celery_queue_prefix, sharded

# No per-example deadline for the property tests: what they check is not timing, and on a
# loaded shared machine (or one talking to Redis) an example's time is noise; the suite's
# timeout (pyproject.toml) still bounds a test.
hypothesis_settings.register_profile("suite", deadline=None)
hypothesis_settings.load_profile("suite")

REDIS_URL = os.environ.get("PIPELINE_TEST_REDIS_URL", "redis://127.0.0.1:6379/12")
# PIPELINE_TEST_CLUSTER=1 (`make test-cluster`): the pipeline's state on a private Redis Cluster
# (3 primaries, 1 replica each) for the whole session; the broker and Celery's result backend
# stay on REDIS_URL, as Celery cannot use a cluster
CLUSTER = os.environ.get("PIPELINE_TEST_CLUSTER", "") == "1"
ROOT = Path(__file__).resolve().parent.parent
RESULTS_TAG = f"t{uuid.uuid4().hex[:6]}"  # this session's result lists


# An attempt's HTTP timeout on the test queues: longer than any test holds a request at the
# simulator (``held``), so a held attempt is never cut off and retried while the test works.
HELD_S = 30
# How long a worker node may take to start (import Celery, connect, register). A few seconds
# on a quiet machine; on a loaded 2-core one (load average 18 measured) it took over 30 s.
NODE_START_S = 90


def held(name: str) -> dict[str, str]:
    """Request headers that make the simulator hold the request (in flight, its slot taken)
    until the test calls ``sim.release(name)``: no race against a fixed latency."""
    return {"x-sim-hold": name}


def give_up_after(timeout: float, what: str | Callable[[], str]) -> Callable[[], None]:
    """An ``on_poll`` for ``Pipeline.iter_results``: fail once ``timeout`` s have passed,
    naming what was awaited (``what`` may be computed then, e.g. from ``inspect()``)."""
    end = time.monotonic() + timeout

    def check() -> None:
        if time.monotonic() > end:
            said = what() if callable(what) else what
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {said}")

    return check


def freed_listener(store: Store) -> Any:
    """A Pub/Sub listener on the store's release bell channel (sharded on a Redis Cluster),
    subscribed when this returns."""
    channel = store.keys.freed_channel()
    listener = store.client.pubsub(ignore_subscribe_messages=True)
    if sharded(channel):
        listener.ssubscribe(channel)
        count = lambda: sum(  # noqa: E731
            n.redis_connection.execute_command("PUBSUB", "SHARDNUMSUB", channel)[1]
            for n in store.client.get_primaries()
        )
    else:
        listener.subscribe(channel)
        count = lambda: store.client.pubsub_numsub(channel)[0][1]  # noqa: E731
    next_message(listener, 0.05)  # sends the subscription
    wait_until(lambda: count() >= 1, 5, f"a subscriber on {channel}")
    return listener


def next_message(listener: Any, timeout: float) -> Any:
    if getattr(listener, "shard_channels", None):
        return listener.get_sharded_message(timeout=timeout)
    return listener.get_message(timeout=timeout)


def published(listener: Any, n: int, what: str, timeout: float = 5.0) -> list[Any]:
    """The next ``n`` messages of a Pub/Sub ``listener`` (subscribed before they were sent),
    and no more: the listener is closed after checking that nothing else arrived."""
    got: list[Any] = []

    def arrived() -> bool:
        message = next_message(listener, 0.1)
        if message is not None:
            got.append(message["data"])
        return len(got) >= n

    wait_until(arrived, timeout, what)
    extra = next_message(listener, 0.2)
    listener.close()
    assert extra is None, f"more than {n} messages: {got} then {extra}"
    return got


@pytest.fixture(scope="session")
def redis_url() -> str:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:  # never skip: the suite needs a real Redis
        pytest.fail(f"Redis is required at {REDIS_URL}: {exc}", pytrace=False)
    return REDIS_URL


@pytest.fixture(scope="session")
def sim() -> Iterator[SimServer]:
    server = SimServer(SimConfig(record_arrivals=True)).start_in_thread()
    yield server
    server.stop()


def results_list(queue: str, pool: str) -> str:
    """A test queue's result list: this session's, in its pool's slot on a Redis Cluster."""
    return f"{RESULTS_TAG}-results-{queue}" + (f"{{p:{pool}}}" if CLUSTER else "")


def queue_entries(sim_url: str) -> list[dict[str, Any]]:
    fast = {"retry_base_delay_s": 0.05, "retry_max_delay_s": 0.4, "request_timeout_s": HELD_S}
    return [
        {"queue_name": "default", "igw_base_url": sim_url, **fast},
        # served only by workers started inside a test (ordering, expiry, cancel)
        {"queue_name": "solo", "igw_base_url": sim_url, "worker_pool_id": "solo", **fast},
        {
            "queue_name": "short",
            "igw_base_url": sim_url,
            "request_timeout_s": 0.3,
            "retry_base_delay_s": 0.05,
            "retry_max_delay_s": 0.2,
        },
        {
            "queue_name": "slowretry",
            "igw_base_url": sim_url,
            "retry_base_delay_s": 1.0,
            "result_queue_name": results_list("slowretry", "default"),
        },
        # bounded result lists (served by the session worker)
        {
            "queue_name": "capped",
            "igw_base_url": sim_url,
            "result_queue_name": results_list("capped", "default"),
            "result_list_max_len": 5,
            "result_ttl_seconds": 60,
            **fast,
        },
        {"queue_name": "nolist", "igw_base_url": sim_url, "result_list": False, **fast},
        *gated_queue_entries(sim_url),
    ]


def local_limit(n: int) -> dict[str, Any]:
    return {"gate_type": "local-max-concurrency", "gate_params": {"limit": n}}


def quota(n: int) -> dict[str, Any]:
    params = {"mode": "concurrency", "attribute": "userid", "limit": n}
    return {"gate_type": "redis-quota", "gate_params": params}


def tokens_quota(limit: int, window: str, **extra: Any) -> dict[str, Any]:
    """A token budget per userid: at most ``limit`` tokens per ``window``."""
    params = {"mode": "tokens", "attribute": "userid", "limit": limit, "window": window}
    return {"gate_type": "redis-quota", "gate_params": {**params, **extra}}


def tenants_gate(per_tenant: int, overall: int) -> dict[str, Any]:
    """A per-tenant concurrency quota behind one global limit, in one composite gate."""
    inner = [
        quota(per_tenant),
        {"gate_type": "global-max-concurrency", "gate_params": {"limit": overall}},
    ]
    return {"gate_type": "composite", "gate_params": {"gates": inner}}


def adaptive(**params: Any) -> dict[str, Any]:
    return {"gate_type": "adaptive-concurrency", "gate_params": params}


def gated_queue_entries(sim_url: str) -> list[dict[str, Any]]:
    """Queues with gates that hold reservations, one result list each (named per session:
    result lists use their configured name verbatim, outside the key prefix)."""
    fast = {"retry_base_delay_s": 0.05, "retry_max_delay_s": 0.4, "request_timeout_s": HELD_S}
    dead = "http://127.0.0.1:9"  # discard port: nothing listens, connections are refused
    wait_quota = {"gate_type": "wait-on-refuse", "gate_params": {"gate": quota(1)}}
    specs: list[tuple[str, str, dict[str, Any], str]] = [
        ("lim1", "default", local_limit(1), sim_url),
        ("parked", "parked", local_limit(1), sim_url),
        (
            "global2",
            "global",
            {"gate_type": "global-max-concurrency", "gate_params": {"limit": 2}},
            sim_url,
        ),
        ("lim2", "default", local_limit(2), sim_url),
        ("quota1", "default", quota(1), sim_url),
        ("quota4", "default", quota(4), sim_url),
        ("qrefuse", "qrefuse", quota(1), sim_url),
        ("quotawait", "default", wait_quota, sim_url),
        # token budgets per userid: a long window (charges outlive the test) and a short one
        ("tokens", "default", tokens_quota(1000, "1m"), sim_url),
        ("tokens1s", "default", tokens_quota(100, "1s"), sim_url),
        # ... whose estimates learn a correction from the answers' usage
        ("tokenslearn", "default", tokens_quota(1000, "1m", estimate_correction="usage"), sim_url),
        ("dead", "default", local_limit(4), dead),
        # poison requests (tests/integration/test_poison.py): three attempts at most
        ("poison", "default", {**local_limit(2), "max_attempts": 3}, sim_url),
        ("prefork", "prefork", local_limit(4), sim_url),
        ("softlim", "softlim", local_limit(4), sim_url),
        ("hardlim", "hardlim", local_limit(4), sim_url),
        ("crash", "crash", quota(4), sim_url),
        ("overadmit", "overadmit", quota(5), sim_url),
        ("chaos", "chaos", quota(8), sim_url),
        ("stalls", "default", quota(4), sim_url),
        # scheduling: tenants behind per-tenant quotas, fair share, two queues on one pool
        ("tenants", "tenants", tenants_gate(2, 6), sim_url),
        ("mtchaos", "mtchaos", tenants_gate(3, 8), sim_url),
        ("fairq", "fairq", {"fair_share": True}, sim_url),
        ("merge1", "merge", {}, sim_url),
        ("merge2", "merge", {}, sim_url),
        ("inproc", "inproc", local_limit(2), sim_url),  # served by the in-process node
        # the adaptive gate (tests/integration/test_adaptive_gate.py), held to its bounds
        ("adapt", "adapt", adaptive(initial=2, max=2), sim_url),
        (
            "adaptwait",
            "adapt",
            {"gate_type": "wait-on-refuse", "gate_params": {"gate": adaptive(initial=1, max=1)}},
            sim_url,
        ),
        (
            "adaptdrop",
            "adapt",
            {
                "gate_type": "tier-priority-admission",
                "gate_params": {
                    "saturation_gate": "adaptive-concurrency",
                    "saturation_gate_params": {"initial": 1, "max": 1},
                },
                "labels": {"classification": "overflow", "tier": "interactive"},
            },
            sim_url,
        ),
        ("adaptcrash", "adaptcrash", adaptive(initial=4, max=4), sim_url),
        ("adaptchaos", "adaptchaos", adaptive(initial=8, max=8), sim_url),
        (
            "skew",
            "skew",
            {"gate_type": "global-max-concurrency", "gate_params": {"limit": 4}},
            sim_url,
        ),
    ]
    entries = [
        {
            "queue_name": name,
            "igw_base_url": url,
            "worker_pool_id": pool,
            "result_queue_name": results_list(name, pool),
            **gate,
            **fast,
        }
        for name, pool, gate, url in specs
    ]
    for e in entries:
        if e["queue_name"] == "stalls":
            e["request_timeout_s"] = 0.4  # stalled attempts time out fast
        if CLUSTER:  # a pool's own quota keys (a cluster refuses one prefix over two pools)
            own_quota_prefix(e, e["worker_pool_id"])
    return entries


def quota_key(pool: str, value: str, attribute: str = "userid") -> str:
    """A redis-quota key of a test queue of ``pool`` (see :func:`own_quota_prefix`)."""
    return (f"quota:{pool}:" if CLUSTER else "quota:") + f"{attribute}:{value}"


def moved_to_pool(q: QueueConfig, name: str, pool: str) -> QueueConfig:
    """A copy of test queue ``q`` named ``name`` in ``pool`` (its quotas that pool's own)."""
    entry = {"gate_type": q.gate_type, "gate_params": copy.deepcopy(q.gate_params)}
    if CLUSTER:
        for part in [entry, *entry["gate_params"].get("gates", [])]:
            if part.get("gate_type") == "redis-quota":
                part["gate_params"]["prefix"] = f"quota:{pool}:"
    listed = results_list(name, pool) if q.result_queue_name else None
    return dataclasses.replace(
        q,
        queue_name=name,
        worker_pool_id=pool,
        gate_params=entry["gate_params"],
        result_queue_name=listed,
    )


def own_quota_prefix(gate: dict[str, Any], pool: str) -> None:
    """Give every redis-quota in ``gate`` (a queue entry or a composite's part) the pool's
    own key prefix, unless it names one."""
    if gate.get("gate_type") == "redis-quota":
        gate["gate_params"].setdefault("prefix", f"quota:{pool}:")
    for part in gate.get("gate_params", {}).get("gates", []):
        own_quota_prefix(part, pool)


@pytest.fixture(scope="session")
def state_url(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Where the pipeline's state lives: ``redis_url``, or a private Redis Cluster (CLUSTER)."""
    if not CLUSTER:
        yield redis_url
        return
    from tests.redis_servers import redis_cluster

    with redis_cluster(tmp_path_factory.mktemp("cluster"), primaries=3, replicas=1) as nodes:
        yield "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes[:3])


@pytest.fixture(scope="session")
def env(
    redis_url: str, state_url: str, sim: SimServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """Environment for worker subprocesses and the in-process client."""
    d = tmp_path_factory.mktemp("cfg")
    qfile = d / "queues.json"
    qfile.write_text(json.dumps(queue_entries(sim.url)))
    e = {
        "PIPELINE_REDIS_URL": state_url,
        "CELERY_BROKER_URL": os.environ.get("PIPELINE_TEST_BROKER_URL") or redis_url,
        "CELERY_RESULT_BACKEND": redis_url,
        "PIPELINE_KEY_PREFIX": f"pltest{uuid.uuid4().hex[:6]}:",
        "PIPELINE_QUEUES": str(qfile),
        "PIPELINE_LEASE_S": "3",
        "PIPELINE_REAPER_PERIOD_S": "0.5",
        "PIPELINE_GATE_WAIT_TIMEOUT_S": "1",
        "PIPELINE_WEDGE_AFTER_S": "1",
        "PIPELINE_RESULT_TTL_S": "3600",
        "PIPELINE_METRICS_PORT": "0",  # the tests that scrape a node give it a port of its own
    }
    os.environ.update(e)
    yield {**os.environ, **e}
    # each session has its own key prefix and Celery queues: clean up only what is ours
    client = redis.Redis.from_url(redis_url)
    for prefix in [e["PIPELINE_KEY_PREFIX"], *ISOLATED]:  # isolated ones a late node rewrote
        drop_keys(client, prefix)
    unlink_matching(client, RESULTS_TAG + "-*")
    client.close()


# Key prefixes handed out by ``isolated()`` (tests/observability.py), one per isolated
# pipeline; their keys are deleted after the test that made them (and again after the session).
ISOLATED: list[str] = []


def unlink_matching(client: redis.Redis, pattern: str) -> None:
    """Delete the keys matching ``pattern``: SCAN and UNLINK in batches. Never FLUSHDB: other
    sessions share this Redis database."""
    batch: list[Any] = []
    for key in client.scan_iter(pattern, count=10_000):
        batch.append(key)
        if len(batch) >= 1000:
            client.unlink(*batch)
            batch.clear()
    if batch:
        client.unlink(*batch)


def drop_keys(client: redis.Redis, prefix: str) -> None:
    """Every key of a pipeline with key prefix ``prefix``: its own keys, the Celery results of
    its batches' requests (named ``<batch id>-<line>``, with no prefix: left behind, thousands
    a batch test would slow every later SCAN of the database for a day), and its Celery queues
    and kombu's bindings of them (named after the prefix: ``celery_queue_prefix``)."""
    for batch_id in client.zrange(Keys(prefix).batches(), 0, -1):
        name = batch_id.decode() if isinstance(batch_id, bytes) else batch_id
        unlink_matching(client, f"celery-task-meta-{name}-*")
    unlink_matching(client, prefix + "*")
    unlink_matching(client, "*" + celery_queue_prefix(prefix) + "*")


@pytest.fixture(autouse=True)
def _drop_isolated_keys() -> Iterator[None]:
    """After each test, the keys of the isolated pipelines it made (none: no Redis call)."""
    made = len(ISOLATED)
    yield
    if len(ISOLATED) > made:
        client = redis.Redis.from_url(REDIS_URL)
        for prefix in ISOLATED[made:]:
            drop_keys(client, prefix)
        client.close()


class WorkerProc:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path, name: str) -> None:
        self.proc, self.log, self.name = proc, log, name

    def stop(self, timeout: float = 20.0) -> None:
        stop_processes([self.proc], timeout)


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout: float = 20.0) -> None:
    """SIGTERM every one (a warm shutdown each, side by side), then wait; kill one that has not
    ended within ``timeout``."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def start_worker(
    env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., WorkerProc]]:
    """Start a real worker node (``pipeline worker``) in a subprocess; waits until its
    dispatcher has registered. All are stopped at the end of the session."""
    started: list[WorkerProc] = []
    logs = tmp_path_factory.mktemp("logs")
    settings = load_settings(env)
    store = Store(settings)

    def start(
        pools: str = "default",
        concurrency: int = 8,
        pool_impl: str = "threads",
        extra_env: dict[str, str] | None = None,
        wait: bool = True,
        celery_args: list[str] | None = None,
    ) -> WorkerProc:
        name = f"w{uuid.uuid4().hex[:6]}@test"
        log = logs / f"{name}.log"
        argv = [
            sys.executable,
            "-m",
            "pipeline",
            "worker",
            "--pools",
            pools,
            "-c",
            str(concurrency),
            "-P",
            pool_impl,
            "-n",
            name,
            "--loglevel",
            "INFO",
        ]
        if celery_args:
            argv += ["--", *celery_args]
        fh = open(log, "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            argv, env={**env, **(extra_env or {})}, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT
        )
        w = WorkerProc(proc, log, name)
        started.append(w)
        if wait:
            pool = pools.split(",")[0]
            key = store.for_pool(pool).keys.pool_nodes(pool)

            def registered() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"worker exited: {log.read_text()[-3000:]}")
                return store.client.zscore(key, name) is not None

            try:
                wait_until(registered, NODE_START_S, f"worker {name}")
            except (AssertionError, TimeoutError):
                w.stop()  # never leave a late node behind to serve a later test's queue
                raise
        return w

    yield start
    for w in started:
        w.stop()


@pytest.fixture(scope="session")
def worker(start_worker: Callable[..., WorkerProc]) -> WorkerProc:
    """The session's worker node for the ``default``, ``short`` and ``slowretry`` queues."""
    return start_worker(pools="default", concurrency=8)


def assert_idle(p: Pipeline, timeout: float = 20.0) -> None:
    """Every queue drains and no gate holds a reservation (invariant 1)."""

    def idle() -> bool:
        info = p.inspect()
        return all(
            q["pending"] == 0
            and q["retry_wait"] == 0
            and q["running"] == 0
            and q["gate"]["in_flight"] == 0
            for q in info.values()
        )

    wait_until(idle, timeout, f"idle queues and gates: {p.inspect()}")
    c = p.store.client
    # every pool's keys (on a Redis Cluster each pool has its own tagged prefix)
    prefixes = {s.keys.prefix for s in p.store.every_pool(p.settings.pools())}

    def scan(tail: str) -> list[str]:
        return [k for pre in prefixes for k in c.scan_iter(pre + tail, count=10_000)]

    leftover = [k for k in scan("gate:*:holders") if c.zcard(k)]
    assert not leftover, f"gate keys still hold slots: {leftover}"
    # nor does the dispatcher still count a request of a quota key, or hold a tenant back
    # for one (lua/sched.lua)
    counted = scan("gate:*:sent")
    assert not counted, f"quota keys still count requests: {counted}"
    held = scan("gate:*:blocked")
    assert not held, f"quota keys still hold tenants back: {held}"


# Keys a running node or dispatcher rewrites on its own (liveness, doorbells, merge state),
# which a refused input must not be blamed for: pool:*, a per-node gate's slot pools, and a
# gate's live nodes (gate:<name>:nodes, which expires once its nodes are gone).
VOLATILE_KEY = re.compile(r"pool:|gate:[^:]*@|gate:[^:]*:nodes$")


def keyspace(p: Pipeline) -> dict[str, tuple[str, int]]:
    """Every key of ``p``'s pools (and its batches' Celery results: none have a prefix) with
    its type and size: what :func:`nothing_stored` compares."""
    c = p.store.client
    prefixes = {s.keys.prefix for s in p.store.every_pool(p.settings.pools())}
    sizes = {
        "string": c.strlen,
        "hash": c.hlen,
        "list": c.llen,
        "set": c.scard,
        "zset": c.zcard,
    }
    out: dict[str, tuple[str, int]] = {}
    for pre in prefixes:
        for key in c.scan_iter(pre + "*", count=10_000):
            if VOLATILE_KEY.search(key[len(pre) :]):
                continue
            kind = c.type(key)
            size = sizes[kind](key) if kind in sizes else 0
            out[key] = (kind, size)
    return out


@contextlib.contextmanager
def nothing_stored(p: Pipeline) -> Iterator[None]:
    """Asserts that the block stored nothing and half-wrote nothing in ``p``'s Redis: no key
    appeared, none went, none changed size (a refused input at a front door)."""
    before = keyspace(p)
    yield
    after = keyspace(p)
    added = sorted(set(after) - set(before))
    gone = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    assert not (added or gone or changed), (
        f"a refused input changed Redis: added {added}, removed {gone}, resized {changed}"
    )


@pytest.fixture
def pl(env: dict[str, str], sim: SimServer) -> Iterator[Pipeline]:
    """A client bound to the test environment; checks for leaks afterwards (after answering
    any request a failed test left held at the simulator)."""
    sim.reset()
    p = Pipeline(load_settings(env))
    yield p
    sim.release_all()
    assert_idle(p)


@pytest.fixture
def served(pl: Pipeline, worker: WorkerProc) -> Pipeline:
    """``pl`` with the session worker running."""
    return pl


# -- the in-process worker node: pytest-celery's session worker ---------------------------------
# For the tests that need a Celery worker but not a separate process (the task's wiring, the
# messages the dispatch script writes, result meta, revoke). pytest-celery 1.3 loads
# ``celery.contrib.pytest``, whose ``celery_session_worker`` runs ``start_worker`` (a
# ``WorkController`` in a thread of this process) with the fixtures below. Subprocess workers
# stay where a separate process is the point: SIGKILL, prefork, time limits, warm shutdown,
# a node's own environment (metrics port, key prefix, broker acks).
IN_PROCESS_POOL = "inproc"


class InProcessNode(TestWorkController):
    """The embedded test worker as a pipeline node. Like ``celery worker`` (and unlike the
    bare test controller) it runs tasks through the worker's tracer, which gives a task its
    node's name (``request.hostname``), and sends ``worker_ready`` once it consumes, which
    starts the node's dispatcher (``tasks.node``). It does not send ``celeryd_init`` /
    ``celeryd_after_setup``: this process keeps its environment, and the node consumes with
    kombu's acks."""

    def on_before_init(self, **kwargs: Any) -> None:
        setup_worker_optimizations(self.app, self.hostname)
        super().on_before_init(**kwargs)

    def on_consumer_ready(self, consumer: Any) -> None:
        worker_ready.send(sender=consumer)
        super().on_consumer_ready(consumer)


@pytest.fixture(scope="session")
def celery_session_app(env: dict[str, str]) -> Celery:
    """The project's own app, not pytest-celery's ``TestApp``: the task, its result backend
    and the node's bootstep are registered on ``tasks.app``. ``celeryconfig`` is read when the
    app's configuration is first used — after ``env`` has set this session's variables."""
    from tasks.app import app

    assert str(app.conf.broker_url) == env["CELERY_BROKER_URL"], "app configured before env"
    return app


@pytest.fixture(scope="session")
def celery_includes() -> tuple[str, ...]:
    return ("tasks.node",)  # the dispatcher bootstep and the release signal handlers


@pytest.fixture(scope="session")
def celery_worker_pool() -> str:
    return "threads"  # the pipeline's default pool; prefork is tested with subprocess nodes


@pytest.fixture(scope="session")
def celery_worker_parameters(env: dict[str, str]) -> dict[str, Any]:
    return {
        "queues": [celery_queue(IN_PROCESS_POOL, env["PIPELINE_KEY_PREFIX"])],
        "concurrency": 4,
        "hostname": f"inproc-{RESULTS_TAG}@test",
        "WorkController": InProcessNode,
        # the ping task (celery.contrib.testing.tasks) would go to Celery's default queue,
        # which the session's subprocess node consumes; being ready is enough here
        "perform_ping_check": False,
        "shutdown_timeout": 30,
    }


@pytest.fixture
def in_process(pl: Pipeline, celery_session_worker: TestWorkController) -> Pipeline:
    """``pl`` with the in-process node serving the ``inproc`` queue (limit 2)."""
    key = pl.store.for_pool(IN_PROCESS_POOL).keys.pool_nodes(IN_PROCESS_POOL)
    wait_until(
        lambda: pl.store.client.zscore(key, celery_session_worker.hostname) is not None,
        10,
        "pl.store.client.zscore(key, celery_session_worker.hostname) is not None",
    )
    return pl
