"""``pipeline run`` as a batch client: checked before anything starts, idempotent by content,
resumable, output written whole with one line per custom_id; and the enqueue resumes after
a crash without storing a line twice."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from pipeline.batch import Batches
from pipeline.batch.ingest import RowBuilder, RowContext, input_lines, scan
from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.sim import SimServer
from tests.conftest import held
from tests.integration.test_cli import run_cli


def write_lines(
    path: Path, tag: str, n: int, extra: dict[int, dict[str, Any]] | None = None
) -> None:
    with open(path, "w") as fh:
        for i in range(n):
            line: dict[str, Any] = {
                "custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "sim-model", "messages": [{"role": "user", "content": str(i)}]},
            }  # fmt: skip
            line.update((extra or {}).get(i, {}))
            fh.write(json.dumps(line) + "\n")


def test_an_unreadable_file_is_one_line_and_exit_2_before_anything_starts(
    tmp_path: Path, env: dict[str, str]
) -> None:
    bare = {k: v for k, v in env.items() if k not in ("PIPELINE_QUEUES",)}
    proc = run_cli(["run", str(tmp_path / "missing.jsonl")], bare, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"pipeline run: cannot read {tmp_path / 'missing.jsonl'}: No such file or directory"
    ]
    assert "simulator" not in proc.stderr and "Traceback" not in proc.stderr


def test_duplicate_custom_ids_exit_2_naming_the_lines_before_anything_is_submitted(
    tmp_path: Path, env: dict[str, str], pl: Pipeline
) -> None:
    path = tmp_path / "dup.jsonl"
    write_lines(path, "d", 4, {2: {"custom_id": "d-0"}, 3: {"custom_id": "d-1"}})
    before = set(pl.store.client.zrange(pl.store.keys.batches(), 0, -1))
    proc = run_cli(["run", str(path), "-o", str(tmp_path / "out.jsonl")], env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "'d-0' on lines 1, 3" in lines[0] and "'d-1' on lines 2, 4" in lines[0]
    assert set(pl.store.client.zrange(pl.store.keys.batches(), 0, -1)) == before
    assert not (tmp_path / "out.jsonl").exists()


def test_running_the_same_file_again_attaches_and_sends_nothing(
    tmp_path: Path, env: dict[str, str], served: Pipeline, sim: SimServer
) -> None:
    path = tmp_path / "in.jsonl"
    write_lines(path, "again", 20, {5: {"headers": {"x-sim-fail-first": "9",
                                                     "x-sim-fail-status": "400"}}})  # fmt: skip
    out = tmp_path / "out.jsonl"
    first = run_cli(["run", str(path), "-o", str(out), "--json-summary"], env)
    assert first.returncode == 0, first.stderr
    sent = sim.stats()["requests"]
    assert sent == 20
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == [f"again-{i}" for i in range(20)]
    assert rows[5]["status_code"] == 400
    out.unlink()
    second = run_cli(["run", str(path), "-o", str(out), "--json-summary"], env)
    assert second.returncode == 0, second.stderr
    assert "attached to batch" in second.stderr
    assert sim.stats()["requests"] == sent  # nothing sent again
    again = [json.loads(x) for x in out.read_text().splitlines()]
    assert again == rows
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["outcomes"] == {"ok (200)": 19, "HTTP 400": 1}
    # --format openai: OpenAI's output and error files
    proc = run_cli(["run", str(path), "-o", str(tmp_path / "o.jsonl"), "--format", "openai"], env)
    assert proc.returncode == 0, proc.stderr
    ok = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    bad = [json.loads(x) for x in (tmp_path / "o.errors.jsonl").read_text().splitlines()]
    assert len(ok) == 19 and len(bad) == 1
    assert ok[0]["response"]["body"]["object"] == "chat.completion" and ok[0]["error"] is None
    assert bad[0]["custom_id"] == "again-5" and bad[0]["response"]["status_code"] == 400
    assert bad[0]["error"]["code"] == "http_error"
    # and no temporary file is left next to the output
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "in.jsonl",
        "o.errors.jsonl",
        "o.jsonl",
        "out.jsonl",
    ]


def test_a_batch_id_of_other_content_is_refused(
    tmp_path: Path, env: dict[str, str], served: Pipeline
) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_lines(a, "a", 2)
    write_lines(b, "b", 2)
    bid = f"batch_run_{os.getpid()}_{tmp_path.name[-6:]}"
    assert (
        run_cli(["run", str(a), "-o", str(tmp_path / "o"), "--batch-id", bid], env).returncode == 0
    )
    proc = run_cli(["run", str(b), "-o", str(tmp_path / "o"), "--batch-id", bid], env)
    assert proc.returncode == 2 and "other content" in proc.stderr


def test_an_enqueue_cut_short_resumes_after_its_last_stored_line(
    served: Pipeline, sim: SimServer, tmp_path: Path
) -> None:
    """An enqueuer that stored the first chunks and died (its lease lapsed): the next one
    stores only the rest; a second resumer and a stale chunk change nothing."""
    path = tmp_path / "in.jsonl"
    write_lines(path, "res", 300)
    b = Batches(served)
    batch, _ = b.create(source={"kind": "path", "path": str(path)}, extensions=True)
    rec = b.at(batch.id).record(batch.id)
    ctx = RowContext(batch.id, "default", 0, float(rec["expires_at"]), float(rec["created_at"]),
                     "{}", None, True, False)  # fmt: skip
    with open(path, "rb") as fh:
        result = scan(input_lines(fh), RowBuilder(served, ctx), max_body_bytes=1 << 20,
                      max_lines=1000)  # fmt: skip
    assert (
        b.at(batch.id).start(batch.id, total=300, invalid=0, lines=300, model=None) == "in_progress"
    )
    chunks = list(result.chunks_iter())
    assert len(chunks) > 3
    for after, upto, items in chunks[:2]:  # the first enqueuer stores two chunks, then dies
        assert b.at(batch.id).submit_chunk(batch.id, after, upto, items) == [1] * (upto - after)
    stale = chunks[1]
    result.close()
    assert b.get(batch.id).submitted == chunks[1][1]
    resumed = b.ingest(b.get(batch.id), lambda: open(path, "rb"))
    assert resumed.submitted == 300
    assert b.ingest(resumed, lambda: open(path, "rb")).submitted == 300  # nothing left
    late = b.at(batch.id).submit_chunk(batch.id, *stale)  # the dead one's next call, fenced off
    assert late == ["fenced", "300"]
    done = b.wait(batch.id, timeout=60)
    assert done.status == "completed" and done.request_counts.completed == 300
    attempts = sim.stats()["attempts_by_request_id"]
    assert [attempts[done.request_id(n)] for n in range(1, 301)] == [1] * 300


# ``python -m pipeline`` with Ctrl-C's default handler: a test run started in the background
# (``make test &``) ignores SIGINT, and a child inherits that, so Python would install no
# KeyboardInterrupt handler and the command would never see the test's Ctrl-C.
WITH_CTRL_C = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('pipeline', run_name='__main__', alter_sys=True)"
)


def test_ctrl_c_leaves_the_batch_running_and_says_how_to_reattach(
    tmp_path: Path, env: dict[str, str], served: Pipeline, sim: SimServer
) -> None:
    """A line is held at the simulator, so the batch is still running when the command gets
    SIGINT: it exits 130 naming the batch and the command to re-attach, and the batch runs on;
    with --cancel-on-exit the batch is cancelled (the held line, in flight, finishes when the
    test lets it go)."""
    import signal
    import subprocess
    import sys

    from pipeline.batch import content_batch_id
    from tests.conftest import ROOT

    b = Batches(served)
    for cancel in (False, True):
        path = tmp_path / f"in-{cancel}.jsonl"
        name = f"int{int(cancel)}{tmp_path.name[-6:]}"
        hold = {"headers": held(f"{name}-hold"), "timeout": 60}
        write_lines(path, name, 3, {0: hold})
        bid = content_batch_id(path)
        args = ["run", str(path), "-o", str(tmp_path / "o.jsonl"), "--no-progress"]
        proc = subprocess.Popen(
            [sys.executable, "-c", WITH_CTRL_C, *args, *(["--cancel-on-exit"] if cancel else [])],
            env={**env, "PYTHONFAULTHANDLER": "1"}, cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

        def two_done(bid: str = bid) -> bool:
            return bool(b.at(bid).record(bid)) and b.get(bid).request_counts.done == 2

        wait_until(two_done, 30, "two lines done, one held")
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # where it hangs: faulthandler prints every thread
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"pipeline run did not stop within 60 s of SIGINT:\n{err}")
        assert proc.returncode == 130, err
        if cancel:
            assert f"batch {bid} cancelled" in err
        else:
            assert f"batch {bid} keeps running; re-attach with: pipeline run {path}" in err
            assert b.get(bid).status == "in_progress"
            b.cancel(bid)
        assert b.get(bid).status == "cancelling"  # the held line is still in flight
        sim.release(f"{name}-hold")
        assert b.wait(bid, timeout=30).status == "cancelled"
        assert not (tmp_path / "o.jsonl").exists()
