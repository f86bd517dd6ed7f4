"""Issue 47's two scenarios of ``adaptive-concurrency`` that a single backlog does not show,
through the pipeline against the simulator's engine model (``bench/adaptive.py`` runs the
static sweep, the gate and the batch gateway's AIMD on one backlog). One worker node per run,
ratios measured in one invocation, rates in the model's requests per second (wall clock x
time scale), times in its seconds (wall / time scale).

- ``priority``: an idle engine first (priority-9 requests alone, paced: their latency there);
  then the static limit(s) of ``--levels`` with a priority-0 backlog alone (the best static
  throughput); then the adaptive gate (with the engine's ``/metrics``) with the same backlog
  plus priority-9 requests arriving at ``--share`` of the best static throughput (Poisson).
  Targets: priority-9 latency p99 <= 1.5 x its p99 on the idle engine; the backlog's
  throughput >= 0.85 of the best static. ``--engine-priority``: the engine schedules by
  priority (``--scheduling-policy priority``) and the queue sends it (``engine_priority``).
- ``capacity``: the adaptive gate with a backlog while the engine's capacity halves at
  ``--phase`` model seconds and doubles back at twice that; beside it static runs on an engine
  of half capacity (``--half-levels``) and of full capacity (``--levels``) from the start.
  Targets: preemptions stop within 10 s of the halving, and from then to the doubling the
  rate is >= 0.9 of the best static limit on the halved engine; from 30 s after the doubling
  to the end >= 0.9 of the best on the full engine.

    .venv/bin/python bench/adaptive_mix.py priority --backlog 5000          # ~10 min
    .venv/bin/python bench/adaptive_mix.py priority --engine-priority
    .venv/bin/python bench/adaptive_mix.py capacity                         # ~6 min
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Node,
    PipelineEnv,
    Sim,
    bench_session,
    global_gate,
    log,
    pct,
    queue_entry,
    table,
    verdict,
)
from pipeline.sim.presets import PRESETS

PRESET, SCALE = "kv-bound", 0.02
P99_OF_IDLE, BACKLOG_OF_BEST = 1.5, 0.85
STOP_S, HALVED_OF_BEST, SETTLE_S, DOUBLED_OF_BEST = 10.0, 0.9, 30.0, 0.9


@dataclass
class Outcome:
    label: str
    n: int = 0  # the backlog's requests (priority 0)
    rate: float = 0.0  # model req/s of the backlog, first submit to its last result
    p9: list[float] = field(default_factory=list)  # model s, submit to result, priority 9
    p9_engine: list[float] = field(default_factory=list)  # ... arrival to answer at the engine
    preemptions: int = 0
    failed: int = 0
    limit: str = ""
    finishes: list[float] = field(default_factory=list)  # engine clock, each answer (wall)
    preempted_at: list[float] = field(default_factory=list)  # engine clock, each new one
    t0: float = 0.0  # engine clock at the first submit


def body(preset: str) -> dict[str, Any]:
    work = PRESETS[preset].workload
    return {"model": "sim-model", "prompt": " ".join(["w"] * work.prompt_tokens),
            "max_tokens": work.max_tokens}  # fmt: skip


def engine_sim(preset: str, scale: float, engine_priority: bool) -> Sim:
    work = PRESETS[preset].workload
    extra = ["--engine", preset, "--time-scale", f"{scale:g}", "--seed", "1"]
    if work.completion_min_ratio < 1.0:
        extra += ["--completion-min-ratio", f"{work.completion_min_ratio:g}"]
    if engine_priority:
        extra += ["--scheduling-policy", "priority"]
    return Sim(record_arrivals=True, extra=extra)


def adaptive_gate(sim: Sim, headroom: float | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"metrics_url": sim.url + "/metrics"}
    if headroom is not None:
        params["priority_headroom"] = headroom
    return {"gate_type": "adaptive-concurrency", "gate_params": params}


def preemptions(sim: Sim) -> int:
    return int(sim.stats()["engine"]["preemptions"])


class Watch(threading.Thread):
    """Polls the engine's preemption counter (every 50 ms of wall clock) and records when it
    moved, by the simulator's clock (``time.monotonic()``, the same in every process)."""

    def __init__(self, sim: Sim) -> None:
        super().__init__(daemon=True)
        self.sim, self.stop_event, self.at = sim, threading.Event(), []  # type: ignore[var-annotated]
        self.last = preemptions(sim)

    def run(self) -> None:
        while not self.stop_event.wait(0.05):
            now = preemptions(self.sim)
            if now > self.last:
                self.at.extend([time.monotonic()] * (now - self.last))
                self.last = now

    def stop(self) -> list[float]:
        self.stop_event.set()
        self.join(5)
        return list(self.at)


