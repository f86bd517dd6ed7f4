"""The ``pipeline`` command: run, worker, submit, status, explain, reload, sim, flower."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from contextlib import suppress
from typing import Any

import redis

from ..config import bool_env, load_settings
from ..config.settings import DEFAULT_REDIS_URL
from ..errors import PipelineError
from ..gates import check_gates
from ..redact import redact_text, redact_url
from .args import (
    Parser,
    finite_float,
    log_level,
    non_negative_float,
    port,
    positive_float,
    positive_int,
    usage_error,
)


def _setup_logging(level: str = "INFO") -> None:
    from ..observability import logs

    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logs.log_format() == "json":
        logs.use_json(logging.getLogger())
        logging.captureWarnings(True)  # a warning too is a JSON line, not raw stderr text


def cmd_worker(args: argparse.Namespace) -> int:
    settings = check_gates(load_settings())  # a bad gate stops the node before it starts
    from ..worker import check_endpoints

    check_endpoints(settings)  # so does a missing api_key_env variable or TLS file
    configured = sorted(settings.pools())
    pools = [p for p in (args.pools or "").split(",") if p] or configured
    unknown = [p for p in pools if p not in configured]
    if unknown:
        usage_error(
            "worker",
            f"--pools: no worker pool {unknown[0]!r} in this configuration (its pools: "
            f"{', '.join(configured)})",
        )
    events = args.events
    if events is None:
        events = bool_env(os.environ, "PIPELINE_TASK_EVENTS", False)
    # the pipeline's own tasks package, wherever a module named "tasks" is on sys.path
    from .celery_face import load_tasks, run_celery

    load_tasks()  # registers the task, the bootstep and the signal handlers
    from tasks.app import app, celery_queue

    from ..observability import logs

    queues = ",".join(celery_queue(p) for p in pools)
    argv = ["worker", "-P", args.pool_impl, "-c", str(args.concurrency), "-Q", queues]
    argv += ["--loglevel", args.loglevel]
    if logs.log_format() == "json":  # no banner: every line the node writes is a JSON object
        argv.insert(0, "--quiet")
    if events:
        argv.append("-E")
    if args.hostname:
        argv += ["-n", args.hostname]
    argv += [a for a in (args.celery_args or []) if a != "--"]
    _setup_logging(args.loglevel)
    return run_celery(app, argv)  # Celery's exit status: a node stopped at start-up is not 0


def cmd_submit(args: argparse.Namespace) -> int:
    from ..client import Pipeline
    from ..client.api import SUBMIT_KEYS

    # every submit argument is an option; one not given is None, which submit reads as absent
    req = Pipeline().submit(args.payload, **{key: getattr(args, key) for key in SUBMIT_KEYS})
    print(req.id)
    if args.wait is not None:
        result = req.result(timeout=args.wait or None)
        print(json.dumps(result.to_dict()))
        return 0 if result.ok else 1
    return 0


def _json(text: str) -> Any:
    """An argument that is JSON text (``-``: read from stdin); not JSON is a usage error."""
    try:
        return json.loads(sys.stdin.read() if text == "-" else text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg}") from None


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from ..client import Pipeline
    from ..observability.status import render, status_snapshot
    from ..redact import redact_url

    p = Pipeline()
    if args.json:
        print(json.dumps(status_snapshot(p), indent=2))
    elif not args.watch:
        console = Console()
        console.print(f"[dim]redis: {redact_url(p.settings.redis_url)}")
        console.print(render(p))
    else:
        with Live(render(p), refresh_per_second=4) as live, suppress(KeyboardInterrupt):
            while True:
                time.sleep(args.interval)
                live.update(render(p))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from ..client import Pipeline
    from ..errors import UnknownRequest

    try:
        explanation = Pipeline().explain(args.id)
    except UnknownRequest:
        print(
            f"pipeline explain: unknown request id {args.id!r} (never submitted here, or its "
            "result expired)",
            file=sys.stderr,
        )
        return 2
    if args.json:
        print(json.dumps(explanation.to_dict(), indent=2))
    else:
        print(explanation.to_text())
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel each id; exit 2 naming an unknown one (the others are still cancelled)."""
    from ..client import Pipeline
    from ..errors import UnknownRequest

    p = Pipeline()
    running = "abort" if args.abort else "finish"
    code = 0
    for rid in args.ids:
        try:
            state = p.state(rid)
        except UnknownRequest:
            print(f"pipeline cancel: unknown request id {rid!r}", file=sys.stderr)
            code = 2
            continue
        if p.cancel(rid, running, args.by):
            print(f"{rid}: cancelled" + (" (its running attempt aborted)" * (state == "running")))
        elif state == "done":
            print(f"{rid}: already done")
        else:
            print(f"{rid}: running; its attempt finishes unless still waiting for a gate slot "
                  "(--abort stops it)")  # fmt: skip
    return code


