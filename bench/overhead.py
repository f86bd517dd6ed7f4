"""Target 2, overhead: with a 0 ms simulator, 5,000 requests through the full pipeline
(``submit_many``, sorted set, dispatcher, gate, fenced start, result) must reach >= 1.5x plain
Celery's throughput with the same pool and slots, measured in the same run; Redis commands per
request reported beside plain Celery's.

Both run against the same Redis and the same simulator (a subprocess), one worker node each
(``-P threads -c 64`` by default), started once; rounds alternate plain, pipeline, plain, ...
and the ratio is taken of the median rates.

- plain Celery (``bench/plain_celery.py``): the client ``apply_async``-es N tasks (one producer;
  no result subscription, its cheapest path), each task POSTs to the simulator. Done when every
  task's result is in the result backend.
- pipeline: ``Pipeline.submit_many`` of N requests to a queue with a ``local-max-concurrency``
  gate whose limit is the slot count (so the gate's acquire and release run but never refuse);
  done when every request's result is written.

The pipeline runs twice per round: as configured by default (no task events until a monitor
asks for them: the same event setting as the plain baseline, Celery's default), which gives the
target ratio, and with task events on (``PIPELINE_TASK_EVENTS=1``, what a node costs while
Flower watches it), whose ratio is printed beside it.

Redis commands are ``INFO commandstats`` deltas over a round divided by N (the private
``redis-server`` sees only this benchmark; the few completion checks are subtracted). CPU ms
per request per process come from ``/proc``.

    .venv/bin/python bench/overhead.py                       # ~2 min
    .venv/bin/python bench/overhead.py -P prefork -c 2
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from pipeline.cli.services import wait_until

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    BODY,
    PY,
    SLOTS,
    CpuMeter,
    Node,
    PipelineEnv,
    RedisHandle,
    Sim,
    base_parser,
    bench_session,
    command_delta,
    fmt_commands,
    items,
    local_gate,
    log,
    queue_entry,
    start_proc,
    stop_proc,
    table,
    verdict,
)


class Plain:
    """The plain-Celery baseline: its worker node and a client."""

    def __init__(self, rh: RedisHandle, workdir: Path, pool: str, slots: int) -> None:
        os.environ["BENCH_REDIS_URL"] = rh.url
        from bench import plain_celery

        self.mod = plain_celery
        env = {**os.environ, "BENCH_REDIS_URL": rh.url}
        argv = [PY, "-m", "celery", "-A", "bench.plain_celery", "worker", "-P", pool]
        argv += ["-c", str(slots), "-Q", plain_celery.QUEUE, "--loglevel", "WARNING"]
        argv += ["-n", f"plain{os.getpid()}@bench"]
        self.proc = start_proc(argv, env, workdir / "plain-worker.log")
        self.rh = rh

    def publish(self, sim: Sim, n: int, tag: str) -> list[str]:
        """Publish ``n`` tasks, each POSTing one request to ``sim``; returns their ids."""
        from celery._state import _set_task_join_will_block

        app, post = self.mod.app, self.mod.post
        body = json.dumps(BODY, separators=(",", ":"))
        url = f"{sim.url}/v1/completions"
        ids: list[str] = []
        _set_task_join_will_block(True)  # no per-task result subscription (cheapest client)
        try:
            with app.producer_or_acquire() as producer:
                for i in range(n):
                    headers = {"Content-Type": "application/json", "x-request-id": f"{tag}-{i}"}
                    res = post.apply_async(args=(url, body, headers), producer=producer)
                    ids.append(res.id)
        finally:
            _set_task_join_will_block(False)
        return ids

    def run(self, sim: Sim, n: int, tag: str) -> tuple[float, int]:
        """Publish ``n`` tasks and wait for all their results; returns (seconds, polls)."""
        app = self.mod.app
        t0 = time.monotonic()
        ids = self.publish(sim, n, tag)
        sim.wait_successes(n, timeout=120 + n * 0.02)
        keys = [app.backend.get_key_for_task(i).decode() for i in ids]
        polls = 0

        def all_stored() -> bool:
            nonlocal polls
            polls += 1
            return (
                sum(
                    int(self.rh.client.exists(*keys[j : j + 1000]))
                    for j in range(0, len(keys), 1000)
                )
                == n
            )

        wait_until(all_stored, 30, "plain Celery results", interval=0.002)
        return time.monotonic() - t0, polls * ((n + 999) // 1000)

    def warm(self, sim: Sim) -> None:
        wait_until(lambda: self.proc.poll() is None, 1, "self.proc.poll() is None")
        self.run(sim, 200, f"plainwarm{time.time_ns()}")

    def stop(self) -> None:
        stop_proc(self.proc, 20)


WITH_EVENTS = "pipeline, task events"


def pipeline_run(penv: PipelineEnv, sim: Sim, n: int, tag: str) -> tuple[float, int]:
    """Submit ``n`` requests and wait until all are done; returns (seconds, polls). Call
    :func:`check_results` afterwards (outside any measurement)."""
    p = penv.pipeline()
    stats_key = p.store.keys.stats("ovh")
    done0 = int(p.store.client.hget(stats_key, "ok") or 0)
    batch = [dict(it, queue="ovh") for it in items(n, tag)]
    t0 = time.monotonic()
    p.submit_many(batch)
    sim.wait_successes(n, timeout=120 + n * 0.05)
    polls = 0

    def all_done() -> bool:
        nonlocal polls
        polls += 1
        return int(p.store.client.hget(stats_key, "ok") or 0) - done0 >= n

    wait_until(all_done, 30, "pipeline results", interval=0.002)
    return time.monotonic() - t0, polls


def check_results(penv: PipelineEnv, n: int, tag: str) -> None:
    """Every request of a :func:`pipeline_run` ended 200."""
    p = penv.pipeline()
    results = list(p.iter_results([it["id"] for it in items(n, tag)]))
    bad = sum(1 for r in results if r.status_code != 200)
    if bad or len(results) != n:
        raise RuntimeError(f"{bad} of {len(results)} pipeline results were not 200")


def measure(
    kind: str,
    rh: RedisHandle,
    sim: Sim,
    pids: dict[str, int],
    fn: Callable[[], tuple[float, int]],
    n: int,
) -> dict[str, Any]:
    sim.reset()
    cmd0 = rh.commandstats()
    cpu = CpuMeter(pids).start()
    elapsed, polls = fn()
    cpu.stop()
    delta = command_delta(cmd0, rh.commandstats())
    poll_cmd = "exists" if kind == "plain" else "hget"
    delta[poll_cmd] = delta.get(poll_cmd, 0) - polls
    total = sum(delta.values())
    res = {
        "kind": kind,
        "rate": n / elapsed,
        "elapsed": elapsed,
        "cmds": total / n,
        "top": fmt_commands(delta, n),
        "cpu_ms": cpu.per_request_ms(n),
    }
    log(f"{kind}: {res['rate']:.0f} req/s, {res['cmds']:.1f} Redis cmds/req ({res['top']})")
    log(f"{kind}: CPU ms per request: {res['cpu_ms']}")
    return res


def main() -> int:
    ap = base_parser(__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("-n", type=int, default=5000, help="requests per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each (alternating)")
    ap.add_argument("-P", "--pool", default="threads", choices=["threads", "prefork"])
    ap.add_argument("-c", "--concurrency", type=int, default=SLOTS, help="slots per worker node")
    ap.add_argument(
        "--loglevel",
        default="INFO",
        help="the pipeline nodes' log level (default INFO, `pipeline worker`'s own; plain Celery "
        "runs at WARNING, `celery worker`'s own)",
    )
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with bench_session(args.redis_url) as (rh, workdir):
        sim = Sim(latency_ms=0)
        plain: Plain | None = None
        nodes: list[Node] = []
        try:
            gate = local_gate(args.concurrency)
            envs = {
                kind: PipelineEnv(
                    rh.url, [queue_entry("ovh", sim.url, **gate)], workdir, extra=extra
                )
                for kind, extra in (
                    ("pipeline", {}),
                    (WITH_EVENTS, {"PIPELINE_TASK_EVENTS": "1"}),
                )
            }
            pids: dict[str, dict[str, int]] = {}
            for kind, penv in envs.items():
                node = Node(
                    penv, concurrency=args.concurrency, pool_impl=args.pool, loglevel=args.loglevel
                )
                nodes.append(node)
                pipeline_run(penv, sim, 200, f"pwarm{len(nodes)}")
                pids[kind] = {"worker": node.proc.pid}
            plain = Plain(rh, workdir, args.pool, args.concurrency)
            plain.warm(sim)
            pids["plain"] = {"worker": plain.proc.pid}
            for p in pids.values():
                p.update(sim=sim.proc.pid, client=os.getpid())
                if rh.proc is not None:
                    p["redis"] = rh.proc.pid
            for r in range(args.rounds):
                log(f"round {r + 1}/{args.rounds}: plain Celery, {args.n} tasks")
                run_plain = partial(plain.run, sim, args.n, f"plain{r}")
                rows.append(measure("plain", rh, sim, pids["plain"], run_plain, args.n))
                for kind, penv in envs.items():
                    log(f"round {r + 1}/{args.rounds}: {kind}, {args.n} requests")
                    run_ours = partial(pipeline_run, penv, sim, args.n, f"{kind}{r}")
                    rows.append(measure(kind, rh, sim, pids[kind], run_ours, args.n))
                    check_results(penv, args.n, f"{kind}{r}")
        finally:
            if plain is not None:
                plain.stop()
            for node in nodes:
                node.stop()
            sim.stop()

    def median(kind: str, field: str) -> float:
        return statistics.median(r[field] for r in rows if r["kind"] == kind)

    plain_rate, ours_rate = median("plain", "rate"), median("pipeline", "rate")
    plain_cmds, ours_cmds = median("plain", "cmds"), median("pipeline", "cmds")
    ratio = ours_rate / plain_rate
    print(
        f"\nOverhead: 0 ms simulator, {args.n} requests per round, {args.rounds} rounds each, "
        f"-P {args.pool} -c {args.concurrency}, pipeline nodes at {args.loglevel}"
    )
    print(
        table(
            ["round", "system", "req/s", "Redis cmds/req", "CPU ms/req (by process)"],
            [
                [i // (1 + len(envs)) + 1, r["kind"], r["rate"], r["cmds"], r["cpu_ms"]]
                for i, r in enumerate(rows)
            ],
        )
    )
    print("\nRedis commands per request, by command (last round):")
    for kind in ("plain", "pipeline", WITH_EVENTS):
        last = [r for r in rows if r["kind"] == kind][-1]
        print(f"  {kind:8s} {last['cmds']:.1f}: {last['top']}")
    events_rate, events_cmds = median(WITH_EVENTS, "rate"), median(WITH_EVENTS, "cmds")
    print(
        f"\nmedian: plain Celery {plain_rate:.0f} req/s ({plain_cmds:.1f} cmds/req), "
        f"pipeline {ours_rate:.0f} req/s ({ours_cmds:.1f} cmds/req), "
        f"pipeline with task events {events_rate:.0f} req/s ({events_cmds:.1f} cmds/req)"
    )
    print(
        f"ratio pipeline / plain Celery (neither sends task events) = {ratio:.3f}  "
        f"target >= 1.5  {verdict(ratio >= 1.5)}"
    )
    with_events = events_rate / plain_rate
    print(f"ratio with the pipeline's task events on (Flower watching) = {with_events:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
