"""Target 4, scale: 1,000,000 queued requests. ``submit_many`` >= 20,000 requests/s; Redis memory
per queued request (small payload) reported and <= 1 KiB; dispatch rate with 1M queued within
2x of the rate with 1k queued.

Phases, in the order they run, on a private ``redis-server`` (so ``used_memory`` and ``INFO
commandstats`` see only this benchmark):

1. submit: ``Pipeline.submit_many`` of 1M small requests (a 57-byte JSON payload, generated
   ids, default deadline) in calls of 10,000 to queue ``big``, whose pool has no worker, so
   they stay queued. Rate = requests / total time of the calls (validation included).
   Memory = ``used_memory`` delta / 1M, with the ``MEMORY USAGE`` of one request record and
   the per-request share of the pending and expiry sorted sets.
2. dispatch script: ``Store.tick`` (one ``dispatch.lua`` call, as the dispatcher makes it)
   moving 64 requests per call, timed over 200 calls (after one untimed call that loads the
   script), on a 1k backlog (queue ``small``) and on the 1M backlog; between calls (untimed)
   the moved requests are cancelled, which frees the pool, and the backlog is topped up to its
   size. Also the script's own time in Redis per moved request: the ``INFO commandstats``
   time of every script command (EVALSHA, EVAL, FCALL and their ``_RO`` forms) across each
   call, which must be exactly one script call (load-independent).
3. end to end: a real worker node (threads, 64 slots) against a 0 ms simulator drains 3,000
   requests with a ~1k backlog (topped up by the client as it drains) and then with the 1M
   backlog; rate = completions / s after a 200-request warm-up.
4. fair share (``--fair``, default the same size as phase 1; 0 skips it): phase 2 on a queue
   with ``fair_share`` (indexed by tenant: every dispatch picks the next tenant's turn), 1k
   waiting over 100 tenants against 1M waiting over 10,000 tenants.
5. finished, never popped: 200,000 requests (``--finished``) end (a cancel: the same terminal
   step as any result) on a queue with the default result list (trimmed to 100,000 entries,
   expiring with the result TTL) and on one with ``result_list: false``; nobody pops either
   list. Memory = ``used_memory`` delta / requests (the request records, which expire after
   the result TTL, the notify lists, which expire after 5 min, and the result list), with the
   list's own ``MEMORY USAGE`` and length: the list stops growing at its cap.

    .venv/bin/python bench/scale.py                  # ~3 min, ~1.5 GB of Redis memory
    .venv/bin/python bench/scale.py -n 100000        # a quicker look
"""

from __future__ import annotations

import json
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
    RedisHandle,
    Sim,
    base_parser,
    bench_session,
    log,
    queue_entry,
    table,
    verdict,
)
from pipeline.store.scripts import ScriptCall, run_batch

CHUNK = 10_000
SMALL = 1_000
TICK_BATCH = 64
TICKS = 200
E2E_N = 3_000
E2E_WARM = 200


def small_items(n: int, queue: str, tenants: int = 0) -> list[dict[str, Any]]:
    """``n`` small items; with ``tenants``, spread round-robin over that many userids."""
    if not tenants:
        return [{"payload": BODY, "queue": queue} for _ in range(n)]
    return [
        {"payload": BODY, "queue": queue, "metadata": {"userid": f"t{i % tenants}"}}
        for i in range(n)
    ]


SCRIPT_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")


def script_stats(client: Any) -> tuple[int, int]:
    """Script calls run so far and the time Redis spent in them (µs), whatever the call form
    (a private server: only this benchmark)."""
    stats = client.info("commandstats")
    rows = [stats.get(f"cmdstat_{c}", {}) for c in SCRIPT_COMMANDS]
    return sum(int(r.get("calls", 0)) for r in rows), sum(int(r.get("usec", 0)) for r in rows)


def cancel_all(store: Any, ids: list[str], ttl_s: int) -> None:
    """Cancel ``ids`` in one round trip (results kept ``ttl_s``)."""
    calls = [
        ScriptCall(store.scripts.cancel, [store.keys.request(i), *store.keys.families], [ttl_s])
        for i in ids
    ]
    for reply in run_batch(store.client, calls):
        if isinstance(reply, Exception):
            raise reply