def cmd_reload(args: argparse.Namespace) -> int:
    """Every live node re-reads its queue and pool files; exit 1 unless all applied it."""
    from ..store import Keys, connect
    from ..store.keys import pool_keys
    from .services import wait_until

    # only Redis and the key prefix are needed here: this host's queue file may not even
    # validate (a node checks its own)
    env = {k: v for k, v in os.environ.items() if k not in ("PIPELINE_QUEUES", "PIPELINE_POOLS")}
    settings = load_settings(env)
    keys = Keys(settings.key_prefix)
    # every pool's registry (on a Redis Cluster each in its pool's slot: any pool's tag)
    pools = pool_keys(settings.key_prefix, "*") if settings.redis_cluster else keys
    client = connect(settings.redis_url)
    sec, usec = client.time()  # liveness is scored by the server's clock
    nodes = sorted(
        {
            str(node)
            for key in client.scan_iter(pools.pool_nodes_pattern(), count=1000)
            for node in client.zrangebyscore(key, sec + usec / 1e6, "+inf")
        }
    )
    generation = int(client.incr(keys.config_reload()))
    if not nodes:
        print("no live worker node: nothing to reload", file=sys.stderr)
        return 1
    outcomes: dict[str, dict[str, Any]] = {}

    def all_answered() -> bool:
        for node, raw in zip(nodes, client.hmget(keys.config_reloads(), nodes), strict=True):
            data = json.loads(raw) if raw else {}
            if int(data.get("generation", 0)) >= generation:
                outcomes[node] = data
        return len(outcomes) == len(nodes)

    with suppress(TimeoutError):
        wait_until(all_answered, args.timeout, "the nodes", interval=0.1)
    ok = True
    for node in nodes:
        data = outcomes.get(node)
        if data is None:
            ok = False
            print(f"{node}: no answer within {args.timeout:g} s")
            continue
        ok = ok and data["result"] in ("success", "unchanged")
        detail = f": {data['reason']}" if data.get("reason") else ""
        print(f"{node}: {data['result']}{detail}")
    return 0 if ok else 1


# the tasks page shows each attempt's request id (args), queue / priority / attempt (kwargs),
# result and exception (a retry's reason, a failure's status or error code)
FLOWER_COLUMNS = (
    "--tasks_columns=name,uuid,state,args,kwargs,result,exception,received,runtime,worker"
)
FLOWER_DEFAULT_ADDRESS = "127.0.0.1"


def cmd_flower(args: argparse.Namespace) -> int:
    from .celery_face import load_tasks, run_celery
    from .flower import effective_options, joined

    argv = [FLOWER_COLUMNS]
    if args.address is not None:
        argv.append(f"--address={args.address}")
    if args.port is not None:
        argv.append(f"--port={args.port}")
    auth = os.environ.get("FLOWER_BASIC_AUTH")
    if auth:
        argv.append(f"--basic-auth={auth}")
    argv += joined([a for a in (args.flower_args or []) if a != "--"])
    # where Flower will listen, as Flower itself resolves it: FLOWER_* variables, then its
    # config file (--conf, flowerconfig.py), then the command line, last one winning
    try:
        where = effective_options(argv)
    except ValueError as exc:
        usage_error("flower", str(exc))
    if not where.address and not where.unix_socket:  # Flower's own default: every interface
        argv.append(f"--address={FLOWER_DEFAULT_ADDRESS}")
        where = where.at(FLOWER_DEFAULT_ADDRESS)
    if not 1 <= where.port <= 65535:
        usage_error("flower", f"--port: must be a TCP port 1-65535, not {where.port}")
    if not where.local and not where.authenticated:
        usage_error(
            "flower",
            f"refusing to expose Flower on {where.address}:{where.port} without "
            "FLOWER_BASIC_AUTH=user:password (or Flower's --auth): bind to 127.0.0.1",
        )
    tasks = load_tasks()
    # task events are off on the workers until a monitor asks for them: ask now, not at
    # Flower's first periodic enable_events (5 s after it starts)
    try:
        tasks.app.control.enable_events()
    except Exception as exc:  # noqa: BLE001 - Flower asks again periodically
        print(f"could not enable task events yet: {redact_text(str(exc))}", file=sys.stderr)
    return run_celery(tasks.app, ["flower", *argv])


