"""``adaptive-concurrency`` against a real server (issue 47): llama.cpp's ``llama-server``
(continuous batching over ``--parallel`` slots, its ``/metrics`` on) serving the tiny
random-weight GGUF that ``bench/tokens_real.py`` makes (its docstring builds the server and
the model). In one invocation: ``global-max-concurrency`` at each limit of ``--levels`` (the
sweep), then the adaptive gate from the answers alone and with the server's ``/metrics``
(llama.cpp's names: ``llamacpp:requests_processing``, ``requests_deferred``,
``kv_cache_usage_ratio``). One worker node per run, ``--requests`` completions each (a prompt
of ``--prompt-words`` words, ``max_tokens`` ``--max-tokens``, ``ignore_eos``), submitted at
once. Target: adaptive >= 0.9 of the sweep's best.

    .venv/bin/python bench/adaptive_llama.py \\
        --llama-server /tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server \\
        --model /tmp/llama/tiny-qwen2.gguf                       # ~5 min
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Node,
    PipelineEnv,
    bench_session,
    global_gate,
    log,
    queue_entry,
    table,
    verdict,
)
from bench.tokens_real import LlamaServer

OF_BEST = 0.9


def one(rh: Any, workdir: Path, url: str, gate: dict[str, Any], args: argparse.Namespace
        ) -> tuple[float, int, str]:  # fmt: skip
    """(req/s, failed, the limit at the end) of ``--requests`` completions through ``gate``."""
    name = f"q{uuid.uuid4().hex[:6]}"
    penv = PipelineEnv(rh.url, [queue_entry(name, url, request_timeout_s=600, **gate)], workdir)
    node = Node(penv, concurrency=args.slots)
    pl = penv.pipeline()
    body = {"model": "tiny", "prompt": " ".join(["hello"] * args.prompt_words),
            "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0}  # fmt: skip
    try:
        start = time.monotonic()
        ids = [r.id for r in pl.submit_many(
            [{"payload": body, "queue": name, "timeout": 3600}] * args.requests)]  # fmt: skip
        results = list(pl.iter_results(ids, poll_s=0.05))
        rate = len(results) / (time.monotonic() - start)
        view = pl.inspect()[name]["gate"].get("adaptive")
        limit = f"{view['limit']} ({view['reason_code']})" if view else "static"
        return rate, sum(not r.ok for r in results), limit
    finally:
        node.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", required=True, help="the llama-server binary")
    p.add_argument("--model", required=True, help="the GGUF it serves")
    p.add_argument("--parallel", type=int, default=8, help="llama-server slots (-np)")
    p.add_argument("--levels", default="1,2,4,8,16", help="static limits, comma-separated")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--slots", type=int, default=32, help="the worker node's slots")
    p.add_argument("--repeat", type=int, default=1, help="rounds of every gate, interleaved")
    p.add_argument("--redis-url")
    args = p.parse_args()
    rows: list[list[Any]] = []
    with bench_session(args.redis_url) as (rh, workdir):
        server = LlamaServer(args.llama_server, args.model, args.parallel, workdir,
                             extra=["--metrics"])  # fmt: skip
        try:
            plan = [(f"global-max-concurrency {n}", global_gate(n))
                    for n in (int(x) for x in args.levels.split(","))]  # fmt: skip
            adaptive = {"gate_type": "adaptive-concurrency"}
            plan += [("adaptive (answers)", {**adaptive, "gate_params": {}}),
                     ("adaptive (/metrics)", {**adaptive, "gate_params": {
                         "metrics_url": server.url + "/metrics"}})]  # fmt: skip
            rates: dict[str, list[float]] = {}
            for label, gate in plan * args.repeat:  # rounds of the plan: load drifts
                rate, failed, limit = one(rh, workdir, server.url, gate, args)
                log(f"{label}: {rate:.2f} req/s, {failed} failed, limit {limit}")
                rates.setdefault(label, []).append(rate)
                rows = [r for r in rows if r[0] != label] + [[label, rate, failed, limit]]
        finally:
            server.stop()
    for r in rows:  # each gate's median round
        mine = sorted(rates[r[0]])
        r[1] = mine[len(mine) // 2]
        if len(mine) > 1:
            r[0] += f" (median of {' '.join(f'{x:.3g}' for x in rates[r[0]])})"
    best = max(r[1] for r in rows if str(r[0]).startswith("global"))
    for r in rows:
        r.insert(2, r[1] / best)
    print(f"\nllama-server ({Path(args.model).name}, -np {args.parallel}, 1 thread): "
          f"{args.requests} completions of {args.max_tokens} tokens a run, one node of "
          f"{args.slots} slots; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(table(["gate", "req/s", "of best static", "failed", "limit at the end"], rows))
    worst = min(r[2] for r in rows if str(r[0]).startswith("adaptive"))
    print(f"target: adaptive >= {OF_BEST} of the best static ({worst:.3f}): "
          f"{verdict(worst >= OF_BEST)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