def submit_phase(rh: RedisHandle, p: Any, n: int) -> dict[str, Any]:
    rh.client.execute_command("MEMORY", "PURGE")
    mem0 = rh.used_memory()
    spent = 0.0
    done = 0
    next_log = time.monotonic() + 10
    while done < n:
        batch = small_items(min(CHUNK, n - done), "big")
        t0 = time.perf_counter()
        p.submit_many(batch)
        spent += time.perf_counter() - t0
        done += len(batch)
        if time.monotonic() > next_log:
            log(f"submitted {done:,} ({done / spent:,.0f}/s)")
            next_log = time.monotonic() + 10
    rh.client.execute_command("MEMORY", "PURGE")
    mem1 = rh.used_memory()
    keys = p.store.keys
    sample = rh.client.zrange(keys.expiry("big"), 0, 0)[0]
    record = int(rh.client.memory_usage(keys.request(sample), samples=0) or 0)
    pending = int(rh.client.memory_usage(keys.pending("big"), samples=0) or 0)
    expiry = int(rh.client.memory_usage(keys.expiry("big"), samples=0) or 0)
    return {
        "n": n,
        "seconds": spent,
        "rate": n / spent,
        "mem_per_req": (mem1 - mem0) / n,
        "record": record,
        "pending": pending / n,
        "expiry": expiry / n,
        "used_memory_mb": mem1 / 2**20,
    }


def tick_phase(p: Any, queue: str, backlog: int, tenants: int = 0) -> dict[str, Any]:
    """Dispatch-script rate on a backlog kept at ``backlog`` requests, and the script's own
    time in Redis per moved request."""
    store = p.store
    q = p.settings.queues[queue]
    pending = p.store.keys.pending(queue)
    spent = 0.0
    usec = 0
    moved = 0
    for i in range(TICKS + 1):  # the first call loads the script: not timed
        calls0, usec0 = script_stats(store.client)
        t0 = time.perf_counter()
        res = store.tick(q, [q], 1.0, -1, TICK_BATCH)
        elapsed = time.perf_counter() - t0
        calls1, usec1 = script_stats(store.client)
        if i:
            if calls1 - calls0 != 1:
                raise RuntimeError(f"a tick ran {calls1 - calls0} script calls, not 1")
            spent += elapsed
            usec += usec1 - usec0
            moved += len(res.moved)
        cancel_all(store, [d.id for d in res.moved], 60)  # frees the pool (untimed)
        short = backlog - int(store.client.zcard(pending))
        if short > 0:
            p.submit_many(small_items(short, queue, tenants))
    if not moved or not usec:
        raise RuntimeError(f"{queue}: {moved} moved in {usec} µs of scripts: nothing measured")
    return {
        "backlog": int(store.client.zcard(pending)),
        "rate": moved / spent,
        "moved": moved,
        "usec": usec / moved,
    }


def fair_phase(rh: RedisHandle, p: Any, n: int) -> dict[str, Any]:
    """Fair-share dispatch at 1k waiting (100 tenants) and at ``n`` (10,000 tenants)."""
    from pipeline.store import sched

    s = p.store
    for queue in ("fsmall", "fbig"):
        sched.setup(s.client, s.scripts, s.keys, queue, "pf" + queue, "userid", True)
    p.submit_many(small_items(SMALL, "fsmall", 100))
    rh.client.execute_command("MEMORY", "PURGE")
    mem0 = rh.used_memory()
    done = 0
    while done < n:
        size = min(CHUNK, n - done)
        p.submit_many(small_items(size, "fbig", 10_000))
        done += size
    rh.client.execute_command("MEMORY", "PURGE")
    mem_per_req = (rh.used_memory() - mem0) / n
    tenants = int(rh.client.zcard(s.keys.ready("fbig")))
    small = tick_phase(p, "fsmall", SMALL, 100)
    big = tick_phase(p, "fbig", n, 10_000)
    return {"small": small, "big": big, "tenants": tenants, "mem_per_req": mem_per_req}


