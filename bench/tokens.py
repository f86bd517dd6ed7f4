"""Token budgets (issue 14 item 4, issue 33 item 4): a backlog through ``redis-quota`` in
``tokens`` mode against the simulator. Targets: the tokens the simulator receives per window,
per key, never exceed the limit by more than one request's estimate error; a tenant at its
budget waits in the dispatcher, not in refusals: at most 1.2 dispatches per request (the 5 %
answered 503 once are dispatched twice).

Setup: a private ``redis-server``, the simulator in a subprocess (50 ms, ``--record-arrivals``:
it logs each 200's arrival time and usage; completion tokens drawn from [0.3, 1] × max_tokens,
so estimates are mostly high; a token per prompt word), one worker node (16 threads), one queue
with a token budget of ``--limit`` tokens per ``--window`` per userid. Two tenants, each with
``-n`` requests submitted at once: prompts of 5–60 words, either long words (the estimate,
characters / 4, is about twice the simulator's count) or one-letter words (about half: the
estimate is low), ``max_tokens`` 20–200; 5 % answered 503 on their first attempt (refunded,
then retried), plus one request per tenant larger than the whole budget (dropped).

Measured per run, per tenant, from the simulator's own log: the most tokens (prompt +
completion) whose requests arrived within any ``window`` (every window that starts at an
arrival), against the limit; the largest estimate error of one request (usage − estimate:
positive = under-estimated); the budget used (tokens served over the backlog's span ÷ the
budget of that span); dispatches per request (from the records: a refusal or a retry is one
more).

    .venv/bin/python bench/tokens.py            # three runs, ~1.5 min
"""

from __future__ import annotations

import json
import random
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
    base_parser,
    bench_session,
    log,
    queue_entry,
    table,
    verdict,
)
from pipeline.gates.tokens import DEFAULT_MAX_TOKENS, estimate_tokens

TENANTS = ("alice", "bob")
LONG = ("lattice", "harbor", "summit", "canyon", "meadow", "falcon", "quartz")
SHORT = ("a", "b", "c", "d", "e")
MAX_DISPATCHES = 1.2  # per request


def make_items(n: int, tenant: str, rng: random.Random, limit: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(n):
        words = rng.choice((LONG, SHORT))
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(5, 60)))
        payload = {"model": "sim-model", "prompt": prompt, "max_tokens": rng.randint(20, 200)}
        item: dict[str, Any] = {
            "payload": payload,
            "id": f"{tenant}-{i}",
            "metadata": {"userid": tenant},
            "timeout": 900,
        }
        if rng.random() < 0.05:
            item["headers"] = {"x-sim-fail-first": "1", "x-sim-fail-status": "503"}
        out.append(item)
    too_big = {"model": "sim-model", "prompt": "x", "max_tokens": limit}  # estimate limit + 1
    out.append(
        {"payload": too_big, "id": f"{tenant}-big", "metadata": {"userid": tenant}, "timeout": 900}
    )
    return out


def max_window(arrivals: list[tuple[float, int, str]], window: float) -> tuple[int, list[str]]:
    """The most tokens arriving within ``window`` s (windows starting at an arrival), and the
    requests in that window."""
    best, best_ids = 0, []
    j, total = 0, 0
    for i, (t, _, _) in enumerate(arrivals):
        while j < len(arrivals) and arrivals[j][0] < t + window:
            total += arrivals[j][1]
            j += 1
        if total > best:
            best, best_ids = total, [rid for _, _, rid in arrivals[i:j]]
        total -= arrivals[i][1]
    return best, best_ids


def one_run(rh: Any, workdir: Path, sim: Sim, args: Any, run: int) -> list[list[Any]]:
    gate = {
        "gate_type": "redis-quota",
        "gate_params": {
            "mode": "tokens",
            "attribute": "userid",
            "limit": args.limit,
            "window": args.window,
        },
    }
    penv = PipelineEnv(rh.url, [queue_entry("tok", sim.url, **gate)], workdir)
    rng = random.Random(run)
    items = [it for t in TENANTS for it in make_items(args.n, t, rng, args.limit)]
    estimates = {it["id"]: estimate_tokens(it["payload"], DEFAULT_MAX_TOKENS) for it in items}
    sim.reset()
    node = Node(penv, concurrency=16)
    try:
        pl = penv.pipeline()
        t0 = time.monotonic()
        pl.submit_many([{**it, "queue": "tok"} for it in items])
        results = {it["id"]: pl.wait(it["id"], timeout=900) for it in items}
        took = time.monotonic() - t0
        dispatches = {rid: int(pl.record(rid).get("dispatches") or 0) for rid in results}
    finally:
        node.stop()
    log_rows = sim.tokens()
    rows = []
    for tenant in TENANTS:
        mine = sorted((t, p + c, rid) for t, p, c, rid in log_rows if rid.startswith(tenant + "-"))
        served = {rid: n for _, n, rid in mine}
        errors = {rid: served[rid] - estimates[rid] for rid in served}
        peak, in_peak = max_window(mine, args.window)
        under = max(errors.values())  # the largest under-estimate of one request
        under_in_peak = sum(max(0, errors[rid]) for rid in in_peak)
        span = mine[-1][0] - mine[0][0] + args.window
        used = sum(served.values()) / (span / args.window * args.limit)
        ids = [it["id"] for it in items if it["id"].startswith(tenant + "-")]
        ok = sum(results[r].ok for r in ids)
        dropped = sum(results[r].error_code == "GATE_DROPPED" for r in ids)
        per_req = sum(dispatches[r] for r in ids) / len(ids)
        rows.append(
            [
                f"run {run + 1} {tenant}",
                f"{peak} / {args.limit} ({peak / args.limit:.3f})",
                f"{under:+d}",
                f"{min(errors.values()):+d}",
                under_in_peak,
                f"{used:.2f}",
                f"{ok} ok, {dropped} dropped",
                f"{per_req:.2f}",
                f"{took:.0f} s",
                verdict(peak <= args.limit + max(0, under)),
                verdict(per_req <= MAX_DISPATCHES),
            ]
        )
        log(f"run {run + 1} {tenant}: peak {peak} of {args.limit}, max under-estimate {under}")
    return rows


def main() -> int:
    ap = base_parser(__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("-n", type=int, default=300, help="requests per tenant")
    ap.add_argument("--limit", type=int, default=3000, help="tokens per window per tenant")
    ap.add_argument("--window", type=float, default=2.0, help="window, s")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows: list[list[Any]] = []
    with bench_session(args.redis_url) as (rh, workdir):
        sim = Sim(latency_ms=50, record_arrivals=True, extra=["--completion-min-ratio", "0.3"])
        try:
            for run in range(args.runs):
                rows += one_run(rh, workdir, sim, args, run)
        finally:
            sim.stop()
    print(
        f"\nToken budget {args.limit} tokens / {args.window:g} s per tenant, "
        f"{args.n} requests per tenant (+1 too large), 16 slots, 50 ms simulator\n"
    )
    print(
        table(
            [
                "run",
                "max tokens in a window / limit",
                "max under-est.",
                "max over-est.",
                "under-est. in that window",
                "budget used",
                "results",
                "dispatches / req",
                "wall",
                "≤ limit + one error",
                f"≤ {MAX_DISPATCHES:g} dispatches",
            ],
            rows,
        )
    )
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
