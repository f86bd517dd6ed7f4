"""``kill -9`` of ``pipeline serve`` or of ``pipeline run`` in the middle of a batch, then a
restart: the batch completes with exactly one output line per custom_id, and the model
server receives no request twice (the worker node is not killed: no attempt was in flight
in a killed process). The first kill comes as soon as the batch exists (its lines being
checked or stored), the second while its requests run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from pipeline.batch import Batches, content_batch_id
from pipeline.cli.services import wait_until
from pipeline.sim import SimConfig, SimServer
from tests.conftest import ROOT, WorkerProc, assert_idle
from tests.integration.batch.conftest import ServeProc
from tests.observability import Isolated, isolated, start_node

N = 3000


@pytest.fixture
def slow_sim() -> Iterator[SimServer]:
    server = SimServer(SimConfig(latency_ms=15)).start_in_thread()
    yield server
    server.stop()


@pytest.fixture
def iso(env: dict[str, str], slow_sim: SimServer, tmp_path: Path) -> Iterator[Isolated]:
    i = isolated(
        env,
        tmp_path,
        [{"queue_name": "k", "igw_base_url": slow_sim.url}],
        PIPELINE_BATCH_LEASE_S="2",
        PIPELINE_FILES_DIR=str(tmp_path / "files"),
    )
    yield i
    assert_idle(i.pl, timeout=60)


def phase(b: Batches, bid: str) -> str:
    x = b.get(bid)
    return f"{x.status} (lines stored {x.submitted}/{x.lines}, done {x.request_counts.done})"


def check_once(sim: SimServer, ids: list[str]) -> None:
    attempts = sim.stats()["attempts_by_request_id"]
    assert [attempts.get(i, 0) for i in ids] == [1] * len(ids)


def test_kill_9_of_pipeline_serve_mid_batch(
    iso: Isolated, start_worker: Callable[..., WorkerProc], slow_sim: SimServer, tmp_path: Path
) -> None:
    w, _ = start_node(start_worker, iso, concurrency=4)
    srv = ServeProc({**iso.env, "PIPELINE_BATCH_QUEUE": iso.queue("k")}, tmp_path / "s.log")
    try:
        srv.start()
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-x")
        path = tmp_path / "in.jsonl"
        with open(path, "w") as fh:
            for i in range(N):
                body = {"model": "sim-model", "messages": [{"role": "user", "content": f"{i}"}]}
                fh.write(
                    json.dumps(
                        {
                            "custom_id": f"k-{i}",
                            "method": "POST",
                            "url": "/v1/chat/completions",
                            "body": body,
                        }
                    )
                    + "\n"
                )
        f = client.files.create(file=open(path, "rb"), purpose="batch")
        batch = client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        b = Batches(iso.pl)
        srv.kill()  # 1: while its lines are checked or stored
        print("first kill at:", phase(b, batch.id))
        srv.start()
        wait_until(
            lambda: b.get(batch.id).request_counts.done >= N // 3,
            120,
            "a third of the batch done",
            interval=0.05,
        )
        srv.kill()  # 2: while its requests run
        print("second kill at:", phase(b, batch.id))
        srv.start()
        done = wait_until(
            lambda: (x := client.batches.retrieve(batch.id)).status == "completed" and x,
            180,
            "the batch to complete",
            interval=0.2,
        )
        assert done.request_counts.total == N and done.request_counts.completed == N
        lines = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in lines) == sorted(f"k-{i}" for i in range(N))
        check_once(slow_sim, [x["id"] for x in lines])
    finally:
        srv.stop()
        w.stop()


def test_kill_9_of_pipeline_run_mid_batch(
    iso: Isolated, start_worker: Callable[..., WorkerProc], slow_sim: SimServer, tmp_path: Path
) -> None:
    w, _ = start_node(start_worker, iso, concurrency=4)
    proc: subprocess.Popen[bytes] | None = None
    try:
        path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        with open(path, "w") as fh:
            for i in range(N):
                fh.write(
                    json.dumps(
                        {"id": f"r-{i}", "payload": {"prompt": str(i)}, "queue": iso.queue("k")}
                    )
                    + "\n"
                )
        bid = content_batch_id(path)
        b = Batches(iso.pl)
        args = ["run", str(path), "-o", str(out), "--no-progress"]

        def start() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                [sys.executable, "-m", "pipeline", *args],
                env=iso.env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

        def exists() -> bool:
            return bool(b.at(bid).record(bid))

        proc = start()
        wait_until(exists, 60, "the batch", interval=0.01)
        proc.send_signal(signal.SIGKILL)  # 1: while its lines are checked or stored
        proc.wait(10)
        print("first kill at:", phase(b, bid))
        proc = start()
        wait_until(
            lambda: b.get(bid).request_counts.done >= N // 3,
            120,
            "a third of the batch done",
            interval=0.05,
        )
        proc.send_signal(signal.SIGKILL)  # 2: while its requests run
        proc.wait(10)
        print("second kill at:", phase(b, bid))
        assert not out.exists()
        final = subprocess.run(
            [sys.executable, "-m", "pipeline", *args],
            env=iso.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert final.returncode == 0, final.stderr
        rows: list[dict[str, Any]] = [json.loads(x) for x in out.read_text().splitlines()]
        assert [r["custom_id"] for r in rows] == [f"r-{i}" for i in range(N)]
        assert all(r["status_code"] == 200 for r in rows)
        check_once(slow_sim, [r["request_id"] for r in rows])
    finally:
        if proc is not None and proc.poll() is None:  # a failed test leaves no run behind
            proc.kill()
            proc.wait()
        w.stop()