def run(
    rh: Any,
    workdir: Path,
    sim: Sim,
    label: str,
    gate: dict[str, Any],
    args: argparse.Namespace,
    backlog: int,
    p9_rate: float = 0.0,  # wall req/s of priority 9 while the backlog lasts
    p9_count: int = 0,  # or: this many priority-9 requests alone, at p9_rate
    capacity: tuple[tuple[float, float], ...] = (),  # (wall s after the first submit, replicas)
) -> Outcome:
    name = f"q{uuid.uuid4().hex[:6]}"
    entry = queue_entry(name, sim.url, request_timeout_s=3600, **gate)
    if args.engine_priority:
        entry["engine_priority"] = True
    penv = PipelineEnv(rh.url, [entry], workdir)
    node = Node(penv, concurrency=args.concurrency)
    pl, out = penv.pipeline(), Outcome(label, backlog)
    stop = threading.Event()
    p9_ids: list[str] = []

    def stream() -> None:  # priority 9, Poisson arrivals, on a client of its own
        client, rng = penv.pipeline(), random.Random(7)
        while not stop.is_set() and (not p9_count or len(p9_ids) < p9_count):
            if stop.wait(rng.expovariate(p9_rate)):
                break
            p9_ids.append(client.submit(body(args.preset), queue=name, priority=9,
                                        timeout=3600).id)  # fmt: skip

    def flips(t0: float) -> None:
        for at, replicas in capacity:
            if stop.wait(max(0.0, t0 + at - time.monotonic())):
                return
            sim.http.post("/sim/engine", json={"replicas": replicas})
            log(f"{label}: capacity x{replicas:g}")

    try:
        sim.reset()
        sim.http.post("/sim/engine", json={"replicas": capacity[0][1] if capacity and
                                           capacity[0][0] == 0 else 1.0})  # fmt: skip
        watch = Watch(sim)
        watch.start()
        out.t0 = time.monotonic()
        threads = [threading.Thread(target=stream, daemon=True)] if p9_rate else []
        threads += [threading.Thread(target=flips, args=(out.t0,), daemon=True)]
        for t in threads:
            t.start()
        items = [{"payload": body(args.preset), "queue": name, "timeout": 3600}] * backlog
        ids = [r.id for r in pl.submit_many(items)] if backlog else []
        results = list(pl.iter_results(ids, poll_s=0.1))
        if p9_count:
            threads[0].join()
        stop.set()
        for t in threads:
            t.join(10)
        p9 = list(pl.iter_results(list(p9_ids), poll_s=0.1))
        out.preempted_at = watch.stop()
        out.preemptions = len(out.preempted_at)
        out.failed = sum(not r.ok for r in [*results, *p9])
        if results:
            first = min(r.submitted_at for r in results if r.submitted_at is not None)
            last = max(r.finished_at for r in results if r.finished_at is not None)
            out.rate = backlog / (last - first) * args.scale
        out.p9 = [r.latency_s / args.scale for r in p9 if r.ok and r.latency_s is not None]
        arrivals = sim.arrivals()
        out.finishes = sorted(f for _, f, _ in arrivals)
        mine = set(p9_ids)
        out.p9_engine = [(f - a) / args.scale for a, f, rid in arrivals if rid in mine]
        view = pl.inspect()[name]["gate"].get("adaptive")
        out.limit = f"{view['limit']} ({view['reason_code']})" if view else "static"
    finally:
        stop.set()
        node.stop()
    log(f"{label}: {out.rate:.3f} req/s, p9 p99 {pct(out.p9, 99):.1f} s over {len(out.p9)}, "
        f"{out.preemptions} preempted, {out.failed} failed, limit {out.limit}")  # fmt: skip
    return out