def cmd_serve(args: argparse.Namespace) -> int:
    from ..serve import serve

    _setup_logging(args.loglevel.upper())
    serve(args.host, args.port, args.loglevel)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..batch import BatchSettings
    from ..batch.run import (
        LOST_EXIT,
        Run,
        RunError,
        RunOptions,
        StateLostRun,
        check_file,
        check_outputs,
    )
    from ..client import Pipeline
    from .services import NodeFailed, Services

    console = Console(stderr=True)
    opts = RunOptions(
        path=args.file,
        output=args.output,
        batch_id=args.batch_id,
        completion_window=args.completion_window,
        queue=args.queue,
        out_format=args.format,
        error_output=args.error_output,
        timeout=args.timeout,
        show_progress=not args.no_progress,
    )
    services = Services()

    def on_term(signum: int, _frame: Any) -> None:  # stop what we started, also on SIGTERM
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    started = time.time()
    run = None
    embedded = False
    try:
        # the arguments, the settings and the whole file are checked before anything starts
        settings = load_settings()
        if args.queue is not None and args.queue not in settings.queues:
            usage_error(
                "run",
                f"--queue: no queue named {args.queue!r} (configured: "
                f"{', '.join(sorted(settings.queues))})",
            )
        check_outputs(opts)
        _check_worker_log(args.worker_log)
        limit = BatchSettings.from_env(settings).max_lines
        check_file(args.file, settings.max_payload_bytes, limit)
        env, embedded = _start_services(args, services, console)
        pipeline = Pipeline(load_settings(env))
        _start_worker(args, services, console, env, pipeline)
        run = Run(pipeline, opts, console)
        run.start()
        batch = run.follow()
        summary = run.write(started)
        console.print(summary.table())
        console.print(f"batch {batch.id} {batch.status}; results: {opts.output}")
        if args.json_summary:
            print(json.dumps(summary.as_dict()))
        return 0
    except RunError as exc:
        print(f"pipeline run: {exc}", file=sys.stderr)
        return 2
    except StateLostRun as exc:
        print(f"pipeline run: {exc}", file=sys.stderr)
        return LOST_EXIT
    except NodeFailed as exc:
        print(f"pipeline run: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, TimeoutError) as exc:
        if run is not None and run.batch is not None:
            _stop_following(args, run, services, console, embedded)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        services.close()


def _stop_following(
    args: argparse.Namespace, run: Any, services: Any, console: Any, embedded: bool
) -> None:
    if args.cancel_on_exit:
        b = run.batches.cancel(run.batch.id)
        console.print(f"batch {b.id} cancelled ({b.status})")
        return
    console.print(run.reattach_hint(), soft_wrap=True)  # one line, to copy
    if embedded:
        console.print(
            "[yellow]its Redis is the embedded one this command started, which stops "
            "now: running the command again starts the batch afresh"
        )
    elif services.procs:
        console.print("the worker this command started stops now; re-attaching starts one")


def _start_services(
    args: argparse.Namespace, services: Any, console: Any
) -> tuple[dict[str, str], bool]:
    """An embedded Redis and the simulator when none is configured; (env, embedded Redis)."""
    env = dict(os.environ)
    settings = load_settings(env)
    embedded = bool(args.embedded_redis) or embedded_redis_needed(
        settings.redis_url,
        named=bool(env.get("PIPELINE_REDIS_URL")),
        sentinel_master=settings.redis_sentinel_master,
    )
    if embedded:
        url = services.start_redis()
        console.print(f"[dim]started an embedded redis-server ({url}): it stops with this command")
        env.update(PIPELINE_REDIS_URL=url, CELERY_BROKER_URL=url, CELERY_RESULT_BACKEND=url)
    if not env.get("PIPELINE_QUEUES") and not env.get("PIPELINE_ENDPOINT"):
        url = services.start_simulator(args.sim_latency_ms, args.sim_jitter_ms)
        console.print(f"[dim]no endpoint configured: started the simulator ({url})")
        env["PIPELINE_ENDPOINT"] = url
    os.environ.update(env)
    return env, embedded


def embedded_redis_needed(url: str, *, named: bool, sentinel_master: str | None = None) -> bool:
    """Whether ``pipeline run`` starts an embedded Redis: only for a Redis nobody named
    (``PIPELINE_REDIS_URL`` unset: ``named`` False) where nothing listens (connection
    refused). A Redis that was named and does not answer, or any Redis that refuses the
    login, the TLS handshake or anything else, is a RunError: the URL redacted, and why."""
    from ..batch.run import RunError
    from .services import probe_redis

    problem = probe_redis(url, sentinel_master=sentinel_master)
    if problem is None:
        return False
    if problem.refused and not named:
        return True
    where = "PIPELINE_REDIS_URL" if named else "PIPELINE_REDIS_URL unset: the default"
    hint = " (--embedded-redis runs on a throw-away one)" if problem.refused else ""
    raise RunError(f"no Redis to use at {redact_url(url)} ({where}): {problem.reason}{hint}")


def _check_worker_log(path: str) -> None:
    """``--worker-log`` must be a file this command can append to (RunError otherwise)."""
    from ..batch.run import RunError

    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise RunError(f"--worker-log {path}: is a directory")
    if not os.path.isdir(parent):
        raise RunError(f"--worker-log {path}: no directory {parent}")


# How long a worker node this command starts may take to register. A few seconds on a quiet
# machine; much more on a loaded one. A node that exits meanwhile fails the run at once.
NODE_START_S = 90


def _start_worker(
    args: argparse.Namespace, services: Any, console: Any, env: dict[str, str], pipeline: Any
) -> None:
    """Start a worker node for the pools the file's lines use that no live node serves, and
    wait until it registers. NodeFailed, with the last lines of its log, when it exits first
    or does not register within :data:`NODE_START_S`."""
    from .services import wait_until

    needed = _pools_used(args.file, pipeline.settings, args.queue)

    def missing_pools() -> list[str]:
        client = pipeline.store.client
        sec, usec = client.time()  # liveness is scored by the server's clock
        now = sec + usec / 1e6
        return [
            p
            for p in needed
            if client.zcount(pipeline.store.for_pool(p).keys.pool_nodes(p), now, "+inf") == 0
        ]

    pools = ",".join(missing_pools())
    if pools:
        worker_args = ["--pools", pools, "-c", str(args.concurrency), "--loglevel", "WARNING"]
        node = services.start_worker(env, worker_args, args.worker_log)
        console.print(
            f"[dim]no worker running for pool(s) {pools}: started one "
            f"({args.concurrency} slots, log: {args.worker_log})"
        )

        def registered() -> bool:
            node.check()  # NodeFailed when it has exited
            return not missing_pools()

        try:
            wait_until(registered, NODE_START_S, "the worker node")
        except TimeoutError:
            node.fail(f"did not register within {NODE_START_S} s")


def _pools_used(path: str, settings: Any, queue: str | None) -> list[str]:
    """The worker pools of the queues the file's lines name; a line naming none is in the
    batch's queue (``--queue``, else ``default``, else the first configured: as Run.start)."""
    default = queue or ("default" if "default" in settings.queues else next(iter(settings.queues)))
    queues: set[str] = set()
    with open(path, encoding="utf-8", errors="replace") as fh:
        for text in fh:
            try:
                obj = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                continue
            named = obj.get("queue", default) if isinstance(obj, dict) else None
            if isinstance(named, str) and named in settings.queues:
                queues.add(named)
    return sorted({settings.queues[q].worker_pool_id for q in queues})


def _batch_id(text: str) -> str:
    from ..batch.service import BATCH_ID

    if not BATCH_ID.match(text):
        raise argparse.ArgumentTypeError(
            f"must be 1-128 characters of [A-Za-z0-9_.-], not {text!r}"
        )
    return text


def _window(text: str) -> str:
    from ..batch.model import window_seconds
    from ..errors import InvalidRequest

    try:
        window_seconds(text)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("completion_window: ")) from None
    return text


