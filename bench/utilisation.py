"""Target 1, utilisation: a gate with limit 16 in front of a simulator with 100 ms latency must
keep it busy: 2,000 requests at >= 0.95 of the ceiling limit/latency (160 req/s), and never
more than 16 at the simulator (``max_concurrency_observed``). Every node is started as a
user starts one: the ``pipeline`` console script's ``worker`` with its own defaults (threads
pool, 64 slots, log level INFO), only ``--pools`` and a name given. Scenarios, one run:

- ``1 node``: one worker node, ``local-max-concurrency`` limit 16;
- ``1 node, no gate, pool workers 16``: for reference, the request's lifecycle alone (submit,
  dispatch, fenced start, result) at the same load: no gate, the pool capped at 16 workers, so
  the dispatcher keeps 16 at the simulator and sends the next one when a slot frees (no
  look-ahead: each freed slot waits for a tick, so it runs 0.94–0.95 of the ceiling);
- ``1 node, 20% 503``: the same, with every 5th request answered 503 on its first attempt
  (retried after the queue's backoff, 50 ms base);
- ``3 nodes``: three worker nodes (64 slots each) sharing one global limit: a
  ``global-max-concurrency`` gate (limit 16; look-ahead and parking across nodes);
- ``redis-quota`` in concurrency mode, limit 16, all requests of one tenant, on one node and
  on three, with and without the 503s: the dispatcher counts the tenant's requests against its
  quota (quota-aware dispatch) and sends a few past it, which park for the key's next release;
  and, for comparison, with the pool capped at 16 workers;
- eight tenants, each ``redis-quota`` concurrency 3, behind one ``global-max-concurrency`` 16
  (one composite gate), their requests submitted in blocks of 50 per tenant, so the head of
  the queue is one tenant at a time (one node and three), without and with ``fair_share``
  (in exact order the tenants drain one block after another, so the last blocks belong to
  a few tenants, each capped at 3: a tail the pool cannot fill; taking turns, they drain
  together). An exact-order scenario's target is 0.97 of the bound that order allows
  (:func:`exact_order_bound`, printed as "bound"), not of the ceiling. Each tenant mix runs
  a short backlog and a long one (``--backlogs``, 800 and 5,000 requests): in a short run
  the start and the end weigh more. The 8 combinations (exact order and fair share, 1 and 3
  nodes, 800 and 5,000) are the four tenant scenarios of one run.

Each run also prints where its time went against the ceiling (:func:`bench.handoff.lost_time`):
the first submit to the first arrival, filling the first 16 slots, the waits of later
arrivals for a slot a finish freed (in exact order also the order's tail, its tenants capped
at 3), and the last requests finishing one after another.

For reference, ``--plain`` runs plain Celery under the same load (``bench/plain_celery.py``:
one worker node with 16 threads, so never more than 16 at the simulator; each task POSTs one
request and stores its status code in Celery's Redis result backend; the client publishes
without subscribing to results), once before the scenarios and once after them, because the
machine's speed drifts over a run. That is the Redis CPU per request of a task queue with no
gate, order, deadline, fencing or lease, measured in the same run. Each scenario's Redis CPU is
printed as a multiple of the two runs' mean. Every run also prints its Redis CPU over the
simulator's CPU, per request: the simulator does the same work whatever the tree, so the
quotient takes out most of the machine's speed, which moves between neighbouring runs
(BENCHMARKS.md, Method).

Throughput = requests / (first submit .. the simulator's N-th 200, by its own clock). All
results are then read back through ``Pipeline.iter_results`` and must be 200. ``dispatches
/ req`` counts how often a request went to a worker (1.0: no attempt was refused back to the
queue). Per request, by process: CPU ms; and Redis's read events (``INFO stats``
``total_reads_processed``: one per client round trip, however many commands it pipelined),
commands (those inside scripts too), script calls (``EVALSHA`` and ``EVAL``) and the Celery
consumers' ``BRPOP``s, over the same span. ``--nodes N`` runs the chosen scenarios on N worker
nodes: how Redis per request grows with the fleet.

    .venv/bin/python bench/utilisation.py            # ~7 min (tenant mixes both ways)
    .venv/bin/python bench/utilisation.py --only quota-1node --only tenants8
    .venv/bin/python bench/utilisation.py --only tenants8 --only tenants8-3nodes \
        --only tenants8-fair --only tenants8-fair-3nodes          # the 8 tenant combinations
    .venv/bin/python bench/utilisation.py --only 1node --plain
    .venv/bin/python bench/utilisation.py --only 3nodes-global --nodes 6   # the same on 6 nodes
    .venv/bin/python bench/utilisation.py --cluster --only 1node --only 3nodes-global

Two ways to measure a run (``--ways``, one after the other; ``--rounds N`` repeats them):
``bench`` is the measure above (a warm-up of 32 requests through the fresh node, then the
clock from the first submit to the simulator's last answer); ``user`` is how a user runs it
(:func:`as_user`): once the node has logged ``ready.``, a fresh Python process imports
``pipeline``, calls ``pipeline.submit_many`` and then ``result()`` on each request, and the
clock runs from that first submit to the last result read, with no warm-up; "where the time
went" then adds ``result``, the last answer to the client's reading it. The tenant mixes run
both ways by default (their target is read on both rows), the other scenarios the bench's
way: a user's rows count the client's ``result()`` calls in their Redis figures. Every run
prints the machine's load average as it started.

    .venv/bin/python bench/utilisation.py --only tenants8-fair --backlogs 800 \
        --ways bench,user --rounds 3           # the fair mix both ways, ~2 min

``--cluster`` runs the scenarios with the pipeline's state on a private 3-primary Redis Cluster
(``--replicas N`` each) and a private standalone Redis as Celery's broker; the one pool
(``default``) lives on one primary, whose CPU and counters are the "Redis" figures (the
consumers' ``BRPOP``s are on the broker then, not counted).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    ClusterHandle,
    CpuMeter,
    Node,
    PipelineEnv,
    RedisHandle,
    Sim,
    above_zero,
    add_cluster_args,
    base_parser,
    bench_session,
    global_gate,
    items,
    local_gate,
    log,
    pct,
    process_ids,
    queue_entry,
    quota_gate,
    table,
    verdict,
)
from bench.handoff import handoffs, lost_time, mean_concurrency
from bench.overhead import Plain
from pipeline.store.scripts import node_client

LIMIT = 16
LATENCY_MS = 100.0
TENANTS, PER_TENANT, BLOCK = 8, 3, 50
TENANT_BACKLOGS = (800, 5000)  # a tenant mix runs a short backlog and a long one
TENANTS_GATE = {
    "gate_type": "composite",
    "gate_params": {"gates": [quota_gate(PER_TENANT), global_gate(LIMIT)]},
}


def tenant_items(n: int, tag: str, fail_every: int = 0) -> list[dict[str, Any]]:
    """``n`` items of ``TENANTS`` tenants in blocks of ``BLOCK`` (tenant 0's first 50, then
    tenant 1's, ...): the head of the queue is one tenant at a time."""
    out = items(n, tag, fail_every)
    for i, it in enumerate(out):
        it["metadata"] = {"userid": f"tenant{(i // BLOCK) % TENANTS}"}
    return out


def exact_order_bound(keys: list[str], limit: int, per_key: int, service_s: float) -> float:
    """The most of the ceiling that serving ``keys`` (each request's tenant, in queue order) in
    exact order allows: whenever a slot is free, the first waiting request whose tenant runs
    fewer than ``per_key`` starts at once, and each takes ``service_s``. The tail that order
    leaves (the last tenants' blocks, ``per_key`` at a time) is the order's, not the
    dispatcher's."""
    waiting, running, ends, now = list(keys), dict.fromkeys(keys, 0), [], 0.0
    while waiting or ends:
        while len(ends) < limit:
            i = next((i for i, k in enumerate(waiting) if running[k] < per_key), None)
            if i is None:
                break
            running[waiting[i]] += 1
            heapq.heappush(ends, (now + service_s, waiting.pop(i)))
        now, key = heapq.heappop(ends)
        running[key] -= 1
    return len(keys) * service_s / limit / now


SCENARIOS: dict[str, dict[str, Any]] = {
    "1node": {"nodes": 1, "gate": local_gate(LIMIT), "label": "1 node, local-max-concurrency 16"},
    "1node-nogate": {
        "nodes": 1,
        "gate": {"gate_type": "constant"},
        "pool_workers": LIMIT,
        "label": "1 node, no gate, pool workers 16",
    },
    "503": {
        "nodes": 1,
        "gate": local_gate(LIMIT),
        "fail_every": 5,
        "label": "1 node, 20% first-attempt 503",
    },
    "3nodes-global": {
        "nodes": 3,
        "gate": global_gate(LIMIT),
        "label": "3 nodes, global-max-concurrency 16",
    },
    "quota-1node": {"nodes": 1, "gate": quota_gate(LIMIT), "label": "1 node, redis-quota 16"},
    "quota-503": {
        "nodes": 1,
        "gate": quota_gate(LIMIT),
        "fail_every": 5,
        "label": "1 node, redis-quota 16, 20% 503",
    },
    "3nodes": {"nodes": 3, "gate": quota_gate(LIMIT), "label": "3 nodes, redis-quota 16"},
    "3nodes-quota-503": {
        "nodes": 3,
        "gate": quota_gate(LIMIT),
        "fail_every": 5,
        "label": "3 nodes, redis-quota 16, 20% 503",
    },
    "3nodes-pool": {
        "nodes": 3,
        "gate": quota_gate(LIMIT),
        "pool_workers": LIMIT,
        "label": "3 nodes, redis-quota 16 + pool workers 16",
    },
    "tenants8": {
        "backlogs": True,
        "ways": ["bench", "user"],
        "exact_order": True,
        "nodes": 1,
        "gate": TENANTS_GATE,
        "make": tenant_items,
        "label": "1 node, 8 tenants x quota 3, global 16",
    },
    "tenants8-3nodes": {
        "backlogs": True,
        "ways": ["bench", "user"],
        "exact_order": True,
        "nodes": 3,
        "gate": TENANTS_GATE,
        "make": tenant_items,
        "label": "3 nodes, 8 tenants x quota 3, global 16",
    },
    "tenants8-fair": {
        "backlogs": True,
        "ways": ["bench", "user"],
        "nodes": 1,
        "gate": {**TENANTS_GATE, "fair_share": True},
        "make": tenant_items,
        "label": "1 node, 8 tenants x quota 3, global 16, fair",
    },
    "tenants8-fair-3nodes": {
        "backlogs": True,
        "ways": ["bench", "user"],
        "nodes": 3,
        "gate": {**TENANTS_GATE, "fair_share": True},
        "make": tenant_items,
        "label": "3 nodes, 8 tenants x quota 3, global 16, fair",
    },
}


# A user's script (what the user ran): submit the batch, then wait for each result
USER_CLIENT = """
import json, sys, time
import pipeline
items = json.loads(open(sys.argv[1]).read())
t0 = time.monotonic()
reqs = pipeline.submit_many(items)
submitted = time.monotonic()
results = [r.result(timeout=float(sys.argv[2])) for r in reqs]
print(json.dumps({"t0": t0, "submit_s": submitted - t0, "t1": time.monotonic()}))
"""


def as_user(penv: PipelineEnv, batch: list[dict[str, Any]], timeout: float) -> dict[str, float]:
    """Run ``batch`` as a user does: a fresh Python process imports ``pipeline``, calls
    ``pipeline.submit_many`` and then ``Request.result()`` on each request in turn; returns
    its clock (``time.monotonic()``, the machine's one clock) at the first submit (``t0``) and
    at the last result (``t1``), and how long the submit took."""
    path = penv.workdir / f"batch-{batch[0]['id']}.json"
    path.write_text(json.dumps(batch))
    argv = [sys.executable, "-c", USER_CLIENT, str(path), str(timeout)]
    done = subprocess.run(
        argv, env=penv.env(), capture_output=True, text=True, timeout=timeout + 60, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the user's client failed: {done.stderr[-3000:]}")
    return {k: float(v) for k, v in json.loads(done.stdout.splitlines()[-1]).items()}


def run_batch(
    penv: PipelineEnv,
    sim: Sim,
    queue: str,
    n: int,
    tag: str,
    fail_every: int = 0,
    pids: dict[str, int] | None = None,
    make: Callable[..., list[dict[str, Any]]] = items,
    user: bool = False,
) -> dict[str, Any]:
    """Submit ``n`` requests through the pipeline and wait for them; returns measurements.
    By default after a warm-up of 32 requests, from the first submit to the simulator's n-th
    answer; with ``user``, as a user runs it (:func:`as_user`: no warm-up, a fresh client
    process, until it has read the last result)."""
    p = penv.pipeline()
    if not user:
        warm = [dict(it, queue=queue) for it in make(LIMIT * 2, f"{tag}-warm")]
        list(p.iter_results([r.id for r in p.submit_many(warm)]))
        sim.reset()
    batch = [dict(it, queue=queue) for it in make(n, tag, fail_every)]
    ids = [it["id"] for it in batch]
    store = p.store.for_pool("default")  # on a Redis Cluster, the pool's slot
    server = node_client(store.client, store.keys.prefix)  # its primary (the Redis itself)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    cpu = CpuMeter(pids or {}).start()
    counts0 = redis_counts(server)
    timeout = 60 + n * 0.05
    if user:
        clock = as_user(penv, batch, timeout)
        t0, t_submit, t1 = clock["t0"], clock["submit_s"], clock["t1"]
        last = sim.last_answer(n, timeout=10)
    else:
        t0 = time.monotonic()
        p.submit_many(batch)
        t_submit = time.monotonic() - t0
        t1 = last = sim.last_answer(n, timeout=timeout)  # every request a 200 (checked)
    cpu.stop()
    counts = per_request(counts0, redis_counts(server), n)
    elapsed = t1 - t0
    results = list(p.iter_results(ids))
    bad = [r for r in results if r.status_code != 200]
    with store.client.pipeline(transaction=False) as pipe:
        for rid in ids:
            pipe.hget(store.keys.request(rid), "dispatches")
        dispatches = sum(int(d or 0) for d in pipe.execute())
    stats = sim.stats()
    arrivals = sim.arrivals()
    gaps = [g * 1000 for g in handoffs(arrivals, LIMIT)]
    lost = lost_time(arrivals, t0, LIMIT)
    if user:
        lost["result"] = t1 - last  # the last answer to the client's reading it
    return {
        "n": n,
        "elapsed": elapsed,
        "submit_s": t_submit,
        "rate": n / elapsed,
        "max_conc": int(stats["max_concurrency_observed"]),
        "sim_requests": int(stats["requests"]),
        "not_ok": len(bad),
        "by_status": stats["by_status"],
        "attempts": sum(r.attempts for r in results),
        "mean_conc": mean_concurrency(arrivals),
        # how long the simulator really held a request (its 100 ms plus its own overhead)
        "service_ms": 1000 * sum(f - a for a, f, _ in arrivals) / max(1, len(arrivals)),
        "handoff_p50": pct(gaps, 50),
        "lost": lost,
        "cpu": cpu.used,
        "cpu_ms": cpu.per_request_ms(n),
        "dispatches": dispatches / n,
        "load": load,  # the machine's load average as the run started
        **counts,
    }


def redis_counts(client: Any) -> tuple[int, int, int, int]:
    """So far: the server's read events (each a wake-up for a client's round trip, however
    many commands it pipelined), commands run (those inside scripts too), script calls
    (``EVALSHA``, and ``EVAL`` after a ``NOSCRIPT``) and ``BRPOP``s (the Celery consumers'
    wake-ups)."""
    with client.pipeline(transaction=False) as pipe:
        pipe.info("stats")
        pipe.info("commandstats")
        stats, commands = pipe.execute()

    def calls(name: str) -> int:
        return int(commands.get(f"cmdstat_{name}", {}).get("calls", 0))

    return (
        int(stats["total_reads_processed"]),
        int(stats["total_commands_processed"]),
        calls("evalsha") + calls("eval"),
        calls("brpop"),
    )


def per_request(before: tuple[int, ...], after: tuple[int, ...], n: int) -> dict[str, float]:
    """:func:`redis_counts` over a run, per request."""
    reads, commands, scripts, brpop = (b - a for a, b in zip(before, after, strict=True))
    return {
        "redis_reads": reads / n,
        "redis_commands": commands / n,
        "redis_scripts": scripts / n,
        "redis_brpop": brpop / n,
    }


def redis_line(res: dict[str, Any]) -> str:
    """A run's Redis counts per request, as printed."""
    return (
        f"{res['redis_reads']:.2f} reads (round trips), {res['redis_commands']:.1f} commands, "
        f"{res['redis_scripts']:.2f} script calls, {res['redis_brpop']:.2f} BRPOP"
    )


def scenario(
    rh: RedisHandle | ClusterHandle,
    workdir: Path,
    *,
    nodes: int,
    gate: dict[str, Any],
    n: int,
    fail_every: int = 0,
    label: str,
    pool_workers: int | None = None,
    make: Callable[..., list[dict[str, Any]]] = items,
    exact_order: bool = False,
    backlogs: bool = False,
    user: bool = False,
    ways: list[str] | None = None,  # how runs() measures it: not this run's
) -> dict[str, Any]:
    sim = Sim(latency_ms=LATENCY_MS, record_arrivals=True)
    workers: list[Node] = []
    try:
        pools = None if pool_workers is None else [{"id": "default", "workers": pool_workers}]
        queues = [queue_entry("util", sim.url, **gate)]
        penv = PipelineEnv(rh.url, queues, workdir, pools=pools, broker_url=rh.broker_url)
        for _ in range(nodes):
            workers.append(Node(penv))
        if user:
            for w in workers:
                w.wait_ready()
        log(f"{label}: {nodes} node(s) up, running {n} requests")
        pids = process_ids(rh, sim, [w.proc.pid for w in workers])
        tag = f"u{len(label)}{nodes}{fail_every}-{time.monotonic_ns()}"
        res = run_batch(penv, sim, "util", n, tag, fail_every, pids, make, user)
    finally:
        for w in workers:
            w.stop()
        sim.stop()
    res["label"] = label
    ceiling = LIMIT * 1000.0 / LATENCY_MS
    res["ratio"] = res["rate"] / ceiling
    res["bound"] = 1.0
    if exact_order:
        keys = [it["metadata"]["userid"] for it in make(n, "bound")]
        res["bound"] = exact_order_bound(keys, LIMIT, PER_TENANT, LATENCY_MS / 1000)
    floor = 0.97 * res["bound"] if exact_order else 0.95
    res["ok"] = res["ratio"] >= floor and res["max_conc"] <= LIMIT and res["not_ok"] == 0
    log(f"{label}: {res['rate']:.1f} req/s, ratio {res['ratio']:.3f}, max {res['max_conc']}")
    log(f"{label}: CPU ms per request: {res['cpu_ms']}")
    log(f"{label}: Redis per request: {redis_line(res)}")
    return res


PLAIN_LABEL = "plain Celery, 16 threads (reference)"


def plain_scenario(rh: RedisHandle, workdir: Path, *, n: int) -> dict[str, Any]:
    """Plain Celery under the utilisation load: ``n`` tasks published at once to one worker
    node with ``LIMIT`` threads, each POSTing to the simulator (100 ms). Measured as
    :func:`run_batch` measures the pipeline (CPU and Redis counters from the first publish to
    the simulator's n-th answer)."""
    sim = Sim(latency_ms=LATENCY_MS, record_arrivals=True)
    plain: Plain | None = None
    try:
        plain = Plain(rh, workdir, "threads", LIMIT)
        plain.warm(sim)
        log(f"{PLAIN_LABEL}: running {n} tasks")
        pids = process_ids(rh, sim, [plain.proc.pid])
        sim.reset()
        cpu = CpuMeter(pids).start()
        counts0 = redis_counts(rh.client)
        t0 = time.monotonic()
        plain.publish(sim, n, "plainu")
        t1 = sim.last_answer(n, timeout=60 + n * 0.05)
        cpu.stop()
        counts = per_request(counts0, redis_counts(rh.client), n)
        stats = sim.stats()
    finally:
        if plain is not None:
            plain.stop()
        sim.stop()
    rate = n / (t1 - t0)
    ratio = rate / (LIMIT * 1000.0 / LATENCY_MS)
    res = {
        "label": PLAIN_LABEL,
        "n": n,
        "rate": rate,
        "ratio": ratio,
        "max_conc": int(stats["max_concurrency_observed"]),
        "not_ok": n - int(stats["by_status"].get("200", 0)),
        "cpu": cpu.used,
        "cpu_ms": cpu.per_request_ms(n),
        **counts,
    }
    log(f"{PLAIN_LABEL}: {rate:.1f} req/s, ratio {ratio:.3f}, CPU ms per request: {res['cpu_ms']}")
    return res


def main() -> int:
    ap = base_parser(__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("-n", type=int, default=2000, help="requests per scenario")
    ap.add_argument("--only", choices=list(SCENARIOS), action="append")
    ap.add_argument(
        "--backlogs",
        type=lambda text: [above_zero(int)(v) for v in text.split(",")],
        default=list(TENANT_BACKLOGS),
        help="requests per tenant-mix scenario, comma-separated (default: %(default)s)",
    )
    ap.add_argument(
        "--nodes",
        type=above_zero(int),
        help="run each scenario on this many worker nodes instead of its own count",
    )
    ap.add_argument(
        "--plain",
        action="store_true",
        help="also run plain Celery under the same load, for its Redis CPU per request",
    )
    ap.add_argument(
        "--ways",
        type=lambda text: [way_of(w) for w in text.split(",")],
        help="how each run is measured, comma-separated, alternating: 'bench' (a warm-up of "
        "32, first submit to the simulator's last answer) and 'user' (as a user runs it: no "
        "warm-up, a fresh client process until it read the last result); default: bench, "
        "and both for the tenant mixes",
    )
    ap.add_argument(
        "--rounds", type=above_zero(int), default=1, help="run the chosen scenarios this often"
    )
    add_cluster_args(ap)
    args = ap.parse_args()
    if args.cluster and args.plain:
        ap.error("--plain runs on a standalone Redis only")
    plain: list[dict[str, Any]] = []  # before and after the scenarios: the machine drifts
    with bench_session(args.redis_url, args.cluster, args.replicas) as (rh, workdir):
        if args.plain:
            plain.append(plain_scenario(rh, workdir, n=args.n))
        rows = run_chosen(rh, workdir, args)
        if args.plain:
            plain.append(plain_scenario(rh, workdir, n=args.n))
    print(
        f"\nUtilisation: limit {LIMIT}, latency {LATENCY_MS:.0f} ms, ceiling "
        f"{LIMIT * 1000 / LATENCY_MS:.0f} req/s, {args.n} requests (tenant mixes: "
        f"{', '.join(map(str, args.backlogs))})"
        + (
            f"; the state on a 3-primary Redis Cluster ({args.replicas} replica(s) each), "
            "a standalone Redis the broker; Redis = the primary holding the pool's slot"
            if args.cluster
            else ""
        )
    )
    print(
        table(
            [
                "scenario",
                "req/s",
                "of ceiling",
                "bound",
                "of bound",
                "max at sim",
                "mean at sim",
                "sim service ms",
                "hand-off p50 ms",
                "HTTP attempts",
                "dispatches / req",
                "not 200",
                "target",
            ],
            [
                [
                    r["label"],
                    r["rate"],
                    r["ratio"],
                    r["bound"],
                    r["ratio"] / r["bound"],
                    r["max_conc"],
                    r["mean_conc"],
                    r["service_ms"],
                    r["handoff_p50"],
                    r["sim_requests"],
                    r["dispatches"],
                    r["not_ok"],
                    verdict(r["ok"]),
                ]
                for r in rows
            ],
        )
    )
    print(
        "target: >= 0.95 of ceiling (exact-order tenant mixes: >= 0.97 of the bound that order\n"
        "allows), max at sim <= 16, every result 200; bound 1 where the order leaves no tail"
    )
    print_lost(rows)
    print("CPU ms per request, by process; Redis round trips, commands, script calls and BRPOPs:")
    for r in rows + plain:
        print(f"  {r['label']}: {r['cpu_ms']}")
        print(f"    {redis_line(r)}")
    if plain:
        for when, p in zip(("before", "after"), plain, strict=True):
            print(
                f"{PLAIN_LABEL}, {when}: {p['rate']:.1f} req/s ({p['ratio']:.3f} of ceiling, "
                f"max {p['max_conc']} at sim, {p['not_ok']} not 200), "
                f"Redis CPU {redis_ms(p):.2f} ms per request"
            )
        base = sum(redis_ms(p) for p in plain) / len(plain)
        print(f"Redis CPU per request, as a multiple of plain Celery's ({base:.2f} ms, the mean):")
        for r in rows:
            print(f"  {r['label']}: {redis_ms(r):.2f} ms = {redis_ms(r) / base:.2f} x")
    metered = [r for r in rows + plain if not math.isnan(redis_ms(r) / sim_ms(r))]
    if metered:  # (not on a shared Redis, --redis-url: its CPU is not metered)
        print("Redis CPU per request over the simulator's (the same work in every tree and run,")
        print("so a yardstick of the machine's speed at that moment):")
        for r in metered:
            print(f"  {r['label']}: {redis_ms(r) / sim_ms(r):.2f}")
    return 0


def print_lost(rows: list[dict[str, Any]]) -> None:
    """Where each run's time went (:func:`bench.handoff.lost_time`)."""
    print("Where the time went, s (slot-seconds / 16): the first submit to the first arrival,")
    print("filling the first 16 slots, waits for a freed slot, the last ones finishing:")
    for r in rows:
        lost = ", ".join(f"{k} {v:.3f}" for k, v in r["lost"].items())
        print(f"  {r['label']}: elapsed {r['elapsed']:.3f}: {lost} (load {r['load']})")


def run_chosen(
    rh: RedisHandle | ClusterHandle, workdir: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """The chosen scenarios' rows, ``--rounds`` times."""
    only = set(args.only or SCENARIOS)
    chosen = [on_nodes(spec, args.nodes) for key, spec in SCENARIOS.items() if key in only]
    rows: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        for spec in chosen:
            rows += runs(rh, workdir, spec, args.n, args.backlogs, args.ways)
    return rows


def runs(
    rh: RedisHandle | ClusterHandle,
    workdir: Path,
    spec: dict[str, Any],
    n: int,
    backlogs: list[int],
    ways: list[str] | None = None,
) -> list[dict[str, Any]]:
    """A scenario's rows: one run of ``n`` requests, or a tenant mix's run per backlog (the
    short one and the long one); each measured in each of ``ways`` (default: the
    scenario's own), one after the other."""
    ways = ways or spec.get("ways") or ["bench"]
    if not spec.get("backlogs"):
        return [scenario(rh, workdir, n=n, **as_way(spec, way)) for way in ways]
    return [
        scenario(
            rh, workdir, n=b, **as_way({**spec, "label": f"{spec['label']}, {b} requests"}, way)
        )
        for b in backlogs
        for way in ways
    ]


def way_of(text: str) -> str:
    """An argparse ``type`` for ``--ways``: ``bench`` or ``user``."""
    if text not in ("bench", "user"):
        raise argparse.ArgumentTypeError(f"a way is 'bench' or 'user', not {text!r}")
    return text


def as_way(spec: dict[str, Any], way: str) -> dict[str, Any]:
    """A scenario measured the bench's way (as it is) or a user's, its label saying so."""
    return (
        spec if way == "bench" else {**spec, "user": True, "label": f"{spec['label']}, as a user"}
    )


def on_nodes(spec: dict[str, Any], nodes: int | None) -> dict[str, Any]:
    """A scenario run on ``nodes`` worker nodes (None: its own count), its label saying so."""
    if nodes is None:
        return spec
    label = re.sub(r"^\d+ nodes?", f"{nodes} node{'s' if nodes > 1 else ''}", spec["label"])
    return {**spec, "nodes": nodes, "label": label}


def sim_ms(res: dict[str, Any]) -> float:
    """The simulator's CPU ms per request of a run."""
    used = res["cpu"].get("sim")
    return float("nan") if not used else used * 1000 / res["n"]


def redis_ms(res: dict[str, Any]) -> float:
    """The private Redis server's CPU ms per request of a run (``nan`` on a shared Redis,
    which is not metered)."""
    used = res["cpu"].get("redis")
    return float("nan") if used is None else used * 1000 / res["n"]


if __name__ == "__main__":
    sys.exit(main())
