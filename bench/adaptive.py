"""The adaptive-concurrency gate through the pipeline against the simulator's engine model
(issue 47), until ``bench/engine.py`` carries the issue's scenarios: one ``pipeline worker``
per run, a backlog of the preset's workload submitted at once (a cold start), and for each gate
the throughput, the engine's preemptions, its mean queue time over its mean latency (the
histograms' sums: vLLM's buckets are too coarse at a small time scale for a p90) and the most
requests the engine ever held at once. Compared in one invocation: ``global-max-concurrency``
at a few limits (the sweep), ``adaptive-concurrency`` from the answers alone and with the
engine's ``/metrics``, and the llm-d batch gateway's AIMD (``controller: aimd-baseline``).

    .venv/bin/python bench/adaptive.py --preset kv-bound --requests 600
    .venv/bin/python bench/adaptive.py --preset h100 --levels 16,32,64
    .venv/bin/python bench/adaptive.py --preset h100 --cap 24 --levels 16,24,32

Rates are in the model's requests per second (wall clock x time scale). The machine is shared:
the load average is printed with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
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
    queue_entry,
    table,
)
from pipeline.sim.presets import PRESETS

SCALES = {"h100": 0.25, "kv-bound": 0.02, "compute-bound": 0.05}
LEVELS = {"h100": "16,32,48", "kv-bound": "8,12,13,16,24", "compute-bound": "16,32,48"}


@dataclass
class Run:
    label: str
    seconds: float  # wall clock, first submit to last result
    requests: int
    preemptions: int
    queue_share: float  # mean queue time / mean e2e latency, from the engine's histograms
    peak: int  # the most requests the engine held at once (running + waiting)
    limit: str  # the adaptive gate's limit at the end, and why


def histograms(sim: Sim) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in sim.http.get("/metrics").text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith(("_sum", "_count")) or name == "vllm:num_preemptions_total":
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def one(
    rh: Any, workdir: Path, sim: Sim, label: str, gate: dict[str, Any], args: argparse.Namespace
) -> Run:
    body: dict[str, Any] = {"model": "sim-model", "prompt": "w", "max_tokens": 4}
    if args.preset != "fixed":
        work = PRESETS[args.preset].workload
        body = {"model": "sim-model", "prompt": " ".join(["w"] * work.prompt_tokens),
                "max_tokens": work.max_tokens}  # fmt: skip
    name = f"q{uuid.uuid4().hex[:6]}"
    penv = PipelineEnv(rh.url, [queue_entry(name, sim.url, request_timeout_s=600, **gate)],
                       workdir)  # fmt: skip
    node = Node(penv, concurrency=args.concurrency)
    pl = penv.pipeline()
    try:
        sim.reset()
        before = histograms(sim)
        start = time.monotonic()
        ids = [r.id for r in pl.submit_many(
            [{"payload": body, "queue": name, "timeout": 3600} for _ in range(args.requests)]
        )]  # fmt: skip
        results = list(pl.iter_results(ids, poll_s=0.1))
        seconds = time.monotonic() - start
        bad = [r for r in results if not r.ok]
        if bad:
            log(f"{label}: {len(bad)} failed, e.g. {bad[0]}")
        after = histograms(sim)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        q, e = "vllm:request_queue_time_seconds", "vllm:e2e_request_latency_seconds"
        qn, en = delta.get(f"{q}_count", 0.0), delta.get(f"{e}_count", 0.0)
        share = (delta[f"{q}_sum"] / qn) / (delta[f"{e}_sum"] / en) if qn and en else 0.0
        engine = sim.stats().get("engine") or {"max_running_observed": sim.stats()[
            "max_concurrency_observed"], "max_waiting_observed": 0}  # fmt: skip
        gate_desc = pl.inspect()[name]["gate"]
        view = gate_desc.get("adaptive")
        limit = f"{view['limit']} ({view['reason_code']})" if view else str(gate_desc["limit"])
        return Run(label, seconds, len(results), int(delta.get("vllm:num_preemptions_total", 0)),
                   share, engine["max_running_observed"] + engine["max_waiting_observed"],
                   limit)  # fmt: skip
    finally:
        node.stop()


def merged(runs: list[Run]) -> list[Run]:
    """Each gate's rounds as one run: its median rate (the time of the round of median rate),
    its preemptions and queue share summed and averaged, the largest peak, the last limit."""
    out = []
    for label in dict.fromkeys(r.label for r in runs):
        mine = [r for r in runs if r.label == label]
        mid = sorted(mine, key=lambda r: r.requests / r.seconds)[len(mine) // 2]
        rates = " ".join(f"{r.requests / r.seconds:.3g}" for r in mine)
        out.append(Run(f"{label} (median of {len(mine)}: {rates} wall req/s)", mid.seconds,
                       mid.requests, round(sum(r.preemptions for r in mine) / len(mine)),
                       sum(r.queue_share for r in mine) / len(mine), max(r.peak for r in mine),
                       mine[-1].limit))  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset",
        choices=[*sorted(PRESETS), "fixed"],
        default="kv-bound",
        help="an engine preset, or 'fixed': a server of fixed latency and no limit",
    )
    p.add_argument("--latency-ms", type=float, default=200.0, help="with --preset fixed")
    p.add_argument("--scale", type=float, help="time scale (default: the preset's bench scale)")
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--concurrency", type=int, default=48, help="worker slots (at most 64)")
    p.add_argument("--levels", help="static limits of the sweep, comma-separated")
    p.add_argument("--cap", type=int, default=0, help="a gateway answering 429 above this")
    p.add_argument("--modes", default="static,answers,metrics,aimd")
    p.add_argument("--repeat", type=int, default=1, help="rounds of every gate, interleaved")
    p.add_argument("--redis-url")
    args = p.parse_args()
    scale = args.scale or SCALES.get(args.preset, 1.0)
    levels = [int(x) for x in (args.levels or LEVELS.get(args.preset, "32,64")).split(",")]
    modes = args.modes.split(",")
    extra = ["--latency-ms", f"{args.latency_ms:g}"]
    if args.preset != "fixed":
        work = PRESETS[args.preset].workload
        extra = ["--engine", args.preset, "--time-scale", f"{scale:g}", "--seed", "1"]
        if work.completion_min_ratio < 1.0:
            extra += ["--completion-min-ratio", f"{work.completion_min_ratio:g}"]
    runs: list[Run] = []
    with bench_session(args.redis_url) as (rh, workdir):
        sim = Sim(max_concurrency=args.cap, extra=[*extra, "--overload", "429"])
        try:
            plan: list[tuple[str, dict[str, Any]]] = []
            if "static" in modes:
                plan += [(f"global-max-concurrency {n}", global_gate(n)) for n in levels]
            adaptive = {"gate_type": "adaptive-concurrency"}
            if "answers" in modes:
                plan.append(("adaptive (answers)", {**adaptive, "gate_params": {}}))
            if "metrics" in modes:
                params = {"metrics_url": sim.url + "/metrics"}
                plan.append(("adaptive (/metrics)", {**adaptive, "gate_params": params}))
            if "aimd" in modes:
                params = {"controller": "aimd-baseline", "min": 5, "max": 100, "initial": 100}
                plan.append(("batch gateway AIMD", {**adaptive, "gate_params": params}))
            for label, gate in plan * args.repeat:  # rounds of the plan: load drifts
                log(f"{args.preset}: {label} ...")
                runs.append(one(rh, workdir, sim, label, gate, args))
                r = runs[-1]
                log(f"  {r.requests / r.seconds * scale:.3f} req/s (model), "
                    f"{r.preemptions} preempted, limit {r.limit}")  # fmt: skip
        finally:
            sim.stop()
    runs = merged(runs) if args.repeat > 1 else runs
    best = max((r.requests / r.seconds for r in runs if r.label.startswith("global")), default=0)
    rows = [
        [r.label, r.requests / r.seconds * scale, (r.requests / r.seconds) / best if best else 0,
         f"{r.preemptions / r.requests:.1%}", f"{r.queue_share:.1%}", r.peak, r.limit]
        for r in runs
    ]  # fmt: skip
    cap = f", a 429 above {args.cap} in flight" if args.cap else ""
    load = os.getloadavg()[0]
    print(f"\n{args.preset} at time scale {scale:g}{cap}: {args.requests} requests, a cold "
          f"start, one node of {args.concurrency} slots; load average {load:.1f}")  # fmt: skip
    print(table(["gate", "req/s (model)", "of best static", "preempted", "queue / latency",
                 "engine peak", "limit at the end"], rows))  # fmt: skip
    print(json.dumps({"load": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
