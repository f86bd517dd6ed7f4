"""In-flight scale (issue 46, items 2 and 4): one node ``pipeline worker -c N`` (started as a user
starts it, :class:`bench.common.Node`) against an engine that answers in seconds with no
limit (the simulator, ``--max-concurrency 0``), behind a ``global-max-concurrency`` of N in a
pool of ``workers`` N, so the node's slots are the only bound. Per scenario:

- req/s over the ceiling (slots / latency), from the first submit to the last result, and
  "steady": latency / (latency + the mean hand-off), the run without its ramp and its end;
- attempts per request (the simulator's count of calls per request id: 1.00 is every request
  sent once), and the most requests the simulator had at once;
- error lines in the node's log (ERROR, CRITICAL, a traceback) and its WARNING lines;
- the node's Redis connections at their peak: ``CLIENT LIST`` entries whose address is one of
  the node process's sockets (:func:`bench.common.node_redis_connections`), sampled every
  0.5 s;
- the node's peak RSS (``VmHWM``) and its threads at their peak;
- the node's CPU ms per request (user + system, ``/proc``), and its ratio to the ``-c 64``
  scenario of the same invocation.

Targets (BENCHMARKS.md): ``-c 256`` at 2 s >= 0.95 of 128 req/s; ``-c 1024`` at 5 s >= 0.95 of
205 req/s; ``-c 4096`` at 20 s >= 0.90 of 205 req/s; every request one attempt and 0 error
lines; <= 64 Redis connections per node whatever ``-c`` is; RSS at 4,096 in flight <= 1.5 GiB;
CPU per request at ``-c 1024`` <= 1.25x that at ``-c 64``.

Each node first runs one wave of ``slots`` 1 s calls (not measured): a long-running node has
its threads and its connections to the model server; what its very first burst costs more
(thread creation, connecting) is start-up, not throughput.

:func:`scenario` runs one node and is what another script imports (``bench/engine.py``).

    .venv/bin/python bench/inflight.py                      # 64, 256, 1024 (~3 min)
    .venv/bin/python bench/inflight.py --only 256           # the issue's reproduction
    .venv/bin/python bench/inflight.py --only 64 --only 1024 --only 4096   # ~7 min
    .venv/bin/python bench/inflight.py --only 1024 --latency-ms 2000 --jitter-ms 3000  # 2-5 s
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    CpuMeter,
    Node,
    PipelineEnv,
    RedisHandle,
    Sim,
    base_parser,
    bench_session,
    global_gate,
    items,
    log,
    node_redis_connections,
    proc_status,
    queue_entry,
    table,
    verdict,
)
from bench.handoff import handoffs, lost_time

QUEUE = "inflight"
# slots -> (latency ms, requests): ten rounds of the slots (five at 4,096: 100 s of 20 s calls)
SCENARIOS: dict[int, tuple[int, int]] = {
    64: (2000, 640),
    256: (2000, 2560),
    1024: (5000, 10240),
    4096: (20000, 20480),
}
TARGETS = {256: 0.95, 1024: 0.95, 4096: 0.90}
MAX_CONNECTIONS = 64
MAX_RSS_4096 = 1.5 * 2**30
CPU_RATIO = 1.25
WARM_MS = 1000  # the warm-up wave's latency
ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback \(most recent call last\)")
WARNING_LINE = re.compile(r"\bWARNING\b")


@dataclass
class Outcome:
    """One scenario's figures (see the module's docstring)."""

    slots: int
    latency_s: float
    n: int
    done: int = 0
    elapsed_s: float = 0.0
    attempts_per_request: float = 0.0
    max_attempts: int = 0
    max_at_sim: int = 0
    error_lines: int = 0
    warning_lines: int = 0
    first_errors: list[str] = field(default_factory=list)
    peak_connections: int = 0
    peak_threads: int = 0
    rss_bytes: int = 0
    cpu_ms_per_request: float = 0.0
    steal_pct: float = 0.0
    load: str = ""
    lost: dict[str, float] = field(default_factory=dict)  # bench.handoff.lost_time
    steady: float = 0.0  # steady_ratio

    @property
    def ceiling(self) -> float:
        return self.slots / self.latency_s

    @property
    def rate(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def ratio(self) -> float:
        return self.rate / self.ceiling


class Sampler:
    """Samples a node's Redis connections and threads every ``every`` s, keeping the peaks."""

    def __init__(self, rh: RedisHandle, pid: int, every: float = 0.5) -> None:
        self.rh, self.pid, self.every = rh, pid, every
        self.connections = 0
        self.threads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inflight-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        try:
            conns = node_redis_connections(self.rh.client, self.pid)
            self.connections = max(self.connections, conns)
            self.threads = max(self.threads, int(proc_status(self.pid).get("Threads", 0)))
        except Exception as exc:  # noqa: BLE001 - a sample missed; the next one counts
            log(f"sampler: {exc}")

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()


