"""The ``adaptive-concurrency`` controller (``pipeline/gates/knee.py``) against the engine
model in virtual time: no Redis, no HTTP, no clock, so a 2,000-request run takes a second and
is the same every time. A closed loop with a backlog: ``slots`` worker slots (the node
ceiling) take requests whenever the gate's limit has room; each one goes to the engine
(``pipeline/sim/engine.py``) with the preset's workload; its answer is one observation of the
window, aggregated as ``gate_adaptive_observe.lua`` does; a window closes after the
controller's due time, as ``gate_adaptive_close.lua`` decides, and the engine's metrics are read
then when ``engine_metrics`` is set. In front of the engine an optional gateway cap answers 429
to what exceeds it (the request is retried after a short backoff).

A static limit is the same loop with the limit never moved: the sweep the adaptive runs are
compared with.

    .venv/bin/python bench/adaptive_model.py                 # every preset, ~30 s
    .venv/bin/python bench/adaptive_model.py --preset kv-bound --trace
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.gates import knee
from pipeline.sim.engine import Engine, Sequence
from pipeline.sim.presets import PRESETS

RETRY_S = 1.0  # model seconds a 429'd request waits before it is tried again (x scale: wall)


@dataclass
class Scenario:
    preset: str
    requests: int = 2000
    slots: int = 64
    static: int | None = None  # a fixed limit instead of the controller
    engine_metrics: bool = False
    cap: int | None = None  # a gateway in front answers 429 above this many in flight
    capacity: tuple[tuple[float, float], ...] = ()  # (at model s, replicas)
    controller: str = "knee"
    initial: int = 8
    seed: int = 1


@dataclass
class Result:
    finished: int = 0
    duration: float = 0.0  # model s, first request to last answer
    preemptions: int = 0
    overloads: int = 0
    queue_times: list[float] = field(default_factory=list)  # model s in the engine's queue
    service_times: list[float] = field(default_factory=list)  # model s, arrival to finish
    trace: list[tuple[float, int, str]] = field(default_factory=list)  # (t, limit, reason)
    finishes: list[float] = field(default_factory=list)  # model s of each answer

    @property
    def throughput(self) -> float:
        return self.finished / self.duration if self.duration else 0.0

    def rate_between(self, t0: float, t1: float) -> float:
        n = sum(1 for t in self.finishes if t0 <= t < t1)
        return n / (t1 - t0) if t1 > t0 else 0.0

    @property
    def queue_p90_share(self) -> float:
        """The engine queue time's p90 over the mean service time."""
        if not self.queue_times:
            return 0.0
        q = sorted(self.queue_times)[int(0.9 * (len(self.queue_times) - 1))]
        return q / (sum(self.service_times) / len(self.service_times))


