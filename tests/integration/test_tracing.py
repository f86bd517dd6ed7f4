"""OpenTelemetry tracing of attempts: a ``process-request`` span per attempt, a child
``http-request`` span, W3C trace context taken from the request's metadata and sent on in the
outgoing request. Attempts run for real (Redis, fenced start, HTTP to a recording server);
spans go to the SDK's in-memory exporter, or, in a worker subprocess configured only by
``OTEL_*`` variables, to its console exporter."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pipeline.cli.services import wait_until
from pipeline.config import with_overrides
from pipeline.dispatch import Dispatcher
from pipeline.observability import tracing
from pipeline.worker import AttemptId, Report, Runtime, Status, observe
from tests.conftest import ROOT, WorkerProc, assert_idle
from tests.observability import Isolated, isolated, start_node

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"


class Recorder:
    """A real HTTP model server stand-in: records each call's headers; answers the statuses
    scripted per ``x-request-id`` (then 200)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []
        self.script: dict[str, list[int]] = {}
        self.hold: dict[str, threading.Event] = {}  # an id's calls wait until it is set
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                rec.calls.append(headers)
                gate = rec.hold.get(headers.get("x-request-id", ""))
                if gate is not None:
                    gate.wait(30)
                todo = rec.script.get(headers.get("x-request-id", ""), [])
                status = todo.pop(0) if todo else 200
                body = json.dumps({"choices": [{"text": "ok"}]} if status == 200 else {}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def calls_for(self, rid: str) -> list[dict[str, str]]:
        return [c for c in self.calls if c.get("x-request-id") == rid]


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    r = Recorder()
    yield r
    r.httpd.shutdown()
    r.httpd.server_close()


@pytest.fixture
def traced(env: dict[str, str], recorder: Recorder, tmp_path: Path) -> Iterator[Isolated]:
    iso = isolated(env, tmp_path, [{"queue_name": "t", "igw_base_url": recorder.url}])
    yield iso
    assert_idle(iso.pl)


@pytest.fixture
def rt(traced: Isolated) -> Iterator[Runtime]:
    """A worker runtime in this process (as a pool child has)."""
    runtime = Runtime(traced.settings)
    yield runtime
    runtime.stop()


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    tracing.use_tracer_provider(provider)
    yield exp
    tracing.use_tracer_provider(None)
    provider.shutdown()


def run_one_attempt(iso: Isolated, rt: Runtime, rid: str, timeout: float = 10.0) -> Report:
    """Dispatch the request (when due) and run one attempt here, as the task would."""
    q = iso.settings.queues[iso.queue("t")]

    def dispatched() -> Any:
        return iso.pl.store.tick(q, [q], 1.0, -1, 1).moved

    moved = wait_until(dispatched, timeout, f"{rid} dispatched")
    assert [d.id for d in moved] == [rid]
    attempt = rt.begin(AttemptId(rid, moved[0].token, q.queue_name), "test-node")
    assert attempt is not None
    attempt.acquire()
    observe.attempt_started(attempt)
    return observe.observed_run(attempt)


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def test_attempt_span_continues_the_callers_trace_and_propagates_it(
    traced: Isolated, rt: Runtime, recorder: Recorder, exporter: InMemorySpanExporter
) -> None:
    iso = traced
    req = iso.pl.submit(
        {"model": "m-7", "prompt": "hi"},
        queue=iso.queue("t"),
        metadata={"traceparent": TRACEPARENT, "tracestate": "vendor=abc", "userid": "u"},
    )
    recorder.script[req.id] = [503]
    assert run_one_attempt(iso, rt, req.id).status is Status.RETRY
    assert run_one_attempt(iso, rt, req.id).status is Status.SUCCESS
    spans = exporter.get_finished_spans()
    attempts = by_name(spans, "process-request")
    calls = by_name(spans, "http-request")
    assert len(attempts) == 2 and len(calls) == 2
    for i, span in enumerate(attempts):
        assert format(span.context.trace_id, "032x") == TRACE_ID
        assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_SPAN
        assert span.parent.is_remote
        attrs = span.attributes
        assert attrs is not None
        # the reference's current names, and the old ones for one release
        assert attrs["gen_ai.request.id"] == attrs["request.id"] == req.id
        assert attrs["gen_ai.request.model"] == "m-7"
        assert attrs["llm_d.async.queue.name"] == attrs["queue.name"] == iso.queue("t")
        assert attrs["llm_d.async.queue.id"] == attrs["queue.id"] == iso.queue("t")
        assert attrs["llm_d.async.retry_count"] == attrs["retry.count"] == i
        # a retryable failure records its category but is not an error
        assert span.status.status_code is StatusCode.UNSET
    first = attempts[0].attributes or {}
    assert first["llm_d.async.error.category"] == first["error.category"] == "SERVER_ERROR"
    assert "error.category" not in (attempts[1].attributes or {})
    assert "llm_d.async.error.category" not in (attempts[1].attributes or {})
    for call, attempt, seen in zip(calls, attempts, recorder.calls_for(req.id), strict=True):
        assert call.kind is SpanKind.CLIENT
        assert call.parent is not None and call.parent.span_id == attempt.context.span_id
        # the model server got the HTTP span's context, in the caller's trace
        assert seen["traceparent"] == f"00-{TRACE_ID}-{call.context.span_id:016x}-01"
        assert seen["tracestate"] == "vendor=abc"
    assert calls[0].attributes["http.response.status_code"] == 503  # type: ignore[index]
    assert calls[1].attributes["http.response.status_code"] == 200  # type: ignore[index]


def test_fatal_error_marks_the_span_and_a_new_trace_starts_without_context(
    traced: Isolated, rt: Runtime, recorder: Recorder, exporter: InMemorySpanExporter
) -> None:
    iso = traced
    req = iso.pl.submit({"prompt": "bad"}, queue=iso.queue("t"))
    recorder.script[req.id] = [400]
    assert run_one_attempt(iso, rt, req.id).status is Status.FAILED
    (span,) = by_name(exporter.get_finished_spans(), "process-request")
    assert span.parent is None
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes is not None and span.attributes["error.category"] == "INVALID_REQ"
    assert span.attributes["llm_d.async.error.category"] == "INVALID_REQ"
    assert "gen_ai.request.model" not in span.attributes  # the payload names no model
    (seen,) = recorder.calls_for(req.id)
    assert seen["traceparent"].split("-")[1] == format(span.context.trace_id, "032x")


def start_held_attempt(
    iso: Isolated, rt: Runtime, recorder: Recorder, rid: str
) -> tuple[threading.Thread, list[Report], str]:
    """Dispatch ``rid`` and run its attempt in a thread; the recorder holds its HTTP call
    until the test sets ``recorder.hold[rid]``. Returns the thread, its report (once it ends)
    and the attempt's token."""
    q = iso.settings.queues[iso.queue("t")]
    recorder.hold[rid] = threading.Event()
    (moved,) = wait_until(
        lambda: iso.pl.store.tick(q, [q], 1.0, -1, 1).moved,
        10,
        "iso.pl.store.tick(q, [q], 1.0, -1, 1).moved",
    )
    attempt = rt.begin(AttemptId(rid, moved.token, q.queue_name), "test-node")
    assert attempt is not None
    attempt.acquire()
    reports: list[Report] = []
    thread = threading.Thread(target=lambda: reports.append(observe.observed_run(attempt)))
    thread.start()
    wait_until(lambda: recorder.calls_for(rid), 10, "the held call")
    return thread, reports, moved.token


def linked_reenqueue(exporter: InMemorySpanExporter, rid: str) -> tuple[ReadableSpan, ReadableSpan]:
    """The request's ``re-enqueue`` span and the ``process-request`` span it links to."""
    spans = exporter.get_finished_spans()
    (reenqueue,) = by_name(spans, "re-enqueue")
    attempt = next(
        s for s in by_name(spans, "process-request") if (s.attributes or {})["request.id"] == rid
    )
    assert reenqueue.parent is None  # a trace of its own
    assert [link.context.span_id for link in reenqueue.links] == [attempt.context.span_id]
    assert reenqueue.links[0].context.trace_id == attempt.context.trace_id
    attrs = reenqueue.attributes or {}
    assert attrs["gen_ai.request.id"] == attrs["request.id"] == rid
    return reenqueue, attempt


def test_reenqueue_span_when_a_node_requeues_an_attempt_at_shutdown(
    traced: Isolated, rt: Runtime, recorder: Recorder, exporter: InMemorySpanExporter
) -> None:
    """A node shutting down requeues its cut-off attempt (``Runtime.abandon``, as the
    ``worker_shutdown`` handler does): a ``re-enqueue`` span links to that attempt's span."""
    iso = traced
    req = iso.pl.submit(
        {"prompt": "slow"}, queue=iso.queue("t"), metadata={"traceparent": TRACEPARENT}
    )
    thread, reports, token = start_held_attempt(iso, rt, recorder, req.id)
    rt.abandon(AttemptId(req.id, token, iso.queue("t")), cancel=False, reason="worker shutdown")
    assert iso.pl.state(req.id) == "queued"
    recorder.hold[req.id].set()
    thread.join(10)
    assert reports[0].status is Status.STALE  # its late outcome is fenced off
    reenqueue, attempt = linked_reenqueue(exporter, req.id)
    assert (reenqueue.attributes or {})["llm_d.async.reenqueue.reason"] == "worker shutdown"
    assert format(attempt.context.trace_id, "032x") == TRACE_ID  # the caller's trace
    assert reenqueue.context.trace_id != attempt.context.trace_id
    del recorder.hold[req.id]
    assert run_one_attempt(iso, rt, req.id).status is Status.SUCCESS


def test_reenqueue_span_when_the_reaper_requeues_an_attempt(
    traced: Isolated, rt: Runtime, recorder: Recorder, exporter: InMemorySpanExporter
) -> None:
    """The attempt's process stops renewing its lease (as if it died); another node's reaper
    requeues the request and links its ``re-enqueue`` span to the attempt's span through the
    context the attempt left in Redis (the reaper's process never saw that span)."""
    iso = traced
    settings = with_overrides(iso.settings, lease_s=0.5)
    dying = Runtime(settings)
    req = iso.pl.submit({"prompt": "orphan"}, queue=iso.queue("t"))
    thread, reports, token = start_held_attempt(iso, dying, recorder, req.id)
    assert iso.pl.record(req.id)["attempt_span"].startswith(token + " ")
    dying.stop()  # no more lease renewals
    tracing._attempts.clear()  # the reaper is another process: it knows only what Redis says
    reaper = Dispatcher(settings, [iso.pool()], node="reaper", slots=1, send=lambda m: None,
                        store=iso.pl.store)  # fmt: skip
    try:
        wait_until(lambda: reaper.reap() == 1, 10, "the reaper", interval=0.1)
    finally:
        reaper.stop()
    recorder.hold[req.id].set()
    thread.join(10)
    assert reports[0].status is Status.STALE
    reenqueue, _ = linked_reenqueue(exporter, req.id)
    assert (reenqueue.attributes or {})["llm_d.async.reenqueue.reason"] == "lease expired"
    del recorder.hold[req.id]
    assert run_one_attempt(iso, rt, req.id).status is Status.SUCCESS


SCRIPT = """
import json, sys
from pipeline.config import with_overrides
from pipeline.dispatch import Dispatcher
from pipeline.observability import tracing
from pipeline.client import Pipeline
from pipeline.worker import AttemptId, Runtime, observe
p = Pipeline()
q = p.settings.queues[sys.argv[1]]
req = p.submit({"prompt": "x"}, queue=q.queue_name, metadata={"traceparent": sys.argv[2]})
(d,) = p.store.tick(q, [q], 1.0, -1, 1).moved
attempt = Runtime(p.settings).begin(AttemptId(req.id, d.token, q.queue_name), "script")
attempt.acquire()
observe.attempt_started(attempt)
report = observe.observed_run(attempt)
ours = ("opentelemetry.sdk.trace", "opentelemetry.propagate")  # redis-py imports the rest
print(json.dumps({"status": report.status.value, "enabled": tracing.enabled(),
                  "otel_imported": [m for m in ours if m in sys.modules]}))
"""


def test_off_without_otel_environment(traced: Isolated, recorder: Recorder) -> None:
    """No ``OTEL_*`` variables: an attempt runs with tracing off, without loading the
    OpenTelemetry SDK or propagators, and sends no ``traceparent`` (not even the caller's)."""
    env = {k: v for k, v in traced.env.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, traced.queue("t"), TRACEPARENT],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data == {"status": "success", "enabled": False, "otel_imported": []}
    (seen,) = recorder.calls
    assert "traceparent" not in seen


def test_worker_traces_from_otel_environment(
    traced: Isolated, recorder: Recorder, start_worker: Callable[..., WorkerProc]
) -> None:
    """A worker node started with only ``OTEL_TRACES_EXPORTER=console`` exports the spans of
    a real attempt (retried once), in the caller's trace."""
    otel = {
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_SERVICE_NAME": "pipeline-test",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    w, _ = start_node(start_worker, traced, concurrency=2, extra_env=otel)
    try:
        req = traced.pl.submit(
            {"prompt": "hi"}, queue=traced.queue("t"), metadata={"traceparent": TRACEPARENT}
        )
        recorder.script[req.id] = [503]
        assert traced.pl.wait(req.id, timeout=20).ok

        def exported() -> list[dict[str, Any]]:
            spans = [s for s in _console_spans(w.log.read_text()) if s["name"] == "process-request"]
            return spans if len(spans) == 2 else []

        spans = wait_until(exported, 10, "spans on the console exporter", interval=0.05)
        for i, span in enumerate(spans):
            assert span["context"]["trace_id"] == f"0x{TRACE_ID}"
            assert span["parent_id"] == f"0x{PARENT_SPAN}"
            assert span["attributes"]["request.id"] == req.id
            assert span["attributes"]["retry.count"] == i
            assert span["resource"]["attributes"]["service.name"] == "pipeline-test"
        seen = recorder.calls_for(req.id)
        assert len(seen) == 2 and all(TRACE_ID in c["traceparent"] for c in seen)
    finally:
        w.stop()


def _console_spans(text: str) -> list[dict[str, Any]]:
    """The JSON span objects ConsoleSpanExporter printed (pretty-printed, one per span)."""
    out: list[dict[str, Any]] = []
    dec = json.JSONDecoder()
    i = text.find("{\n")
    while i != -1:
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{\n", i + 1)
            continue
        if isinstance(obj, dict) and "context" in obj and "name" in obj:
            out.append(obj)
        i = text.find("{\n", end)
    return out
