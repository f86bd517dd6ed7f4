"""Bad batch lines at every door: each field of a line missing, null or of the wrong type, and
lines that are not a JSON object, not JSON, not UTF-8, empty, huge or nested too deep. Each is
an error line naming its field (``param`` and the message) — never an exception, a hang or a
traceback — and a batch that is stored ends with exact counts and no request half-written.

Every case goes through the Python door (``pipeline.submit_batch``: the batch fails naming the
line; with ``invalid_lines: error_file`` the good line runs and the bad one is an error line);
some also through ``pipeline run`` (exit 0, the line's INVALID_REQUEST result naming the field,
no traceback) and through ``pipeline serve`` (upload and create with the ``openai`` SDK)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from openai import OpenAI

import pipeline
import pipeline.client.api
from pipeline.batch import Batch, Batches, content_batch_id
from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from tests.conftest import nothing_stored
from tests.integration.batch.conftest import ServeProc
from tests.integration.batch.conftest import start_serve as start_serve  # the fixture, here too
from tests.integration.test_cli import run_cli

URL = "/v1/chat/completions"
MB = 1 << 20  # the test environment's max_payload_bytes (the default)


def chat(cid: str, text: str = "hi") -> dict[str, Any]:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": text}]}
    return {"custom_id": cid, "method": "POST", "url": URL, "body": body}


def without(key: str, **changes: Any) -> bytes:
    """A good OpenAI line with ``key`` left out and ``changes`` made."""
    line = chat("bad")
    line.pop(key, None)
    line.update(changes)
    return orjson.dumps(line)


def given(**changes: Any) -> bytes:
    line = chat("bad")
    line.update(changes)
    return orjson.dumps(line)


def run_line(**fields: Any) -> bytes:
    """A line of ``submit`` arguments (``pipeline run``'s own form)."""
    return orjson.dumps(fields)


def nested(depth: int) -> bytes:
    return (
        b'{"custom_id": "bad", "method": "POST", "url": "'
        + URL.encode()
        + b'", "body": '
        + (b'{"a": ' + b"[" * depth + b"]" * depth + b"}")
        + b"}"
    )


@dataclass(frozen=True)
class Case:
    name: str
    line: bytes
    code: str
    param: str | None  # the field named (None: the line as a whole)
    says: str  # what the message says besides the field
    doors: tuple[str, ...] = ()  # more doors than Python: "run", "http"

    def __str__(self) -> str:
        return self.name


CASES = [
    # OpenAI form: custom_id, method, url, body
    Case("body-missing", without("body"), "missing_required_parameter", "body", "missing body",
         ("run", "http")),
    Case("body-null", given(body=None), "invalid_body", "body", "not null", ("http",)),
    Case("body-string", given(body="hello"), "invalid_body", "body", "not a string"),
    Case("body-array", given(body=[1, 2]), "invalid_body", "body", "not an array"),
    Case("custom_id-missing", without("custom_id"), "missing_required_parameter", "custom_id",
         "missing custom_id", ("http",)),
    Case("custom_id-null", given(custom_id=None), "invalid_custom_id", "custom_id", "not null"),
    Case("custom_id-number", given(custom_id=7), "invalid_custom_id", "custom_id", "a number"),
    Case("custom_id-empty", given(custom_id=""), "invalid_custom_id", "custom_id", "empty"),
    Case("custom_id-long", given(custom_id="x" * 600), "invalid_custom_id", "custom_id",
         "longer than 512"),
    Case("method-null", given(method=None), "invalid_method", "method", "not null"),
    Case("method-get", given(method="GET"), "invalid_method", "method", "not 'GET'", ("http",)),
    Case("method-number", given(method=1), "invalid_method", "method", "not a number"),
    Case("url-null", given(url=None), "invalid_url", "url", "not null"),
    Case("url-number", given(url=5), "invalid_url", "url", "not a number"),
    Case("url-unknown", given(url="/v2/chat"), "invalid_url", "url", "not '/v2/chat'"),
    Case("unknown-field", given(bogus=1), "invalid_request", "bogus", "unknown field"),
    # the run fields an OpenAI line may carry too (Python, pipeline run)
    Case("priority-string", given(priority="high"), "invalid_request", "priority",
         "integer from 0 to 9", ("run",)),
    Case("priority-null", given(priority=None), "invalid_request", "priority", "is null"),
    Case("priority-bool", given(priority=True), "invalid_request", "priority", "true/false"),
    Case("priority-range", given(priority=12), "invalid_request", "priority", "not 12"),
    Case("deadline-string", given(deadline="tomorrow"), "invalid_request", "deadline",
         "Unix time"),
    Case("deadline-null", given(deadline=None), "invalid_request", "deadline", "is null"),
    Case("deadline-past", given(deadline=1000.0), "invalid_request", "deadline", "in the past"),
    Case("deadline-and-timeout", given(deadline=time.time() + 600, timeout=60),
         "invalid_request", "deadline", "give one"),
    Case("timeout-negative", given(timeout=-1), "invalid_request", "timeout", "positive"),
    Case("timeout-null", given(timeout=None), "invalid_request", "timeout", "is null"),
    Case("metadata-string", given(metadata="x"), "invalid_request", "metadata", "not a string"),
    Case("metadata-number-value", given(metadata={"team": 1}), "invalid_request", "metadata",
         "'team' is a number"),
    Case("headers-null", given(headers=None), "invalid_request", "headers", "is null"),
    Case("headers-array", given(headers=["a"]), "invalid_request", "headers", "not an array"),
    Case("headers-bad-name", given(headers={"a b": "1"}), "invalid_request", "headers",
         "header"),
    Case("queue-number", given(queue=3), "invalid_request", "queue", "not 3"),
    Case("queue-unknown", given(queue="nope"), "invalid_request", "queue", "unknown queue"),
    # pipeline run's form: id, payload, endpoint
    Case("payload-missing", run_line(id="bad", endpoint=URL), "missing_required_parameter",
         "payload", "missing payload", ("run",)),
    Case("payload-null", run_line(id="bad", payload=None), "invalid_body", "payload", "not null"),
    Case("id-null", run_line(id=None, payload={}), "invalid_custom_id", "id", "not null"),
    Case("endpoint-number", run_line(payload={}, endpoint=5), "invalid_url", "endpoint",
         "not a number"),
    Case("endpoint-null", run_line(payload={}, endpoint=None), "invalid_url", "endpoint",
         "not null"),
    # lines that are no JSON object
    Case("not-json", b"{custom_id: bad", "invalid_json_line", None, "not JSON", ("run", "http")),
    Case("array", b"[1, 2]", "invalid_json_line", None, "not a JSON object but an array"),
    Case("string", b'"a line"', "invalid_json_line", None, "not a JSON object but a string"),
    Case("empty-object", b"{}", "missing_required_parameter", "custom_id", "missing custom_id"),
    Case("not-utf8", given(body={"prompt": "cafE9"}).replace(b"cafE9", b"caf\xe9"),
         "invalid_json_line", "body", "not UTF-8", ("run", "http")),
    Case("huge", given(body={"prompt": "x" * (2 * MB)}), "line_too_large", "body",
         "too large", ("http",)),
    Case("body-over-the-limit", given(body={"prompt": "x" * MB}), "line_too_large", "body",
         "larger than"),
    Case("nested-deep", nested(2000), "invalid_json_line", "body", "nested deeper than 1024",
         ("http",)),
    Case("nested-too-deep-to-send", nested(300), "invalid_body", "body", "nested too deeply"),
]  # fmt: skip


def check_error(entry: dict[str, Any], case: Case, line: int = 2) -> None:
    """A batch ``errors`` entry (or an error record) says the line, code and field."""
    message = str(entry["message"])
    assert entry["code"] == case.code, entry
    assert message.startswith(f"line {line}: "), entry
    assert case.says in message, entry
    if case.param is not None:
        assert case.param in message, entry
    if "param" in entry:
        assert entry["param"] == case.param, entry


def assert_nothing_stored_for(pl: Pipeline, batch: Batch, lines: range) -> None:
    keys = pl.store_of(batch.queue).keys
    for n in lines:
        assert not pl.store.client.exists(keys.request(batch.request_id(n))), n


@pytest.fixture
def door(served: Pipeline, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pipeline]:
    """``pipeline``'s module functions on the test pipeline (a worker serving it)."""
    monkeypatch.setattr(pipeline.client.api, "_default", served)
    yield served


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 16
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_python_door(door: Pipeline, case: Case) -> None:
    good = chat(f"ok-{uuid.uuid4().hex[:8]}")
    # a bad line fails the batch, naming it; nothing of the batch is stored
    batch = pipeline.submit_batch([good, case.line])
    assert batch.status == "failed" and batch.failed_at, batch
    assert batch.errors is not None and len(batch.errors) == 1, batch.errors
    check_error(batch.errors[0], case)
    assert batch.errors[0]["line"] == 2
    c = batch.request_counts
    assert (c.total, c.completed, c.failed) == (0, 0, 0)
    assert_nothing_stored_for(door, batch, range(1, 3))
    # ... or, when asked, it is an error line and the rest runs: exact counts
    batch = pipeline.submit_batch([good, case.line], metadata={"invalid_lines": "error_file"})
    done = batch.wait(timeout=60)
    assert done.status == "completed", done
    c = done.request_counts
    assert (c.total, c.completed, c.failed) == (2, 1, 1)
    out = list(Batches(door).lines(done))
    assert [x.number for x in out] == [1, 2]
    assert out[0].ok and out[0].custom_id == good["custom_id"]
    assert out[1].invalid is not None and out[1].result is None
    check_error(out[1].invalid, case)
    assert out[1].error()[0] == "INVALID_REQUEST"
    assert_nothing_stored_for(door, done, range(2, 3))


def test_a_line_python_cannot_write_as_json_is_refused_before_anything_is_stored(
    door: Pipeline,
) -> None:
    for bad in ({"custom_id": "x", "body": {"a": {1, 2}}}, {"custom_id": "x", "body": {1: "a"}},
                "caf\udce9"):  # fmt: skip
        with nothing_stored(door), pytest.raises(pipeline.InvalidRequest) as exc:
            pipeline.submit_batch([chat("ok"), bad])
        assert exc.value.field == "lines_or_path" and "line 2" in str(exc.value)


def test_blank_lines_are_skipped_and_an_input_of_none_fails_the_batch(door: Pipeline) -> None:
    batch = pipeline.submit_batch([b"", b"   ", b"\t"])
    assert batch.status == "failed" and batch.errors is not None
    assert [e["code"] for e in batch.errors] == ["empty_file"]
    # a blank line is no request: the others keep their line numbers
    done = pipeline.submit_batch([chat("a"), b"", chat("b")]).wait(timeout=60)
    assert done.status == "completed" and done.request_counts.total == 2
    assert [x.number for x in Batches(door).lines(done)] == [1, 3]


def test_a_byte_order_mark_opening_a_file_is_not_part_of_its_first_line(
    door: Pipeline, tmp_path: Path
) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + orjson.dumps(chat("a")) + b"\n")
    done = pipeline.submit_batch(str(path)).wait(timeout=60)
    assert done.status == "completed" and done.request_counts.completed == 1


