"""Optional OpenTelemetry tracing of attempts (the ``[otel]`` extra).

Per attempt, a ``process-request`` span with the reference's attributes (``request.id``,
``queue.id``, ``queue.name``, ``retry.count``, ``error.category``) and a child ``http-request``
span around the HTTP call. A W3C ``traceparent`` / ``tracestate`` (and ``baggage``) found in the
request's ``metadata`` is the parent of the attempt span; the HTTP span's context is injected
into the outgoing request headers, so the model server continues the trace.

It is on when ``opentelemetry`` is importable and the standard environment asks for traces:
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (exporter ``otlp``) or
``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``; ``none`` = off), unless ``OTEL_SDK_DISABLED``
is true. ``OTEL_SERVICE_NAME`` (default ``celery-llm-pipeline``), ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER`` / ``_ARG`` and ``OTEL_BSP_*`` are read by the SDK itself;
``OTEL_EXPORTER_OTLP_PROTOCOL`` picks ``http/protobuf`` (default, shipped in the extra) or
``grpc`` (needs ``opentelemetry-exporter-otlp-proto-grpc``). Otherwise every function here is a
no-op that never imports ``opentelemetry``. Tests (and embedders) install a provider with
:func:`use_tracer_provider`.

A provider is set up per process, after a fork (prefork pool children get their own).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("pipeline.tracing")

SERVICE_NAME = "celery-llm-pipeline"
TRACER_NAME = "pipeline"
PROPAGATED = ("traceparent", "tracestate", "baggage")

_lock = threading.Lock()
_pid: int | None = None  # process the state below belongs to
_tracer: Any = None  # an opentelemetry Tracer, or None when tracing is off
_provider: Any = None  # the SDK provider we created (shut down at exit), if any
_override: Any = None  # a provider installed by use_tracer_provider()


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
            try:
                if protocol.strip().lower() == "grpc":
                    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                        OTLPSpanExporter,
                    )
                else:
                    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                        OTLPSpanExporter,
                    )
            except ImportError as exc:
                log.warning("tracing: no OTLP exporter for protocol %s (%s)", protocol, exc)
                continue
            out.append(OTLPSpanExporter())
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
    """This process's tracer, or None when tracing is off (cheap after the first call)."""
    global _pid, _tracer, _provider
    pid = os.getpid()
    if _pid == pid:
        return _tracer
    with _lock:
        if _pid != pid:
            _provider = None
            if _override is not None:
                _tracer = _override.get_tracer(TRACER_NAME)
            else:
                _tracer = _from_env()
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


# -- spans ------------------------------------------------------------------------------
class AttemptSpan:
    """Handle on an attempt's span (a no-op when tracing is off)."""

    def __init__(self, span: Any = None) -> None:
        self.span = span

    def set(self, key: str, value: Any) -> None:
        if self.span is not None and value is not None:
            self.span.set_attribute(key, value)

    def fail(self, description: str) -> None:
        """Mark the span as an error (fatal outcomes only, as in the reference)."""
        if self.span is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, description))


_OFF = AttemptSpan()


def _carrier(metadata: Mapping[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in metadata.items() if k.lower() in PROPAGATED}


@contextmanager
def attempt_span(
    request_id: str, queue_id: str, queue_name: str, retry_count: int, metadata: Mapping[str, str]
) -> Iterator[AttemptSpan]:
    """The ``process-request`` span of one attempt, child of the trace context in the
    request's ``metadata`` (if any), current for the block."""
    t = tracer()
    if t is None:
        yield _OFF
        return
    from opentelemetry.propagate import extract

    parent = extract(_carrier(metadata))
    attributes = {
        "request.id": request_id,
        "queue.id": queue_id,
        "queue.name": queue_name,
        "retry.count": retry_count,
    }
    with t.start_as_current_span("process-request", context=parent, attributes=attributes) as s:
        yield AttemptSpan(s)


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
