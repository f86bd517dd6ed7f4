"""What a worker logs about a request (docs/observability.md, "Logs"): never a body unless
``PIPELINE_LOG_BODIES=1``; JSON lines carry the running attempt's fields (:func:`bind`)."""

from __future__ import annotations

import contextvars
import json
import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

LOG_FORMATS = ("text", "json")
_FIELDS = ("request_id", "queue", "attempt", "status", "attempts", "latency_s")
_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "pipeline_log_context", default=None
)


def log_bodies() -> bool:
    """``PIPELINE_LOG_BODIES=1``: logs (and Celery's view of a result) may show bodies."""
    return os.environ.get("PIPELINE_LOG_BODIES", "").strip().lower() in ("1", "true", "yes", "on")


def log_format() -> str:
    """``PIPELINE_LOG_FORMAT``: ``text`` (default) or ``json``; anything else is ``text``."""
    raw = os.environ.get("PIPELINE_LOG_FORMAT", "").strip().lower()
    return raw if raw in LOG_FORMATS else "text"


def bind(**fields: Any) -> None:
    """Add fields to this thread's (or task's) log context."""
    current = _context.get()
    _context.set({**(current or {}), **{k: v for k, v in fields.items() if v is not None}})


def clear() -> None:
    _context.set(None)


def result_summary(result: Mapping[str, Any], bodies: bool = False) -> dict[str, Any]:
    """The loggable part of a terminal result (the wire form of ``Result``), as Celery's
    "Task … succeeded" line and Flower show it: id, status or error code, attempts, latency."""
    out: dict[str, Any] = {"id": result.get("id")}
    if result.get("status_code") is not None:
        out["status_code"] = result["status_code"]
    if result.get("error_code"):
        out["error_code"] = result["error_code"]
    out["attempts"] = result.get("attempts")
    submitted, finished = result.get("submitted_at"), result.get("finished_at")
    if isinstance(submitted, int | float) and isinstance(finished, int | float):
        out["latency_s"] = round(max(0.0, finished - submitted), 3)
    if bodies:
        out["payload"] = result.get("payload")
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per line; without bound fields the request id comes from Celery's own
    ``extra={"data": {"id": ...}}`` (its "received" and "succeeded" lines)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
            "thread": record.threadName,
        }
        fields = _context.get()
        if fields:
            out.update((k, fields[k]) for k in _FIELDS if k in fields)
        data = getattr(record, "data", None)
        if "request_id" not in out and isinstance(data, dict) and data.get("id"):
            out["request_id"] = str(data["id"])
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class LineHandler(logging.StreamHandler):
    """A stream handler that writes each record as one ``write(2)`` of the whole line on the
    stream's file descriptor, without a lock. On a node with dozens of attempt threads, the
    stock handler holds its lock across the write, and every thread that logs meanwhile
    queues behind it and then for the GIL: Celery's per-attempt "succeeded" line cost ~10 %
    of a node's CPU at full speed (bench/overhead.py), about half of it this convoy. One
    ``write`` of a line is not interleaved with another's (a pipe up to PIPE_BUF, a file on
    Linux always), and nothing is buffered, so a killed node loses no line it logged."""

    fd = 2  # the stream's file descriptor (set by :meth:`replacing`)

    def createLock(self) -> None:  # noqa: N802 - logging's name
        self.lock = None

    def flush(self) -> None:
        """Nothing is buffered here (the stream's own buffer is flushed when taken over)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = (self.format(record) + self.terminator).encode("utf-8", "backslashreplace")
            while data:
                data = data[os.write(self.fd, data) :]
        except Exception:  # noqa: BLE001 - logging's own rule: report, never raise
            self.handleError(record)

    @classmethod
    def replacing(cls, handler: logging.Handler) -> logging.Handler:
        """``handler`` as a :class:`LineHandler` when it is a plain stream handler on a stream
        with a file descriptor (stderr, stdout, an open file), with its level, formatter and
        filters; any other handler as it is."""
        stream = getattr(handler, "stream", None)
        if type(handler) is not logging.StreamHandler or stream is None:
            return handler
        try:
            fd = stream.fileno()
            stream.flush()
        except (OSError, ValueError, AttributeError):  # no descriptor (a StringIO): keep it
            return handler
        line = cls(stream)
        line.fd = fd
        line.setLevel(handler.level)
        line.setFormatter(handler.formatter)
        line.filters = list(handler.filters)
        return line


def use_line_handlers(logger: logging.Logger) -> None:
    """Replace ``logger``'s plain stream handlers by :class:`LineHandler`s."""
    logger.handlers = [LineHandler.replacing(h) for h in logger.handlers]


def use_json(logger: logging.Logger) -> None:
    formatter = JsonFormatter()
    for handler in logger.handlers:
        handler.setFormatter(formatter)