def finished_phase(rh: RedisHandle, p: Any, n: int, queue: str) -> dict[str, Any]:
    """Memory left by ``n`` finished requests of ``queue`` that nobody popped."""
    rh.client.execute_command("MEMORY", "PURGE")
    mem0 = rh.used_memory()
    keys = p.store.keys
    done = 0
    while done < n:
        batch = p.submit_many(small_items(min(CHUNK, n - done), queue))
        cancel_all(p.store, [r.id for r in batch], 3600)
        done += len(batch)
    rh.client.execute_command("MEMORY", "PURGE")
    mem1 = rh.used_memory()
    record = int(rh.client.memory_usage(keys.request(batch[-1].id), samples=0) or 0)
    notify = int(rh.client.memory_usage(keys.notify(batch[-1].id), samples=0) or 0)
    recent = int(rh.client.memory_usage(keys.recent(queue), samples=0) or 0)
    rl = keys.result_list(p.settings.queues[queue]) if p.settings.queues[queue].result_list else ""
    return {
        "per_req": (mem1 - mem0) / n,
        "record": record,
        "notify": notify,
        "recent": recent / n,
        "list_len": int(rh.client.llen(rl)) if rl else 0,
        "list_bytes": int(rh.client.memory_usage(rl, samples=0) or 0) if rl else 0,
        "list_ttl": int(rh.client.ttl(rl)) if rl else None,
    }


