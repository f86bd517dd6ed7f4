"""The ``pipeline`` command: run a JSONL batch (against the test worker, and from nothing
with an embedded Redis), submit and status."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from pipeline.batch.run import RunError
from pipeline.cli.main import embedded_redis_needed
from pipeline.cli.services import free_port, redis_reachable, wait_until
from pipeline.client import Pipeline
from pipeline.redact import redact_url
from pipeline.sim import SimServer
from tests.conftest import NODE_START_S, ROOT, nothing_stored
from tests.observability import isolated
from tests.redis_servers import lone_server

PIPELINE = str(Path(sys.executable).parent / "pipeline")  # the console script, as installed


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
    """``--embedded-redis``: what ``make demo`` does on a machine with no Redis (with
    ``PIPELINE_REDIS_URL`` unset and nothing at the default URL; this machine has one there)."""
    port = free_port()  # nothing listens here: whatever it names, the embedded Redis is used
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "CELERY_"))}
    env["PIPELINE_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    good = write_batch(tmp_path / "in.jsonl", "emb")
    out = tmp_path / "out.jsonl"
    proc = run_cli(
        [
            "run",
            "--embedded-redis",
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
    embedded = re.search(r"embedded redis-server \((redis://[^)]+)\)", proc.stderr)
    assert embedded, proc.stderr
    assert "started the simulator" in proc.stderr and "started one" in proc.stderr
    check_output(out, good)
    assert not redis_reachable(embedded.group(1), 0.5)  # everything it started is gone again


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


# -- which Redis `pipeline run` uses (issue 45, item 7) ------------------------------------------
PASSWORD = "s3cret-" + uuid.uuid4().hex[:8]


def test_run_refuses_a_redis_it_cannot_use_and_starts_nothing(
    tmp_path: Path, env: dict[str, str], pl: Pipeline
) -> None:
    """A wrong password, no password, or TLS to a plain server at PIPELINE_REDIS_URL: exit 2
    naming the URL (redacted) and why, before anything is started — never a throw-away
    embedded Redis that runs the batch and exits 0."""
    write_batch(tmp_path / "in.jsonl", "auth")
    out, log = tmp_path / "out.jsonl", tmp_path / "worker.log"
    with lone_server(tmp_path / "redis", password=PASSWORD) as server:
        for url, says in [
            (f"redis://:wrong-{PASSWORD}@127.0.0.1:{server.port}/0", "authentication failed"),
            (f"redis://127.0.0.1:{server.port}/0", "[Aa]uthentication required"),
            (f"rediss://:{PASSWORD}@127.0.0.1:{server.port}/0", ""),  # no TLS there
        ]:
            args = ["run", str(tmp_path / "in.jsonl"), "-o", str(out), "--worker-log", str(log)]
            with nothing_stored(pl):
                proc = run_cli(args, {**env, "PIPELINE_REDIS_URL": url})
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1, proc.stderr
            assert lines[0].startswith(f"pipeline run: no Redis to use at {redact_url(url)} ")
            assert "(PIPELINE_REDIS_URL)" in lines[0] and re.search(says, lines[0]), lines[0]
            assert PASSWORD not in proc.stderr + proc.stdout
            assert not out.exists() and not log.exists()  # nothing ran, no worker started
        assert server.client().dbsize() == 0


def test_only_an_unnamed_redis_refusing_connections_means_an_embedded_one(tmp_path: Path) -> None:
    """The decision itself: nothing listening at the default URL (PIPELINE_REDIS_URL unset)
    starts an embedded Redis; the same URL named, or a Redis refusing the login, is an error;
    a Redis that answers is used."""
    down = f"redis://127.0.0.1:{free_port()}/0"
    assert embedded_redis_needed(down, named=False)
    with pytest.raises(RunError, match="(PIPELINE_REDIS_URL).*[Cc]onnection refused"):
        embedded_redis_needed(down, named=True)
    with lone_server(tmp_path, password=PASSWORD) as server:
        wrong = f"redis://:nope@127.0.0.1:{server.port}/0"
        for named in (False, True):
            with pytest.raises(RunError, match="authentication failed") as caught:
                embedded_redis_needed(wrong, named=named)
            assert "nope" not in str(caught.value)
        assert not embedded_redis_needed(
            f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0", named=True
        )


# -- the node `pipeline run` starts, in anyone's directory (issue 45, item 8) -------------------
PROJECT_FILES = {
    # a Celery project of the user's own: none of it may be imported by the pipeline's node
    "tasks.py": "raise RuntimeError('the project tasks.py was imported')\n",
    "celeryconfig.py": "raise RuntimeError('the project celeryconfig.py was imported')\n",
    "pipeline.py": "raise RuntimeError('the project pipeline.py was imported')\n",
}


def project_dir(path: Path, package: bool = False) -> Path:
    """A project directory with PROJECT_FILES; ``package``: ``tasks`` as a package, and no
    ``pipeline.py`` (first on PYTHONPATH, a module named ``pipeline`` would stand in for the
    whole product: that name is the product's own)."""
    path.mkdir()
    for name, text in PROJECT_FILES.items():
        if package and name == "pipeline.py":
            continue
        if package and name == "tasks.py":
            (path / "tasks").mkdir()
            (path / "tasks" / "__init__.py").write_text(text)
        else:
            (path / name).write_text(text)
    return path


def test_run_in_a_celery_project_directory(
    tmp_path: Path, env: dict[str, str], sim: SimServer
) -> None:
    """A directory holding tasks.py, celeryconfig.py (and pipeline.py) that fail on import:
    the node `pipeline run` starts there loads the pipeline's own modules and serves the
    batch."""
    iso = isolated(env, tmp_path, [{"queue_name": "q", "igw_base_url": sim.url}])
    project = project_dir(tmp_path / "project")
    lines = [{"id": f"proj-{i}", "payload": {"prompt": str(i)}, "queue": iso.queue("q")}
             for i in range(3)]  # fmt: skip
    (project / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = ["run", "in.jsonl", "-o", "out.jsonl", "-c", "4", "--no-progress", "--timeout", "90"]
    proc = subprocess.run(
        [PIPELINE, *args], env=iso.env, cwd=project, capture_output=True, text=True, timeout=110
    )
    log = (project / "pipeline-worker.log").read_text()
    assert proc.returncode == 0, proc.stderr[-3000:] + log[-3000:]
    assert "started one" in proc.stderr  # no node served the pool: it started one
    assert "project" not in log, log[-3000:]
    rows = [json.loads(x) for x in (project / "out.jsonl").read_text().splitlines()]
    assert [r["status_code"] for r in rows] == [200, 200, 200]


def test_a_node_starts_with_a_tasks_package_first_on_pythonpath(
    tmp_path: Path, env: dict[str, str], sim: SimServer
) -> None:
    """A ``tasks`` package and a ``celeryconfig`` module of someone else's earlier on the path
    than the installed ones (a shared environment): ``pipeline worker`` still runs the
    pipeline's app with its settings, and serves requests."""
    iso = isolated(env, tmp_path, [{"queue_name": "q", "igw_base_url": sim.url}])
    shadow = project_dir(tmp_path / "shadow", package=True)
    log = tmp_path / "node.log"
    name = f"shadowed-{iso.tag}@test"
    with open(log, "wb") as fh:
        node = subprocess.Popen(
            [PIPELINE, "worker", "--pools", iso.pool(), "-c", "2", "-n", name],
            env={**iso.env, "PYTHONPATH": str(shadow)},
            cwd=shadow,  # and in the working directory
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    try:
        key = iso.pl.store.keys.pool_nodes(iso.pool())

        def registered() -> bool:
            if node.poll() is not None:
                raise AssertionError(f"the node exited: {log.read_text()[-3000:]}")
            return iso.pl.store.client.zscore(key, name) is not None

        wait_until(registered, NODE_START_S, f"node {name}")
        assert iso.pl.submit({"prompt": "x"}, queue=iso.queue("q")).result(timeout=60).ok
    finally:
        node.terminate()
        node.wait(30)
    assert "project" not in log.read_text()


def test_run_shows_why_the_node_it_started_did_not_come_up(
    tmp_path: Path, env: dict[str, str], sim: SimServer
) -> None:
    """The node `pipeline run` starts stops at start-up (here: its metrics directory is under a
    file): the run stops at once, exit 1, with the node's last log lines — not a silent wait
    for the node and exit 1 with no word."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    iso = isolated(
        env,
        tmp_path,
        [{"queue_name": "q", "igw_base_url": sim.url}],
        PIPELINE_METRICS_PORT=str(free_port()),
        PROMETHEUS_MULTIPROC_DIR=str(blocker / "metrics"),
    )
    write_batch(tmp_path / "in.jsonl", "dead")
    log = tmp_path / "node.log"
    log.write_text("an earlier run's line\n")
    args = ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    args += ["--queue", iso.queue("q"), "--worker-log", str(log), "--no-progress"]
    started = time.monotonic()
    with nothing_stored(iso.pl):
        proc = run_cli(args, iso.env)
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr
    assert "the worker node it started exited with status 3 before it was ready" in proc.stderr
    assert "node start-up failed at the metrics setup: NotADirectoryError" in proc.stderr
    assert "an earlier run's line" not in proc.stderr  # only what this node wrote
    print(f"pipeline run reported the failed node after {took:.1f} s")
