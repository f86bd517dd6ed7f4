"""Optional OpenTelemetry tracing of attempts (the ``[otel]`` extra; spans, attributes and
``OTEL_*`` variables in docs/observability.md, "Tracing"). Off, every function is a no-op that
never imports ``opentelemetry``; on, each process (a forked child too) sets up its provider."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from importlib import import_module
from typing import Any

from ..store.keys import holder as make_holder

log = logging.getLogger("pipeline.tracing")

SERVICE_NAME = "celery-llm-pipeline"
TRACER_NAME = "pipeline"
PROPAGATED = ("traceparent", "tracestate", "baggage")
# current attribute name -> the name it had before (both are set, for one release)
ALIASES = {
    "gen_ai.request.id": "request.id",
    "llm_d.async.queue.id": "queue.id",
    "llm_d.async.queue.name": "queue.name",
    "llm_d.async.retry_count": "retry.count",
    "llm_d.async.error.category": "error.category",
}
_REMEMBERED = 4096  # attempt span contexts kept per process for re-enqueue links

_lock = threading.Lock()
_pid: int | None = None  # process the state below belongs to
_tracer: Any = None  # an opentelemetry Tracer, or None when tracing is off
_provider: Any = None  # the SDK provider we created (shut down at exit), if any
_override: Any = None  # a provider installed by use_tracer_provider()
_attempts: OrderedDict[str, Any] = OrderedDict()  # holder -> its process-request SpanContext


def _wanted(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def _exporters(env: Mapping[str, str]) -> list[Any]:
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "otlp").lower().split(",")]
    out: list[Any] = []
    for name in filter(None, names):
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter())
        elif name == "otlp":
            protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
            )
            kind = "grpc" if protocol.strip().lower() == "grpc" else "http"
            try:
                module = import_module(f"opentelemetry.exporter.otlp.proto.{kind}.trace_exporter")
            except ImportError as exc:
                log.warning("tracing: no OTLP exporter for protocol %s (%s)", protocol, exc)
                continue
            out.append(module.OTLPSpanExporter())
        elif name != "none":
            log.warning("tracing: unsupported OTEL_TRACES_EXPORTER %r ignored", name)
    return out


def _from_env() -> Any:
    """A tracer configured from the environment, or None (off)."""
    env = os.environ
    if not _wanted(env):
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning(
            "tracing requested by OTEL_* but opentelemetry is not installed (pip "
            "install 'celery-llm-pipeline[otel]')"
        )
        return None
    global _provider
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):  # e.g. set up by opentelemetry-instrument
        return current.get_tracer(TRACER_NAME)
    attrs = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
    provider = TracerProvider(resource=Resource.create(attrs))
    for exporter in _exporters(env):
        provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider = provider
    log.info("tracing on: exporting spans (%s)", env.get("OTEL_TRACES_EXPORTER", "otlp"))
    return provider.get_tracer(TRACER_NAME)


def tracer() -> Any:
    """This process's tracer, or None when tracing is off."""
    global _pid, _tracer, _provider
    pid = os.getpid()
    if _pid == pid:
        return _tracer
    with _lock:
        if _pid != pid:
            _provider = None
            _tracer = _override.get_tracer(TRACER_NAME) if _override is not None else _from_env()
            _pid = pid
    return _tracer


def enabled() -> bool:
    return tracer() is not None


def use_tracer_provider(provider: Any) -> None:
    """Trace with ``provider`` (e.g. an SDK provider with an in-memory exporter), or go back
    to the environment's configuration with None."""
    global _override, _pid
    with _lock:
        _override = provider
        _pid = None


def shutdown() -> None:
    """Flush and stop the provider this module created (at process exit)."""
    provider = _provider
    if provider is not None and _pid == os.getpid():
        try:
            provider.shutdown()
        except Exception as exc:  # noqa: BLE001 - best effort at exit
            log.debug("tracing shutdown failed: %s", exc)


