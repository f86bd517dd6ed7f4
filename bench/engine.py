"""The pipeline against the engine model (issue 46 item 4): what a pool sized for a
continuous-batching engine gets. ``bench/utilisation.py`` stays the fine-grained check (16 x
100 ms, a server whose latency never moves); ``bench/engine_model.py`` drives the engine
without the pipeline. Scenarios, each one function, one run each (``--only NAME``, repeatable):

- ``h100``, ``kv-bound``, ``compute-bound``: a **static-limit sweep** of the preset. For each
  ``global-max-concurrency`` limit L of a list spanning well below to well above the preset's
  knee, ``pipeline sim --engine PRESET --time-scale S`` (the preset's workload: its prompts,
  ``max_tokens`` and completion lengths) behind worker nodes started as a user starts them
  (``pipeline worker -c SLOTS``, :class:`bench.common.Node`) with slots for L and its
  look-ahead, in a pool file with as many ``workers``; N = L x rounds requests (enough rounds for
  ~``--seconds`` of wall clock, at least 6) submitted at once, every result read back.
- ``tenants8-fair-kv``: the **8-tenant fair-share mix** on ``kv-bound``: eight tenants, each a
  ``redis-quota`` of 3 behind one ``global-max-concurrency`` of 16 with ``fair_share`` (what
  ``bench/utilisation.py``'s ``tenants8-fair`` runs against the fixed server), their requests in
  blocks of 50 per tenant; and in the same run the static limit 16 with one tenant, its
  reference.
- prefix grouping against the engine's prefix cache (issue 50) is ``bench/prefix.py``: its
  own batch (5,000 chat lines over 10 system prompts) and runs, the issue's targets.
- ``inflight``: ``bench/inflight.py``'s in-flight scale scenario (one node at ``-c`` 256 and
  1,024 against a simulator of 2 and 5 s with no limit; ``bench/inflight.py`` runs 4,096 too).

Measured per run, from the engine's side (the simulator's ``/sim/arrivals``: when each request
arrived at the engine and when its answer was written, one clock for every process), over the
run's steady part: from the 2L-th arrival (the limit filled and refilled once: a batch
submitted at once starts in step, and an engine's first rounds run unlike its later ones) to
the last one (then nothing is left to send and the engine drains):

- **req/s**: the answers written in it over its length, in the model's requests per second
  (wall clock x S);
- **latency**: the mean time at the engine of those requests (arrival to answer, the engine's
  own queue included), in the model's seconds (wall clock / S);
- **queue**: the mean of the engine's ``vllm:request_queue_time_seconds`` over the whole run
  (arrival to first scheduling, a preempted request's requeues not counted again), model s;
- **preempted / req**: the engine's preemptions over the run, per request;
- **Little**: req/s x latency, Little's Law's number at the engine; **mean at engine** the
  number measured (each request's time at the engine within the span, over its length) and
  **of limit** that over L: how full the pipeline keeps the limit (1.00: a request leaves and
  the next one arrives at once). Little's estimate runs a little under the measure when the
  answers come in rounds or their latencies spread: the span's edges cut them;
- **max at engine**: the most the simulator ever had at once (never above L);
- **model**: what the engine gives an ideal closed-loop client at concurrency L (virtual time,
  no HTTP, no pipeline: :func:`bench.engine_model.predict`) and **of model** the ratio;
- **of best**: req/s over the sweep's best: the curve a user reads to choose a limit;
- **gain**: d ln(req/s) / d ln(limit) from the row before (1: throughput grew as fast as the
  limit, 0: not at all); the knee printed under the table is the last limit reached with a
  gain of at least 0.5;
- **node CPU ms**, **Redis CPU ms**: the worker nodes' and the Redis server's CPU per request
  (user + system, first submit to last result).

Every engine duration is multiplied by the time scale S so that a point takes tens of seconds
(printed with each table; ``--time-scale`` overrides the presets' here). Each run starts one
node ``pipeline worker -c SLOTS`` with the limit plus the dispatcher's look-ahead for it
(``PIPELINE_LOOKAHEAD=auto``: half the limit, at most 8 a node), a pool file with as many
``workers``; ``--node-slots N`` caps a node's slots and runs a larger limit on several nodes.

    .venv/bin/python bench/engine.py --only h100             # ~4 min
    .venv/bin/python bench/engine.py --only kv-bound         # ~4 min
    .venv/bin/python bench/engine.py --only compute-bound    # ~3 min
    .venv/bin/python bench/engine.py --only kv-bound --only tenants8-fair-kv   # with its best
    .venv/bin/python bench/engine.py --quick                 # every scenario, 3 levels, ~4 min
    .venv/bin/python bench/engine.py --only h100 --limits 64,192 --seconds 30
"""

