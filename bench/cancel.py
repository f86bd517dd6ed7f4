"""Cancel that stops running work: how soon ``cancel(id, running="abort")`` closes a running
attempt's connection, across worker nodes, for attempts mid-call and attempts parked at their
worker for a gate slot. Target (issue 33): p99 <= 1 s over 200 cancels on 3 nodes, 0 gate
reservations left, 0 responses written after the cancel.

Three worker nodes (``--nodes``, threads, ``--concurrency`` each) serve one queue behind a
``global-max-concurrency`` gate (``--limit``); the simulator answers after ``--latency-ms``
(2 min by default: no call ends on its own). Requests are submitted, and in rounds the bench
cancels, one by one in random order, every request that has a running attempt: those the
simulator has (mid-call) and those parked at a node for the gate (running, not at the
simulator). Per mid-call cancel, the delay is from just before ``cancel()`` to the moment the
simulator saw the client hang up (``/sim/hangups``, both on this machine's clock). A parked one
must never reach the simulator. At the end every request has exactly one result, CANCELLED,
written by the cancel, the simulator answered nothing, and no gate holds a reservation.

    .venv/bin/python bench/cancel.py                  # 200 cancels, 3 nodes, ~1 min
    .venv/bin/python bench/cancel.py --cancels 50 --nodes 1
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    BODY,
    Node,
    PipelineEnv,
    Sim,
    base_parser,
    bench_session,
    global_gate,
    log,
    pct,
    queue_entry,
    table,
    verdict,
)
from pipeline.cli.services import wait_until

QUEUE = "cancel"


def running_ids(pl: Any, ids: list[str]) -> list[str]:
    """The ids among ``ids`` whose request has a running attempt."""
    store = pl.store_of(QUEUE)
    with store.client.pipeline(transaction=False) as p:
        for rid in ids:
            p.hget(store.keys.request(rid), "state")
        states = p.execute()
    return [rid for rid, s in zip(ids, states, strict=True) if s == "running"]


def idle(pl: Any) -> bool:
    q = pl.inspect()[QUEUE]
    return bool(q["pending"] == q["retry_wait"] == q["running"] == q["gate"]["in_flight"] == 0)


def main() -> int:
    ap = base_parser(__doc__ or "")
    ap.add_argument("--cancels", type=int, default=200, help="running attempts to cancel")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16, help="threads per node")
    ap.add_argument("--limit", type=int, default=16, help="the global gate's limit")
    ap.add_argument("--latency-ms", type=float, default=120_000.0)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    total = args.cancels + args.nodes * args.concurrency  # the last round still has plenty
    with bench_session(args.redis_url) as (rh, workdir):
        sim = Sim(latency_ms=args.latency_ms)
        penv = PipelineEnv(
            rh.url,
            [queue_entry(QUEUE, sim.url, request_timeout_s=600, **global_gate(args.limit))],
            workdir,
        )
        nodes = [Node(penv, concurrency=args.concurrency) for _ in range(args.nodes)]
        pl = penv.pipeline()
        try:
            ids = [f"c-{i}" for i in range(total)]
            pl.submit_many(
                [{"payload": BODY, "id": rid, "queue": QUEUE, "timeout": 900} for rid in ids]
            )
            log(f"{total} submitted; {args.nodes} nodes x {args.concurrency}, limit {args.limit}")
            asked: dict[str, float] = {}  # id -> time just before its cancel
            mid_call_then: set[str] = set()  # at the server at the round's start
            while len(asked) < args.cancels:
                left = [r for r in ids if r not in asked]
                at_server = min(args.limit, len(left))  # the gate's slots all taken; the
                # look-ahead the dispatcher sends past them parks at the nodes
                wait_until(
                    lambda n=at_server: sim.stats()["in_flight"] >= n,
                    60,
                    "attempts at the server",
                    interval=0.05,
                )
                running = running_ids(pl, left)
                sent = sim.stats()["attempts_by_request_id"]
                rng.shuffle(running)
                for rid in running[: args.cancels - len(asked)]:
                    if rid in sent:
                        mid_call_then.add(rid)
                    asked[rid] = time.time()
                    assert pl.cancel(rid, running="abort", by="bench")
                log(f"cancelled {len(asked)} ({len(mid_call_then)} at the server before)")
            for rid in ids:  # the rest, not measured
                if rid not in asked:
                    pl.cancel(rid, running="abort", by="bench")
            wait_until(lambda: idle(pl), 60, "every attempt ended, every slot free")
            in_flight_left = pl.inspect()[QUEUE]["gate"]["in_flight"]
            hung = {rid: (t, sent) for t, rid, sent in sim.http.get("/sim/hangups").json()}
            stats = sim.stats()
            results = {rid: pl.wait(rid, 10) for rid in asked}
        finally:
            for n in nodes:
                n.stop()
            sim.stop()
    # mid-call: at the server when its cancel came (one taken for parked at the round's start
    # may have got a slot since); parked: never sent. A parked attempt handed a slot while the
    # abort notice was on its way is sent, then closed when the notice lands: "in flight".
    reached = {r for r in asked if stats["attempts_by_request_id"].get(r)}
    unclosed = [r for r in reached if r not in hung]
    mid_call = {r for r in reached if r in hung and hung[r][1] <= asked[r]}
    in_flight = {r for r in reached if r in hung and hung[r][1] > asked[r]}
    parked = set(asked) - reached
    delays = [hung[r][0] - asked[r] for r in mid_call | in_flight]
    sent_late = [hung[r][1] - asked[r] for r in in_flight]
    wrong = [r for r, res in results.items() if res.error_code != "CANCELLED"]
    late = [r for r, res in results.items() if (res.finished_at or 0) > asked[r] + 1.0]
    answered = int(stats["by_status"].get("200", 0))
    print()
    print(
        table(
            ["cancels", "mid-call", "parked", "in flight", "closed p50 s", "p99", "max", "target"],
            [
                [
                    len(asked),
                    len(mid_call),
                    len(parked),
                    len(in_flight),
                    pct(delays, 50),
                    pct(delays, 99),
                    max(delays, default=float("nan")),
                    f"p99 <= 1 s: {verdict(bool(delays) and pct(delays, 99) <= 1.0)}",
                ]
            ],
        )
    )
    print()
    print(
        table(
            ["check", "count", "target"],
            [
                ["attempts at the server never closed", len(unclosed), "0"],
                ["responses answered by the server", answered, "0"],
                ["results not CANCELLED", len(wrong), "0"],
                ["results written > 1 s after their cancel", len(late), "0"],
                ["gate reservations left", in_flight_left, "0"],
            ],
        )
    )
    ok = not (unclosed or answered or wrong or late or in_flight_left)
    print(f"\ninvariants: {verdict(ok)}")
    if in_flight:
        print(
            f"in flight: {len(in_flight)} parked attempts were handed a slot while their abort "
            f"notice was on its way; sent {1000 * max(sent_late):.1f} ms after the cancel at "
            "most, then closed, never answered"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
