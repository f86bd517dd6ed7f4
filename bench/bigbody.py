"""Large answers (issue 48, item 9): what a 15 MiB answer costs Redis and the worker node, with
its body inline in every copy of the result (``PIPELINE_BODY_INLINE_MAX=0``, the old way) and
stored once in a key of its own (the default threshold).

Per mode, one worker node (threads, ``--concurrency``) serves one queue; the simulator answers
each request with ``--mib`` MiB (``max_tokens`` sized to it); ``--answers`` requests are
submitted in waves of ``--in-flight``. Meanwhile a probe PINGs Redis every 2 ms on its own
connection, and the slow log (threshold 1 ms) keeps every command that ran longer: how long one
finish blocks every other client. At the end: Redis memory per answer (``used_memory`` before
the first submit and once every result is stored), the worker node's peak RSS growth per answer
in flight (sampled every 5 ms), and each result read back through ``pipeline.get`` with its
full body.

    .venv/bin/python bench/bigbody.py                   # 8 answers of 15 MiB, 4 in flight
    .venv/bin/python bench/bigbody.py --mib 4 --answers 4
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from bench.common import (
    ROOT,
    Node,
    PipelineEnv,
    RedisHandle,
    Sim,
    above_zero,
    base_parser,
    bench_session,
    log,
    proc_status,
    queue_entry,
    table,
)
from pipeline.store.scripts import source

QUEUE = "big"
BYTES_PER_TOKEN = 6.1  # the simulator's " word" per completion token, on average
MODES = {"inline (before)": "0", "stored once (after)": None}


class PingProbe:
    """PING every ``period`` s on a connection of its own; keeps each round trip's time."""

    def __init__(self, url: str, period: float = 0.002) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=None)
        self.period = period
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self.client.ping()
            self.times.append(time.perf_counter() - t0)
            self._stop.wait(self.period)

    def __enter__(self) -> PingProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()


class RssPeak:
    """The highest VmRSS (bytes) of process ``pid``, sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = self.rss()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return int(proc_status(self.pid).get("VmRSS", "0 kB").split()[0]) * 1024

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def script_names() -> dict[str, str]:
    """SHA1 → name of every script the pipeline registers (``EVALSHA <sha>`` in the slow log)."""
    names = {}
    for path in (ROOT / "pipeline" / "store" / "lua").glob("*.lua"):
        if path.stem != "lib":
            names[hashlib.sha1(source(path.stem).encode()).hexdigest()] = path.stem + ".lua"
    return names


def slow_commands(client: redis.Redis) -> dict[str, float]:
    """The slow log's longest run (ms) per command name (a script's by its file's name)."""
    scripts = script_names()
    out: dict[str, float] = {}
    for e in client.slowlog_get(1024):
        cmd = e["command"]
        words = (cmd.decode(errors="replace") if isinstance(cmd, bytes) else str(cmd)).split()
        name = words[0].upper()
        if name == "EVALSHA" and len(words) > 1:
            name = scripts.get(words[1], "EVALSHA ?")
        out[name] = max(out.get(name, 0.0), e["duration"] / 1000)
    return out


def key_bytes(client: redis.Redis) -> int:
    """MEMORY USAGE summed over every key of the database."""
    total = 0
    for key in client.scan_iter(count=1000):
        total += int(client.memory_usage(key, samples=0) or 0)
    return total


def patient_result(req: Any, stalls: list[int]) -> Any:
    """``req.result()``, again after a client call timed out on a Redis held by a finish
    (counted in ``stalls``)."""
    while True:
        try:
            return req.result(timeout=600)
        except (redis.TimeoutError, redis.ConnectionError):
            stalls[0] += 1


