"""What a worker node logs at INFO: the request id, status, attempts and latency of each
attempt — never the prompt or the response (user data) unless ``PIPELINE_LOG_BODIES=1`` — and,
with ``PIPELINE_LOG_FORMAT=json``, one JSON object per line carrying the request id, queue and
attempt. Real worker nodes (threads and prefork), a real Redis, the simulator over HTTP."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli.services import wait_until
from pipeline.sim import SimServer
from tests.conftest import WorkerProc, assert_idle
from tests.observability import Isolated, isolated, start_node


@pytest.fixture
def iso(env: dict[str, str], sim: SimServer, tmp_path: Path) -> Isolated:
    return isolated(env, tmp_path, [{"queue_name": "m", "igw_base_url": sim.url}])


@pytest.fixture
def node(
    start_worker: Callable[..., WorkerProc],
) -> Iterator[Callable[..., WorkerProc]]:
    started: list[WorkerProc] = []

    def start(iso: Isolated, **kw: Any) -> WorkerProc:
        w, _ = start_node(start_worker, iso, concurrency=2, **kw)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


def workload(iso: Isolated, marker: str) -> dict[str, str]:
    """Requests whose prompt and response carry ``marker`` (the simulator answers with the
    request's ``model``): a success, one after two 503s, one ending in a 400. Returns the ids
    by kind once all are done."""
    m = iso.queue("m")
    body = {"model": f"model-{marker}", "prompt": f"prompt {marker}"}
    ids = {
        "ok": iso.pl.submit(body, queue=m).id,
        "retried": iso.pl.submit(
            body, queue=m, headers={"x-sim-fail-first": "2", "x-sim-fail-status": "503"}
        ).id,
        "failed": iso.pl.submit(
            body, queue=m, headers={"x-sim-fail-first": "1", "x-sim-fail-status": "400"}
        ).id,
    }
    results = {k: iso.pl.wait(rid, timeout=20) for k, rid in ids.items()}
    assert marker in results["ok"].payload  # the response does carry it
    assert results["retried"].ok and results["retried"].attempts == 3
    assert results["failed"].status_code == 400
    return ids


def done_lines(ids: dict[str, str]) -> list[str]:
    """What the node logs when each request of :func:`workload` ends."""
    return [f"[{ids['ok']}] succeeded", f"[{ids['retried']}] succeeded",
            f"[{ids['failed']}] raised expected"]  # fmt: skip


def log_text(w: WorkerProc, *needles: str) -> str:
    """The node's log once it holds every needle (log lines are written as they happen)."""

    def text() -> str | None:
        t = w.log.read_text()
        return t if all(n in t for n in needles) else None

    return str(wait_until(text, 10, f"{needles} in {w.log}"))


def test_a_worker_at_info_logs_no_body(iso: Isolated, node: Callable[..., WorkerProc]) -> None:
    w = node(iso)
    marker = uuid.uuid4().hex
    ids = workload(iso, marker)
    text = log_text(w, *done_lines(ids))
    assert_idle(iso.pl)
    assert marker not in text
    assert "simulated failure" not in text  # the 400's and 503s' response bodies
    (ok_line,) = [line for line in text.splitlines() if f"[{ids['ok']}] succeeded" in line]
    assert f"{{'id': '{ids['ok']}', 'status_code': 200, 'attempts': 1, 'latency_s': " in ok_line
    (retried,) = [line for line in text.splitlines() if f"[{ids['retried']}] succeeded" in line]
    assert "'attempts': 3" in retried
    assert f"[{ids['retried']}] retry: HTTP 503\n" in text
    assert "RequestFailed('HTTP 400 (" in text
    assert " received" not in text  # Celery's per-attempt "received" line: at DEBUG only


def test_celerys_received_line_shows_at_debug_only() -> None:
    """The worker's logging set-up leaves Celery's per-attempt "Task … received" line out
    above DEBUG (it says nothing the outcome line does not) and keeps it at DEBUG."""
    from tasks.node import RECEIVED_LOGGER, _on_logging_setup

    received = logging.getLogger(RECEIVED_LOGGER)
    before = received.level
    try:
        received.setLevel(logging.NOTSET)
        _on_logging_setup(logger=None, loglevel=logging.DEBUG)
        assert received.level == logging.NOTSET
        _on_logging_setup(logger=None, loglevel="INFO")
        assert received.level == logging.WARNING
    finally:
        received.setLevel(before)


def test_log_bodies_1_shows_them(iso: Isolated, node: Callable[..., WorkerProc]) -> None:
    w = node(iso, extra_env={"PIPELINE_LOG_BODIES": "1"})
    marker = uuid.uuid4().hex
    ids = workload(iso, marker)
    text = log_text(w, *done_lines(ids))
    assert_idle(iso.pl)
    assert f"model-{marker}" in text  # the response, in the success line
    assert "RequestFailed('HTTP 400: " in text and "simulated failure" in text


@pytest.mark.parametrize("pool_impl", ["threads", "prefork"])
def test_json_logs_are_one_object_per_line_with_the_request_id(
    iso: Isolated, node: Callable[..., WorkerProc], pool_impl: str
) -> None:
    w = node(iso, pool_impl=pool_impl, extra_env={"PIPELINE_LOG_FORMAT": "json"})
    marker = uuid.uuid4().hex
    ids = workload(iso, marker)
    text = log_text(w, *done_lines(ids))
    assert_idle(iso.pl)
    assert marker not in text
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert all(isinstance(r, dict) and {"ts", "level", "logger", "message"} <= set(r)
               for r in records)  # fmt: skip
    assert any(r["message"].startswith("pipeline dispatcher started") for r in records)
    for kind, rid in ids.items():
        mine = [r for r in records if f"[{rid}]" in r["message"]]
        assert mine, kind
        assert all(r.get("request_id") == rid for r in mine), mine
        attempt_lines = [r for r in mine if "received" not in r["message"]]
        assert attempt_lines and all(
            r["queue"] == iso.queue("m") and isinstance(r["attempt"], int) for r in attempt_lines
        ), attempt_lines
    (ok,) = [r for r in records if f"[{ids['ok']}] succeeded" in r["message"]]
    assert ok["status"] == 200 and ok["attempts"] == 1 and ok["latency_s"] >= 0
    assert ok["attempt"] == 1
    retries = [r for r in records if f"[{ids['retried']}] retry" in r["message"]]
    assert [r["attempt"] for r in retries] == [1, 2] and {r["status"] for r in retries} == {"retry"}
    (failed,) = [r for r in records if f"[{ids['failed']}] raised expected" in r["message"]]
    assert failed["status"] == 400 and failed["level"] == "INFO"


def test_the_task_result_is_whole_for_the_backend_and_a_summary_for_the_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What Celery does with the task's return value: its result backend stores the whole
    result (kombu's JSON, through ``__json__``), its success line and Flower show
    ``saferepr`` of it — the summary (this breaks if Celery's ``saferepr`` stops falling back
    to ``repr`` for a non-container: see docs/production.md, upgrading Celery)."""
    from celery.utils.saferepr import saferepr

    from tasks.app import app
    from tasks.inference import TaskResult

    result = {"id": "r1", "status_code": 200, "payload": "BODY-TEXT", "attempts": 2,
              "submitted_at": 10.0, "finished_at": 10.25}  # fmt: skip
    value = TaskResult(result)
    meta = app.backend._get_result_meta(result=value, state="SUCCESS", traceback=None,
                                        request=None)  # fmt: skip
    assert json.loads(app.backend.encode(meta))["result"] == result
    monkeypatch.delenv("PIPELINE_LOG_BODIES", raising=False)
    shown = saferepr(value, 1024)
    assert shown == "{'id': 'r1', 'status_code': 200, 'attempts': 2, 'latency_s': 0.25}"
    monkeypatch.setenv("PIPELINE_LOG_BODIES", "1")
    assert "'payload': 'BODY-TEXT'" in saferepr(value, 1024)
    assert dict(value) == result
