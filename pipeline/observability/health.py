"""The worker node's ``/metrics``, ``/healthz`` and ``/readyz`` (docs/observability.md,
"Health"), from its main process; a port that is taken is logged and the node runs on."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import redis
from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from ..config import Settings
from ..store import connect
from . import metrics
from .collectors import scrape_registry

log = logging.getLogger("pipeline.health")

PING_TIMEOUT_S = 3.0
ReadyCheck = Callable[[], str | None]  # None when ready, else why not


class NodeServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on one port, in a daemon thread."""

    def __init__(
        self,
        settings: Settings,
        host: str,
        port: int,
        *,
        dispatchers: list[Any] | None = None,
        checks: list[ReadyCheck] | None = None,
    ) -> None:
        self.checks = list(checks or [])
        self.stopping = threading.Event()
        self._redis = connect(
            settings.redis_url,
            sentinel_master=settings.redis_sentinel_master,
            timeout=PING_TIMEOUT_S,
            decode_responses=False,
        )
        self._metrics = make_wsgi_app(scrape_registry(settings, dispatchers))
        self.httpd = make_server(host, port, self._app, ThreadingWSGIServer, _LogHandler)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> NodeServer:
        threading.Thread(
            target=self.httpd.serve_forever, name="pipeline-metrics", daemon=True
        ).start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._redis.close()

    def not_ready(self) -> str | None:
        """Why the node is not ready (shutting down, no PING answer, a check's reason), or None."""
        if self.stopping.is_set():
            return "shutting down"
        try:
            self._redis.ping()
        except redis.RedisError as exc:
            return f"redis unreachable: {type(exc).__name__}"
        for check in self.checks:
            try:
                reason = check()
            except Exception as exc:  # noqa: BLE001 - a failing check means not ready
                reason = f"{type(exc).__name__}: {exc}"
            if reason:
                return reason
        return None

    def _app(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        data: dict[str, Any] = {"error": "not found", "paths": ["/metrics", "/healthz", "/readyz"]}
        status = 404
        if path == "/metrics":
            try:
                return list(self._metrics(environ, start_response))
            except Exception as exc:  # noqa: BLE001 - answer 500, keep serving
                log.warning("metrics scrape failed: %s", exc)
                status, data = 500, {"error": f"scrape failed: {type(exc).__name__}"}
        elif path == "/healthz":
            status, data = 200, {"status": "ok"}
        elif path == "/readyz":
            reason = self.not_ready()
            status, data = 503, {"status": "not ready", "reason": reason}
            if reason is None:
                status, data = 200, {"status": "ready"}
        body = (json.dumps(data) + "\n").encode()
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        start_response(f"{status} {HTTPStatus(status).phrase}", headers)
        return [body]


class _LogHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        log.debug("%s %s", self.address_string(), format % args)


_node_server: NodeServer | None = None


def _consuming(worker: Any) -> str | None:
    consumer = getattr(worker, "consumer", None)
    if consumer is None:
        return "consumer not started"
    conn = getattr(consumer, "connection", None)
    if conn is None or not getattr(conn, "connected", False):
        return "broker not connected"
    if getattr(consumer, "task_consumer", None) is None:
        return "not consuming"
    return None


def _dispatching(dispatchers: list[Any]) -> str | None:
    for dispatcher in dispatchers:
        thread = getattr(dispatcher, "_thread", None)
        if thread is None or not thread.is_alive():
            return "dispatcher not running"
    return None


def start_node(worker: Any, dispatchers: list[Any], settings: Settings) -> NodeServer | None:
    """Start the node's endpoint for a Celery worker and its dispatchers (main process; one
    per pool on a Redis Cluster)."""
    global _node_server
    port = metrics.port_from_env()
    if port == 0:
        return None
    host = os.environ.get("PIPELINE_METRICS_HOST") or metrics.DEFAULT_HOST
    try:
        server = NodeServer(
            settings,
            host,
            port,
            dispatchers=dispatchers,
            checks=[lambda: _dispatching(dispatchers), lambda: _consuming(worker)],
        ).start()
    except OSError as exc:
        log.warning("metrics endpoint not started on %s:%d: %s", host, port, exc)
        return None
    _node_server = server
    from celery.signals import worker_shutting_down

    worker_shutting_down.connect(_on_shutting_down, weak=False)
    log.info("metrics, healthz and readyz on http://%s:%d", *server.address)
    return server


def _on_shutting_down(**_: Any) -> None:
    if _node_server is not None:
        _node_server.stopping.set()


def stop_node() -> None:
    global _node_server
    server, _node_server = _node_server, None
    if server is not None:
        server.stop()
