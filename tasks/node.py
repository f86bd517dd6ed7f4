"""Worker-node integration: a bootstep that runs the dispatcher (and the config reloader) in
the worker's main process, and the signal handlers that release reservations on paths where
no task hook runs. ``SIGHUP`` reloads the node's queue and pool files (Celery's own SIGHUP
handler would restart the worker)."""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import bootsteps
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    celeryd_after_setup,
    celeryd_init,
    task_postrun,
    task_revoked,
    worker_init,
    worker_process_init,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from celery.worker import state as worker_state

from pipeline.config import Settings
from pipeline.dispatch import Dispatcher
from pipeline.errors import UnsafeRedis
from pipeline.observability import health, logs, metrics, tracing
from pipeline.redact import redact_text, redact_url
from pipeline.store import DirectPublish, Dispatched, check_redis
from pipeline.worker import check_endpoints, runtime
from pipeline.worker.limits import ensure_open_files
from pipeline.worker.process import SNAPSHOT_ENV
from pipeline.worker.reload import Reloader

from . import compat
from .app import app, celery_queue, pool_of
from .inference import attempt_id, infer

log = logging.getLogger("pipeline.node")
_shutting_down = threading.Event()
# the schemes of a Redis broker (kombu's redis and sentinel transports share its key layout)
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "sentinel://")
EXIT_UNSAFE_REDIS = 2
EXIT_STARTUP_FAILED = 3


