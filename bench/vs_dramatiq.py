"""Target 5, versus Dramatiq: the workload of target 1 (limit 16, 100 ms simulator, 2,000
requests) through the pipeline and through Dramatiq with ``ConcurrentRateLimiter``
(``bench/dramatiq_app.py``), back to back in the same run, as a ratio of throughputs.

Scenarios (``--only`` picks some): ``1node`` (one worker process, 64 threads each side),
``503`` (the same, every 5th request answered 503 on its first attempt), ``3nodes`` (three
worker processes of 64 threads each side; the pipeline uses ``global-max-concurrency``).
Dramatiq retries a full limiter with its Retries middleware, backoff 100..1000 ms
(``--min-backoff-ms`` / ``--max-backoff-ms``).

    .venv/bin/python bench/vs_dramatiq.py                 # ~3 min
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    BODY,
    PY,
    SLOTS,
    CpuMeter,
    RedisHandle,
    Sim,
    base_parser,
    bench_session,
    global_gate,
    local_gate,
    log,
    process_ids,
    start_proc,
    stop_proc,
    table,
    verdict,
)
from bench.utilisation import LATENCY_MS, LIMIT, scenario


def dramatiq_scenario(
    rh: RedisHandle,
    workdir: Path,
    *,
    processes: int,
    n: int,
    fail_every: int,
    min_backoff_ms: int,
    max_backoff_ms: int,
) -> dict[str, Any]:
    """``n`` requests through Dramatiq workers (``processes`` x 64 threads)."""
    rh.client.delete("bench-limit")
    sim = Sim(latency_ms=LATENCY_MS, record_arrivals=True)
    env = {
        **os.environ,
        "BENCH_REDIS_URL": rh.url,
        "BENCH_LIMIT": str(LIMIT),
        "BENCH_DRAMATIQ_MIN_BACKOFF_MS": str(min_backoff_ms),
        "BENCH_DRAMATIQ_MAX_BACKOFF_MS": str(max_backoff_ms),
    }
    os.environ.update({k: env[k] for k in env if k.startswith("BENCH_")})
    from bench import dramatiq_app

    procs = []
    try:
        for i in range(processes):
            argv = [PY, "-m", "dramatiq", "bench.dramatiq_app", "--processes", "1"]
            argv += ["--threads", str(SLOTS), "--queues", dramatiq_app.QUEUE]
            procs.append(start_proc(argv, env, workdir / f"dramatiq-{i}.log"))
        url = f"{sim.url}/v1/completions"
        body = json.dumps(BODY, separators=(",", ":"))

        def send(count: int, tag: str) -> None:
            for i in range(count):
                headers = {"Content-Type": "application/json", "x-request-id": f"{tag}-{i}"}
                if fail_every and i % fail_every == 0:
                    headers |= {"x-sim-fail-first": "1", "x-sim-fail-status": "503"}
                dramatiq_app.infer.send(url, body, headers)

        send(LIMIT * 2, f"dwarm{time.time_ns()}")  # warm-up, also waits for the workers
        sim.wait_successes(LIMIT * 2, timeout=120)
        sim.reset()
        log(f"dramatiq: {processes} process(es) up, running {n} requests")
        pids = process_ids(rh, sim, [p.pid for p in procs])
        cpu = CpuMeter(pids).start()
        t0 = time.monotonic()
        send(n, f"d{processes}{fail_every}")
        t1 = sim.last_answer(n, timeout=120 + n * 0.2)
        cpu.stop()
        stats = sim.stats()
    finally:
        for p in procs:
            stop_proc(p, 20)
        sim.stop()
    rate = n / (t1 - t0)
    ceiling = LIMIT * 1000.0 / LATENCY_MS
    res = {
        "rate": rate,
        "ratio": rate / ceiling,
        "max_conc": int(stats["max_concurrency_observed"]),
        "sim_requests": int(stats["requests"]),
        "cpu_ms": cpu.per_request_ms(n),
    }
    log(f"dramatiq: {rate:.1f} req/s, ratio {res['ratio']:.3f}, max {res['max_conc']}")
    log(f"dramatiq: CPU ms per request: {res['cpu_ms']}")
    return res


SCENARIOS = {
    "1node": ("1 node / process", 1, 0),
    "503": ("1 node, 20% first-attempt 503", 1, 5),
    "3nodes": ("3 nodes / processes", 3, 0),
}


def main() -> int:
    ap = base_parser(__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("-n", type=int, default=2000, help="requests per scenario and system")
    ap.add_argument("--only", choices=list(SCENARIOS), action="append")
    ap.add_argument("--min-backoff-ms", type=int, default=100)
    ap.add_argument("--max-backoff-ms", type=int, default=1000)
    args = ap.parse_args()
    rows = []
    with bench_session(args.redis_url) as (rh, workdir):
        for key in args.only or list(SCENARIOS):
            label, nodes, fail_every = SCENARIOS[key]
            gate = local_gate(LIMIT) if nodes == 1 else global_gate(LIMIT)
            ours = scenario(
                rh,
                workdir,
                nodes=nodes,
                gate=gate,
                n=args.n,
                fail_every=fail_every,
                label=f"pipeline, {label}",
            )
            theirs = dramatiq_scenario(
                rh,
                workdir,
                processes=nodes,
                n=args.n,
                fail_every=fail_every,
                min_backoff_ms=args.min_backoff_ms,
                max_backoff_ms=args.max_backoff_ms,
            )
            rows.append((label, ours, theirs))
    print(
        f"\nVersus Dramatiq: limit {LIMIT}, latency {LATENCY_MS:.0f} ms, ceiling "
        f"{LIMIT * 1000 / LATENCY_MS:.0f} req/s, {args.n} requests; Dramatiq backoff "
        f"{args.min_backoff_ms}..{args.max_backoff_ms} ms"
    )
    print(
        table(
            [
                "scenario",
                "pipeline req/s",
                "of ceiling",
                "max",
                "Dramatiq req/s",
                "of ceiling",
                "max",
                "HTTP attempts",
                "pipeline / Dramatiq",
            ],
            [
                [
                    label,
                    o["rate"],
                    o["ratio"],
                    o["max_conc"],
                    t["rate"],
                    t["ratio"],
                    t["max_conc"],
                    f"{o['sim_requests']} / {t['sim_requests']}",
                    f"{o['rate'] / t['rate']:.2f}x",
                ]
                for label, o, t in rows
            ],
        )
    )
    print("target 5 is a reported ratio; target 1 (>= 0.95 of ceiling, max <= 16) per system:")
    for label, o, t in rows:
        print(
            f"  {label}: pipeline {verdict(o['ok'])}, Dramatiq "
            f"{verdict(t['ratio'] >= 0.95 and t['max_conc'] <= LIMIT)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