def test_a_huge_line_of_a_file_is_refused_unread_and_the_next_line_still_runs(
    door: Pipeline, tmp_path: Path
) -> None:
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as fh:
        fh.write(orjson.dumps(chat("a")) + b"\n")
        fh.write(b'{"custom_id": "big", "body": {"p": "' + b"x" * (8 * MB) + b'"}}\n')
        fh.write(orjson.dumps(chat("c")) + b"\n")
    done = pipeline.submit_batch(str(path), metadata={"invalid_lines": "error_file"})
    done = done.wait(timeout=60)
    c = done.request_counts
    assert (done.status, c.total, c.completed, c.failed) == ("completed", 3, 2, 1)
    out = list(Batches(door).lines(done))
    assert out[1].invalid is not None and out[1].invalid["code"] == "line_too_large"
    assert out[1].invalid["param"] == "body"
    assert out[2].ok and out[2].custom_id == "c"


# -- pipeline run ------------------------------------------------------------------------------
RUN_CASES = [c for c in CASES if "run" in c.doors]


@pytest.mark.parametrize("case", RUN_CASES, ids=str)
def test_pipeline_run_door(
    served: Pipeline, tmp_path: Path, env: dict[str, str], case: Case
) -> None:
    tag = uuid.uuid4().hex[:8]  # new content: a batch of its own
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_bytes(orjson.dumps(chat(f"ok-{tag}")) + b"\n" + case.line + b"\n")
    proc = run_cli(["run", str(path), "-o", str(out), "--no-progress"], env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 2
    assert rows[0]["custom_id"] == f"ok-{tag}" and rows[0]["status_code"] == 200
    assert rows[1]["error_code"] == "INVALID_REQUEST"
    check_error({"code": case.code, "message": rows[1]["error_message"]}, case)
    batch = Batches(served).get(content_batch_id(path))
    c = batch.request_counts
    assert (batch.status, c.total, c.completed, c.failed) == ("completed", 2, 1, 1)
    assert_nothing_stored_for(served, batch, range(2, 3))


# -- pipeline serve ----------------------------------------------------------------------------
HTTP_CASES = [c for c in CASES if "http" in c.doors]


def closed(client: OpenAI, batch_id: str) -> Any:
    def done() -> Any:
        b = client.batches.retrieve(batch_id)
        return b if b.status in ("completed", "failed", "expired", "cancelled") else None

    return wait_until(done, 60, f"batch {batch_id} to close", interval=0.2)


@pytest.mark.parametrize("case", HTTP_CASES, ids=str)
def test_http_door(
    pl: Pipeline, start_serve: Callable[..., ServeProc], tmp_path: Path, case: Case
) -> None:
    srv = start_serve()
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-anything", max_retries=0)
    path = tmp_path / "in.jsonl"
    path.write_bytes(orjson.dumps(chat("ok")) + b"\n" + case.line + b"\n")
    f = client.files.create(file=path, purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h")
    b = closed(client, b.id)
    assert b.status == "failed" and b.errors is not None and b.errors.data is not None, b
    assert len(b.errors.data) == 1
    check_error(b.errors.data[0].model_dump(), case)
    assert b.errors.data[0].line == 2
    assert b.request_counts is not None and b.request_counts.total == 0
    assert_nothing_stored_for(pl, Batches(pl).get(b.id), range(1, 3))
    log = srv.log.read_text()
    assert "Traceback" not in log, log


def test_http_door_error_file(
    served: Pipeline, start_serve: Callable[..., ServeProc], tmp_path: Path
) -> None:
    """With ``invalid_lines: error_file`` the bad line goes to the error file and the good ones
    run: exact counts, one output line per input line."""
    srv = start_serve()
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-anything", max_retries=0)
    case = CASES[0]  # body missing
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join([orjson.dumps(chat("a")), case.line, orjson.dumps(chat("c"))]))
    f = client.files.create(file=path, purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h",
                              metadata={"invalid_lines": "error_file"})  # fmt: skip
    b = closed(client, b.id)
    assert b.status == "completed" and b.request_counts is not None, b
    counts = b.request_counts
    assert (counts.total, counts.completed, counts.failed) == (3, 2, 1)
    assert b.output_file_id and b.error_file_id
    ok = client.files.content(b.output_file_id).text.splitlines()
    errs = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert [json.loads(x)["custom_id"] for x in ok] == ["a", "c"]
    assert len(errs) == 1 and errs[0]["custom_id"] == "bad"
    check_error(errs[0]["error"], case)
    assert "Traceback" not in srv.log.read_text()