def _serve_log_level(text: str) -> str:
    return log_level(text).lower()  # uvicorn's names


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pipeline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run a JSONL batch and write its results (resumable)")
    p.add_argument("file")
    p.add_argument("-o", "--output", default="results.jsonl")
    p.add_argument(
        "--batch-id",
        type=_batch_id,
        help="the batch to create or attach to (default: from the file's content)",
    )
    p.add_argument(
        "--completion-window", type=_window, default="24h", help="every line's deadline (24h)"
    )
    p.add_argument("--queue", help="the queue of lines that name none (default: default)")
    p.add_argument(
        "--format",
        choices=["results", "openai"],
        default="results",
        help="results: one result line per request; openai: OpenAI's output and error files",
    )
    p.add_argument("--error-output", help="--format openai: the error file (<output>.errors)")
    p.add_argument(
        "--cancel-on-exit", action="store_true", help="on Ctrl-C or --timeout, cancel the batch"
    )
    p.add_argument("--timeout", type=positive_float, help="stop waiting after this many s (exit 1)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json-summary", action="store_true", help="also print the summary as JSON")
    p.add_argument(
        "-c", "--concurrency", type=positive_int, default=64, help="slots of the worker it starts"
    )
    p.add_argument("--worker-log", default="pipeline-worker.log")
    p.add_argument(
        "--embedded-redis",
        action="store_true",
        help="run on a throw-away redis-server started here (it stops with the command, and "
        "the batch with it), whatever PIPELINE_REDIS_URL says; without it, one is started "
        "only when PIPELINE_REDIS_URL is unset and nothing listens at the default URL",
    )
    p.add_argument("--sim-latency-ms", type=non_negative_float, default=150.0)
    p.add_argument("--sim-jitter-ms", type=non_negative_float, default=200.0)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("worker", help="a Celery worker node with its dispatcher")
    p.add_argument("--pools", help="comma-separated worker pools (default: all configured)")
    p.add_argument("-c", "--concurrency", type=positive_int, default=64)
    p.add_argument("-P", "--pool-impl", default="threads", choices=["threads", "prefork", "solo"])
    p.add_argument("-n", "--hostname")
    p.add_argument("--loglevel", type=log_level, default="INFO")
    p.add_argument(
        "-E",
        "--events",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send task events from the start (also PIPELINE_TASK_EVENTS=1); by default they "
        "are off until Flower (`pipeline flower`) turns them on",
    )
    p.add_argument("celery_args", nargs=argparse.REMAINDER, help="passed to celery worker")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("submit", help="submit one request (payload as JSON, or - for stdin)")
    p.add_argument("payload", type=_json)
    p.add_argument("--queue", default="default")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--id")
    p.add_argument("--deadline", type=finite_float)
    p.add_argument("--timeout", type=finite_float)
    p.add_argument("--endpoint")
    p.add_argument("--metadata", type=_json, help="JSON object of str to str")
    p.add_argument("--headers", type=_json, help="JSON object of str to str")
    p.add_argument(
        "--wait",
        type=non_negative_float,
        nargs="?",
        const=0.0,
        help="wait for the result (optionally at most this many s)",
    )
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="queues, gates and their holders")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", action="store_true")
    p.add_argument("--interval", type=positive_float, default=1.0)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "explain", help="where a request is and why: queue position, quota, gate decisions"
    )
    p.add_argument("id", help="the request id")
    p.add_argument("--json", action="store_true", help="the same fields as JSON, for scripts")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("cancel", help="cancel requests (--abort: running attempts too)")
    p.add_argument("ids", nargs="+", metavar="ID", help="request ids")
    p.add_argument(
        "--abort",
        action="store_true",
        help="also stop a running attempt: close its connection (the model server stops)",
    )
    p.add_argument("--by", default=None, help="who cancels, for explain (default: user@host)")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("serve", help="OpenAI's Files and Batches API and a batch page")
    p.add_argument("--host", default="127.0.0.1", help="without PIPELINE_API_KEYS: loopback only")
    p.add_argument("--port", type=port, default=8080)
    p.add_argument("--loglevel", type=_serve_log_level, default="info")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "reload", help="every worker node re-reads its queue and pool files (as on SIGHUP)"
    )
    p.add_argument(
        "--timeout", type=positive_float, default=15.0, help="wait this long for the nodes"
    )
    p.set_defaults(func=cmd_reload)

    p = sub.add_parser("sim", help="the OpenAI-compatible simulator")
    from .. import sim

    sim.add_arguments(p)
    p.set_defaults(func=sim.run_from_args)

    p = sub.add_parser("flower", help="Flower for the pipeline's Celery app")
    p.add_argument(
        "--address",
        help=f"where Flower listens (default {FLOWER_DEFAULT_ADDRESS}); beyond loopback only "
        "with FLOWER_BASIC_AUTH=user:password",
    )
    p.add_argument("--port", type=port, help="default 5555")
    p.add_argument("flower_args", nargs=argparse.REMAINDER, help="passed to Flower")
    p.set_defaults(func=cmd_flower)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except PipelineError as exc:
        print(f"pipeline: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except redis.RedisError as exc:  # the Redis does not answer, refuses the login, ...
        from .services import describe_error

        url = os.environ.get("PIPELINE_REDIS_URL") or DEFAULT_REDIS_URL
        print(
            f"pipeline {args.command}: the Redis at {redact_url(url)} (PIPELINE_REDIS_URL): "
            f"{describe_error(exc)}",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130


def _one_line(text: str) -> str:
    return redact_text(" ".join(text.split()))
