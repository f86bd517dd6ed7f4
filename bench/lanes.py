"""What a script call costs over a connection borrowed from the process's shared few
(``pipeline.store.scripts.Lanes``) against one pinned by the calling thread
(the path before issue 46), on a private Redis: the same trivial
``EVALSHA`` in a loop, by ``--threads`` threads at once, each path in turn (alternating rounds).

Reported per call: wall µs and process CPU µs (user + system, all threads), and the difference
in CPU µs, which ``bench/overhead.py`` turns into a share of the worker's CPU per request (about
three script calls per request: the start with its acquire, the finish with its release, and a
share of the dispatcher's ticks).

    .venv/bin/python bench/lanes.py                      # 1 and 64 threads
    .venv/bin/python bench/lanes.py --threads 256 --lanes 24
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import base_parser, bench_session, log, table
from pipeline.store import connect
from pipeline.store.scripts import Lanes, execute_on

SCRIPT = "return redis.call('INCR', KEYS[1])"


_local = threading.local()


def pinned(client: Any) -> Any:
    """The calling thread's own connection, made outside any pool (as each thread pinned one
    before issue 46)."""
    conn = getattr(_local, "conn", None)
    if conn is None:
        pool = client.connection_pool
        conn = _local.conn = pool.connection_class(**pool.connection_kwargs)
    return conn


def run(path: str, client: Any, sha: str, threads: int, calls: int) -> tuple[float, float]:
    """(wall µs, CPU µs) per call of ``threads`` threads making ``calls`` calls each."""
    command = ("EVALSHA", sha, 1, "lanes:bench")
    start = threading.Barrier(threads + 1)

    def work() -> None:
        lanes = Lanes.of(client)
        own = pinned(client)
        start.wait()
        for _ in range(calls):
            if path == "lanes":
                replies = lanes.execute([command])
            else:
                replies = execute_on(own, [command])
            assert replies is not None and not isinstance(replies[0], Exception)

    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    start.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    for t in ts:
        t.join()
    n = threads * calls
    return (time.perf_counter() - t0) * 1e6 / n, (time.process_time() - c0) * 1e6 / n


def main() -> int:
    ap = base_parser(__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("--threads", type=int, action="append", help="threads (repeatable)")
    ap.add_argument("--calls", type=int, default=20000, help="calls per round, all threads")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lanes", type=int, default=24, help="PIPELINE_REDIS_CONNECTIONS")
    args = ap.parse_args()
    rows: list[list[Any]] = []
    with bench_session(args.redis_url) as (rh, _):
        client = connect(rh.url, connections=args.lanes)
        sha = client.script_load(SCRIPT)
        for threads in args.threads or [1, 64]:
            got: dict[str, list[tuple[float, float]]] = {"pinned": [], "lanes": []}
            per = max(1, args.calls // threads)
            for path in ("pinned", "lanes"):
                run(path, client, sha, threads, min(per, 200))  # connect, warm up
            for _ in range(args.rounds):
                for path in ("pinned", "lanes"):
                    got[path].append(run(path, client, sha, threads, per))
            wall = {p: statistics.median(w for w, _ in v) for p, v in got.items()}
            cpu = {p: statistics.median(c for _, c in v) for p, v in got.items()}
            log(f"{threads} threads: wall {wall}, CPU {cpu}")
            rows.append(
                [
                    threads,
                    wall["pinned"],
                    wall["lanes"],
                    cpu["pinned"],
                    cpu["lanes"],
                    cpu["lanes"] - cpu["pinned"],
                    Lanes.of(client).opened,
                ]
            )
        client.close()
    print(f"\nScript call over a borrowed connection (Lanes, {args.lanes}) vs a pinned one")
    print(
        table(
            [
                "threads",
                "wall µs pinned",
                "wall µs lanes",
                "CPU µs pinned",
                "CPU µs lanes",
                "CPU µs added",
                "lanes opened",
            ],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
