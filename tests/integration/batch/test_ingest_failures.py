"""An ingest that raises (a bug, a disk that fails: what no bad line should cause) is bounded:
``pipeline serve`` tries a batch a few times with a backoff, one log line a try, then fails it
with the reason; ``submit_batch`` fails the batch at once and raises a typed error. No batch is
left ``validating`` or half-stored for ever, and the counts stay exact."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

import pipeline
import pipeline.client.api
from pipeline.batch import Batches, BatchSettings, Files, content_batch_id
from pipeline.batch import ingest as ingest_module
from pipeline.batch.records import BatchRecords
from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.serve.background import Background
from pipeline.sim import SimServer
from tests.observability import Isolated, isolated

URL = "/v1/chat/completions"


def chat(cid: str) -> dict[str, Any]:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": cid}]}
    return {"custom_id": cid, "method": "POST", "url": URL, "body": body}


class Boom(RuntimeError):
    """The unexpected error injected."""


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Line parsing raises (a parser bug): each call's line number."""
    seen: list[int] = []

    def parse(number: int, raw: bytes, **kw: Any) -> Any:
        seen.append(number)
        raise Boom("a parser bug")

    monkeypatch.setattr(ingest_module, "parse_line", parse)
    return seen


@pytest.fixture
def iso(env: dict[str, str], sim: SimServer, tmp_path: Path) -> Iterator[Isolated]:
    """A pipeline of its own (no other test's batches in its Redis keys)."""
    yield isolated(env, tmp_path, [{"queue_name": "q", "igw_base_url": sim.url}])


