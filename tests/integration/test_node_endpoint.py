"""The node's ``/metrics`` / ``/healthz`` endpoint binds where ``PIPELINE_METRICS_HOST`` and
``PIPELINE_METRICS_PORT`` say (loopback unless told otherwise: docs/production.md, secrets)."""

from __future__ import annotations

import httpx
import pytest

from pipeline.config import load_settings
from pipeline.observability import health
from tests.observability import free_port


def test_the_endpoint_binds_to_the_configured_host(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("PIPELINE_METRICS_HOST", "127.0.0.2")
    monkeypatch.setenv("PIPELINE_METRICS_PORT", str(port))
    server = health.start_node(None, None, load_settings(env))
    try:
        assert server is not None and server.address == ("127.0.0.2", port)
        assert httpx.get(f"http://127.0.0.2:{port}/healthz", timeout=5).status_code == 200
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        health.stop_node()
