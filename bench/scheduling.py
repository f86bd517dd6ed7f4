"""Scheduling targets measured on the real dispatch script (``Store.tick_pool``, as the
dispatcher calls it), on a private ``redis-server``; counts of dispatches, so the machine's load
does not change them:

1. merge, ``random-robin``: two backlogged queues on one pool, 400 dispatches in ticks of 1-4
   (as free slots come): each queue's share of every 40 consecutive dispatches must be
   50 % ± 10 % (16-24 of 40) with equal weights, 75 % ± 10 % (26-34) with weights 3:1.
   Three runs each (each run: a new random start). For contrast, the same windows of a fresh
   coin per dispatch (simulated, 1,000 runs): how often one misses.
2. fair share: tenant A submits 2,000 requests, then tenant B 20 at the same priority with
   later deadlines, one dispatch per tick: within how many dispatches after B's submission
   all of B's 20 went (target <= 45). Three runs.

    .venv/bin/python bench/scheduling.py     # ~10 s
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import BODY, PipelineEnv, base_parser, bench_session, log, table, verdict
from pipeline.store import sched

WINDOW = 40
DISPATCHES = 400


def windows(order: list[str], queue: str) -> tuple[int, int]:
    counts = [order[i : i + WINDOW].count(queue) for i in range(len(order) - WINDOW + 1)]
    return min(counts), max(counts)


def merge_run(penv: PipelineEnv, weights: tuple[int, int], seed: int) -> dict[str, Any]:
    p = penv.pipeline()
    s = p.store
    rng = random.Random(seed)
    deadline = time.time() + 3600
    for name in ("a", "b"):
        p.submit_many(
            [{"payload": BODY, "queue": name, "deadline": deadline} for _ in range(DISPATCHES)]
        )
    qa, qb = p.settings.queues["a"], p.settings.queues["b"]
    order: list[str] = []
    starts = (rng.random(), rng.random())
    while len(order) < DISPATCHES:
        active = sum(int(s.client.zcard(s.keys.active(q))) for q in ("a", "b"))
        entries = [
            s.queue_tick(qa, budget=1.0, rand=starts[0]),
            s.queue_tick(qb, budget=1.0, rand=starts[1]),
        ]
        res = s.tick_pool("m", entries, active + rng.randint(1, 4))
        order += [d.queue for d in res.moved]
    lo, hi = windows(order[:DISPATCHES], "a")
    expect = WINDOW * weights[0] / sum(weights)
    for name in ("a", "b"):  # empty the queues for the next run
        for key in s.client.scan_iter(s.keys.prefix + f"q:{name}:*", count=10_000):
            s.client.delete(key)
    s.client.delete(s.keys.merge("m"))
    return {"lo": lo, "hi": hi, "ok": lo >= expect - 4 and hi <= expect + 4, "expect": expect}


def coin_misses(weights: tuple[int, int], runs: int = 1000) -> tuple[float, float]:
    """How often a fresh weighted coin per dispatch leaves the ± 10 % band: in one window of
    40 dispatches, and anywhere in a run of 400."""
    rng = random.Random(1)
    share = weights[0] / sum(weights)
    expect = WINDOW * share
    first = anywhere = 0
    for _ in range(runs):
        order = ["a" if rng.random() < share else "b" for _ in range(DISPATCHES)]
        lo, hi = windows(order, "a")
        anywhere += lo < expect - 4 or hi > expect + 4
        n = order[:WINDOW].count("a")
        first += n < expect - 4 or n > expect + 4
    return first / runs, anywhere / runs


def fair_run(penv: PipelineEnv) -> int:
    p = penv.pipeline()
    s = p.store
    sched.setup(s.client, s.scripts, s.keys, "f", "fp", "userid", True)
    now = time.time()
    p.submit_many(
        [
            {"payload": BODY, "queue": "f", "deadline": now + 600 + i, "metadata": {"userid": "A"}}
            for i in range(2000)
        ]
    )
    bees = {
        r.id
        for r in p.submit_many(
            [
                {
                    "payload": BODY,
                    "queue": "f",
                    "deadline": now + 9000 + i,
                    "metadata": {"userid": "B"},
                }
                for i in range(20)
            ]
        )
    }
    q = p.settings.queues["f"]
    n = 0
    while bees:
        active = int(s.client.zcard(s.keys.active("f")))
        res = s.tick_pool("fp", [s.queue_tick(q, budget=1.0)], active + 1)
        n += len(res.moved)
        bees -= {d.id for d in res.moved}
    sched.teardown(s.client, s.keys, "f")
    for key in s.client.scan_iter(s.keys.prefix + "q:f:*", count=10_000):
        s.client.delete(key)
    return n


def main() -> int:
    ap = base_parser(__doc__.split("\n\n")[0] if __doc__ else "")
    ap.parse_args()
    rows: list[list[Any]] = []
    with bench_session(None) as (rh, workdir):
        for weights in ((1, 1), (3, 1)):
            queues = [
                {"queue_name": "a", "igw_base_url": "http://127.0.0.1:9", "worker_pool_id": "m",
                 "weight": weights[0]},
                {"queue_name": "b", "igw_base_url": "http://127.0.0.1:9", "worker_pool_id": "m",
                 "weight": weights[1]},
            ]  # fmt: skip
            penv = PipelineEnv(rh.url, queues, workdir)
            for run in range(3):
                r = merge_run(penv, weights, seed=run + 10 * weights[0])
                log(f"merge {weights}: run {run + 1}: window share of a {r['lo']}..{r['hi']}")
                rows.append(
                    [
                        f"merge {weights[0]}:{weights[1]}, run {run + 1}",
                        f"{r['lo']}..{r['hi']} of {WINDOW}",
                        f"{r['expect'] - 4:.0f}..{r['expect'] + 4:.0f}",
                        verdict(r["ok"]),
                    ]
                )
            one, anywhere = coin_misses(weights)
            rows.append(
                [
                    f"  (a fresh coin per dispatch, {weights[0]}:{weights[1]}: misses in one / "
                    "any window)",
                    f"{one:.0%} / {anywhere:.0%}",
                    "",
                    "",
                ]
            )
        fq = [
            {"queue_name": "f", "igw_base_url": "http://127.0.0.1:9", "worker_pool_id": "fp",
             "fair_share": True},
        ]  # fmt: skip
        penv = PipelineEnv(rh.url, fq, workdir)
        for run in range(3):
            n = fair_run(penv)
            log(f"fair share: run {run + 1}: B's 20 dispatched within {n}")
            rows.append(
                [
                    f"fair share: B's 20 behind A's 2,000, run {run + 1}",
                    f"within {n} dispatches",
                    "<= 45",
                    verdict(n <= 45),
                ]
            )
    print("\nScheduling (dispatch script, counts)")
    print(table(["measure", "value", "target", ""], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