from __future__ import annotations

import concurrent.futures
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import inflight as inflight_bench
from bench.common import (
    CpuMeter,
    Node,
    PipelineEnv,
    RedisHandle,
    Sim,
    above_zero,
    base_parser,
    bench_session,
    global_gate,
    log,
    process_ids,
    queue_entry,
    quota_gate,
    table,
    verdict,
)
from bench.engine_model import predict, scrape
from pipeline.sim.presets import PRESETS

QUEUE = "engine"
NODE_SLOTS = 4096  # the most slots a node is started with (one node holds thousands)
LOOKAHEAD_MAX = 8  # PIPELINE_LOOKAHEAD=auto: half the gate's capacity, 1-8 per node
OF_LIMIT, FAIR_JAIN, FAIR_OF_STATIC = 0.95, 0.99, 0.95
GAIN = 0.5  # the knee: where a larger limit raises throughput less than half as fast
QUEUE_TIME = "vllm:request_queue_time_seconds"


@dataclass(frozen=True)
class Sweep:
    """A preset's static-limit sweep: the limits, those of ``--quick``, the time inflight_bench."""

    preset: str
    limits: tuple[int, ...]
    quick: tuple[int, ...]
    time_scale: float


# The limits span each preset's knee (bench/engine_model.py): h100 ~192 (the published
# sweep's), kv-bound ~12 (the KV cache full), compute-bound ~64 (the prefills' arithmetic).
# Time scales: the most the pipeline is asked for is ~20-115 req/s of wall clock (one node
# spends ~2.5 ms of CPU a request), a request 0.4-6 s: a hand-off of a few ms is then a small
# part of a request, as on a real engine.
SWEEPS = {
    "h100": Sweep("h100", (8, 32, 64, 128, 192, 256, 384, 512), (8, 64, 192), 0.5),
    "kv-bound": Sweep("kv-bound", (2, 4, 8, 12, 16, 24, 32, 64), (4, 12, 32), 0.02),
    "compute-bound": Sweep("compute-bound", (4, 8, 16, 32, 64, 128, 256), (8, 64, 256), 0.2),
}
TENANTS, PER_TENANT, FAIR_LIMIT, BLOCK = 8, 3, 16, 50


@dataclass
class Run:
    """One run of ``n`` requests at one limit (figures in the model's time; see the module)."""

    label: str
    limit: int
    n: int
    nodes: int
    slots: int  # per node
    scale: float
    load: str = ""
    wall_s: float = 0.0  # first submit to the last result read, wall clock
    rate: float = math.nan  # model req/s
    latency: float = math.nan  # model s at the engine
    queue: float = math.nan  # model s in the engine's queue
    preempted: float = 0.0  # per request
    max_at_engine: int = 0
    at_engine: float = math.nan  # time-average number at the engine over the window
    max_waiting: int = 0
    not_ok: int = 0
    max_attempts: int = 0
    cpu_ms: dict[str, float] = field(default_factory=dict)  # per request: nodes, engine, redis
    predicted: float = math.nan  # model req/s of an ideal closed loop at this limit
    by_tenant: dict[str, int] = field(default_factory=dict)  # answers in the window

    @property
    def little(self) -> float:
        return self.rate * self.latency

    @property
    def of_limit(self) -> float:
        return self.at_engine / self.limit

    @property
    def clean(self) -> bool:
        return self.max_at_engine <= self.limit and self.not_ok == 0 and self.max_attempts <= 1


@dataclass
class Section:
    """What a scenario prints: a title, a table, lines under it, and its verdicts."""

    title: str
    headers: list[str]
    rows: list[list[Any]]
    notes: list[str] = field(default_factory=list)
    ok: bool = True


