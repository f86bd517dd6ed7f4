"""The simulator's engine model against a measured sweep (issue 46 item 1). Target: the
``h100`` preset reproduces llm-d PR #1865's sweep (Llama-3.1-8B on one H100, ~256 output
tokens) within 10 % at every concurrency, and Little's Law (throughput x latency =
concurrency) within 5 %.

No pipeline: ``pipeline sim --engine PRESET --time-scale S`` in a subprocess, driven in a
closed loop over raw keep-alive HTTP/1.1 connections, one per unit of concurrency, each
sending its next request as soon as its answer is in. The clients start spread over one
expected latency, run two more, then are measured for ten (at least 8 s of wall clock):
throughput is the answers that ended in the window over its length, latency their mean,
queue time and preemptions the deltas of the engine's own vllm:request_queue_time_seconds
and vllm:num_preemptions_total over the window. Every duration of the engine is multiplied
by the time scale S so that a run fits this machine; the table gives times in the model's
seconds (wall clock / S) and rates in the model's requests per second (wall clock x S).
"model" is what the engine predicts in virtual time for the same closed loop (no HTTP, no
clock): the gap to "req/s" is what the real-time driving and the HTTP costs.

    .venv/bin/python bench/engine_model.py                    # the three presets, ~8 min
    .venv/bin/python bench/engine_model.py --preset h100      # the calibration, ~2 min
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Sim, above_zero, log, table, verdict
from pipeline.sim.engine import Engine, EngineConfig
from pipeline.sim.presets import PRESETS, Preset

# llm-d PR #1865, the Async Processor operations guide: concurrency -> req/s
H100_SWEEP = {8: 4.2, 64: 24.1, 128: 35.8, 192: 40.4, 256: 44.3, 512: 61.4}
THROUGHPUT_TOLERANCE, LITTLE_TOLERANCE = 0.10, 0.05


@dataclass
class Row:
    concurrency: int
    throughput: float  # model req/s
    latency: float  # model s
    queue: float  # model s, mean time in the engine's queue
    preemptions: int
    max_waiting: int
    predicted: float  # model req/s, virtual time

    @property
    def little(self) -> float:
        return self.throughput * self.latency / self.concurrency


def predict(config: EngineConfig, preset: Preset, concurrency: int) -> tuple[float, float]:
    """(req/s, mean latency s) of the closed loop in the engine's virtual time (time scale
    1): every client resubmits at once; the first quarter of the run is not counted."""
    work = preset.workload
    rng = random.Random(1)
    engine = Engine(config, 0.0)
    arrivals = [i * 0.01 for i in range(concurrency)]
    heapq.heapify(arrivals)
    done: list[tuple[float, float]] = []
    n = 0
    while len(done) < 30 * concurrency:
        at = engine.next_event_at()
        if arrivals and (at is None or arrivals[0] <= at):
            t = heapq.heappop(arrivals)
            n += 1
            low = max(1, int(work.completion_min_ratio * work.max_tokens + 0.999))
            out = rng.randint(low, work.max_tokens) if low < work.max_tokens else work.max_tokens
            engine.add(n, work.prompt_tokens, out, t)
            continue
        assert at is not None
        engine.advance(at)
        for event in engine.take_events():
            if event.kind == "finish":
                done.append((event.seq.arrival, event.at))
                heapq.heappush(arrivals, event.at)
    horizon = engine.now
    start = horizon / 4
    window = [(a, b) for a, b in done if b >= start]
    return len(window) / (horizon - start), sum(b - a for a, b in window) / len(window)


class Client:
    """One keep-alive connection sending the same request in a loop: (start, end) per answer."""

    def __init__(self, host: str, port: int, request: bytes, log: list[tuple[float, float]]):
        self.host, self.port, self.request, self.log = host, port, request, log
        self.stop = False

    async def run(self, delay: float) -> None:
        await asyncio.sleep(delay)
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            while not self.stop:
                began = time.monotonic()
                writer.write(self.request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"not a 200: {head[:40]!r}")
                self.log.append((began, time.monotonic()))
        finally:
            writer.close()


def scrape(sim: Sim) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in sim.http.get("/metrics").text.splitlines():
        if line.startswith("vllm:") and "_bucket" not in line:
            name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
            out[name] = float(value)
    return out


async def level(sim: Sim, preset: Preset, concurrency: int, scale: float, minimum: float) -> Row:
    work = preset.workload
    config = preset.config
    predicted, latency = predict(config, preset, concurrency)
    expected = latency * scale  # wall clock
    body = json.dumps({"model": "sim-model", "prompt": " ".join(["w"] * work.prompt_tokens),
                       "max_tokens": work.max_tokens})  # fmt: skip
    host, port = sim.url.split("//", 1)[1].split(":")
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    request = f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode()
    sim.reset()
    answers: list[tuple[float, float]] = []
    clients = [Client(host, int(port), request, answers) for _ in range(concurrency)]
    tasks = [asyncio.create_task(c.run(expected * i / concurrency)) for i, c in enumerate(clients)]
    await asyncio.sleep(3 * expected)  # the spread start and two latencies
    before, start = scrape(sim), time.monotonic()
    engine_before = sim.stats()["engine"]
    await asyncio.sleep(max(10 * expected, minimum))
    after, end = scrape(sim), time.monotonic()
    engine_after = sim.stats()["engine"]
    for c in clients:
        c.stop = True
    await asyncio.gather(*tasks)
    window = [(a, b) for a, b in answers if start <= b <= end]
    throughput = len(window) / (end - start)
    mean = sum(b - a for a, b in window) / len(window)
    q = "vllm:request_queue_time_seconds"
    count = after[f"{q}_count"] - before[f"{q}_count"]
    queue = (after[f"{q}_sum"] - before[f"{q}_sum"]) / count if count else 0.0
    preempted = engine_after["preemptions"] - engine_before["preemptions"]
    return Row(concurrency, throughput * scale, mean / scale, queue / scale, preempted,
               engine_after["max_waiting_observed"], predicted)  # fmt: skip


def sweep(name: str, scale: float, minimum: float, levels: tuple[int, ...]) -> list[Row]:
    preset = PRESETS[name]
    work = preset.workload
    extra = ["--engine", name, "--time-scale", f"{scale:g}", "--seed", "1"]
    if work.completion_min_ratio < 1.0:
        extra += ["--completion-min-ratio", f"{work.completion_min_ratio:g}"]
    sim = Sim(extra=extra)
    rows = []
    try:
        for c in levels:
            rows.append(asyncio.run(level(sim, preset, c, scale, minimum)))
            r = rows[-1]
            log(f"{name} c={c}: {r.throughput:.2f} req/s, latency {r.latency:.2f} s, "
                f"Little {r.little:.3f}, preemptions {r.preemptions}")  # fmt: skip
    finally:
        sim.stop()
    return rows


def report(name: str, scale: float, rows: list[Row]) -> bool:
    work = PRESETS[name].workload
    print(f"\n{name} (time scale {scale:g}; {work.prompt_tokens}-token prompts, "
          f"max_tokens {work.max_tokens}"
          + (f", completions from {work.completion_min_ratio:g} x max" if
             work.completion_min_ratio < 1 else "") + ")")  # fmt: skip
    ok = True
    headers = ["concurrency", "req/s", "model", "latency s", "x latency / c", "queue s",
               "preempted", "max waiting"]  # fmt: skip
    if name == "h100":
        headers += ["H100 req/s", "ratio", ""]
    out = []
    for r in rows:
        cells: list[object] = [r.concurrency, r.throughput, r.predicted, r.latency, r.little,
                               r.queue, r.preemptions, r.max_waiting]  # fmt: skip
        little_ok = abs(r.little - 1) <= LITTLE_TOLERANCE
        if name == "h100" and r.concurrency in H100_SWEEP:
            ratio = r.throughput / H100_SWEEP[r.concurrency]
            good = abs(ratio - 1) <= THROUGHPUT_TOLERANCE and little_ok
            cells += [H100_SWEEP[r.concurrency], ratio, verdict(good)]
            ok &= good
        else:
            ok &= little_ok
        out.append(cells)
    print(table(headers, out))
    best = max(r.throughput for r in rows)
    knee = next(r.concurrency for r in rows if r.throughput >= 0.9 * best)
    preempting = next((r.concurrency for r in rows if r.preemptions), None)
    print(f"shape: at most {best:.3g} req/s, 90 % of it from concurrency {knee}; "
          f"preemptions {f'from concurrency {preempting}' if preempting else 'none'}")  # fmt: skip
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=[*sorted(PRESETS), "all"], default="all")
    parser.add_argument("--time-scale", type=above_zero(float),
                        help="instead of each preset's (pipeline/sim/presets.py)")  # fmt: skip
    parser.add_argument("--min-seconds", type=above_zero(float), default=8.0,
                        help="shortest measured window per level, wall clock")  # fmt: skip
    parser.add_argument("--concurrency", type=above_zero(int), action="append",
                        help="instead of each preset's levels (repeatable)")  # fmt: skip
    args = parser.parse_args()
    names = sorted(PRESETS) if args.preset == "all" else [args.preset]
    names.sort(key=lambda n: n != "h100")
    results = {}
    for name in names:
        work = PRESETS[name].workload
        scale = args.time_scale or work.time_scale
        levels = tuple(args.concurrency or work.concurrency)
        results[name] = (scale, sweep(name, scale, args.min_seconds, levels))
    ok = True
    for name, (scale, rows) in results.items():
        ok &= report(name, scale, rows)
    target = f"Little's Law within {LITTLE_TOLERANCE:.0%} (every row)"
    if "h100" in results:
        target = f"h100 within {THROUGHPUT_TOLERANCE:.0%} of the H100 sweep and {target}"
    print(f"\n{target}: {verdict(ok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