@contextmanager
def startup_step(step: str) -> Iterator[None]:
    """One step of the node's start-up (its settings, the Redis check, the metrics directory,
    the reload snapshot, the dispatcher...). An exception in it stops the node: one ERROR line
    naming the step, exit status :data:`EXIT_STARTUP_FAILED`. Celery logs and swallows an
    exception raised by a signal handler and would report the node ready without the step;
    a ``SystemExit`` passes through it (and through the worker's start, as its exit status)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - any failure stops the node, named
        log.error(
            "node start-up failed at %s: %s: %s; stopping",
            step,
            type(exc).__name__,
            redact_text(" ".join(str(exc).split())),
        )
        raise SystemExit(EXIT_STARTUP_FAILED) from None


def send_to_celery(moved: list[Dispatched]) -> None:
    """Publish dispatched attempts, in order, over one producer connection: one Redis
    round trip for the whole batch where the transport can batch (kombu's Redis transport)."""
    settings = runtime().settings
    with app.producer_or_acquire() as producer, producer.batch():
        for d in moved:
            pool = settings.queues[d.queue].worker_pool_id
            kwargs: dict[str, Any] = {
                "queue": d.queue,
                "priority": d.priority,
                "attempt": d.dispatch_no,
            }
            if d.tenant:
                kwargs["tenant"] = d.tenant
            infer.apply_async(
                args=(d.id, d.token),
                kwargs=kwargs,
                task_id=d.id,
                queue=celery_queue(pool),
                producer=producer,
            )


def direct_publish(settings: Settings, pools: list[str], origin: str) -> dict[str, DirectPublish]:
    """Pools whose attempts the dispatch script can push into Celery itself: when the broker is
    the pipeline's own Redis (the same URL) with kombu's plain key layout. Otherwise (RabbitMQ,
    another Redis, ``global_keyprefix``, ``PIPELINE_DIRECT_PUBLISH=0``) the dispatcher
    publishes through ``apply_async``."""
    conf = app.conf
    options = conf.broker_transport_options or {}
    if (
        not settings.direct_publish
        or str(conf.broker_url or "") != settings.redis_url
        or not settings.redis_url.startswith(REDIS_SCHEMES)
        or options.get("global_keyprefix")
    ):
        return {}
    return {p: DirectPublish(celery_queue(p), infer.name, origin) for p in pools}


def served_pools(worker: Any) -> list[str]:
    names = list(worker.app.amqp.queues.consume_from or worker.app.amqp.queues)
    pools = [p for p in (pool_of(n) for n in names) if p]
    return pools or ["default"]


class DispatcherStep(bootsteps.StartStopStep):
    """Runs a :class:`Dispatcher` next to the consumer of a worker node."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.dispatchers: list[Dispatcher] = []
        self.reloader: Reloader | None = None

    def start(self, worker: Any) -> None:
        with startup_step("the dispatcher's setup"):
            self._start(worker)

    def _start(self, worker: Any) -> None:
        _shutting_down.clear()
        rt = runtime()
        for warning in check_endpoints(rt.settings):
            log.warning("%s", warning)
        fd_warning = ensure_open_files(int(worker.concurrency or 1))
        if fd_warning:
            log.warning("%s", fd_warning)
        pools = served_pools(worker)
        direct = direct_publish(rt.settings, pools, f"{os.getpid()}@{worker.hostname}")
        # on a Redis Cluster a dispatcher per pool: each ticks and waits in its pool's slot
        groups = [[p] for p in pools] if rt.settings.redis_cluster else [pools]
        self.dispatchers = [
            Dispatcher(
                rt.settings,
                group,
                node=worker.hostname,
                slots=int(worker.concurrency or 1),
                send=send_to_celery,
                store=rt.store.for_pool(group[0]),
                direct=direct,
            )
            for group in groups
        ]
        self.reloader = Reloader(rt, worker.hostname, self.dispatchers)
        metrics.config_applied(time.time(), reload=False)
        # started by worker_ready: a node offers its slots only once it consumes, so nothing
        # is dispatched into a queue nobody reads yet
        _ready_to_start.append((worker, self.dispatchers, self.reloader))

    def stop(self, worker: Any) -> None:
        _shutting_down.set()
        health.stop_node()
        if self.reloader is not None:
            self.reloader.stop()
            self.reloader = None
        for dispatcher in self.dispatchers:
            dispatcher.stop()
        self.dispatchers = []


app.steps["worker"].add(DispatcherStep)
_ready_to_start: list[tuple[Any, list[Dispatcher], Reloader]] = []


def freeze_startup_heap(collect: bool = True) -> None:
    """Move what the node allocated while starting (Celery, kombu, the app, its settings) into
    the collector's permanent generation, so a full collection walks only what came later.
    Unfrozen, a full collection of a started worker's heap holds the GIL in the middle of a run
    long enough to stall every slot's hand-off behind it (figures: BENCHMARKS.md)."""
    if collect:
        gc.collect()
    gc.freeze()


@worker_process_init.connect
def _on_process_init(**_: Any) -> None:
    # a prefork child: its heap is the parent's copy; no collect (it would dirty shared pages)
    freeze_startup_heap(collect=False)
    # a reload is the node's (its main process); a child follows the node's snapshot
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def _reload_on_sighup(reloader: Reloader) -> None:
    """SIGHUP reloads the config instead of restarting the worker (Celery's handler, installed
    when the worker started, is replaced)."""
    if threading.current_thread() is not threading.main_thread():
        log.warning("not in the main thread: SIGHUP does not reload (use `pipeline reload`)")
        return
    signal.signal(signal.SIGHUP, lambda *_: reloader.request())


@worker_ready.connect
def _on_ready(**_: Any) -> None:
    """The node consumes: start its dispatchers, reloader and metrics endpoint (a failure
    stops the node before Celery reports it ready)."""
    while _ready_to_start:
        worker, dispatchers, reloader = _ready_to_start.pop()
        with startup_step("starting the dispatcher"):
            for dispatcher in dispatchers:
                dispatcher.start()
        with startup_step("starting the config reloader"):
            reloader.start()
            _reload_on_sighup(reloader)
        with startup_step("the metrics endpoint"):
            health.start_node(worker, dispatchers, dispatchers[0].settings)
        log.info(
            "pipeline dispatcher started on %s for pools %s (%s slots)",
            worker.hostname,
            ", ".join(p for d in dispatchers for p in d.pools),
            worker.concurrency,
        )
    freeze_startup_heap()


@worker_init.connect
def _on_worker_init(**_: Any) -> None:
    """A worker node is being built (``celery worker``, ``pipeline worker``, an embedded test
    node), before it connects to the broker or forks its pool: patch kombu here, never on
    ``import tasks`` (a client, ``pipeline serve`` or Flower imports it too). A kombu outside
    the pinned range stops the node, naming tasks/compat.py."""
    with startup_step("the kombu patches (tasks/compat.py)"):
        compat.install()


@celeryd_init.connect
def _on_init(sender: str | None = None, **_: Any) -> None:
    """Name this node before the pool forks, so every process of the node (prefork children
    included) shares per-node gate state under the worker's hostname."""
    if sender:
        os.environ["PIPELINE_NODE"] = sender
    with startup_step("loading the node's settings"):
        runtime()
    with startup_step("the Redis check"):
        refuse_unsafe_redis()
    with startup_step("the metrics setup"):
        metrics.setup_node(sender)
    with startup_step("the reload snapshot"):
        _snapshot_path()


def _snapshot_path() -> None:
    """Where this node writes the config it accepted on a reload, for its pool children (a
    fresh private directory per node start, removed at exit; see ``Runtime.follow_snapshot``).
    Never inherited: a node started by another process gets its own."""
    os.environ[SNAPSHOT_ENV] = os.path.join(metrics.private_dir("pipeline-config-"), "config.json")


def refuse_unsafe_redis() -> None:
    """Stop the node before it starts (exit 2, one log line naming the setting and the fix)
    when the pipeline's Redis is a Redis Cluster node, or may evict keys (``maxmemory-policy``
    other than ``noeviction``) unless ``PIPELINE_ALLOW_EVICTION=1`` (then a warning, at every
    start)."""
    rt = runtime()
    where = redact_url(rt.settings.redis_url)
    try:
        check_redis(rt.store.client, where, allow=rt.settings.allow_eviction)
    except UnsafeRedis as exc:
        log.critical("refusing to start: %s", exc)
        raise SystemExit(EXIT_UNSAFE_REDIS) from None


@celeryd_after_setup.connect
def _on_after_setup(sender: str | None = None, instance: Any = None, **_: Any) -> None:
    """On a Redis broker, consume the pipeline's Celery queues without kombu's unacked
    bookkeeping (``no_ack``): two Redis round trips per message in the consumer's thread
    (record on delivery, delete on ack) for a redelivery the pipeline never needs — a lost
    attempt's request is requeued by the pipeline's reaper when its lease lapses, and a stale
    message is fenced off by its token. Celery's ``worker_disable_prefetch`` then bounds what
    a node takes to its free execution slots, as the prefetch count did."""
    with startup_step("the broker consumer's setup"):
        _consume_without_acks(instance)


def _consume_without_acks(instance: Any) -> None:
    if instance is None or not no_ack_broker(instance.app):
        return
    queues = instance.app.amqp.queues
    consumed = queues.consume_from or queues
    no_ack = [name for name in consumed if pool_of(name) is not None]
    for name in no_ack:
        consumed[name].no_ack = True
    instance.app.conf.worker_disable_prefetch = True
    # and so does a BRPOP's batch (tasks/compat.py): what Celery's bound leaves free
    slots = getattr(instance, "max_concurrency", None) or instance.concurrency
    compat.bound_batches(lambda: int(slots) - len(worker_state.reserved_requests), no_ack)


def no_ack_broker(celery_app: Any) -> bool:
    """Whether the pipeline's queues are consumed without acks: a Redis broker, unless
    ``PIPELINE_BROKER_ACKS=1`` keeps kombu's acks (and its visibility-timeout redelivery)."""
    url = str(celery_app.conf.broker_url or "")
    return url.startswith(REDIS_SCHEMES) and not runtime().settings.broker_acks


@worker_shutting_down.connect
def _on_shutting_down(**_: Any) -> None:
    _shutting_down.set()
    # attempts parked for a slot give it up and go back to their queue: a warm shutdown
    # waits for running attempts, not for parked ones
    runtime().bell.close()


@worker_shutdown.connect
def _on_shutdown(**_: Any) -> None:
    """The very end of a node (after a warm shutdown drained the pool): attempts of this
    process still live were cut off (a cold shutdown of the threads pool): requeue them."""
    rt = runtime()
    for who in rt.live_attempts():
        rt.abandon(who, cancel=False, reason="worker shutdown")
    tracing.shutdown()  # flush the spans (re-enqueue ones included) before the process ends


@task_revoked.connect
def _on_revoked(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    expired: bool = False,
    **_: Any,
) -> None:
    """A revoked attempt (``request`` is the task's context): cancelled by a user — a revoked
    id stays revoked in Celery, so every later message of it is discarded, and the request
    must end — or killed by a cold shutdown (requeued)."""
    if request is None or getattr(sender, "name", None) != infer.name:
        return
    who = attempt_id(list(request.args or ()), request.kwargs or {})
    if who is None:
        return
    cancel = not _shutting_down.is_set()
    runtime().abandon(who, cancel=cancel, reason="revoked" if cancel else "worker shutdown")


# Celery's "Task … received" line, one per attempt: it says nothing the attempt's outcome line
# does not (that names the id too, with status, attempts and latency), and on a busy node its
# formatting and writing hold the GIL, time every slot hand-over waits behind (figures:
# BENCHMARKS.md). It shows at DEBUG.
RECEIVED_LOGGER = "celery.worker.strategy"


@after_setup_logger.connect
@after_setup_task_logger.connect
def _on_logging_setup(
    logger: logging.Logger | None = None, loglevel: int | str | None = None, **_: Any
) -> None:
    """Celery's handlers (the root logger's and ``celery.task``'s, in the node and in every
    prefork child) write each line in one lock-free write (``logs.LineHandler``), with
    ``PIPELINE_LOG_FORMAT=json`` one JSON object per line. Above DEBUG,
    Celery's per-attempt "received" line is left out (:data:`RECEIVED_LOGGER`)."""
    if logger is not None:
        logs.use_line_handlers(logger)
        if logs.log_format() == "json":
            logs.use_json(logger)
    level = logging.getLevelName(loglevel) if isinstance(loglevel, str) else loglevel
    if isinstance(level, int) and level > logging.DEBUG:
        logging.getLogger(RECEIVED_LOGGER).setLevel(logging.WARNING)


@task_postrun.connect
def _on_postrun(**_: Any) -> None:
    """After every attempt (retries included, once Celery logged its line): the pool thread's
    log context is the next attempt's, not this one's."""
    logs.clear()
