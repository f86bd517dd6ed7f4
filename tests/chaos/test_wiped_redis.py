"""Chaos: Redis restarted *without* persistence (its state wiped) while requests run, park and
wait (issue 48, item 3). Persistence is the defence (docs/production.md); the store epoch is the
alarm. The node says it (an ERROR line), the calls whose holders vanished are aborted before
anything new is sent (never over the limit at the server), a waiting client gets ``StateLost``
naming the ids, ``pipeline status`` says when it was noticed, new submissions work, and
``pipeline run`` names the lines to re-run and exits 3 with one line, no traceback. Every id
ends with one terminal result or the documented StateLost, and no gate holds a reservation.

``PIPELINE_CHAOS_LONG=1`` (``make test-chaos-long``) wipes it under hundreds of calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from pipeline import StateLost, UnknownRequest
from pipeline.cli.services import wait_until
from pipeline.observability.status import render_state, store_state
from pipeline.sim import SimServer
from tests.chaos.private_node import start_node
from tests.conftest import assert_idle, give_up_after, held, stop_processes
from tests.redis_servers import Server, start_server

LONG = os.environ.get("PIPELINE_CHAOS_LONG") == "1"
LIMIT = 200 if LONG else 4
SLOTS = 2 * LIMIT  # the node parks as many as run


def items(name: str, n: int) -> list[dict[str, Any]]:
    return [
        {"payload": {"i": i}, "id": f"{name}-{uuid.uuid4().hex[:8]}", "timeout": 300,
         "headers": held(name)}
        for i in range(n)
    ]  # fmt: skip


def wipe(server: Server, tmp: Path) -> Server:
    """SIGKILL the server and start an empty one on its port (no persistence: nothing comes
    back)."""
    server.kill()
    return start_server(tmp / uuid.uuid4().hex[:6], "wiped", port=server.port)


def test_wiped_redis_is_said_and_survived(sim: SimServer, tmp_path: Path) -> None:
    server = start_server(tmp_path / "first", "wiped")
    queue = {
        "igw_base_url": sim.url, "retry_base_delay_s": 0.1, "retry_max_delay_s": 1,
        "request_timeout_s": 120,
        "gate_type": "global-max-concurrency", "gate_params": {"limit": LIMIT},
    }  # fmt: skip
    node = start_node(
        tmp_path, server.url, queue, slots=SLOTS, name="wiped@test", PIPELINE_LEASE_S="3",
        PIPELINE_DISPATCH_LEASE_S="5", PIPELINE_REAPER_PERIOD_S="0.5",
    )  # fmt: skip
    env, log = node.env, node.log
    run: subprocess.Popen[bytes] | None = None
    try:
        pl = node.pipeline()
        sim.reset()
        old = [r.id for r in pl.submit_many(items("wipe-old", 2 * LIMIT))]
        sim.wait_held("wipe-old", LIMIT)  # the rest park at the node or wait in the queue

        server = wipe(server, tmp_path)
        new = [r.id for r in pl.submit_many(items("wipe-new", 2 * LIMIT))]

        # said loudly by the node
        wait_until(lambda: "Redis lost its state" in log.read_text(), 30, "the node's ERROR line")
        # the calls whose holders vanished are aborted
        wait_until(lambda: sim.stats()["hangups"] >= LIMIT, 30, "the old calls aborted")
        # a waiting client: StateLost naming every old id, never UnknownRequest
        with pytest.raises(StateLost) as lost:
            list(pl.iter_results(old, on_poll=give_up_after(30, "StateLost")))
        assert sorted(lost.value.ids) == sorted(old)
        with pytest.raises(StateLost):
            pl.wait(old[0], timeout=10)
        # pipeline status says when it was noticed
        line = render_state(store_state(pl))
        assert line is not None and "Redis lost its state: noticed at" in line.plain
        # new submissions work, never over the limit beside the aborted ones
        sim.wait_held("wipe-new", LIMIT)
        sim.release("wipe-new")
        done = {r.id: r for r in pl.iter_results(new, on_poll=give_up_after(60, "new results"))}
        assert set(done) == set(new) and all(r.ok for r in done.values())
        pushed = [json.loads(x)["id"] for x in pl.store.client.lrange(
            pl.store.keys.result_list(pl.settings.queues["default"]), 0, -1)]  # fmt: skip
        assert sorted(pushed) == sorted(new)  # one terminal result each
        assert sim.stats()["max_concurrency_observed"] <= LIMIT
        assert_idle(pl)

        # pipeline run: its batch goes with a second wipe
        lines = tmp_path / "batch.jsonl"
        lines.write_text("".join(json.dumps(i) + "\n" for i in items("wipe-run", LIMIT + 2)))
        out = tmp_path / "out.jsonl"
        run = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "run", str(lines), "-o", str(out),
             "--no-progress"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
        )  # fmt: skip
        sim.wait_held("wipe-run", LIMIT)
        server = wipe(server, tmp_path)
        _, err = run.communicate(timeout=120)
        text = err.decode()
        assert run.returncode == 3, text
        assert "Traceback" not in text, text
        assert "lost its state" in text and "out.rerun.jsonl" in text, text
        assert (tmp_path / "out.rerun.jsonl").read_text() == lines.read_text()
        wait_until(lambda: sim.stats()["hangups"] >= 2 * LIMIT, 30, "the run's calls aborted")
        assert sim.stats()["max_concurrency_observed"] <= LIMIT
        # until it submits again this client takes any missing record for a lost one; then
        # it stores under the new epoch, and an id it never submitted is unknown again
        with pytest.raises(StateLost):
            pl.get("never-submitted")
        assert pl.submit({"after": 2}, timeout=60).result(timeout=60).ok
        with pytest.raises(UnknownRequest):
            pl.get("never-submitted")
        assert_idle(pl)
    finally:
        sim.release_all()
        if run is not None and run.poll() is None:
            stop_processes([run])
        stop_processes([node.proc])
        server.stop()