@dataclass
class Context:
    """What every scenario gets: the Redis, a work directory, the options, earlier runs."""

    rh: RedisHandle
    workdir: Path
    quick: bool
    seconds: float
    node_slots: int
    time_scale: float | None
    limits: tuple[int, ...] | None
    lookahead: int | None = None  # PIPELINE_LOOKAHEAD of the nodes (None: auto)
    runs: dict[str, list[Run]] = field(default_factory=dict)  # scenario -> its runs


# -- one run ---------------------------------------------------------------------------------
def engine_sim(preset: str, scale: float) -> Sim:
    """``pipeline sim --engine PRESET --time-scale S`` recording each answer's arrival."""
    work = PRESETS[preset].workload
    extra = ["--engine", preset, "--time-scale", f"{scale:g}", "--seed", "1"]
    if work.completion_min_ratio < 1.0:
        extra += ["--completion-min-ratio", f"{work.completion_min_ratio:g}"]
    return Sim(record_arrivals=True, extra=extra)


def node_plan(limit: int, node_slots: int, lookahead: int | None = None) -> tuple[int, int]:
    """(nodes, slots per node) for a slot gate of ``limit``: each node its share of the limit
    plus the look-ahead the dispatcher sends it (``lookahead``, else
    ``PIPELINE_LOOKAHEAD=auto``: half the limit, 1-8 per node), at most ``node_slots`` a
    node."""
    ahead = lookahead if lookahead is not None else min(LOOKAHEAD_MAX, max(1, -(-limit // 2)))
    if node_slots <= ahead:
        raise SystemExit(f"--node-slots {node_slots}: a node needs more than its look-ahead")
    nodes = math.ceil(limit / (node_slots - ahead))
    return nodes, math.ceil(limit / nodes) + ahead


def payload(preset: str) -> dict[str, Any]:
    work = PRESETS[preset].workload
    prompt = " ".join(["w"] * work.prompt_tokens)  # the simulator counts a token per word
    return {"model": "sim-model", "prompt": prompt, "max_tokens": work.max_tokens}


def one_tenant(n: int) -> list[str]:
    return ["bench"] * n


def tenant_blocks(n: int) -> list[str]:
    """``TENANTS`` tenants in blocks of ``BLOCK``: tenant 0's first 50, then tenant 1's..."""
    return [f"tenant{(i // BLOCK) % TENANTS}" for i in range(n)]


def run_once(
    ctx: Context,
    sim: Sim,
    preset: str,
    scale: float,
    *,
    label: str,
    limit: int,
    gate: dict[str, Any],
    n: int,
    expected_s: float,
    tenants: Callable[[int], list[str]] = one_tenant,
) -> Run:
    """``n`` requests of ``preset``'s workload through ``gate`` in front of ``sim``, on
    nodes started for this run, all submitted at once (a request ``expected_s`` of wall
    clock at the engine); the engine-side figures of the run."""
    nodes, slots = node_plan(limit, ctx.node_slots, ctx.lookahead)
    run = Run(label, limit, n, nodes, slots, scale)
    timeouts: dict[str, Any] = {
        "request_timeout_s": max(300, 20 * expected_s),
        "default_timeout_s": 3600,
    }
    q = queue_entry(QUEUE, sim.url, **gate, **timeouts)
    pools = [{"id": "default", "workers": nodes * slots}]
    env = {"PIPELINE_METRICS_PORT": "0"}  # several nodes on one machine: no port to share
    if ctx.lookahead is not None:
        env["PIPELINE_LOOKAHEAD"] = str(ctx.lookahead)
    penv = PipelineEnv(ctx.rh.url, [q], ctx.workdir, pools=pools, extra=env)
    workers = start_nodes(penv, nodes, slots)
    try:
        p = penv.pipeline()
        body = payload(preset)
        tag = f"{label.replace(' ', '')}-{time.monotonic_ns()}"
        owners = tenants(n)
        batch = [
            {"payload": body, "queue": QUEUE, "id": f"{tag}-{i}", "metadata": {"userid": who}}
            for i, who in enumerate(owners)
        ]
        tenant_of = {f"{tag}-{i}": who for i, who in enumerate(owners)}
        sim.reset()
        before, engine_before = scrape(sim), sim.stats()["engine"]
        run.load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        log(f"{label}: {n} requests, {nodes} node(s) x {slots} slots, load {run.load}")
        cpu = CpuMeter(process_ids(ctx.rh, sim, [w.proc.pid for w in workers])).start()
        t0 = time.monotonic()
        reqs = p.submit_many(batch)
        results = list(p.iter_results([r.id for r in reqs], poll_s=0.1))
        run.wall_s = time.monotonic() - t0
        used = cpu.stop()
        after, stats = scrape(sim), sim.stats()
        arrivals = sim.arrivals()
    finally:
        for w in workers:
            w.stop()
    run.cpu_ms = {
        "nodes": sum(v for k, v in used.items() if k.startswith("worker")) * 1000 / n,
        "engine": used.get("sim", math.nan) * 1000 / n,
        "redis": used.get("redis", math.nan) * 1000 / n,
    }
    run.not_ok = sum(r.status_code != 200 for r in results)
    tries = list(stats.get("attempts_by_request_id", {}).values())
    run.max_attempts = max([*tries, *(r.attempts for r in results)], default=0)
    run.max_at_engine = int(stats["max_concurrency_observed"])
    engine = stats["engine"]
    run.max_waiting = int(engine["max_waiting_observed"])
    run.preempted = (engine["preemptions"] - engine_before["preemptions"]) / n
    count = after[f"{QUEUE_TIME}_count"] - before.get(f"{QUEUE_TIME}_count", 0.0)
    total = after[f"{QUEUE_TIME}_sum"] - before.get(f"{QUEUE_TIME}_sum", 0.0)
    run.queue = total / count / scale if count else math.nan
    window(run, arrivals, tenant_of)
    log(
        f"{label}: {run.rate:.2f} req/s (model), latency {run.latency:.2f} s, "
        f"of limit {run.of_limit:.3f}, max at engine {run.max_at_engine}, "
        f"queue {run.queue:.2f} s, preempted/req {run.preempted:.2f}, {run.wall_s:.1f} s wall"
    )
    return run


def start_nodes(penv: PipelineEnv, nodes: int, slots: int) -> list[Node]:
    """``nodes`` nodes of ``slots`` slots, started side by side (each waits for Celery's
    mingle); if one fails the others are stopped."""
    with concurrent.futures.ThreadPoolExecutor(nodes) as pool:
        futures = [pool.submit(Node, penv, concurrency=slots) for _ in range(nodes)]
    started = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for node in started:
            node.stop()
        raise failed[0]  # type: ignore[misc]
    return started


def window(run: Run, arrivals: list[tuple[float, float, str]], tenant_of: dict[str, str]) -> None:
    """The run's steady part, by the engine's clock: from the 2L-th arrival (the limit filled
    and refilled once: a batch submitted at once starts in step, and the engine's first
    rounds run unlike the later ones) to the last one (then nothing is left to send, and the
    engine drains). Its rate
    (answers written in it over its length), the mean time at the engine of those requests,
    the time-average number at the engine, and each tenant's answers in it."""
    starts = sorted(a for a, _, _ in arrivals)
    if len(starts) <= 2 * run.limit:
        return
    t1, t2 = starts[2 * run.limit - 1], starts[-1]
    inside = [(a, f, rid) for a, f, rid in arrivals if t1 < f <= t2]
    if not inside or t2 <= t1:
        return
    run.rate = len(inside) / (t2 - t1) * run.scale
    run.latency = sum(f - a for a, f, _ in inside) / len(inside) / run.scale
    busy = sum(max(0.0, min(f, t2) - max(a, t1)) for a, f, _ in arrivals)
    run.at_engine = busy / (t2 - t1)
    run.by_tenant = {}
    for _, _, rid in inside:
        who = tenant_of.get(rid, "?")
        run.by_tenant[who] = run.by_tenant.get(who, 0) + 1


def rounds_for(ctx: Context, latency_s: float) -> int:
    """Rounds of L requests for ~``ctx.seconds`` of wall clock (a request ``latency_s``), at
    least 6 (``--quick``: 4): the span measured leaves out the first two."""
    return max(4 if ctx.quick else 6, min(40, round(ctx.seconds / max(latency_s, 1e-3))))


# -- scenarios -------------------------------------------------------------------------------
def sweep(ctx: Context, name: str) -> Section:
    """A preset's static-limit sweep (see the module)."""
    spec = SWEEPS[name]
    preset = PRESETS[spec.preset]
    scale = ctx.time_scale or spec.time_scale
    limits = ctx.limits or (spec.quick if ctx.quick else spec.limits)
    sim = engine_sim(spec.preset, scale)
    runs: list[Run] = []
    try:
        for limit in limits:
            predicted, latency = predict(preset.config, preset, limit)
            n = limit * rounds_for(ctx, latency * scale)
            run = run_once(
                ctx,
                sim,
                spec.preset,
                scale,
                label=f"{name} L={limit}",
                limit=limit,
                gate=global_gate(limit),
                n=n,
                expected_s=latency * scale,
            )
            run.predicted = predicted
            runs.append(run)
    finally:
        sim.stop()
    ctx.runs[name] = runs
    best = max((r.rate for r in runs if not math.isnan(r.rate)), default=math.nan)
    rows = [
        [
            r.limit,
            f"{r.nodes} x {r.slots}",
            r.n,
            r.rate,
            r.predicted,
            r.rate / r.predicted,
            r.latency,
            r.queue,
            r.preempted,
            r.little,
            r.of_limit,
            r.at_engine,
            r.max_at_engine,
            r.rate / best,
            elasticity(runs, i),
            r.cpu_ms["nodes"],
            r.cpu_ms["redis"],
            r.load,
            verdict(r.of_limit >= OF_LIMIT and r.clean),
        ]
        for i, r in enumerate(runs)
    ]
    work = preset.workload
    title = (
        f"{name}: {preset.summary}; {work.prompt_tokens}-token prompts, max_tokens "
        f"{work.max_tokens}"
        + (f" (from {work.completion_min_ratio:g} x)" if work.completion_min_ratio < 1 else "")
        + f"; time scale {scale:g} (times below in the model's seconds = wall / {scale:g}, "
        f"rates in its req/s = wall x {scale:g})"
    )
    ok = all(r.of_limit >= OF_LIMIT and r.clean for r in runs)
    target = (
        f"target: every row's 'of limit' >= {OF_LIMIT}, never more than the limit at the "
        f"engine, every result 200 after one attempt: {verdict(ok)}"
    )
    return Section(title, SWEEP_HEADERS, rows, [*sweep_notes(runs, best), target], ok)


SWEEP_HEADERS = [
    "limit",
    "nodes x slots",
    "requests",
    "req/s",
    "model",
    "of model",
    "latency s",
    "queue s",
    "preempted/req",
    "Little",
    "of limit",
    "mean at engine",
    "max at engine",
    "of best",
    "gain",
    "node CPU ms",
    "Redis CPU ms",
    "load",
    "target",
]


def elasticity(runs: list[Run], i: int) -> float:
    """How much faster than the limit the throughput grew from the row before: d ln(req/s)
    / d ln(limit), 1 while the engine turns every added request into throughput, 0 once it
    is saturated."""
    if i == 0 or runs[i].limit == runs[i - 1].limit:
        return math.nan
    a, b = runs[i - 1], runs[i]
    return math.log(b.rate / a.rate) / math.log(b.limit / a.limit)


def sweep_notes(runs: list[Run], best: float) -> list[str]:
    """How to read the curve: its best, its knee, where the engine starts to queue."""
    if not runs or math.isnan(best):
        return []
    top = next(r for r in runs if r.rate == best)
    ninety = next(r for r in runs if r.rate >= 0.9 * best)
    drop = next((i for i in range(1, len(runs)) if elasticity(runs, i) < GAIN), None)
    knee = runs[drop - 1] if drop else runs[-1]
    queues = next((r for r in runs if r.queue > 0.1 * r.latency), None)
    preempts = next((r for r in runs if r.preempted > 0), None)
    return [
        f"best {best:.3g} req/s at limit {top.limit} (latency {top.latency:.3g} s), 90 % of "
        f"it from limit {ninety.limit} ({ninety.latency:.3g} s); the knee: up to limit "
        f"{knee.limit} ({knee.rate:.3g} req/s, {knee.latency:.3g} s) each step raised req/s at "
        f"least {GAIN:.0%} as fast as the limit ('gain'), past it less",
        "the engine's own queue above 10 % of the latency from limit "
        + (f"{queues.limit}" if queues else "- (never)")
        + "; preemptions from limit "
        + (f"{preempts.limit}" if preempts else "- (none)"),
    ]


def tenants8_fair_kv(ctx: Context) -> Section:
    """The 8-tenant fair-share mix on ``kv-bound``, and the static limit 16 beside it."""
    name = "kv-bound"
    spec, preset = SWEEPS[name], PRESETS[name]
    scale = ctx.time_scale or spec.time_scale
    predicted, latency = predict(preset.config, preset, FAIR_LIMIT)
    cycles = round(rounds_for(ctx, latency * scale) * FAIR_LIMIT / (TENANTS * BLOCK))
    n = TENANTS * BLOCK * max(1 if ctx.quick else 2, cycles)
    composite = {
        "gate_type": "composite",
        "fair_share": True,
        "gate_params": {"gates": [quota_gate(PER_TENANT), global_gate(FAIR_LIMIT)]},
    }
    sim = engine_sim(name, scale)
    try:
        static = run_once(
            ctx,
            sim,
            name,
            scale,
            label=f"static L={FAIR_LIMIT}",
            limit=FAIR_LIMIT,
            gate=global_gate(FAIR_LIMIT),
            n=n,
            expected_s=latency * scale,
        )
        fair = run_once(
            ctx,
            sim,
            name,
            scale,
            label="8 tenants fair",
            limit=FAIR_LIMIT,
            gate=composite,
            n=n,
            expected_s=latency * scale,
            tenants=tenant_blocks,
        )
    finally:
        sim.stop()
    static.predicted = fair.predicted = predicted
    ctx.runs["tenants8-fair-kv"] = [static, fair]
    counts = [fair.by_tenant.get(f"tenant{t}", 0) for t in range(TENANTS)]
    jain = sum(counts) ** 2 / (TENANTS * sum(c * c for c in counts)) if any(counts) else 0.0
    swept = [r for r in ctx.runs.get(name, []) if not math.isnan(r.rate)]
    best = max(swept, key=lambda r: r.rate, default=None)
    rows: list[list[Any]] = []
    for r in (static, fair):
        shares = (
            [
                r.by_tenant.get(f"tenant{t}", 0) / max(1, sum(r.by_tenant.values()))
                for t in range(TENANTS)
            ]
            if r is fair
            else []
        )
        rows.append(
            [
                r.label,
                r.n,
                r.rate,
                r.rate / static.rate,
                r.rate / best.rate if best else math.nan,
                r.latency,
                r.queue,
                r.preempted,
                r.of_limit,
                r.max_at_engine,
                " ".join(f"{s:.3f}" for s in shares) or "-",
                jain if r is fair else "-",
                r.load,
            ]
        )
    ok = (
        jain >= FAIR_JAIN
        and fair.rate >= FAIR_OF_STATIC * static.rate
        and fair.clean
        and static.clean
    )
    notes = [
        f"each tenant a redis-quota of {PER_TENANT} behind global-max-concurrency "
        f"{FAIR_LIMIT}, fair_share; blocks of {BLOCK} per tenant; time scale {scale:g}",
        f"target: Jain >= {FAIR_JAIN} and req/s >= {FAIR_OF_STATIC} of the static limit "
        f"{FAIR_LIMIT}'s: {verdict(ok)}",
    ]
    if best is not None:
        notes.append(f"the kv-bound sweep's best: {best.rate:.3g} req/s at limit {best.limit}")
    headers = [
        "run",
        "requests",
        "req/s",
        "of static",
        "of best",
        "latency s",
        "queue s",
        "preempted/req",
        "of limit",
        "max at engine",
        "tenants' shares",
        "Jain",
        "load",
    ]
    return Section(
        f"8 tenants, fair share, on kv-bound (limit {FAIR_LIMIT})", headers, rows, notes, ok
    )


def inflight(ctx: Context) -> Section:
    """``bench/inflight.py``'s scenario: one node at ``-c`` 256 and 1,024 (``--quick``: 256)
    against a simulator of 2 and 5 s with no limit, its targets."""
    chosen = [256] if ctx.quick else [256, 1024]
    rows = []
    ok = True
    for slots in chosen:
        latency_ms, n = inflight_bench.SCENARIOS[slots]
        o = inflight_bench.scenario(ctx.rh, ctx.workdir, slots, latency_ms, n)
        good = (
            o.ratio >= inflight_bench.TARGETS.get(slots, 0)
            and o.max_attempts <= 1
            and not o.error_lines
            and o.peak_connections <= inflight_bench.MAX_CONNECTIONS
        )
        ok &= good
        rows.append(
            [
                f"-c {slots}, {o.latency_s:g} s",
                f"{o.done}/{o.n}",
                o.rate,
                o.ratio,
                o.attempts_per_request,
                o.error_lines,
                o.peak_connections,
                f"{o.rss_bytes / 2**20:.0f}",
                o.cpu_ms_per_request,
                o.load,
                verdict(good),
            ]
        )
    headers = [
        "scenario",
        "done",
        "req/s",
        "of ceiling",
        "attempts/req",
        "errors",
        "Redis conns",
        "RSS MiB",
        "CPU ms/req",
        "load",
        "target",
    ]
    target = "targets: bench/inflight.py's (its docstring), and <= 64 Redis connections"
    return Section("in-flight scale (bench/inflight.py)", headers, rows, [target], ok)


# name -> the scenario; a gate of the next issue's (adaptive-concurrency) adds its own here
SCENARIOS: dict[str, Callable[[Context], Section]] = {
    "h100": lambda ctx: sweep(ctx, "h100"),
    "kv-bound": lambda ctx: sweep(ctx, "kv-bound"),
    "compute-bound": lambda ctx: sweep(ctx, "compute-bound"),
    "tenants8-fair-kv": tenants8_fair_kv,
    "inflight": inflight,
}
DEFAULT = ("h100", "kv-bound", "compute-bound", "tenants8-fair-kv")


def main() -> int:
    ap = base_parser(__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument(
        "--only",
        choices=list(SCENARIOS),
        action="append",
        help=f"a scenario (repeatable; default: {', '.join(DEFAULT)})",
    )
    ap.add_argument(
        "--quick", action="store_true", help="a smoke run: three limits per sweep, ~5 s a run"
    )
    ap.add_argument(
        "--seconds", type=above_zero(float), help="wall clock a run aims at (default 20; --quick 5)"
    )
    ap.add_argument(
        "--time-scale",
        type=above_zero(float),
        help="instead of each sweep's (printed with its table)",
    )
    ap.add_argument(
        "--limits",
        type=lambda t: tuple(above_zero(int)(v) for v in t.split(",")),
        help="the limits of a sweep, comma-separated (instead of its own)",
    )
    ap.add_argument(
        "--lookahead",
        type=int,
        help="the nodes' PIPELINE_LOOKAHEAD (default: auto: half the limit, 1-8)",
    )
    ap.add_argument(
        "--node-slots",
        type=above_zero(int),
        default=NODE_SLOTS,
        help="the most slots a node is started with (default %(default)s)",
    )
    args = ap.parse_args()
    chosen = [k for k in SCENARIOS if k in (args.only or DEFAULT)]
    seconds = args.seconds or (5.0 if args.quick else 20.0)
    sections: list[Section] = []
    with bench_session(args.redis_url) as (rh, workdir):
        ctx = Context(
            rh,
            workdir,
            args.quick,
            seconds,
            args.node_slots,
            args.time_scale,
            args.limits,
            args.lookahead,
        )
        for key in chosen:
            sections.append(SCENARIOS[key](ctx))
    for s in sections:
        print(f"\n{s.title}")
        print(table(s.headers, s.rows))
        for line in s.notes:
            print(line)
    print("\n" + "; ".join(f"{s.title.split(':')[0]} {verdict(s.ok)}" for s in sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
