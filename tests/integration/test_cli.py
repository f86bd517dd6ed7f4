"""The ``pipeline`` command: run a JSONL batch (against the test worker, and from nothing
with an embedded Redis), submit and status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from pipeline.cli.services import free_port, wait_until
from pipeline.client import Pipeline
from tests.conftest import ROOT


def run_cli(
    args: list[str], env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_batch(path: Path, tag: str) -> list[str]:
    lines = [
        {
            "custom_id": f"{tag}-a",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": "one"},
        },
        {
            "custom_id": f"{tag}-b",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "two"}]},
            "priority": 5,
        },
        {
            "id": f"{tag}-c",
            "payload": {"prompt": "three"},
            "timeout": 60,
            "headers": {"x-sim-fail-first": "1", "x-sim-fail-status": "503"},
        },
        {"id": f"{tag}-d", "payload": {"prompt": "four"}, "priority": 42},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n{broken json\n")
    return [f"{tag}-a", f"{tag}-b", f"{tag}-c"]


def check_output(out: Path, good: list[str]) -> dict[str, Any]:
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5
    by_id = {r.get("custom_id") or r["id"]: r for r in rows}
    for rid in good:
        assert by_id[rid]["status_code"] == 200, by_id[rid]
    invalid = [r for r in rows if r.get("error_code") == "INVALID_REQUEST"]
    assert len(invalid) == 2
    assert any("priority" in r["error_message"] for r in invalid)
    assert any("not JSON" in r["error_message"] for r in invalid)
    return by_id


def test_run_jsonl_against_a_running_worker(
    tmp_path: Path, env: dict[str, str], served: Pipeline
) -> None:
    tag = uuid.uuid4().hex[:6]
    good = write_batch(tmp_path / "in.jsonl", tag)
    out = tmp_path / "out.jsonl"
    proc = run_cli(
        ["run", str(tmp_path / "in.jsonl"), "-o", str(out), "--json-summary", "--timeout", "60"],
        env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "started" not in proc.stderr  # the worker was already running: nothing started
    by_id = check_output(out, good)
    assert by_id[f"{tag}-c"]["attempts"] == 2
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["total"] == 5 and summary["outcomes"]["ok (200)"] == 3
    assert summary["outcomes"]["INVALID_REQUEST"] == 2
    assert "Batch summary" in proc.stderr and "latency p95" in proc.stderr


def test_run_from_nothing_starts_embedded_redis_sim_and_worker(tmp_path: Path) -> None:
    port = free_port()  # nothing listens here: the command must start its own Redis
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "CELERY_"))}
    env["PIPELINE_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    good = write_batch(tmp_path / "in.jsonl", "emb")
    out = tmp_path / "out.jsonl"
    proc = run_cli(
        [
            "run",
            str(tmp_path / "in.jsonl"),
            "-o",
            str(out),
            "--sim-latency-ms",
            "0",
            "--sim-jitter-ms",
            "0",
            "-c",
            "4",
            "--worker-log",
            str(tmp_path / "worker.log"),
            "--timeout",
            "90",
        ],
        env,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr + (tmp_path / "worker.log").read_text()[-2000:]
    assert "embedded redis-server" in proc.stderr
    assert "started the simulator" in proc.stderr and "started one" in proc.stderr
    check_output(out, good)
    # everything it started is gone again
    from pipeline.cli.services import redis_reachable

    assert not redis_reachable(env["PIPELINE_REDIS_URL"], 0.5)


def test_submit_and_status_commands(env: dict[str, str], served: Pipeline) -> None:
    proc = run_cli(["submit", '{"prompt": "cli"}', "--timeout", "30", "--wait", "20"], env)
    assert proc.returncode == 0, proc.stderr
    rid, result = proc.stdout.strip().splitlines()
    assert json.loads(result)["id"] == rid and json.loads(result)["status_code"] == 200
    proc = run_cli(["status", "--json"], env)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert {"default", "solo", "short", "slowretry", "lim1"} <= set(info)
    assert info["default"]["gate"]["type"] == "constant"
    assert info["default"]["done_last_minute"] >= 1
    bad = run_cli(["submit", '{"prompt": "x"}', "--priority", "11"], env)
    assert bad.returncode == 2 and "priority" in bad.stderr


def test_cancel_command(env: dict[str, str], served: Pipeline, sim: Any) -> None:
    """``pipeline cancel ID...``: a queued request is cancelled; an unknown id exits 2 naming
    it; ``--abort`` closes a running attempt's call (here: one held at the simulator)."""
    pl = served
    queued = pl.submit({"p": 1}, queue="solo", timeout=30).id  # no worker serves solo
    proc = run_cli(["cancel", queued, "no-such-id", "--by", "cli-test"], env)
    assert proc.returncode == 2 and "no-such-id" in proc.stderr
    assert proc.stdout.strip() == f"{queued}: cancelled"
    assert pl.wait(queued, 5).error_code == "CANCELLED"
    assert pl.explain(queued).log[0].fields["by"] == "cli-test"
    again = run_cli(["cancel", queued], env)
    assert again.returncode == 0 and again.stdout.strip() == f"{queued}: already done"
    bad = run_cli(["cancel", queued, "--by", "a\tb"], env)
    assert bad.returncode == 2 and "by" in bad.stderr
    rid = pl.submit({"p": 2}, queue="lim2", timeout=60, headers={"x-sim-hold": "cli"}).id
    sim.wait_held("cli", 1, timeout_s=20)
    proc = run_cli(["cancel", rid, "--abort"], env)
    assert (
        proc.returncode == 0
        and proc.stdout.strip() == f"{rid}: cancelled (its running attempt aborted)"
    )
    wait_until(lambda: any(r == rid for _, r, _ in sim.hangups()), 10, "the call closed")