def scenario(
    rh: RedisHandle,
    workdir: Path,
    slots: int,
    latency_ms: int,
    n: int,
    *,
    jitter_ms: int = 0,
    timeout_s: float | None = None,
    extra_env: dict[str, str] | None = None,
) -> Outcome:
    """One node ``pipeline worker -c slots`` against a simulator of ``latency_ms`` (+ up to
    ``jitter_ms``) with no limit, ``n`` requests submitted at once; waits for every result
    (at most ``timeout_s``, default three times the ideal time plus a minute)."""
    latency_s = (latency_ms + jitter_ms / 2) / 1000
    out = Outcome(slots, latency_s, n)
    ideal = n / (slots / latency_s)
    timeout_s = timeout_s if timeout_s is not None else 3 * ideal + 60
    sim = Sim(latency_ms=latency_ms, record_arrivals=True, extra=["--jitter-ms", str(jitter_ms)])
    node: Node | None = None
    try:
        timeout = {"request_timeout_s": latency_s * 3 + 30, "default_timeout_s": 3600}
        q = queue_entry(QUEUE, sim.url, **global_gate(slots), **timeout)
        extra = {"PIPELINE_METRICS_PORT": "0", **(extra_env or {})}  # no port clash
        penv = PipelineEnv(
            rh.url, [q], workdir, pools=[{"id": "default", "workers": slots}], extra=extra
        )
        node = Node(penv, concurrency=slots)
        p = penv.pipeline()
        stats = p.store.keys.stats(QUEUE)
        # a long-running node has its threads and connections: one wave of 1 s calls starts
        # them (what a node's very first burst costs more is its start-up, not its throughput)
        hold = {"x-sim-latency-ms": str(WARM_MS)}
        warm = [dict(it, queue=QUEUE, headers=hold) for it in items(slots, f"warm{slots}")]
        p.submit_many(warm)
        _wait_done(p, stats, len(warm), 120 + slots * 0.02)
        sim.reset()
        log(f"-c {slots}: {n} requests at {latency_ms} ms (+{jitter_ms}); ideal {ideal:.0f} s")
        batch = [dict(it, queue=QUEUE) for it in items(n, f"run{slots}")]
        cpu = CpuMeter({"worker": node.proc.pid})
        with Sampler(rh, node.proc.pid) as sampler:
            cpu.start()
            t0 = time.monotonic()
            p.submit_many(batch)
            out.done = _wait_done(p, stats, n + len(warm), timeout_s) - len(warm)
            out.elapsed_s = time.monotonic() - t0
            cpu.stop()
        out.peak_connections, out.peak_threads = sampler.connections, sampler.threads
        out.cpu_ms_per_request = cpu.used["worker"] * 1000 / max(1, out.done)
        out.steal_pct = cpu.steal_pct
        out.load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        out.rss_bytes = int(proc_status(node.proc.pid).get("VmHWM", "0 kB").split()[0]) * 1024
        st = sim.stats()
        tries = list(st.get("attempts_by_request_id", {}).values())
        out.attempts_per_request = sum(tries) / n
        out.max_attempts = max(tries, default=0)
        out.max_at_sim = int(st.get("max_concurrency_observed", 0))
        arrivals = sim.arrivals()
        out.lost = lost_time(arrivals, t0, slots)
        out.steady = steady_ratio(arrivals, slots, latency_s)
    finally:
        if node is not None:
            node.stop()
            _read_log(node.log_path, out)
        sim.stop()
    log(
        f"-c {slots}: {out.done}/{n} in {out.elapsed_s:.1f} s = {out.rate:.1f} req/s "
        f"({out.ratio:.3f} of {out.ceiling:.0f}); attempts/req {out.attempts_per_request:.3f}; "
        f"errors {out.error_lines}; Redis conns {out.peak_connections}; "
        f"RSS {out.rss_bytes / 2**20:.0f} MiB; CPU {out.cpu_ms_per_request:.2f} ms/req; "
        f"lost s: " + ", ".join(f"{k} {v:.2f}" for k, v in out.lost.items())
    )
    return out


def steady_ratio(arrivals: list[tuple[float, float, str]], slots: int, latency_s: float) -> float:
    """The run without its ramp and its end: latency / (latency + the mean hand-off, a freed
    slot's wait for its next request: :func:`bench.handoff.handoffs`), what the node keeps up
    once every slot is busy."""
    waits = handoffs(arrivals, slots)
    return latency_s / (latency_s + sum(waits) / len(waits)) if waits else float("nan")


