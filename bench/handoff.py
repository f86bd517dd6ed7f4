"""Target 3, hand-off: the time from a gate slot's release to the next request's arrival at the
simulator must be p99 <= 5 ms (the reference polls every second).

A queue with a ``local-max-concurrency`` gate (limit 1 by default) on one worker node, a
backlog of requests, the simulator recording ``(arrival, finish)`` per answered request. With
limit L, the k-th arrival (k >= L, in time order) can only start once k - L + 1 requests have
finished, so its hand-off is ``arrival[k] - finish[k - L]`` (both sorted). The finish time is
taken just before the simulator writes the response, so a hand-off covers: response on the
wire, the worker reading it, release of the slot, the result write that rings the
dispatcher's doorbell, a dispatch tick, the Celery message, the worker's consumer, the task's
fenced start and gate acquire, and the next HTTP request.

    .venv/bin/python bench/handoff.py                 # limit 1, 20 ms latency, 500 requests
    .venv/bin/python bench/handoff.py --limit 16 --latency-ms 100 -n 2000
    .venv/bin/python bench/handoff.py --cluster      # the state on a 3-primary Redis Cluster
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Node,
    PipelineEnv,
    Sim,
    add_cluster_args,
    base_parser,
    bench_session,
    items,
    local_gate,
    log,
    pct,
    queue_entry,
    table,
    verdict,
)


def handoffs(arrivals: list[tuple[float, float, str]], limit: int) -> list[float]:
    """Seconds from the (k - limit)-th finish to the k-th arrival, for every k >= limit."""
    starts = sorted(a[0] for a in arrivals)
    ends = sorted(a[1] for a in arrivals)
    return [starts[k] - ends[k - limit] for k in range(limit, len(starts))]


def lost_time(arrivals: list[tuple[float, float, str]], t0: float, limit: int) -> dict[str, float]:
    """Where a run of ``limit`` slots lost time against the server's ceiling, in seconds of the
    run (slot-seconds over ``limit``): ``start`` (the first submit to the first arrival: the
    client's submit, the first dispatch), ``ramp`` (filling the first ``limit`` slots),
    ``hand-offs`` (each later arrival's wait for the slot a finish freed: see
    :func:`handoffs`), ``end`` (the last ones finishing one by one) and ``service`` (the
    server's own time past its nominal latency is not counted here: it is the server's)."""
    starts = sorted(a[0] for a in arrivals)
    ends = sorted(a[1] for a in arrivals)
    last = ends[-1]
    k = min(limit, len(starts))
    return {
        "start": starts[0] - t0,
        "ramp": sum(s - starts[0] for s in starts[:k]) / limit,
        "hand-offs": sum(handoffs(arrivals, limit)) / limit,
        "end": sum(last - e for e in ends[-k:]) / limit,
    }


def mean_concurrency(arrivals: list[tuple[float, float, str]]) -> float:
    """Average number of requests at the simulator between the first arrival and last finish."""
    if not arrivals:
        return 0.0
    busy = sum(f - a for a, f, _ in arrivals)
    span = max(f for _, f, _ in arrivals) - min(a for a, _, _ in arrivals)
    return busy / span if span > 0 else 0.0


def run(
    redis_url: str,
    workdir: Path,
    limit: int,
    latency_ms: float,
    n: int,
    broker_url: str | None = None,
) -> dict[str, Any]:
    sim = Sim(latency_ms=latency_ms, record_arrivals=True)
    node: Node | None = None
    try:
        queue = queue_entry("handoff", sim.url, **local_gate(limit))
        penv = PipelineEnv(redis_url, [queue], workdir, broker_url=broker_url)
        node = Node(penv)
        p = penv.pipeline()
        warm = [dict(it, queue="handoff") for it in items(20, "hw")]
        list(p.iter_results([r.id for r in p.submit_many(warm)]))
        sim.reset()
        log(f"limit {limit}, {latency_ms:g} ms: {n} requests")
        t0 = time.monotonic()
        reqs = p.submit_many([dict(it, queue="handoff") for it in items(n, "h")])
        sim.wait_successes(n, timeout=60 + n * (latency_ms / 1000 + 0.05))
        elapsed = time.monotonic() - t0
        results = list(p.iter_results([r.id for r in reqs]))
        arrivals = sim.arrivals()
        stats = sim.stats()
    finally:
        if node is not None:
            node.stop()
        sim.stop()
    gaps = [g * 1000 for g in handoffs(arrivals, limit)]
    return {
        "limit": limit,
        "latency_ms": latency_ms,
        "n": n,
        "rate": n / elapsed,
        "p50": pct(gaps, 50),
        "p90": pct(gaps, 90),
        "p99": pct(gaps, 99),
        "max": max(gaps) if gaps else float("nan"),
        "mean_conc": mean_concurrency(arrivals),
        "max_conc": int(stats["max_concurrency_observed"]),
        "not_ok": sum(1 for r in results if r.status_code != 200),
    }


def main() -> int:
    ap = base_parser(__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("--limit", type=int, default=1, help="gate limit (local-max-concurrency)")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="simulator latency")
    ap.add_argument("-n", type=int, default=500, help="requests")
    add_cluster_args(ap)
    args = ap.parse_args()
    with bench_session(args.redis_url, args.cluster, args.replicas) as (rh, workdir):
        r = run(rh.url, workdir, args.limit, args.latency_ms, args.n, rh.broker_url)
    ok = r["p99"] <= 5.0
    print(
        f"\nHand-off: limit {r['limit']}, simulator latency {r['latency_ms']:g} ms, {r['n']} "
        f"requests, one worker node (threads, 64 slots)"
        + ("; the state on a 3-primary Redis Cluster, a standalone broker" if args.cluster else "")
    )
    print(
        table(
            [
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "max ms",
                "req/s",
                "mean at sim",
                "max at sim",
                "not 200",
                "target",
            ],
            [
                [
                    r["p50"],
                    r["p90"],
                    r["p99"],
                    r["max"],
                    r["rate"],
                    r["mean_conc"],
                    r["max_conc"],
                    r["not_ok"],
                    verdict(ok),
                ]
            ],
        )
    )
    print("target: p99 <= 5 ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