def test_the_service_fails_a_batch_whose_ingest_raises_after_three_tries(
    iso: Isolated, calls: list[int], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = BatchSettings(files_dir=str(tmp_path / "files"), queue=iso.queue("q"))
    files = Files(iso.pl.store, settings)
    batches = Batches(iso.pl, settings, files)
    background = Background(batches, poll_s=0.05)
    background.ingest_backoff_s = 0.2  # (the default 2 s: 2 then 4 s between the tries)
    try:
        with files.blobs.writer("file-in") as fh:
            fh.write(orjson.dumps(chat("a")) + b"\n")
        files.add("file-in", "in.jsonl", "batch", "")
        caplog.set_level(logging.INFO, logger="pipeline")
        batch, _ = batches.create(endpoint=URL, queue=iso.queue("q"), input_file_id="file-in",
                                  source={"kind": "file"}, files=True)  # fmt: skip
        done = wait_until(
            lambda: (b := batches.get(batch.id)).status != "validating" and b, 30, "failed"
        )
    finally:
        background.stop()
    assert done.status == "failed" and done.failed_at, done
    assert done.errors is not None and len(done.errors) == 1
    error = done.errors[0]
    assert error["code"] == "ingest_failed" and error["line"] is None
    assert "Boom: a parser bug" in error["message"] and "3 times" in error["message"]
    assert calls == [1, 1, 1]  # three tries, no more
    assert not batches.at(batch.id).client.sismember(
        batches.at(batch.id).keys.batches_active(), batch.id
    )
    # one log line a try: two warnings saying when the next comes, then the error (with the
    # one traceback it logs)
    lines = [r for r in caplog.records if batch.id in r.getMessage()]
    assert [r.levelname for r in lines] == ["WARNING", "WARNING", "ERROR"], lines
    assert "try 1 of 3" in lines[0].getMessage() and "again in 0.2 s" in lines[0].getMessage()
    assert "try 2 of 3" in lines[1].getMessage() and "again in 0.4 s" in lines[1].getMessage()
    assert "try 3 of 3; the batch is failed" in lines[2].getMessage()
    assert [r.exc_info is not None for r in lines] == [False, False, True]


@pytest.fixture
def door(served: Pipeline, monkeypatch: pytest.MonkeyPatch) -> Pipeline:
    monkeypatch.setattr(pipeline.client.api, "_default", served)
    return served


def test_submit_batch_fails_the_batch_and_raises_a_typed_error(
    door: Pipeline, calls: list[int]
) -> None:
    bid = f"batch_boom_{uuid.uuid4().hex[:8]}"
    with pytest.raises(pipeline.PipelineError) as exc:
        pipeline.submit_batch([chat("a"), chat("b")], id=bid)
    assert type(exc.value).__name__ == "IngestFailed"
    assert exc.value.batch_id == bid and exc.value.final  # type: ignore[attr-defined]
    assert isinstance(exc.value.__cause__, Boom)
    assert calls == [1]
    batch = pipeline.get_batch(bid)
    assert batch.status == "failed" and batch.errors is not None  # not left validating
    assert batch.errors[0]["code"] == "ingest_failed"
    assert "Boom: a parser bug" in batch.errors[0]["message"]
    c = batch.request_counts
    assert (c.total, c.completed, c.failed) == (0, 0, 0)
    assert not door.store.client.exists(door.store_of("default").keys.request(f"{bid}-1"))


def test_a_batch_cut_off_half_stored_ends_failed_with_every_line_counted(
    door: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Storing raises after the first chunk (32 lines) is stored: those run and end as usual,
    the 8 never stored are counted failed, and the batch ends ``failed`` saying why."""
    submit_chunk = BatchRecords.submit_chunk
    chunks: list[int] = []

    def second_raises(
        self: BatchRecords, batch_id: str, after: int, upto: int, items: bytes
    ) -> Any:
        chunks.append(after)
        if len(chunks) > 1:
            raise Boom("the disk went away")
        return submit_chunk(self, batch_id, after, upto, items)

    monkeypatch.setattr(BatchRecords, "submit_chunk", second_raises)
    bid = f"batch_half_{uuid.uuid4().hex[:8]}"
    with pytest.raises(pipeline.PipelineError) as exc:
        pipeline.submit_batch([chat(f"c{i}") for i in range(40)], id=bid)
    assert type(exc.value).__name__ == "IngestFailed"
    assert "the batch takes no more lines and ends failed" in str(exc.value)
    batch = pipeline.get_batch(bid).wait(timeout=60)
    c = batch.request_counts
    assert (batch.status, c.total, c.completed, c.failed) == ("failed", 40, 32, 8), batch
    assert batch.errors is not None and "the disk went away" in batch.errors[0]["message"]
    out = list(Batches(door).lines(batch))
    assert [x.number for x in out] == list(range(1, 41))
    assert all(x.ok for x in out[:32])
    assert [x.missing for x in out[32:]] == ["batch_failed"] * 8
    assert out[32].custom_id is None  # (an inline input is not read again)
    assert out[39].error()[0] == "CANCELLED"
    keys = door.store_of("default").keys
    assert not door.store.client.exists(keys.request(f"{bid}-33"))


def test_pipeline_run_fails_the_batch_and_says_why_in_one_line(
    served: Pipeline, calls: list[int], tmp_path: Path
) -> None:
    """``pipeline run``'s storing of its file (Run.start, after its own check of the file):
    a RunError, which the command prints as one line with exit 2, not a traceback."""
    from rich.console import Console

    from pipeline.batch.run import Run, RunError, RunOptions

    path = tmp_path / f"in-{uuid.uuid4().hex[:8]}.jsonl"
    path.write_bytes(orjson.dumps(chat(path.name)) + b"\n")
    run = Run(served, RunOptions(str(path), str(tmp_path / "out.jsonl")), Console(quiet=True))
    with pytest.raises(RunError, match="Boom: a parser bug") as exc:
        run.start()
    assert "\n" not in str(exc.value)
    batch = Batches(served).get(content_batch_id(path))
    assert batch.status == "failed" and batch.errors is not None
    assert "Boom: a parser bug" in batch.errors[0]["message"]
