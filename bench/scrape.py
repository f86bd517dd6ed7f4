"""What the scrape-time series cost: one ``/metrics`` collection of the Redis-read series
(queue depth, gate in-flight, deadline proximity) against a private Redis holding N waiting
requests in one queue, and the Redis time of the deadline-proximity script (15 ``ZCOUNT``s per
queue, no scan) from ``INFO commandstats``. Scrapes happen once per Prometheus interval
(15 s by default), not per request: this is the cost per scrape, not per request.

    .venv/bin/python bench/scrape.py                  # 1k, 10k, 100k waiting requests
    .venv/bin/python bench/scrape.py --sizes 1000000
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PipelineEnv, base_parser, bench_session, log, queue_entry


def main() -> int:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--sizes", default="1000,10000,100000", help="waiting requests")
    parser.add_argument("--scrapes", type=int, default=50, help="collections per size")
    args = parser.parse_args()
    from pipeline.observability.collectors import ClusterCollector

    print(f"{'waiting':>9}  {'collect ms (median)':>19}  {'proximity script µs/call':>24}")
    with bench_session(args.redis_url) as (rh, workdir):
        for size in (int(s) for s in args.sizes.split(",")):
            penv = PipelineEnv(rh.url, [queue_entry("q", "http://127.0.0.1:9")], workdir)
            pl = penv.pipeline()
            now = time.time()
            items = [{"payload": {"prompt": "x"}, "queue": "q",
                      "deadline": now + 60 + (i % 86_400)} for i in range(size)]  # fmt: skip
            pl.submit_many(items)
            collector = ClusterCollector(pl.settings)
            list(collector.collect())  # loads the scripts
            client = pl.store.client
            client.config_resetstat()
            times = []
            for _ in range(args.scrapes):
                t0 = time.perf_counter()
                list(collector.collect())
                times.append((time.perf_counter() - t0) * 1000)
            stats = client.info("commandstats")
            evalsha = stats.get("cmdstat_evalsha", {})
            per_call = evalsha.get("usec", 0) / max(1, evalsha.get("calls", 1))
            print(f"{size:>9}  {statistics.median(times):>19.2f}  {per_call:>24.1f}")
            log(f"{size} waiting: {evalsha}")
            client.flushdb()
    return 0


if __name__ == "__main__":
    sys.exit(main())