def run_mode(
    label: str, threshold: str | None, rh: RedisHandle, workdir: Path, sim: Sim, args: Any
) -> dict[str, Any]:
    limit = 64 * 1024 * 1024
    entry = queue_entry(QUEUE, sim.url, max_response_bytes=limit, request_timeout_s=300)
    extra = {} if threshold is None else {"PIPELINE_BODY_INLINE_MAX": threshold}
    penv = PipelineEnv(rh.url, [entry], workdir, extra=extra)
    node = Node(penv, concurrency=args.in_flight)
    node.wait_ready()
    pl = penv.pipeline()
    raw = rh.client
    tokens = int(args.mib * 1024 * 1024 / BYTES_PER_TOKEN)
    body = {"model": "sim-model", "prompt": "big", "max_tokens": tokens}
    try:
        time.sleep(1.0)  # the node settles (its first ticks, its heap frozen)
        raw.config_set("slowlog-log-slower-than", 1000)
        raw.config_set("slowlog-max-len", 1024)
        raw.slowlog_reset()
        mem0, keys0 = rh.used_memory(), key_bytes(raw)
        ids: list[str] = []
        stalls = [0]
        with RssPeak(node.proc.pid) as rss, PingProbe(rh.url) as probe:
            t0 = time.monotonic()
            for w in range(0, args.answers, args.in_flight):
                n = min(args.in_flight, args.answers - w)
                wave = [f"big-{penv.prefix.rstrip(':')}-{w + i}" for i in range(n)]
                reqs = [pl.submit(body, queue=QUEUE, id=rid, timeout=600) for rid in wave]
                for r in reqs:
                    res = patient_result(r, stalls)
                    if not res.ok:
                        raise SystemExit(f"{r.id}: {res.error_code} {res.error_message}")
                ids += wave
            elapsed = time.monotonic() - t0
        mem1, keys1 = rh.used_memory(), key_bytes(raw)
        slow = slow_commands(raw)
        sizes, whole = [], True
        for rid in ids:
            answer = pl.get(rid).result(timeout=10).json()  # the body read back, parsed
            whole = whole and answer["usage"]["completion_tokens"] == tokens
            sizes.append(len(answer["choices"][0]["text"]))
        body_bytes = sum(sizes) / len(sizes)  # the text: all but ~300 bytes of each body
        pings = sorted(probe.times)
        return {
            "label": label,
            "body_mib": body_bytes / 2**20,
            "redis_per_answer": (mem1 - mem0) / len(ids),
            "keys_per_answer": (keys1 - keys0) / len(ids),
            "copies": (keys1 - keys0) / len(ids) / body_bytes,
            "ping_max_ms": pings[-1] * 1000,
            "ping_p99_ms": pings[int(len(pings) * 0.99)] * 1000,
            "slowest_ms": max(slow.values(), default=0.0),
            "finish_ms": slow.get("finish.lua", 0.0),
            "slow": slow,
            "worker_per_inflight": (rss.peak - rss.start) / args.in_flight,
            "elapsed_s": elapsed,
            "stalls": stalls[0],
            "full_bodies": whole,
        }
    finally:
        node.stop()
        raw.config_set("slowlog-log-slower-than", 10000)


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--mib", type=above_zero(float), default=15.0, help="answer size (MiB)")
    p.add_argument("--answers", type=above_zero(int), default=8)
    p.add_argument("--in-flight", type=above_zero(int), default=4)
    p.add_argument("--only", choices=["inline", "once"], help="run one mode")
    args = p.parse_args()
    rows, out = [], []
    with bench_session(args.redis_url) as (rh, workdir):
        sim = Sim()
        try:
            for label, threshold in MODES.items():
                if args.only and (args.only == "inline") != (threshold == "0"):
                    continue
                log(f"{label}: {args.answers} answers of {args.mib} MiB, {args.in_flight} at once")
                r = run_mode(label, threshold, rh, workdir, sim, args)
                log(f"{label}: slowest commands (ms) {r['slow']}")
                out.append(r)
        finally:
            sim.stop()
    for r in out:
        rows.append(
            [
                r["label"],
                f"{r['body_mib']:.1f}",
                f"{r['keys_per_answer'] / 2**20:.1f} MiB ({r['copies']:.2f}x)",
                f"{r['redis_per_answer'] / 2**20:.1f} MiB",
                f"{r['ping_max_ms']:.0f} / {r['ping_p99_ms']:.0f}",
                f"{r['slowest_ms']:.1f}",
                f"{r['finish_ms']:.1f}" if r["finish_ms"] else "< 1",
                f"{r['worker_per_inflight'] / 2**20:.0f} MiB",
                str(r["stalls"]),
                "yes" if r["full_bodies"] else "NO",
            ]
        )
    print(
        table(
            [
                "mode",
                "body MiB",
                "in keys per answer (x body)",
                "used_memory per answer",
                "PING max / p99 ms",
                "slowest command ms",
                "slowest finish.lua ms",
                "worker RSS per answer in flight",
                "client calls timed out",
                "full body read back",
            ],
            rows,
        )
    )
    if len(out) < 2:
        return
    before, after = out
    print(
        f"ratios after/before: bytes in keys per answer "
        f"{after['keys_per_answer'] / before['keys_per_answer']:.2f}, "
        f"PING max {after['ping_max_ms'] / before['ping_max_ms']:.2f}, "
        f"slowest command {after['slowest_ms'] / max(before['slowest_ms'], 1e-9):.2f}, "
        "worker RSS per answer "
        f"{after['worker_per_inflight'] / max(before['worker_per_inflight'], 1):.2f}"
    )


if __name__ == "__main__":
    main()
