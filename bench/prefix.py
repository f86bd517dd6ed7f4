"""Prefix-grouped dispatch against the engine model's prefix cache (issue 50): the
``prefix`` scenario of ``bench/engine.py``, here so that file stays one sweep per preset.

``pipeline sim --engine kv-bound --enable-prefix-caching --time-scale S`` behind one worker
node and an ``adaptive-concurrency`` gate reading the engine's ``/metrics``. A batch of N chat
lines (5,000) over P system prompts (10) of T words (~2,000 tokens: the simulator counts a
token a word) and a short question each, submitted interleaved (line i has prompt i mod P),
all at once. Each run uses prompts of its own, so no run finds another's in the cache. Runs:

- **submission order**: the queue with ``group_prefixes: false``, the pending order;
- **grouped**: the same batch with grouping on (far deadlines: all slack);
- **unique, today** and **unique, grouping on**: a batch of the same size whose lines share
  no prefix, grouping off and on (nothing to group: the rate must not move);
- **deadlines, 10 % slack**: grouped, each line's deadline the time the submission-order run
  finished it (from its submit) plus 10 % of that run's length; ``group_slack_s`` the
  submission-order run's p99 time at the engine x 4 (what a request needs once sent); and
  **deadlines, submission order**, the same deadlines without grouping: on a loaded machine a
  run slower than the first misses deadlines whatever the order. Late requests are counted,
  and those of them passed over for a prefix on the way (their decision log).

Rates are the engine's (lines over its first arrival to its last answer, as
``bench/engine.py`` measures at the engine), and beside them the user's (first submit to last
result: also the ~3-4 s it takes to submit 5,000 lines of ~12 KB), in the model's req/s (wall
x S); the targets are read on the engine's. The
cached-token share is the answers' ``usage.prompt_tokens_details.cached_tokens`` over what
could hit: every line but each prompt's first, its system prompt's full blocks; the engine's
hit rate is ``prefix_cache_hits`` over ``prefix_cache_queries`` (readmissions after a
preemption counted again).

    .venv/bin/python bench/prefix.py                      # ~10 min
    .venv/bin/python bench/prefix.py --lines 1000 --scale 0.01
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Node, PipelineEnv, Sim, bench_session, log, queue_entry, table, verdict
from pipeline.sim.presets import PRESETS

PRESET = "kv-bound"
BLOCK = 16
SPEEDUP, CACHED_SHARE, UNIQUE_BAND = 1.5, 0.8, 0.03


@dataclass
class Run:
    label: str
    n: int
    wall_s: float = 0.0
    rate: float = math.nan  # model req/s, first submit to last result
    engine_rate: float = math.nan  # model req/s, first arrival at the engine to last answer
    hits: int = 0  # the engine's prefix_cache_hits (a preempted sequence's again)
    queries: int = 0
    cached: int = 0  # the answers' usage.prompt_tokens_details.cached_tokens (first admission)
    not_ok: int = 0
    late: int = 0  # ended DEADLINE_EXCEEDED
    late_passed: int = 0  # of those, passed over for a prefix on the way (their decision log)
    max_running: int = 0
    preemptions: int = 0
    finish: dict[int, float] = field(default_factory=dict)  # line -> s from submit to result
    at_engine: list[float] = field(default_factory=list)  # s at the engine, each line


def lines(tag: str, n: int, prompts: int, words: int, shared: bool) -> list[dict[str, Any]]:
    """Chat bodies: line i's system prompt is prompt i mod P of this run (``tag``), else
    (not ``shared``) its own; a question of a few words."""
    work = PRESETS[PRESET].workload
    bodies = []
    cache: dict[int, str] = {}
    for i in range(n):
        k = i % prompts if shared else i
        if k not in cache or not shared:
            system = " ".join(f"{tag}{k}x{j % 97}" for j in range(words))
            cache[k] = system
        bodies.append({
            "model": "sim-model",
            "messages": [{"role": "system", "content": cache[k]},
                         {"role": "user", "content": f"question {i} about it?"}],
            "max_tokens": work.max_tokens,
        })  # fmt: skip
    return bodies


def run(
    rh: Any,
    workdir: Path,
    sim: Sim,
    label: str,
    bodies: list[dict[str, Any]],
    scale: float,
    slots: int,
    queue: dict[str, Any],
    deadlines: list[float] | None = None,
) -> Run:
    r = Run(label, len(bodies))
    name = f"prefix{time.monotonic_ns() % 10**8}"
    gate: dict[str, Any] = {"gate_type": "adaptive-concurrency",
            "gate_params": {"metrics_url": sim.url + "/metrics"}}  # fmt: skip
    entry = queue_entry(name, sim.url, request_path_url="/v1/chat/completions",
                        request_timeout_s=600, **gate, **queue)  # fmt: skip
    penv = PipelineEnv(rh.url, [entry], workdir, extra={"PIPELINE_METRICS_PORT": "0"})
    node = Node(penv, concurrency=slots)
    try:
        pl = penv.pipeline()
        sim.reset()
        t0 = time.time()
        items = []
        for i, body in enumerate(bodies):
            item: dict[str, Any] = {"payload": body, "queue": name, "id": f"{name}-{i}"}
            if deadlines is None:
                item["timeout"] = 36_000
            else:
                item["deadline"] = t0 + deadlines[i]
            items.append(item)
        start = time.monotonic()
        ids = [q.id for q in pl.submit_many(items)]
        index = {rid: i for i, rid in enumerate(ids)}
        for res in pl.iter_results(ids, poll_s=0.05):
            r.finish[index[res.id]] = time.monotonic() - start
            r.not_ok += not res.ok
            if res.ok:
                usage = json.loads(res.payload).get("usage") or {}
                r.cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            if not res.ok and "DEADLINE" in str(res.error_code):
                r.late += 1
                log_events = [e.event for e in pl.explain(res.id).log]
                r.late_passed += "passed" in log_events
        r.wall_s = time.monotonic() - start
        stats = sim.stats()
        arrivals = sim.arrivals()
    finally:
        node.stop()
    engine = stats["engine"]
    r.rate = r.n / r.wall_s * scale
    r.hits, r.queries = engine["prefix_cache_hits"], engine["prefix_cache_queries"]
    r.max_running, r.preemptions = engine["max_running_observed"], engine["preemptions"]
    r.at_engine = sorted(f - a for a, f, _ in arrivals)
    span = max(f for _, f, _ in arrivals) - min(a for a, _, _ in arrivals)
    r.engine_rate = len(arrivals) / span * scale
    log(f"{label}: {r.rate:.3f} req/s (model), {r.wall_s:.1f} s wall, hits {r.hits}, "
        f"max running {r.max_running}, preempted {r.preemptions}, not ok {r.not_ok}")  # fmt: skip
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("--lines", type=int, default=5000)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--words", type=int, default=2000, help="a system prompt's tokens")
    ap.add_argument("--scale", type=float, default=0.01, help="the engine's time scale")
    ap.add_argument("--slots", type=int, default=160, help="the worker node's slots")
    ap.add_argument("--skip-unique", action="store_true")
    ap.add_argument("--redis-url")
    args = ap.parse_args()
    n, scale = args.lines, args.scale
    work = PRESETS[PRESET].workload
    extra = ["--engine", PRESET, "--time-scale", f"{scale:g}", "--seed", "1",
             "--completion-min-ratio", f"{work.completion_min_ratio:g}",
             "--enable-prefix-caching"]  # fmt: skip
    runs: list[Run] = []
    with bench_session(args.redis_url) as (rh, workdir):
        sim = Sim(record_arrivals=True, extra=extra)
        try:

            def go(label: str, tag: str, shared: bool, queue: dict[str, Any],
                   deadlines: list[float] | None = None) -> Run:  # fmt: skip
                bodies = lines(tag, n, args.prompts, args.words, shared)
                r = run(rh, workdir, sim, label, bodies, scale, args.slots, queue, deadlines)
                runs.append(r)
                return r

            plain = go("submission order", "o", True, {"group_prefixes": False})
            grouped = go("grouped", "g", True, {})
            p99 = plain.at_engine[int(0.99 * (len(plain.at_engine) - 1))]
            slack = 0.1 * plain.wall_s
            deadlines = [plain.finish[i] + slack for i in range(n)]
            timed = go("deadlines, 10 % slack", "d", True, {"group_slack_s": round(4 * p99, 3)},
                       deadlines)  # fmt: skip
            control = go("deadlines, submission order", "c", True, {"group_prefixes": False},
                         deadlines)  # fmt: skip
            if not args.skip_unique:
                today = go("unique, today", "u", False, {"group_prefixes": False})
                on = go("unique, grouping on", "v", False, {})
        finally:
            sim.stop()
    possible = (n - args.prompts) * (args.words // BLOCK * BLOCK)
    rows = [[r.label, r.n, r.engine_rate, r.engine_rate / plain.engine_rate, r.rate,
             r.rate / plain.rate, r.wall_s,
             r.cached / possible if possible else math.nan, r.hits / max(1, r.queries),
             r.max_running, r.preemptions, r.not_ok, r.late, r.late_passed]
            for r in runs]  # fmt: skip
    headers = ["run", "lines", "req/s", "of submission order", "req/s from submit",
               "of submission order", "wall s", "cached share",
               "engine hit rate", "max running", "preempted", "not ok", "late",
               "late, passed over"]  # fmt: skip
    print(f"\n{n} chat lines over {args.prompts} system prompts of {args.words} tokens, "
          f"interleaved; {PRESET} with --enable-prefix-caching, time scale {scale:g} (rates "
          f"in the model's req/s = wall x {scale:g}), adaptive-concurrency on /metrics, "
          f"one node of {args.slots} slots")  # fmt: skip
    print(table(headers, rows))
    speed = grouped.engine_rate / plain.engine_rate
    share = grouped.cached / possible if possible else 0.0
    checks = [
        (f"grouped >= {SPEEDUP} x submission order: {speed:.2f}", speed >= SPEEDUP),
        (f"cached-token share >= {CACHED_SHARE}: {share:.3f}", share >= CACHED_SHARE),
        (f"10 % slack ({slack:.1f} s wall, group_slack_s {4 * p99:.2f} s): "
         f"{timed.late} late ({timed.late_passed} of them passed over for a prefix), "
         f"{control.late} in submission order with the same deadlines",
         timed.late <= control.late),
    ]  # fmt: skip
    if not args.skip_unique:
        ratio = on.engine_rate / today.engine_rate
        checks.append((f"no shared prefix: grouping on / off {ratio:.3f} (within "
                       f"{UNIQUE_BAND:.0%})", abs(ratio - 1) <= UNIQUE_BAND))  # fmt: skip
    for text, ok in checks:
        print(f"{text}  {verdict(ok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
