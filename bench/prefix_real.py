"""Prefix-grouped dispatch against a real server (issue 50): llama.cpp's ``llama-server``,
whose slots keep their last prompt's KV cache (``cache_prompt``, on by default) and pick the
idle slot whose cached prompt is most alike, on a tiny model with random weights (prefill
dominates on CPU with long prompts). The server and model are made as ``bench/tokens_real.py``
says (nothing of them is committed).

A batch of N chat lines over P system prompts of W words and a short question each, submitted
interleaved, behind ``local-max-concurrency`` of the server's slots; once with
``group_prefixes: false`` (submission order), once grouped, each with prompts of its own.
Rate: lines over first submit to last result. Target: grouped >= 1.2 x submission order; the
prompt tokens the server says it took from its cache (``timings.cache_n`` of each answer,
llama.cpp's) beside it.

    .venv/bin/python bench/prefix_real.py --llama-server PATH --model tiny-qwen2.gguf
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.common import (
    Node,
    PipelineEnv,
    bench_session,
    free_port,
    local_gate,
    log,
    queue_entry,
    stop_proc,
    table,
    verdict,
)
from pipeline.cli.services import wait_until

TARGET = 1.2
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
]


def start_server(
    binary: str, model: str, parallel: int, ctx: int, cache_ram: int | None, workdir: Path
) -> Any:
    port = free_port()
    argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np",
            str(parallel), "-c", str(ctx * parallel), "-t", "2", "--jinja",
            "--no-webui"]  # fmt: skip
    if cache_ram is not None:
        argv += ["--cache-ram", str(cache_ram)]
    log_path = workdir / "llama-server-prefix.log"
    proc = subprocess.Popen(argv, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited: {log_path.read_text()[-3000:]}")
        try:
            return httpx.get(url + "/health", timeout=2, trust_env=False).is_success
        except httpx.HTTPError:
            return False

    wait_until(healthy, 120, "llama-server /health", interval=0.2)
    return proc, url


def bodies(tag: str, n: int, prompts: int, words: int) -> list[dict[str, Any]]:
    systems = [
        f"{tag} prompt {k}: "
        + " ".join(WORDS[(k * 7 + j * 3 + j // len(WORDS)) % len(WORDS)] for j in range(words))
        for k in range(prompts)
    ]
    return [
        {"model": "m", "max_tokens": 2, "temperature": 0,
         "messages": [{"role": "system", "content": systems[i % prompts]},
                      {"role": "user", "content": f"question {i}?"}]}
        for i in range(n)
    ]  # fmt: skip


def run(rh: Any, workdir: Path, url: str, label: str, items: list[dict[str, Any]],
        parallel: int, queue: dict[str, Any]) -> tuple[float, int, int]:  # fmt: skip
    name = f"pr{time.monotonic_ns() % 10**8}"
    entry = queue_entry(name, url, request_path_url="/v1/chat/completions",
                        request_timeout_s=600, **local_gate(parallel), **queue)  # fmt: skip
    penv = PipelineEnv(rh.url, [entry], workdir, extra={"PIPELINE_METRICS_PORT": "0"})
    node = Node(penv, concurrency=parallel * 2)
    try:
        pl = penv.pipeline()
        start = time.monotonic()
        ids = [r.id for r in pl.submit_many(
            [{"payload": b, "queue": name, "timeout": 36_000} for b in items])]  # fmt: skip
        cached = bad = 0
        for res in pl.iter_results(ids, poll_s=0.05):
            if not res.ok:
                bad += 1
                continue
            cached += (json.loads(res.payload).get("timings") or {}).get("cache_n", 0)
        wall = time.monotonic() - start
    finally:
        node.stop()
    log(f"{label}: {len(items) / wall:.3f} lines/s, {wall:.1f} s, cache_n {cached}, bad {bad}")
    return len(items) / wall, cached, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--parallel", type=int, default=2, help="the server's slots (-np)")
    ap.add_argument("--lines", type=int, default=120)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--words", type=int, default=500, help="words of a system prompt")
    ap.add_argument("--cache-ram", type=int, default=0,
                    help="llama-server's --cache-ram MiB: 0 (default here) leaves each slot "
                    "its own last prompt; -1: the server's default, a prompt cache in RAM "
                    "(8 GiB) that slots restore from")  # fmt: skip
    ap.add_argument("--redis-url")
    args = ap.parse_args()
    rows = []
    with bench_session(args.redis_url) as (rh, workdir):
        ram = None if args.cache_ram < 0 else args.cache_ram
        proc, url = start_server(args.llama_server, args.model, args.parallel,
                                 4 * args.words + 256, ram, workdir)  # fmt: skip
        try:
            plain = run(rh, workdir, url, "submission order",
                        bodies("o", args.lines, args.prompts, args.words), args.parallel,
                        {"group_prefixes": False})  # fmt: skip
            grouped = run(
                rh,
                workdir,
                url,
                "grouped",
                bodies("g", args.lines, args.prompts, args.words),
                args.parallel,
                {},
            )
        finally:
            stop_proc(proc, 10)
    for label, (rate, cached, bad) in (("submission order", plain), ("grouped", grouped)):
        rows.append([label, args.lines, rate, rate / plain[0], cached, bad])
    print(
        f"\nllama-server ({Path(args.model).name}, {args.parallel} slots): {args.lines} "
        f"chat lines over {args.prompts} system prompts of {args.words} words, "
        f"interleaved; --cache-ram {args.cache_ram if args.cache_ram >= 0 else 'default'}"
    )
    print(table(["run", "lines", "lines/s", "of submission order", "cache_n", "not ok"], rows))
    ratio = grouped[0] / plain[0]
    print(f"grouped >= {TARGET} x submission order: {ratio:.2f}  {verdict(ratio >= TARGET)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
