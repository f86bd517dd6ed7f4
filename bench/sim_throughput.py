"""Throughput and latency accuracy of the model-server simulator (``pipeline.sim``).

Starts the simulator in a subprocess (one core, its own event loop; ``--latency-ms``, default 0)
unless ``--url`` is given, then drives it with keep-alive HTTP/1.1 clients: ``--procs``
processes, each running ``--connections`` raw asyncio connections that send one
POST /v1/completions at a time (no pipelining) for ``--seconds`` seconds. Prints requests/s
(all responses must be 200) and the latency the clients saw (mean, p50, p99, ms): with
``--latency-ms 100`` that is how close to 100 ms the simulator answers under that load.

    .venv/bin/python bench/sim_throughput.py --seconds 5 --procs 2 --connections 32
    .venv/bin/python bench/sim_throughput.py --latency-ms 100 --procs 1 --connections 64

``wrk`` gives the same picture with less client overhead, e.g.
``wrk -t1 -c32 -d5s -s post.lua http://127.0.0.1:8000/v1/completions`` with a post.lua that
sets ``wrk.method = "POST"`` and a JSON ``wrk.body``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time
from urllib.parse import urlsplit

BODY = json.dumps({"model": "sim-model", "prompt": "hello world benchmark", "max_tokens": 16})
SERVER = (
    "import argparse, sys\n"
    "from pipeline import sim\n"
    "p = argparse.ArgumentParser()\n"
    "sim.add_arguments(p)\n"
    "sys.exit(sim.run_from_args(p.parse_args(sys.argv[1:])))\n"
)


class _Client(asyncio.Protocol):
    """Sends the same request again as soon as the previous response is complete."""

    def __init__(self, request: bytes, counts: dict[str, int], took: list[float]) -> None:
        self.request, self.counts, self.took, self.buf = request, counts, took, bytearray()
        self.transport: asyncio.Transport | None = None
        self.stopped = False
        self.sent = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.send()

    def send(self) -> None:
        assert self.transport is not None
        self.sent = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = bytes(self.buf[:end])
            match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            total = end + 4 + int(match.group(1) if match else 0)
            if len(self.buf) < total:
                return
            del self.buf[:total]
            self.took.append(time.perf_counter() - self.sent)
            key = "ok" if head.startswith(b"HTTP/1.1 200") else "bad"
            self.counts[key] += 1
            if not self.stopped:
                self.send()


Result = tuple[dict[str, int], list[float]]


async def _drive(host: str, port: int, connections: int, seconds: float) -> Result:
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n{BODY}"
    ).encode()
    counts = {"ok": 0, "bad": 0}
    took: list[float] = []
    loop = asyncio.get_running_loop()
    clients = []
    for _ in range(connections):
        _, proto = await loop.create_connection(lambda: _Client(request, counts, took), host, port)
        clients.append(proto)
    await asyncio.sleep(0.5)  # warm-up, not counted
    start, first = dict(counts), len(took)
    await asyncio.sleep(seconds)
    result = {k: counts[k] - start[k] for k in counts}, took[first:]
    for proto in clients:
        proto.stopped = True
        if proto.transport is not None:
            proto.transport.close()
    return result


def _worker(url: str, connections: int, seconds: float, out: mp.Queue[Result]) -> None:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    out.put(asyncio.run(_drive(host, port, connections, seconds)))


def _start_server(latency_ms: float) -> tuple[subprocess.Popen[str], str]:
    args = [sys.executable, "-c", SERVER, "--port", "0", "--latency-ms", str(latency_ms)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"listening on (\S+)", line)
    if not match:
        proc.kill()
        raise SystemExit(f"simulator did not start: {line!r}")
    return proc, match.group(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an already running simulator (default: start one)")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured duration, s")
    parser.add_argument("--procs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--connections", type=int, default=32, help="per process")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="of the started simulator")
    args = parser.parse_args()
    server, url = (None, args.url) if args.url else _start_server(args.latency_ms)
    try:
        out: mp.Queue[Result] = mp.Queue()
        workers = [
            mp.Process(target=_worker, args=(url, args.connections, args.seconds, out))
            for _ in range(args.procs)
        ]
        for w in workers:
            w.start()
        results = [out.get(timeout=args.seconds + 30) for _ in workers]
        for w in workers:
            w.join()
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
    ok, bad = sum(r["ok"] for r, _ in results), sum(r["bad"] for r, _ in results)
    took = sorted(t * 1000 for _, ts in results for t in ts)
    print(
        f"{ok / args.seconds:,.0f} req/s ({ok} ok, {bad} non-200 in {args.seconds:g} s; "
        f"{args.procs} client procs x {args.connections} keep-alive connections) at {url}; "
        f"latency ms mean {statistics.fmean(took):.2f} p50 {took[len(took) // 2]:.2f} "
        f"p99 {took[int(len(took) * 0.99)]:.2f}"
    )
    return 0 if bad == 0 and ok > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
