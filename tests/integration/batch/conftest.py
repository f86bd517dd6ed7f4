"""A real ``pipeline serve`` process for the batch API tests."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from pipeline.cli.services import free_port, wait_until
from tests.conftest import ROOT


class ServeProc:
    """``pipeline serve`` in a subprocess; ``kill()`` is a SIGKILL, ``start()`` (re)starts it
    on the same port, files directory and environment."""

    def __init__(self, env: dict[str, str], log: Path, port: int | None = None) -> None:
        self.env, self.log = env, log
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServeProc:
        fh = open(self.log, "ab")  # owned by the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "serve", "--port", str(self.port),
             "--loglevel", "warning"],
            env=self.env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
        )  # fmt: skip
        proc = self.proc

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"pipeline serve exited: {self.log.read_text()[-3000:]}")
            try:
                return httpx.get(self.url + "/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 30, "pipeline serve", interval=0.1)
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def start_serve(env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., ServeProc]]:
    """Start ``pipeline serve`` with the test environment (its files under ``tmp_path``)."""
    started: list[ServeProc] = []

    def start(**extra: str) -> ServeProc:
        e = {**env, "PIPELINE_FILES_DIR": str(tmp_path / "files"), **extra}
        s = ServeProc(e, tmp_path / f"serve-{len(started)}.log").start()
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