def e2e_phase(penv: PipelineEnv, pool: str, queue: str, top_up: int | None) -> dict[str, Any]:
    """Completions per second of a worker node draining ``queue`` (topped up to ``top_up``)."""
    p = penv.pipeline()
    client = p.store.client
    stats = p.store.keys.stats(queue)
    pending = p.store.keys.pending(queue)

    def done() -> int:
        return int(client.hget(stats, "ok") or 0)

    def feed() -> None:
        if top_up is not None and client.zcard(pending) < top_up:
            p.submit_many(small_items(top_up // 2, queue))

    base = done()
    feed()
    node = Node(penv, pools=pool)
    try:
        while done() - base < E2E_WARM:
            feed()
            time.sleep(0.01)
        t0, start = time.monotonic(), done()
        while done() - start < E2E_N:
            feed()
            time.sleep(0.01)
        elapsed = time.monotonic() - t0
        count = done() - start
        backlog = int(client.zcard(pending))
    finally:
        node.stop()
    return {"rate": count / elapsed, "backlog": backlog}


def main() -> int:
    ap = base_parser(__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("-n", type=int, default=1_000_000, help="requests to queue")
    ap.add_argument("--skip-e2e", action="store_true", help="skip phase 3")
    ap.add_argument("--finished", type=int, default=200_000, help="phase 5 requests (0: skip)")
    ap.add_argument("--fair", type=int, default=None, help="phase 4 requests (0: skip)")
    args = ap.parse_args()
    fair_n = args.n if args.fair is None else args.fair
    with bench_session(args.redis_url) as (rh, workdir):
        sim = Sim(latency_ms=0)
        try:
            queues = [
                queue_entry("big", sim.url, pool="pbig"),
                queue_entry("small", sim.url, pool="psmall"),
                queue_entry("fin_list", sim.url, pool="pfin"),
                queue_entry("fin_nolist", sim.url, pool="pfin", result_list=False),
                queue_entry("fsmall", sim.url, pool="pffsmall", fair_share=True),
                queue_entry("fbig", sim.url, pool="pffbig", fair_share=True),
            ]
            penv = PipelineEnv(rh.url, queues, workdir)
            p = penv.pipeline()
            log(f"phase 1: submitting {args.n:,} requests")
            sub = submit_phase(rh, p, args.n)
            log(f"submit: {sub['rate']:,.0f}/s, {sub['mem_per_req']:.0f} B per request")
            log("phase 2: dispatch script on 1k and on the big backlog")
            p.submit_many(small_items(SMALL, "small"))
            t_small = tick_phase(p, "small", SMALL)
            t_big = tick_phase(p, "big", args.n)
            log(f"tick: {t_small['rate']:,.0f}/s at 1k, {t_big['rate']:,.0f}/s at {args.n:,}")
            e_small = e_big = None
            if not args.skip_e2e:
                log("phase 3: a worker node drains 3,000 with a 1k and with the big backlog")
                e_small = e2e_phase(penv, "psmall", "small", SMALL)
                e_big = e2e_phase(penv, "pbig", "big", None)
                log(f"e2e: {e_small['rate']:.0f}/s at 1k, {e_big['rate']:.0f}/s at {args.n:,}")
            fair = None
            if fair_n:
                log(f"phase 4: fair share, 1k over 100 tenants and {fair_n:,} over 10,000")
                fair = fair_phase(rh, p, fair_n)
                log(
                    f"fair: {fair['small']['usec']:.1f} µs per dispatch at 1k, "
                    f"{fair['big']['usec']:.1f} at {fair_n:,}"
                )
            fin_list = fin_nolist = None
            if args.finished:
                log(f"phase 5: {args.finished:,} finished requests nobody pops, with/without list")
                fin_list = finished_phase(rh, p, args.finished, "fin_list")
                fin_nolist = finished_phase(rh, p, args.finished, "fin_nolist")
        finally:
            sim.stop()
    mem_ok = sub["mem_per_req"] <= 1024
    tick_ratio = t_small["rate"] / t_big["rate"]
    size = len(json.dumps(BODY, separators=(",", ":")))
    print(f"\nScale: {args.n:,} queued requests (payload: {size} bytes of JSON)")
    rows: list[list[Any]] = [
        [
            "submit_many rate (req/s)",
            f"{sub['rate']:,.0f}",
            ">= 20,000",
            verdict(sub["rate"] >= 20_000),
        ],
        [
            "Redis memory per queued request (B)",
            f"{sub['mem_per_req']:.0f}",
            "<= 1024",
            verdict(mem_ok),
        ],
        ["  of which: request record (MEMORY USAGE)", sub["record"], "", ""],
        [
            "  of which: pending + expiry zset share",
            f"{sub['pending'] + sub['expiry']:.0f}",
            "",
            "",
        ],
        ["dispatch.lua rate at 1k queued (req/s)", f"{t_small['rate']:,.0f}", "", ""],
        [f"dispatch.lua rate at {args.n:,} queued (req/s)", f"{t_big['rate']:,.0f}", "", ""],
        ["  1k / big ratio", f"{tick_ratio:.2f}", "<= 2", verdict(tick_ratio <= 2)],
        [
            "  Redis time per dispatch at 1k / big (µs)",
            f"{t_small['usec']:.1f} / {t_big['usec']:.1f}",
            "",
            "",
        ],
    ]
    if fair is not None:
        fs, fb = fair["small"], fair["big"]
        rows += [
            ["fair share: dispatch.lua rate at 1k / 100 tenants", f"{fs['rate']:,.0f}", "", ""],
            [
                f"fair share: rate at {fair_n:,} / {fair['tenants']:,} tenants",
                f"{fb['rate']:,.0f}",
                "",
                "",
            ],
            [
                "  Redis memory per waiting request, indexed by tenant (B)",
                f"{fair['mem_per_req']:.0f}",
                "",
                "",
            ],
            [
                "  cost per dispatch big / 1k (wall)",
                f"{fs['rate'] / fb['rate']:.2f}",
                "<= 2",
                verdict(fs["rate"] / fb["rate"] <= 2),
            ],
            [
                "  Redis time per dispatch 1k / big (µs), ratio",
                f"{fs['usec']:.1f} / {fb['usec']:.1f}, {fb['usec'] / fs['usec']:.2f}",
                "<= 2",
                verdict(fb["usec"] / fs["usec"] <= 2),
            ],
        ]
    if e_small is not None and e_big is not None:
        e_ratio = e_small["rate"] / e_big["rate"]
        rows += [
            ["end-to-end rate at ~1k queued (req/s)", f"{e_small['rate']:.0f}", "", ""],
            [f"end-to-end rate at {args.n:,} queued (req/s)", f"{e_big['rate']:.0f}", "", ""],
            ["  1k / big ratio", f"{e_ratio:.2f}", "<= 2", verdict(e_ratio <= 2)],
        ]
    if fin_list is not None and fin_nolist is not None:
        cap = 100_000
        rows += [
            [
                f"memory per finished request, result list on (B, {args.finished:,})",
                f"{fin_list['per_req']:.0f}",
                "",
                "",
            ],
            [
                "  of which: record / notify list (5 min) / recent zset (5 min)",
                f"{fin_list['record']} / {fin_list['notify']} / {fin_list['recent']:.0f}",
                "",
                "",
            ],
            [
                "  result list length / MEMORY USAGE (B)",
                f"{fin_list['list_len']:,} / {fin_list['list_bytes']:,}",
                f"<= {cap:,}",
                verdict(fin_list["list_len"] <= cap and (fin_list["list_ttl"] or 0) > 0),
            ],
            [
                "memory per finished request, result_list false (B)",
                f"{fin_nolist['per_req']:.0f}",
                "",
                "",
            ],
        ]
    print(table(["measure", "value", "target", ""], rows))
    print(
        f"submit of {args.n:,} took {sub['seconds']:.1f} s; Redis used_memory after: "
        f"{sub['used_memory_mb']:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