class AttemptSpan:
    """Handle on an attempt's span (a no-op when tracing is off)."""

    def __init__(self, span: Any = None) -> None:
        self.span = span

    def set(self, key: str, value: Any) -> None:
        if self.span is not None:
            self.span.set_attributes(_attrs({key: value}))

    def traceparent(self) -> str | None:
        if self.span is None:
            return None
        c = self.span.get_span_context()
        return f"00-{c.trace_id:032x}-{c.span_id:016x}-{c.trace_flags:02x}"

    def fail(self, description: str) -> None:
        """Fatal outcomes only, as in the reference."""
        if self.span is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, description))


_OFF = AttemptSpan()


def model_of(payload: str | None) -> str | None:
    try:
        model = json.loads(payload or "").get("model")
    except (ValueError, AttributeError):
        return None
    return model if isinstance(model, str) and model else None


def _attrs(current: dict[str, Any]) -> dict[str, Any]:
    """Under their current names and their old ones (``ALIASES``); empty values left out."""
    out: dict[str, Any] = {}
    for name, value in current.items():
        if value is not None and value != "":
            out[name] = value
            if name in ALIASES:
                out[ALIASES[name]] = value
    return out


@contextmanager
def attempt_span(
    request_id: str,
    queue_id: str,
    queue_name: str,
    retry_count: int,
    metadata: Mapping[str, str],
    *,
    payload: str | None,
    holder: str,
) -> Iterator[AttemptSpan]:
    """The ``process-request`` span of one attempt, child of the trace context in the
    request's ``metadata`` (if any), current for the block. ``holder`` (``id:token``): the
    span's context is remembered for a later ``re-enqueue`` link (:func:`reenqueue_span`)."""
    t = tracer()
    if t is None:
        yield _OFF
        return
    from opentelemetry.propagate import extract

    parent = extract({k.lower(): v for k, v in metadata.items() if k.lower() in PROPAGATED})
    attributes = _attrs(
        {
            "gen_ai.request.id": request_id,
            "gen_ai.request.model": model_of(payload),
            "llm_d.async.queue.id": queue_id,
            "llm_d.async.queue.name": queue_name,
            "llm_d.async.retry_count": retry_count,
        }
    )
    with t.start_as_current_span("process-request", context=parent, attributes=attributes) as s:
        with _lock:
            _attempts[holder] = s.get_span_context()
            while len(_attempts) > _REMEMBERED:
                _attempts.popitem(last=False)
        yield AttemptSpan(s)


def reenqueue_span(
    request_id: str,
    token: str,
    reason: str,
    *,
    queue_name: str = "",
    noted: Callable[[], str | None] = lambda: None,
) -> None:
    """A ``re-enqueue`` span (a new trace): an attempt put back without finishing, linked to
    its ``process-request`` span, remembered here or ``noted()`` (its traceparent in Redis)."""
    t = tracer()
    if t is None:
        return
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    with _lock:
        linked = _attempts.pop(make_holder(request_id, token), None)
    try:
        traceparent = noted() if linked is None else None
    except Exception as exc:  # noqa: BLE001 - observability never stops a requeue
        log.warning("re-enqueue span of %s: its traceparent is unknown (%s)", request_id, exc)
        traceparent = None
    if traceparent:
        ctx = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
        found = trace.get_current_span(ctx).get_span_context()
        linked = found if found.is_valid else None
    links = [trace.Link(linked)] if linked is not None else []
    attributes = _attrs(
        {
            "gen_ai.request.id": request_id,
            "llm_d.async.queue.name": queue_name,
            "llm_d.async.reenqueue.reason": reason,
        }
    )
    span = t.start_span(
        "re-enqueue", context=otel_context.Context(), links=links, attributes=attributes
    )
    span.end()


@contextmanager
def http_span(url: str, headers: dict[str, str]) -> Iterator[AttemptSpan]:
    """The ``http-request`` client span (child of the current attempt span); injects its
    context into ``headers`` (replacing any caller-supplied ``traceparent``/``tracestate``)."""
    t = tracer()
    if t is None:
        yield _OFF
        return
    from opentelemetry.propagate import inject
    from opentelemetry.trace import SpanKind

    from ..redact import redact_url

    attributes = {"http.request.method": "POST", "url.full": redact_url(url)}
    with t.start_as_current_span("http-request", kind=SpanKind.CLIENT, attributes=attributes) as s:
        for key in [k for k in headers if k.lower() in PROPAGATED]:
            del headers[key]
        inject(headers)
        yield AttemptSpan(s)