def priority(rh: Any, workdir: Path, sim: Sim, args: argparse.Namespace) -> bool:
    levels = [int(x) for x in args.levels.split(",")]
    statics = [run(rh, workdir, sim, f"static {n}, backlog alone", global_gate(n), args,
                   args.backlog) for n in levels]  # fmt: skip
    best = max(statics, key=lambda o: o.rate)
    p9_rate = args.share * best.rate / args.scale  # wall req/s
    idle = run(rh, workdir, sim, "priority 9 alone (idle engine)", adaptive_gate(sim), args, 0,
               p9_rate=p9_rate, p9_count=args.idle)  # fmt: skip
    gate = adaptive_gate(sim, args.headroom)
    mix = run(rh, workdir, sim, "adaptive, backlog + priority 9", gate, args,
              args.backlog, p9_rate=p9_rate)  # fmt: skip
    idle99, mix99 = pct(idle.p9, 99), pct(mix.p9, 99)
    engine99 = pct(idle.p9_engine, 99)
    ok = mix99 <= P99_OF_IDLE * idle99 and mix.rate >= BACKLOG_OF_BEST * best.rate
    ok = ok and not mix.failed
    rows = [[o.label, o.n, o.rate or "-", o.rate / best.rate if o.rate else "-", len(o.p9),
             pct(o.p9, 50) if o.p9 else "-", pct(o.p9, 99) if o.p9 else "-",
             pct(o.p9, 99) / idle99 if o.p9 else "-",
             pct(o.p9_engine, 99) / engine99 if o.p9_engine else "-",
             o.preemptions / max(1, o.n + len(o.p9)),
             o.failed, o.limit] for o in [*statics, idle, mix]]  # fmt: skip
    print(f"\npriority under saturation, {args.preset} at time scale {args.scale:g}, "
          f"priority 9 at {args.share:.0%} of the best static rate ({p9_rate * args.scale:.3g} "
          f"req/s), engine priority {'on' if args.engine_priority else 'off'}, priority_headroom "
          f"{'default' if args.headroom is None else args.headroom}; load "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    print(table(["run", "backlog", "req/s", "of best static", "p9 n", "p9 p50 s", "p9 p99 s",
                 "p99 of idle", "at the engine: p99 of idle", "preempted/req", "failed",
                 "limit at the end"], rows))  # fmt: skip
    print(
        f"targets: p99 <= {P99_OF_IDLE} x idle ({mix99 / idle99:.2f}), backlog >= "
        f"{BACKLOG_OF_BEST} of best static ({mix.rate / best.rate:.3f}): {verdict(ok)}"
    )
    return ok


def rate_between(finishes: list[float], t0: float, t1: float, scale: float) -> float:
    n = sum(1 for t in finishes if t0 <= t < t1)
    return n / (t1 - t0) * scale if t1 > t0 else 0.0


def steady_rate(o: Outcome, scale: float, skip: float) -> float:
    """A static run's rate from ``skip`` of its span on (its cold start left out) to its last
    arrival's answer."""
    t0, t1 = o.finishes[0], o.finishes[-1]
    return rate_between(o.finishes, t0 + skip * (t1 - t0), t1 + 1e-9, scale)


def capacity(rh: Any, workdir: Path, sim: Sim, args: argparse.Namespace) -> bool:
    s = args.scale
    half = [run(rh, workdir, sim, f"static {n}, half capacity", global_gate(n), args,
                args.static_requests, capacity=((0.0, 0.5),)) for n in
            (int(x) for x in args.half_levels.split(","))]  # fmt: skip
    full = [run(rh, workdir, sim, f"static {n}, full capacity", global_gate(n), args,
                args.static_requests) for n in
            (int(x) for x in args.levels.split(","))]  # fmt: skip
    best_half = max(steady_rate(o, s, 0.2) for o in half)
    best_full = max(steady_rate(o, s, 0.2) for o in full)
    t_half, t_double = args.phase * s, 2 * args.phase * s  # wall s after the first submit
    o = run(rh, workdir, sim, "adaptive, halved then doubled", adaptive_gate(sim), args,
            args.requests, capacity=((t_half, 0.5), (t_double, 1.0)))  # fmt: skip
    halved, doubled = o.t0 + t_half, o.t0 + t_double
    after = [t for t in o.preempted_at if halved <= t < doubled]
    stop_s = (max(after) - halved) / s if after else 0.0
    end = o.finishes[-1]
    r_half = rate_between(o.finishes, halved + STOP_S * s, doubled, s)
    r_full = rate_between(o.finishes, doubled + SETTLE_S * s, end, s)
    r_before = rate_between(o.finishes, o.t0, halved, s)
    ok_stop, ok_half = stop_s <= STOP_S, r_half >= HALVED_OF_BEST * best_half
    ok_full = r_full >= DOUBLED_OF_BEST * best_full
    late = [t for t in o.preempted_at if t >= doubled]
    print(
        f"\ncapacity halves at {args.phase:g} s and doubles back at {2 * args.phase:g} s "
        f"(model), {args.preset} at time scale {s:g}; load {os.getloadavg()[0]:.1f}"
    )
    rows = [[x.label, x.n, steady_rate(x, s, 0.2), x.preemptions / x.n, x.failed] for x in
            [*half, *full]]  # fmt: skip
    print(table(["static run", "requests", "req/s (from 20 % of its span)", "preempted/req",
                 "failed"], rows))  # fmt: skip
    rows = [
        ["before the halving", r_before, "-", len([t for t in o.preempted_at if t < halved]), ""],
        [f"halved, from +{STOP_S:g} s", r_half, r_half / best_half, len(after),
         f"last preemption +{stop_s:.1f} s: {verdict(ok_stop)}; rate {verdict(ok_half)}"],
        [f"doubled, from +{SETTLE_S:g} s", r_full, r_full / best_full, len(late),
         verdict(ok_full)],
    ]  # fmt: skip
    print(table(["adaptive (/metrics)", "req/s", "of best static", "preemptions", "target"],
                rows))  # fmt: skip
    print(f"{o.n} requests, {o.failed} failed, limit at the end {o.limit}")
    return ok_stop and ok_half and ok_full and not o.failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=["priority", "capacity"])
    p.add_argument("--preset", choices=sorted(PRESETS), default=PRESET)
    p.add_argument("--scale", type=float, default=SCALE, help="the engine's time scale")
    p.add_argument("--concurrency", type=int, default=48, help="the node's slots")
    p.add_argument("--levels", default="12,13", help="static limits (full capacity)")
    p.add_argument("--backlog", type=int, default=5000, help="priority: the backlog")
    p.add_argument("--share", type=float, default=0.1, help="priority 9's share of capacity")
    p.add_argument("--idle", type=int, default=40, help="priority 9 requests on the idle engine")
    p.add_argument("--engine-priority", action="store_true")
    p.add_argument("--headroom", type=float, help="priority: the gate's priority_headroom")
    p.add_argument("--half-levels", default="5,6,7", help="capacity: static limits, halved")
    p.add_argument("--static-requests", type=int, default=200)
    p.add_argument("--requests", type=int, default=1800, help="capacity: the adaptive backlog")
    p.add_argument("--phase", type=float, default=1500.0, help="capacity: model s a phase")
    p.add_argument("--redis-url")
    args = p.parse_args()
    with bench_session(args.redis_url) as (rh, workdir):
        sim = engine_sim(args.preset, args.scale, args.engine_priority)
        try:
            ok = (priority if args.scenario == "priority" else capacity)(rh, workdir, sim, args)
        finally:
            sim.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
