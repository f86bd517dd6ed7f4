"""Batch API targets, through a real ``pipeline serve`` process:

1. ingest: upload a 100,000-line OpenAI batch file (chat completions, ~230 bytes a line) and
   create its batch; time from the start of the upload until every line is stored (the
   batch's ``submitted`` reaches its last line). Target >= 20,000 lines/s, and the service's
   memory (peak RSS, ``VmHWM``, against its RSS before the upload) grows <= 100 MB. The
   batch's queue has no worker yet, so nothing runs meanwhile.
2. run: a worker node (threads, 64 slots) against the 0 ms simulator runs the batch at full
   speed while this client reads ``GET /v1/batches/{id}`` back to back (one connection);
   target p99 <= 20 ms.
3. output: the service assembles the output file when the last result arrives
   (``finalizing_at`` -> ``completed_at``, by the Redis clock), and this process assembles it
   again (``Batches.write_files``, 3 times, best of 3): target >= 50,000 lines/s.

CPU seconds of the service and of Redis are reported per line (load-independent), with the
machine's load average and steal time: on a shared 2-core VM the absolute rates are noisy.

    .venv/bin/python bench/batch.py              # ~5 min on a 2-core VM (the run phase)
    .venv/bin/python bench/batch.py -n 20000     # a quicker look
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pipeline.cli.services import wait_until

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.common import (
    PY,
    CpuMeter,
    Node,
    PipelineEnv,
    Sim,
    base_parser,
    bench_session,
    free_port,
    log,
    pct,
    queue_entry,
    start_proc,
    stop_proc,
    table,
    verdict,
)


def write_input(path: Path, n: int) -> int:
    with open(path, "w") as fh:
        for i in range(n):
            body = {
                "model": "sim-model",
                "messages": [{"role": "user", "content": f"Summarise document {i} in one line"}],
                "max_tokens": 4,
            }
            line = {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions"}
            fh.write(json.dumps({**line, "body": body}) + "\n")
    return path.stat().st_size


def rss_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def main() -> int:
    p = base_parser(__doc__ or "")
    p.add_argument("-n", type=int, default=100_000, help="lines in the batch file")
    args = p.parse_args()
    n = args.n
    load0 = os.getloadavg()
    with bench_session(args.redis_url) as (rh, workdir):
        sim = Sim(latency_ms=0)
        penv = PipelineEnv(rh.url, [queue_entry("batch", sim.url, pool="bp")], workdir)
        port = free_port()
        senv = {
            **penv.env(),
            "PIPELINE_BATCH_QUEUE": "batch",
            "PIPELINE_FILES_DIR": str(workdir / "files"),
        }
        serve = start_proc(
            [PY, "-m", "pipeline", "serve", "--port", str(port), "--loglevel", "warning"],
            senv,
            workdir / "serve.log",
        )
        url = f"http://127.0.0.1:{port}"
        http = httpx.Client(base_url=url, timeout=120, trust_env=False)

        def up() -> bool:
            try:
                return http.get("/healthz").status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 60, "pipeline serve", interval=0.1)
        path = workdir / "input.jsonl"
        size = write_input(path, n)
        log(f"input: {n} lines, {size / 1e6:.1f} MB")
        rss0 = rss_kb(serve.pid, "VmRSS")
        meter = CpuMeter({"serve": serve.pid, **({"redis": rh.proc.pid} if rh.proc else {})})
        client = rh.client
        prefix = penv.prefix

        # 1. upload + validation + enqueue
        meter.start()
        t0 = time.perf_counter()
        with open(path, "rb") as fh:
            f = http.post(
                "/v1/files", files={"file": ("input.jsonl", fh)}, data={"purpose": "batch"}
            ).json()
        t_up = time.perf_counter()
        b = http.post(
            "/v1/batches",
            json={
                "input_file_id": f["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        ).json()
        bid = b["id"]

        def stored() -> bool:
            sub, lines = client.hmget(f"{prefix}batch:{bid}", ["submitted", "lines"])
            return bool(lines) and int(sub or 0) >= int(lines)

        wait_until(stored, 600, "every line stored", interval=0.005)
        t1 = time.perf_counter()
        cpu = meter.stop()
        steal = meter.steal_pct
        hwm = rss_kb(serve.pid, "VmHWM")
        ingest_rate = n / (t1 - t0)
        grow_mb = (hwm - rss0) / 1024
        log(f"ingest: {ingest_rate:.0f} lines/s (upload {t_up - t0:.2f} s), RSS +{grow_mb:.0f} MB")

        # 2. run at full speed while reading the batch back to back
        node = Node(penv, pools="bp", concurrency=64)
        lat: list[float] = []
        stop = threading.Event()

        def reader() -> None:
            c = httpx.Client(base_url=url, timeout=30, trust_env=False)
            while not stop.is_set():
                s = time.perf_counter()
                r = c.get(f"/v1/batches/{bid}")
                lat.append((time.perf_counter() - s) * 1000)
                assert r.status_code == 200
                if r.json()["status"] in ("completed", "failed", "expired", "cancelled"):
                    break
            c.close()

        t_run = time.perf_counter()
        th = threading.Thread(target=reader)
        th.start()
        wait_until(
            lambda: client.hget(f"{prefix}batch:{bid}", "status") == "completed",
            3600,
            "the batch to complete",
            interval=0.5,
        )
        run_s = time.perf_counter() - t_run
        stop.set()
        th.join(30)
        rec = client.hgetall(f"{prefix}batch:{bid}")
        assert int(rec["completed"]) == n, rec
        serve_assembly_s = float(rec["completed_at"]) - float(rec["finalizing_at"])
        node.stop()
        load_run = os.getloadavg()

        # 3. output assembly in this process (the same code the service runs)
        from pipeline.batch import Batches, BatchSettings, Files, LocalFileStore

        pl = penv.pipeline()
        bs = BatchSettings.from_env(pl.settings, {"PIPELINE_FILES_DIR": str(workdir / "f2")})
        files = Files(pl.store, bs, LocalFileStore(workdir / "f2"))
        batches = Batches(pl, bs, files)
        times, cpu_out = [], []
        redis_meter = CpuMeter({"redis": rh.proc.pid} if rh.proc else {})
        for _ in range(3):
            redis_meter.start()
            s, c = time.perf_counter(), time.process_time()
            batches.write_files(batches.get(bid))
            times.append(time.perf_counter() - s)
            used = redis_meter.stop()
            cpu_out.append((time.process_time() - c, used.get("redis", 0.0)))
        out_rate = n / min(times)
        out_client_us = min(c for c, _ in cpu_out) * 1e6 / n
        out_redis_us = min(r for _, r in cpu_out) * 1e6 / n

        stop_proc(serve, 15)
        sim.stop()
        http.close()
    per_line = {k: v * 1e6 / n for k, v in cpu.items()}
    rows: list[list[Any]] = [
        [
            "upload + validation + enqueue",
            f"{ingest_rate:,.0f} lines/s",
            ">= 20,000",
            verdict(ingest_rate >= 20_000),
        ],
        [
            "service memory growth (peak RSS)",
            f"{grow_mb:.0f} MB",
            "<= 100 MB",
            verdict(grow_mb <= 100),
        ],
        [
            "GET /v1/batches/{id} p50 / p99 while running",
            f"{pct(lat, 50):.1f} / {pct(lat, 99):.1f} ms",
            "p99 <= 20 ms",
            verdict(pct(lat, 99) <= 20),
        ],
        [
            "output assembly (in process, best of 3)",
            f"{out_rate:,.0f} lines/s",
            ">= 50,000",
            verdict(out_rate >= 50_000),
        ],
        [
            "output assembly (in the service, at finalize)",
            f"{n / serve_assembly_s:,.0f} lines/s",
            "",
            "",
        ],
    ]
    print(table(["target", "measured", "target", ""], rows))
    print(
        f"\nlines {n}; ingest CPU per line: "
        + ", ".join(f"{k} {v:.1f} us" for k, v in per_line.items())
        + f" (sum: {1e6 / sum(per_line.values()):,.0f} lines per CPU-second, one after the"
        + f" other); machine steal {steal:.0f} %"
    )
    print(
        f"output assembly CPU per line: this process {out_client_us:.1f} us, redis "
        f"{out_redis_us:.1f} us (overlapped: at most {1e6 / max(out_client_us, out_redis_us):,.0f}"
        " lines per CPU-second of the busier one)"
    )
    print(f"run: {n} requests in {run_s:.1f} s ({n / run_s:.0f} req/s), {len(lat)} GETs")
    print(f"load average (1/5/15 min) at start {load0}, after the run {load_run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
