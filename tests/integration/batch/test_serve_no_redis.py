"""``pipeline serve`` whose Redis goes away: each call is OpenAI's 503 and one log line naming
the fix, never a traceback (a serve started without one exits 2: front_doors/test_cli.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from tests.integration.batch.conftest import ServeProc
from tests.redis_servers import lone_server


def test_a_call_after_the_redis_went_is_a_503_in_one_line(
    start_serve: Callable[..., ServeProc], tmp_path: Path
) -> None:
    with lone_server(tmp_path / "redis", "--maxmemory-policy", "noeviction") as server:
        url = server.url
        urls = {"PIPELINE_REDIS_URL": url, "CELERY_BROKER_URL": url, "CELERY_RESULT_BACKEND": url}
        serve = start_serve(**urls)
        assert httpx.get(serve.url + "/v1/batches", timeout=30).status_code == 200
    # the Redis is gone (lone_server stopped it)
    answer = httpx.get(serve.url + "/v1/batches", timeout=60)
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["type"] == "server_error" and "Redis" in error["message"]
    log = serve.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    (line,) = [x for x in log.splitlines() if "no Redis answers at" in x]
    assert "GET /v1/batches" in line and "`pipeline up`" in line