class _WindowAgg:
    """gate_adaptive_observe.lua in Python: sums, a peak and a least."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.f: dict[str, float] = {}

    def add(self, **changes: float) -> None:
        for k, v in changes.items():
            if k in ("peak",):
                self.f[k] = max(self.f.get(k, 0), v)
            elif k == "overload_in_flight":
                old = self.f.get(k, 0)
                self.f[k] = v if not old else min(old, v)
            else:
                self.f[k] = self.f.get(k, 0) + v

    @property
    def measured(self) -> int:
        return int(self.f.get("measured", 0))

    def window(self, elapsed: float) -> knee.Window:
        ints = {"answered", "ok", "measured", "peak", "overload", "overload_in_flight",
                "refused"}  # fmt: skip
        return knee.Window(
            elapsed_s=elapsed, **{k: int(v) if k in ints else v for k, v in self.f.items()}
        )


class Loop:
    """One closed-loop run in the engine's model seconds (``scale`` sizes the windows as the
    gate's wall-clock defaults would see them)."""

    def __init__(self, sc: Scenario, scale: float = 1.0) -> None:
        self.sc = sc
        preset = PRESETS[sc.preset]
        self.work = preset.workload
        self.rng = random.Random(sc.seed)
        self.engine = Engine(preset.config, 0.0)
        bounds = {"min": 5, "max": 100, "initial": 100} if sc.controller == "aimd-baseline" else {}
        self.cfg = knee.Config(
            controller=sc.controller,
            initial=sc.initial,
            window_min_s=knee.Config.window_min_s / scale,
            window_max_s=knee.Config.window_max_s / scale,
        )
        self.cfg = dataclasses.replace(self.cfg, **bounds)  # type: ignore[arg-type]
        self.state = knee.initial_state(self.cfg, engine=sc.engine_metrics)
        self.limit = sc.static if sc.static is not None else self.state.limit
        self.res = Result()
        self.now = 0.0
        self.admitted: dict[int, float] = {}  # rid -> admission time
        self.retries: list[tuple[float, int]] = []  # (due, rid): 429'd, tried again later
        self.sent = 0
        self.agg = _WindowAgg(0.0)
        self.changes = sorted(sc.capacity)
        self.hist = [0.0, 0.0, 0.0, 0.0]  # the engine's queue and e2e histograms: sum, count

    def take(self, rid: int, t: float) -> None:
        if self.sc.cap is not None and len(self.admitted) >= self.sc.cap:
            # the gateway refuses at once: an overload observation, tried again later
            count = len(self.admitted) + 1
            self.agg.add(answered=1, in_flight_sum=count, overload=1, overload_in_flight=count,
                         peak=count)  # fmt: skip
            self.res.overloads += 1
            heapq.heappush(self.retries, (t + RETRY_S, rid))
            return
        self.admitted[rid] = t
        work = self.work
        low = max(1, int(work.completion_min_ratio * work.max_tokens + 0.999))
        out = self.rng.randint(low, work.max_tokens) if low < work.max_tokens else work.max_tokens
        self.engine.add(rid, work.prompt_tokens, out, t)

    def fill(self, t: float) -> None:
        tries = 0  # a 429 is answered at once: at most a limit's worth of tries per event
        room = min(self.limit, self.sc.slots)
        while len(self.admitted) < room and tries < self.limit:
            tries += 1
            if self.retries and self.retries[0][0] <= t:
                rid = heapq.heappop(self.retries)[1]
            elif self.sent < self.sc.requests:
                self.sent += 1
                rid = self.sent
            else:
                break
            self.take(rid, t)
        waiting = self.sent < self.sc.requests or self.retries
        if self.limit <= len(self.admitted) < self.sc.slots and waiting:
            self.agg.add(refused=1)

    def close(self, t: float) -> None:
        reading = None
        e = self.engine
        if self.sc.engine_metrics:
            n = len(self.admitted)
            reading = knee.Engine(waiting=e.waiting, running=e.running, kv_usage=e.kv_usage,
                                  preemptions_total=e.counters.preemptions,
                                  histograms=tuple(self.hist),  # type: ignore[arg-type]
                                  in_flight_before=n, in_flight_after=n)  # fmt: skip
        w = self.agg.window(t - self.agg.start)
        self.state = knee.decide(self.state, w, self.cfg, t, reading).state
        if self.sc.static is None:
            self.limit = self.state.limit
        self.res.trace.append((t, self.limit, self.state.reason))
        self.agg = _WindowAgg(t)

    def finished(self, seq: Sequence, at: float) -> None:
        began = self.admitted.pop(int(seq.rid))  # type: ignore[call-overload]
        latency = at - began
        m = 1 if began >= self.agg.start else 0
        tok = seq.output_tokens
        self.agg.add(answered=1, ok=1, ok_latency_s=latency, measured=m,
                     latency_s=latency * m, tokens=tok * m, tokens_sq=tok * tok * m,
                     latency_tokens=latency * tok * m, in_flight_sum=len(self.admitted) + 1,
                     peak=len(self.admitted) + 1)  # fmt: skip
        res = self.res
        res.finished += 1
        queued = (seq.scheduled_at or seq.arrival) - seq.arrival
        self.hist = [self.hist[0] + queued, self.hist[1] + 1, self.hist[2] + at - seq.arrival,
                     self.hist[3] + 1]  # fmt: skip
        res.finishes.append(at)
        res.queue_times.append(queued)
        res.service_times.append(at - seq.arrival)

    def next_event(self) -> float | None:
        events = [e for e in (self.engine.next_event_at(),) if e is not None]
        if self.retries and self.retries[0][0] > self.now:  # due ones wait for a finish
            events.append(self.retries[0][0])
        if self.changes:
            events.append(self.changes[0][0])
        start = self.agg.start
        events += [b for b in (start + self.cfg.window_min_s, start + self.cfg.window_max_s)
                   if b > self.now]  # fmt: skip
        return min(events) if events else None

    def run(self) -> Result:
        self.fill(0.0)
        while self.res.finished < self.sc.requests:
            at = self.next_event()
            if at is None:
                break
            self.now = max(self.now, at)
            if self.changes and self.changes[0][0] <= self.now:
                self.engine.set_capacity(self.changes.pop(0)[1], self.now)
            self.engine.advance(self.now)
            for ev in self.engine.take_events():
                if ev.kind == "finish":
                    self.finished(ev.seq, ev.at)
            elapsed = self.now - self.agg.start
            quick = knee.quick_windows(self.state)
            if knee.window_closes(elapsed, self.agg.measured, len(self.admitted), self.cfg, quick):
                self.close(self.now)
            self.fill(self.now)
        self.res.duration = max(self.res.finishes, default=0.0)
        self.res.preemptions = self.engine.counters.preemptions
        return self.res


def run(sc: Scenario, scale: float = 1.0) -> Result:
    return Loop(sc, scale).run()


PLANS: dict[str, dict[str, object]] = {
    "h100": {"levels": (8, 16, 32, 48, 64), "scale": 0.25},
    "kv-bound": {"levels": (8, 10, 12, 13, 14, 16, 20, 24, 32), "scale": 0.02},
    "compute-bound": {"levels": (16, 32, 48, 64), "scale": 0.05},
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), action="append")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--trace", action="store_true")
    args = p.parse_args()
    for name in args.preset or sorted(PLANS):
        plan = PLANS[name]
        scale = float(plan["scale"])  # type: ignore[arg-type]
        best = 0.0
        rows = []
        for level in plan["levels"]:  # type: ignore[attr-defined]
            r = run(Scenario(name, args.requests, static=level), scale)
            best = max(best, r.throughput)
            rows.append((f"static {level}", r))
        for label, sc in (
            ("adaptive (answers)", Scenario(name, args.requests)),
            ("adaptive (metrics)", Scenario(name, args.requests, engine_metrics=True)),
            ("aimd-baseline", Scenario(name, args.requests, controller="aimd-baseline")),
        ):
            rows.append((label, run(sc, scale)))
        print(f"\n{name} ({args.requests} requests, model seconds)")
        for label, r in rows:
            last = r.trace[-1][1] if r.trace else "-"
            print(f"  {label:22} {r.throughput:8.3f} req/s  {r.throughput / best:5.2f} of best  "
                  f"preempted {r.preemptions / args.requests:6.1%}  queue p90 "
                  f"{r.queue_p90_share:6.1%} of service  final limit {last}")  # fmt: skip
            if args.trace and label.startswith("adaptive"):
                for t, lim, why in r.trace:
                    print(f"      {t:9.1f} {lim:4d}  {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