def _wait_done(p: Any, stats_key: str, n: int, timeout_s: float) -> int:
    """Wait until ``n`` requests of the queue ended (any outcome) or ``timeout_s``; how many."""
    end = time.monotonic() + timeout_s
    done = 0
    while time.monotonic() < end:
        done = sum(int(v) for v in p.store.client.hvals(stats_key))
        if done >= n:
            break
        time.sleep(0.05)
    return done


def _read_log(path: Path, out: Outcome) -> None:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return
    errors = [ln for ln in lines if ERROR_LINE.search(ln)]
    out.error_lines = len(errors)
    out.warning_lines = sum(1 for ln in lines if WARNING_LINE.search(ln))
    out.first_errors = errors[:3]


def main() -> int:
    ap = base_parser(__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument(
        "--only",
        type=int,
        action="append",
        choices=sorted(SCENARIOS),
        help="slots of a scenario to run (repeatable); default 64, 256 and 1024",
    )
    ap.add_argument("--requests", type=int, default=0, help="requests per scenario (default: its)")
    ap.add_argument(
        "--latency-ms", type=int, default=0, help="every scenario's latency (default: its)"
    )
    ap.add_argument(
        "--jitter-ms",
        type=int,
        default=0,
        help="extra uniform latency, 0..this; the ceiling takes the mean (2-5 s: "
        "--latency-ms 2000 --jitter-ms 3000)",
    )
    ap.add_argument(
        "--node-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the nodes (repeatable), e.g. PIPELINE_LOOKAHEAD=32",
    )
    args = ap.parse_args()
    node_env = dict(kv.split("=", 1) for kv in args.node_env)
    chosen = args.only or [64, 256, 1024]
    if 64 not in chosen and any(s in chosen for s in (1024,)):
        log("no -c 64 scenario: the CPU ratio is not computed")
    outcomes: list[Outcome] = []
    with bench_session(args.redis_url) as (rh, workdir):
        for slots in sorted(chosen):
            latency_ms, n = SCENARIOS[slots]
            latency_ms = args.latency_ms or latency_ms
            outcomes.append(
                scenario(
                    rh,
                    workdir,
                    slots,
                    latency_ms,
                    args.requests or n,
                    jitter_ms=args.jitter_ms,
                    extra_env=node_env,
                )
            )
    base = next((o for o in outcomes if o.slots == 64), None)
    rows = []
    for o in outcomes:
        cpu_ratio = o.cpu_ms_per_request / base.cpu_ms_per_request if base else float("nan")
        rows.append(
            [
                f"-c {o.slots}, {o.latency_s:g} s",
                f"{o.done}/{o.n}",
                o.rate,
                o.ratio,
                o.steady,
                o.attempts_per_request,
                o.max_at_sim,
                o.error_lines,
                o.warning_lines,
                o.peak_connections,
                o.peak_threads,
                f"{o.rss_bytes / 2**20:.0f}",
                o.cpu_ms_per_request,
                cpu_ratio,
                f"{o.load} / {o.steal_pct:.0f}%",
            ]
        )
    print("\nIn-flight scale: one node, the simulator with no limit")
    print(
        table(
            [
                "scenario",
                "done",
                "req/s",
                "of ceiling",
                "steady",
                "attempts/req",
                "max at sim",
                "errors",
                "warnings",
                "Redis conns",
                "threads",
                "RSS MiB",
                "CPU ms/req",
                "CPU vs -c 64",
                "load / steal",
            ],
            rows,
        )
    )
    for o in outcomes:
        lost = ", ".join(f"{k} {v:.2f} s" for k, v in o.lost.items())
        print(f"  -c {o.slots}: time lost against the ceiling: {lost}")
        for line in o.first_errors:
            print(f"  -c {o.slots} error: {line[:200]}")
    print()
    for o in outcomes:
        checks = [
            ("one attempt each", o.max_attempts <= 1 and o.done == o.n),
            ("0 error lines", o.error_lines == 0),
            (f"Redis conns <= {MAX_CONNECTIONS}", o.peak_connections <= MAX_CONNECTIONS),
        ]
        if o.slots in TARGETS:
            checks.insert(0, (f"ratio >= {TARGETS[o.slots]}", o.ratio >= TARGETS[o.slots]))
        if o.slots == 4096:
            checks.append(("RSS <= 1.5 GiB", o.rss_bytes <= MAX_RSS_4096))
        if o.slots == 1024 and base is not None:
            r = o.cpu_ms_per_request / base.cpu_ms_per_request
            checks.append((f"CPU/req vs -c 64 {r:.2f} <= {CPU_RATIO}", r <= CPU_RATIO))
        print(f"-c {o.slots}: " + "; ".join(f"{what} {verdict(ok)}" for what, ok in checks))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
