"""``pipeline up``: a local stack in one command, kept running until Ctrl-C. A Redis (the one
at the default URL when it answers, else an embedded one on its port, so every other command
finds it with no setting), the simulator unless ``PIPELINE_QUEUES`` / ``PIPELINE_ENDPOINT``
name a model server, a worker node and the Batch API. Stops them newest first: the Batch API,
the worker, the Redis last (:meth:`Services.close`)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from typing import Any
from urllib.parse import urlsplit

from ..config import load_settings
from ..config.settings import DEFAULT_REDIS_URL
from ..redact import redact_url
from .args import usage_error
from .services import NODE_START_S, NodeFailed, Services, probe_redis, wait_until

SERVE_START_S = 60  # how long the Batch API may take to listen on a loaded machine


def cmd_up(args: argparse.Namespace) -> int:
    services = Services()
    embedded = False

    def on_term(signum: int, _frame: Any) -> None:  # SIGTERM stops the stack as Ctrl-C does
        raise KeyboardInterrupt

    # Ctrl-C too, also when started from a shell that ignores it in background jobs
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_term)
    try:
        load_settings()  # a bad setting stops here, before anything starts
        env = dict(os.environ)
        embedded = _redis(args, services, env)
        if not env.get("PIPELINE_QUEUES") and not env.get("PIPELINE_ENDPOINT"):
            url = services.start_simulator(args.sim_latency_ms, args.sim_jitter_ms)
            env["PIPELINE_ENDPOINT"] = url
            say(f"model:     the simulator at {url} (PIPELINE_ENDPOINT unset)")
        else:
            say("model:     the queues' own servers (PIPELINE_QUEUES / PIPELINE_ENDPOINT)")
        node = _worker(args, services, env)
        serve = _serve(args, services, env)
        say(f"Batch API: http://{args.host}:{args.port}/v1 (log: {args.serve_log})")
        say('ready: in another shell, `pipeline submit \'{"prompt": "hi"}\' --wait`; Ctrl-C stops')
        while True:  # until Ctrl-C, or until a part of the stack stops on its own
            for name, proc, log in (
                ("worker", node.proc, node.log_path),
                ("Batch API", serve, args.serve_log),
            ):
                code = proc.poll()
                if code is not None:
                    print(f"pipeline up: the {name} stopped ({code}; log: {log})", file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        say("stopping: the Batch API, the worker" + ", then the embedded Redis" * embedded)
        return 0
    except (NodeFailed, RuntimeError) as exc:
        print(f"pipeline up: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut it short
        services.close()


def say(line: str) -> None:
    print(line, flush=True)


def _redis(args: argparse.Namespace, services: Services, env: dict[str, str]) -> bool:
    """The Redis of the stack, named in ``env`` for its children: ``--embedded-redis`` (a
    free port), else the one named or at the default URL when it answers, else an embedded one
    at the default URL's port when nothing listens there (exit 2 otherwise). True when it
    started one."""
    named = env.get("PIPELINE_REDIS_URL")
    url = named or DEFAULT_REDIS_URL
    where = "PIPELINE_REDIS_URL" if named else "the default URL"
    if not args.embedded_redis:
        settings = load_settings(env)
        problem = probe_redis(url, sentinel_master=settings.redis_sentinel_master)
        if problem is None:
            say(f"redis:     {redact_url(url)} ({where}; already running: it stays up)")
            return False
        if named or not problem.refused:
            usage_error(
                "up",
                f"no Redis to use at {redact_url(url)} ({where}): {problem.reason} "
                "(--embedded-redis runs a throw-away one)",
            )
    port = 0 if args.embedded_redis else (urlsplit(url).port or 6379)
    url = services.start_redis(port)
    env.update(PIPELINE_REDIS_URL=url, CELERY_BROKER_URL=url, CELERY_RESULT_BACKEND=url)
    hint = "" if port else f"; other shells: export PIPELINE_REDIS_URL={url}"
    say(f"redis:     {url} (embedded, not persistent: it stops with this command{hint})")
    return True


def _worker(args: argparse.Namespace, services: Services, env: dict[str, str]) -> Any:
    """A worker node for every pool, registered (NodeFailed with its log's tail otherwise)."""
    from ..client import Pipeline

    pipeline = Pipeline(load_settings(env))
    pools = sorted(pipeline.settings.pools())
    worker_args = ["-c", str(args.concurrency), "--loglevel", "WARNING"]
    node = services.start_worker(env, worker_args, args.worker_log)

    def registered() -> bool:
        node.check()  # NodeFailed when it has exited
        client = pipeline.store.client
        sec, usec = client.time()  # liveness is scored by the server's clock
        now = sec + usec / 1e6
        return all(
            client.zcount(pipeline.store.for_pool(p).keys.pool_nodes(p), now, "+inf") > 0
            for p in pools
        )

    try:
        wait_until(registered, NODE_START_S, "the worker node")
    except TimeoutError:
        node.fail(f"did not register within {NODE_START_S} s")
    say(f"worker:    pools {', '.join(pools)}, {args.concurrency} slots (log: {args.worker_log})")
    return node


def _serve(args: argparse.Namespace, services: Services, env: dict[str, str]) -> Any:
    """``pipeline serve`` as a child, listening (RuntimeError naming its log otherwise)."""
    proc = services.start_serve(
        env, ["--host", args.host, "--port", str(args.port)], args.serve_log
    )

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(
                f"pipeline serve exited with status {proc.returncode}: see {args.serve_log}"
            )
        try:
            socket.create_connection((args.host, args.port), timeout=0.5).close()
        except OSError:
            return False
        return True

    try:
        wait_until(listening, SERVE_START_S, "pipeline serve", interval=0.1)
    except TimeoutError:
        raise RuntimeError(
            f"pipeline serve did not listen within {SERVE_START_S} s: see {args.serve_log}"
        ) from None
    return proc


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .args import non_negative_float, port, positive_int

    p.add_argument("--host", default="127.0.0.1", help="where the Batch API listens")
    p.add_argument("--port", type=port, default=8080, help="the Batch API's port (8080)")
    p.add_argument(
        "-c", "--concurrency", type=positive_int, default=64, help="the worker's slots (64)"
    )
    p.add_argument(
        "--embedded-redis",
        action="store_true",
        help="always start a throw-away redis-server, on a free port (it stops with the "
        "command); without it, one is started only when nothing listens at the default URL",
    )
    p.add_argument("--worker-log", default="pipeline-worker.log")
    p.add_argument("--serve-log", default="pipeline-serve.log")
    p.add_argument("--sim-latency-ms", type=non_negative_float, default=150.0)
    p.add_argument("--sim-jitter-ms", type=non_negative_float, default=200.0)
    p.set_defaults(func=cmd_up)
