"""Beyond one Redis: six worker pools over a 3-primary Redis Cluster against the same six
pools on one standalone Redis, the same load, in one run (docs/production.md, "Redis
Cluster").

Six pools, one queue each, each queue behind a gate (on every primary one pool behind a
``local-max-concurrency`` gate and one behind a ``global-max-concurrency`` gate, limit 2 each),
one worker node serving all six (threads, 64 slots; on the cluster one dispatcher per pool),
one simulator at 100 ms latency: a ceiling of 6 x 2 / 0.1 s = 120 req/s. The limits are
scaled down from the utilisation bench's 16 so the whole load (worker, simulator, four Redis
servers, this client) stays well inside the machine's 2 cores: plain throughput is then not
CPU-bound, and each Redis server's CPU is its own work. Pool names are chosen so their hash
tags ``{p:<pool>}`` put two pools on each primary (printed). Celery's broker is a private
standalone Redis in both phases, with no Celery result backend (the pipeline's record is the
result; on a cluster there is none by default): the state servers see only the pipeline.

Per server, from its own ``INFO`` over the load (submit .. the simulator's last answer):
script time (``INFO commandstats`` usec of ``EVALSHA``, ``EVAL``, ``FCALL``), Redis CPU
(``INFO cpu`` user + system), commands (those inside scripts too) and round trips per request,
``used_memory``'s growth over the load per request (the finished requests' records stay for
their TTL) and its value at the end (it grows over the runs: one cluster, one standalone
server for the whole invocation). Before the load each server's idle CPU is measured over a few
seconds (the dispatchers' ticks, leases, the server's own cron), to say how much of the
per-request figure is fixed cost spread over a modest load.

Targets, per run:
- each primary's share of the cluster's script time within 1/3 +- 10 % (0.300-0.367);
- the busiest primary's Redis CPU per request it served (its two pools' requests) within 10 %
  of the standalone server's CPU per request (ratio <= 1.10);
- the utilisation scenarios ``1node`` and ``3nodes-global`` of ``bench/utilisation.py`` on the
  cluster (limit 16, 100 ms, 2,000 requests) >= 0.95 of the ceiling (the same scenarios on the
  standalone server, the same broker, in the same run beside them: a loaded machine moves
  both);
- hand-off p99 <= 5 ms on the cluster (``bench/handoff.py``: limit 1, 20 ms, 500 requests; the
  standalone figure of the same run beside it).
Then the projected fleet ceiling: one core per primary, so a primary serves at most
1 s / (its CPU per request) requests a second; with the pools spread evenly (each primary
carries 1/P of the requests), P primaries serve P times that, taken from the busiest primary's
measured figure (and the standalone figure for one server).

    .venv/bin/python bench/cluster.py --runs 3          # ~9 min
    .venv/bin/python bench/cluster.py --runs 1 --skip-utilisation --skip-handoff   # ~1.5 min
    .venv/bin/python bench/cluster.py --replicas 1      # each primary with a replica
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import handoff, utilisation
from bench.common import (
    ClusterHandle,
    CpuMeter,
    Node,
    PipelineEnv,
    RedisHandle,
    Sim,
    above_zero,
    base_parser,
    global_gate,
    items,
    local_gate,
    log,
    queue_entry,
    server_stats,
    stats_delta,
    table,
    verdict,
)

LATENCY_MS = 100.0
PER_PRIMARY = 2
IDLE_S = 3.0
SHARE_TOLERANCE = 0.10  # each primary's share of script time: 1/3 +- 10 % of 1/3
CPU_TOLERANCE = 1.10  # the busiest primary's CPU per request over the standalone's
UTIL_SCENARIOS = ("1node", "3nodes-global")


def pick_pools(ch: ClusterHandle, per_primary: int = PER_PRIMARY) -> dict[str, str]:
    """Pool names whose hash tags put ``per_primary`` of them on each primary: pool ->
    primary (``host:port``), grouped by primary."""
    chosen: dict[str, list[str]] = {p.name: [] for p in ch.primaries}
    for i in range(10_000):
        name = f"pool{i}"
        owner = ch.primary_of(name).name
        if len(chosen[owner]) < per_primary:
            chosen[owner].append(name)
        if all(len(v) == per_primary for v in chosen.values()):
            return {pool: owner for owner, pools in chosen.items() for pool in pools}
    raise RuntimeError("no pool names spread over every primary")


def gate_of(i: int, limit: int) -> dict[str, Any]:
    """Pools alternate gates: on each primary one local, one global."""
    return local_gate(limit) if i % 2 == 0 else global_gate(limit)


def proc_stat() -> tuple[int, int]:
    """(all, idle + iowait) clock ticks of the machine so far."""
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    return sum(f), f[3] + f[4]


def six_pools(
    label: str,
    state_url: str,
    broker_url: str,
    servers: dict[str, tuple[redis.Redis, int]],
    placement: dict[str, str],
    workdir: Path,
    *,
    n_per_pool: int,
    limit: int,
) -> dict[str, Any]:
    """One phase: six pools (``placement``: pool -> the server holding it) on ``state_url``,
    ``n_per_pool`` requests each, submitted at once, interleaved. ``servers``: name ->
    (client, pid) of each state server."""
    pools = list(placement)
    sim = Sim(latency_ms=LATENCY_MS, record_arrivals=True)
    node: Node | None = None
    try:
        queues = [
            queue_entry(f"q-{pool}", sim.url, pool=pool, **gate_of(i, limit))
            for i, pool in enumerate(pools)
        ]
        penv = PipelineEnv(
            state_url, queues, workdir, broker_url=broker_url, result_backend="disabled"
        )
        node = Node(penv, pools=",".join(pools))
        p = penv.pipeline()
        warm = [
            dict(it, queue=f"q-{pool}", id=f"w{pool}-{j}")
            for pool in pools
            for j, it in enumerate(items(limit * 2, "w"))
        ]
        list(p.iter_results([r.id for r in p.submit_many(warm)]))
        # idle: the node up and nothing to do (a measured window, not a wait for a condition)
        idle0 = {name: server_stats(c) for name, (c, _) in servers.items()}
        t_idle = time.monotonic()
        time.sleep(IDLE_S)
        idle = {name: stats_delta(idle0[name], server_stats(c)) for name, (c, _) in servers.items()}
        idle_s = time.monotonic() - t_idle
        sim.reset()
        batch = [
            dict(items(1, "x")[0], queue=f"q-{pool}", id=f"{label[:1]}-{pool}-{j}")
            for j in range(n_per_pool)
            for pool in pools
        ]
        pids = {"worker": node.proc.pid, "sim": sim.proc.pid}
        pids.update({name: pid for name, (_, pid) in servers.items()})
        cpu = CpuMeter(pids).start()
        before = {name: server_stats(c) for name, (c, _) in servers.items()}
        m0 = proc_stat()
        t0 = time.monotonic()
        reqs = p.submit_many(batch)
        n = len(batch)
        t1 = sim.last_answer(n, timeout=60 + n * 0.05)
        m1 = proc_stat()
        after = {name: server_stats(c) for name, (c, _) in servers.items()}
        cpu.stop()
        results = list(p.iter_results([r.id for r in reqs]))
        arrivals = sim.arrivals()
    finally:
        if node is not None:
            node.stop()
        sim.stop()
    per_pool_max = {pool: max_concurrency(arrivals, f"-{pool}-") for pool in pools}
    elapsed = t1 - t0
    total, idle_ticks = (b - a for a, b in zip(m0, m1, strict=True))
    res: dict[str, Any] = {
        "label": label,
        "n": n,
        "elapsed": elapsed,
        "rate": n / elapsed,
        "ratio": n / elapsed / (len(pools) * limit * 1000 / LATENCY_MS),
        "not_ok": sum(1 for r in results if r.status_code != 200),
        "over_limit": {pool: m for pool, m in per_pool_max.items() if m > limit},
        "per_pool_max": max(per_pool_max.values()),
        "machine_busy": 1 - idle_ticks / total if total else float("nan"),
        "cpu_ms": cpu.per_request_ms(n),
        "servers": {},
    }
    for name in servers:
        d = stats_delta(before[name], after[name])
        served = n_per_pool * sum(1 for owner in placement.values() if owner == name)
        idle_rate = idle[name]["cpu_s"] / idle_s
        res["servers"][name] = {
            **d,
            "pools": [pool for pool, owner in placement.items() if owner == name],
            "served": served,
            "cpu_ms_req": 1000 * d["cpu_s"] / served,
            "net_ms_req": 1000 * max(0.0, d["cpu_s"] - idle_rate * elapsed) / served,
            "idle_ms_s": 1000 * idle_rate,
            "script_ms_req": 1000 * d["script_s"] / served,
        }
    return res


def max_concurrency(arrivals: list[tuple[float, float, str]], tag: str) -> int:
    """Most requests whose id contains ``tag`` at the simulator at once."""
    events = sorted(
        (t, +1 if start else -1)
        for a, f, rid in arrivals
        if rid and tag in rid
        for t, start in ((a, True), (f, False))
    )
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def server_table(res: dict[str, Any]) -> str:
    total_script = sum(s["script_s"] for s in res["servers"].values())
    rows = []
    for name, s in res["servers"].items():
        rows.append(
            [
                name,
                ",".join(s["pools"]),
                s["served"],
                1000 * s["script_s"],
                s["script_s"] / total_script if total_script else float("nan"),
                s["script_ms_req"],
                1000 * s["cpu_s"],
                s["cpu_ms_req"],
                s["idle_ms_s"],
                s["net_ms_req"],
                s["commands"] / s["served"],
                s["reads"] / s["served"],
                s["memory"] / s["served"],
                s["used_memory"] / 2**20,
            ]
        )
    return table(
        [
            "server",
            "pools",
            "requests",
            "script ms",
            "script share",
            "script ms/req",
            "CPU ms",
            "CPU ms/req",
            "idle CPU ms/s",
            "CPU ms/req net of idle",
            "commands/req",
            "round trips/req",
            "memory B/req",
            "used_memory MB",
        ],
        rows,
    )


def judge(cluster: dict[str, Any], alone: dict[str, Any]) -> dict[str, Any]:
    servers = cluster["servers"]
    total_script = sum(s["script_s"] for s in servers.values())
    shares = {name: s["script_s"] / total_script for name, s in servers.items()}
    busiest = max(servers, key=lambda k: servers[k]["cpu_s"])
    (alone_s,) = alone["servers"].values()
    cpu_ratio = servers[busiest]["cpu_ms_req"] / alone_s["cpu_ms_req"]
    net_ratio = servers[busiest]["net_ms_req"] / alone_s["net_ms_req"]
    third = 1 / len(servers)
    return {
        "shares": shares,
        "share_ok": all(abs(v - third) <= SHARE_TOLERANCE * third for v in shares.values()),
        "busiest": busiest,
        "busiest_ms": servers[busiest]["cpu_ms_req"],
        "alone_ms": alone_s["cpu_ms_req"],
        "cpu_ratio": cpu_ratio,
        "net_ratio": net_ratio,
        "cpu_ok": cpu_ratio <= CPU_TOLERANCE,
        "throughput_ratio": cluster["rate"] / alone["rate"],
    }


class Alone:
    """The standalone server with the cluster's broker, as ``utilisation.scenario`` takes a
    Redis: the same broker as on the cluster."""

    def __init__(self, rh: RedisHandle, broker_url: str) -> None:
        self.rh, self.url, self.broker_url = rh, rh.url, broker_url

    def metered(self, pool: str = "default") -> dict[str, int]:
        return self.rh.metered(pool)


def fleet(per_request_ms: float, primaries: int) -> float:
    """Requests/s that ``primaries`` primaries of one core each serve, evenly loaded."""
    return primaries * 1000.0 / per_request_ms


def main() -> int:
    ap = base_parser(__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("--runs", type=above_zero(int), default=3)
    ap.add_argument("-n", type=above_zero(int), default=500, help="requests per pool")
    ap.add_argument("--limit", type=above_zero(int), default=2, help="each pool's gate limit")
    ap.add_argument("--replicas", type=int, default=0, help="replicas per primary")
    ap.add_argument("--util-n", type=above_zero(int), default=2000)
    ap.add_argument("--skip-utilisation", action="store_true")
    ap.add_argument("--skip-handoff", action="store_true")
    args = ap.parse_args()
    if args.redis_url:
        ap.error("this bench starts its own servers: no --redis-url")
    workdir = Path(tempfile.mkdtemp(prefix="plbench-"))
    ch = ClusterHandle(workdir, 3, args.replicas)
    alone = RedisHandle(None, workdir)
    runs: list[dict[str, Any]] = []
    try:
        placement = pick_pools(ch)
        log(f"cluster {ch.url} ({args.replicas} replica(s) each); broker {ch.broker_url}")
        for primary in ch.primaries:
            mine = [p for p, o in placement.items() if o == primary.name]
            log(f"primary {primary.name}: pools {', '.join(mine)}")
        assert alone.proc is not None
        cluster_servers = {p.name: (p.client, p.proc.pid) for p in ch.primaries}
        alone_servers = {"standalone": (alone.client, alone.proc.pid)}
        for run in range(1, args.runs + 1):
            out: dict[str, Any] = {"run": run}
            # alternate which goes first: the machine's speed drifts over minutes
            order = ["cluster", "standalone"] if run % 2 else ["standalone", "cluster"]
            for kind in order:
                log(f"run {run}: six pools on the {kind}, {6 * args.n} requests")
                on_cluster = kind == "cluster"
                out[kind] = six_pools(
                    kind,
                    ch.url if on_cluster else alone.url,
                    ch.broker_url,
                    cluster_servers if on_cluster else alone_servers,
                    placement if on_cluster else dict.fromkeys(placement, "standalone"),
                    workdir,
                    n_per_pool=args.n,
                    limit=args.limit,
                )
            out["judge"] = judge(out["cluster"], out["standalone"])
            if not args.skip_utilisation:
                for kind, handle in (("util", ch), ("util_alone", Alone(alone, ch.broker_url))):
                    out[kind] = [
                        utilisation.scenario(
                            handle, workdir, n=args.util_n, **utilisation.SCENARIOS[key]
                        )
                        for key in UTIL_SCENARIOS
                    ]
            if not args.skip_handoff:
                out["handoff"] = {
                    "cluster": handoff.run(ch.url, workdir, 1, 20.0, 500, ch.broker_url),
                    "standalone": handoff.run(alone.url, workdir, 1, 20.0, 500, ch.broker_url),
                }
            print_run(out, args)
            runs.append(out)
    finally:
        ch.close()
        alone.close()
        shutil.rmtree(workdir, ignore_errors=True)
    print_summary(runs, args)
    return 0


def print_run(out: dict[str, Any], args: Any) -> None:
    c, s, j = out["cluster"], out["standalone"], out["judge"]
    ceiling = 6 * args.limit * 1000 / LATENCY_MS
    print(
        f"\n=== run {out['run']}: six pools x limit {args.limit}, simulator {LATENCY_MS:.0f} ms "
        f"(ceiling {ceiling:.0f} req/s), {6 * args.n} requests; 3 primaries, "
        f"{args.replicas} replica(s) each, vs one standalone Redis"
    )
    for res in (c, s):
        print(
            f"{res['label']}: {res['rate']:.1f} req/s ({res['ratio']:.3f} of ceiling), most at "
            f"the simulator per pool {res['per_pool_max']} (limit {args.limit}), "
            f"{res['not_ok']} not 200, machine busy {100 * res['machine_busy']:.0f} % of 2 cores"
        )
        print(f"  CPU ms per request, by process: {res['cpu_ms']}")
        print("  " + server_table(res).replace("\n", "\n  "))
    shares = ", ".join(f"{k} {v:.3f}" for k, v in j["shares"].items())
    print(f"script-time share per primary: {shares} (target 1/3 +- 10 %: {verdict(j['share_ok'])})")
    print(
        f"busiest primary {j['busiest']}: Redis CPU {j['busiest_ms']:.3f} ms per request it "
        f"served vs standalone {j['alone_ms']:.3f} ms = {j['cpu_ratio']:.3f} x (target <= "
        f"{CPU_TOLERANCE:.2f}: {verdict(j['cpu_ok'])}); net of idle {j['net_ratio']:.3f} x"
    )
    print(f"cluster throughput over standalone's: {j['throughput_ratio']:.3f}")
    print(
        "projected fleet ceiling (one core per primary, pools spread evenly, the busiest "
        "primary's CPU per request): "
        + ", ".join(
            f"{k} primar{'y' if k == 1 else 'ies'} {fleet(j['busiest_ms'], k):,.0f}"
            for k in (1, 3, 10)
        )  # fmt: skip
        + f" req/s; one standalone server {fleet(j['alone_ms'], 1):,.0f} req/s"
    )
    for u, a in zip(out.get("util", []), out.get("util_alone", []), strict=True):
        print(
            f"utilisation on the cluster, {u['label']}: {u['rate']:.1f} req/s = {u['ratio']:.3f} "
            f"of the ceiling, max {u['max_conc']} at the simulator, {u['not_ok']} not 200 "
            f"(target >= 0.95: {verdict(u['ok'])}); standalone {a['ratio']:.3f}"
        )
    if "handoff" in out:
        h = out["handoff"]
        print(
            f"hand-off (limit 1, 20 ms): cluster p50 {h['cluster']['p50']:.2f} ms, p99 "
            f"{h['cluster']['p99']:.2f} ms (target <= 5: {verdict(h['cluster']['p99'] <= 5)}); "
            f"standalone p50 {h['standalone']['p50']:.2f} ms, p99 {h['standalone']['p99']:.2f} ms"
        )
    sys.stdout.flush()


def span(values: list[float], fmt: str = ".3f") -> str:
    lo, hi = min(values), max(values)
    return f"{lo:{fmt}}" if lo == hi else f"{lo:{fmt}}-{hi:{fmt}}"


def print_summary(runs: list[dict[str, Any]], args: Any) -> None:
    k = len(runs)
    js = [r["judge"] for r in runs]
    print(f"\n=== summary over {k} run(s)")
    shares = [v for j in js for v in j["shares"].values()]
    print(
        f"each primary's share of script time 1/3 +- 10 %: shares {span(shares)}; "
        f"{sum(j['share_ok'] for j in js)}/{k} runs PASS"
    )
    ratios = [j["cpu_ratio"] for j in js]
    print(
        f"busiest primary's Redis CPU per request <= 1.10 x standalone's: {span(ratios)} x "
        f"(median {statistics.median(ratios):.3f}; net of idle "
        f"{span([j['net_ratio'] for j in js])} x); {sum(j['cpu_ok'] for j in js)}/{k} runs PASS"
    )
    busiest = statistics.median(j["busiest_ms"] for j in js)
    alone = statistics.median(j["alone_ms"] for j in js)
    print(
        f"projected fleet ceiling (median CPU per request: busiest primary {busiest:.3f} ms, "
        f"standalone {alone:.3f} ms; one core per primary, an even spread): "
        + ", ".join(
            f"{p} primar{'y' if p == 1 else 'ies'} {fleet(busiest, p):,.0f} req/s"
            for p in (1, 3, 10)
        )  # fmt: skip
        + f"; one standalone server {fleet(alone, 1):,.0f} req/s"
    )
    print(
        f"six pools, cluster throughput over standalone's: "
        f"{span([j['throughput_ratio'] for j in js])}; of ceiling: cluster "
        f"{span([r['cluster']['ratio'] for r in runs])}, standalone "
        f"{span([r['standalone']['ratio'] for r in runs])}; gates over their limit: "
        f"{sum(len(r[x]['over_limit']) for r in runs for x in ('cluster', 'standalone'))}"
    )
    if runs and "util" in runs[0]:
        for i, key in enumerate(UTIL_SCENARIOS):
            us = [r["util"][i] for r in runs]
            alone = [r["util_alone"][i]["ratio"] for r in runs]
            print(
                f"utilisation on the cluster, {key} >= 0.95: {span([u['ratio'] for u in us])} "
                f"(standalone {span(alone)}); {sum(u['ok'] for u in us)}/{k} runs PASS"
            )
    if runs and "handoff" in runs[0]:
        p99 = [r["handoff"]["cluster"]["p99"] for r in runs]
        alone99 = [r["handoff"]["standalone"]["p99"] for r in runs]
        print(
            f"hand-off p99 on the cluster <= 5 ms: {span(p99, '.2f')} ms (standalone "
            f"{span(alone99, '.2f')} ms); {sum(v <= 5 for v in p99)}/{k} runs PASS"
        )


if __name__ == "__main__":
    sys.exit(main())
