"""Secrets and transport: Redis URLs with a password (plain and TLS, ``rediss://``) work end to
end, and the password never appears in worker logs or in ``pipeline status``."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.cli.services import free_port, redis_reachable, wait_until
from pipeline.client import Pipeline
from pipeline.config import load_settings
from pipeline.redact import redact_url
from pipeline.sim import SimServer
from tests.conftest import NODE_START_S, ROOT
from tests.redis_servers import lone_server, one_node_cluster

PASSWORD = "s3cret-" + uuid.uuid4().hex[:8]


@pytest.fixture(params=["redis", "rediss"])
def secured_redis(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A private redis-server that requires a password (and TLS for ``rediss``)."""
    server = shutil.which("redis-server")
    assert server, "redis-server is required"
    port = free_port()
    argv = [
        server,
        "--save",
        "",
        "--appendonly",
        "no",
        "--bind",
        "127.0.0.1",
        "--requirepass",
        PASSWORD,
    ]
    if request.param == "rediss":
        key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                str(key),
                "-out",
                str(cert),
                "-days",
                "1",
                "-subj",
                "/CN=127.0.0.1",
            ],
            check=True,
            capture_output=True,
        )
        argv += [
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
        ]
        url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_cert_reqs=none"
    else:
        argv += ["--port", str(port)]
        url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: redis_reachable(url, 0.3), 10, "secured redis-server")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_password_urls_work_and_never_leak(
    secured_redis: str, sim: SimServer, tmp_path: Path
) -> None:
    assert PASSWORD not in redact_url(secured_redis)
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if not k.startswith(("PIPELINE_", "CELERY_"))
    }
    env.update(
        PIPELINE_REDIS_URL=secured_redis, PIPELINE_ENDPOINT=sim.url, PIPELINE_KEY_PREFIX="sec:"
    )
    log = tmp_path / "worker.log"
    with open(log, "wb") as fh:
        worker = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "worker", "-c", "4", "--loglevel", "DEBUG"],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    try:
        pl = Pipeline(load_settings(env))
        req = pl.submit({"prompt": "secret"}, timeout=60)
        assert req.result(timeout=NODE_START_S + 30).ok  # the worker starts meanwhile
        status = subprocess.run(
            [sys.executable, "-m", "pipeline", "status", "--json"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert "default" in status.stdout
        assert PASSWORD not in status.stdout + status.stderr
        table = subprocess.run(
            [sys.executable, "-m", "pipeline", "status"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert table.returncode == 0 and "127.0.0.1" in table.stdout, table.stderr
        assert "***" in table.stdout and PASSWORD not in table.stdout + table.stderr
    finally:
        worker.terminate()
        worker.wait(30)
    text = log.read_text(errors="replace")
    assert "pipeline dispatcher started" in text
    assert PASSWORD not in text


# -- every URL form, every place a URL is shown (issue 45, item 4) -------------------------------
@pytest.fixture(params=["query", "cluster"])
def password_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A Redis that requires PASSWORD, named with the password as ``?password=`` (a standalone
    server) or as the userinfo of a ``redis+cluster://`` URL listing two seeds (a one-node
    cluster, by two names)."""
    if request.param == "query":
        with lone_server(tmp_path / "redis", password=PASSWORD) as server:
            yield f"redis://127.0.0.1:{server.port}/0?password={PASSWORD}"
    else:
        with one_node_cluster(tmp_path / "cluster", password=PASSWORD) as node:
            # two seeds, as a cluster URL usually lists: host:port,host:port
            yield f"redis+cluster://:{PASSWORD}@127.0.0.1:{node.port},localhost:{node.port}"


def test_status_and_serve_never_show_the_password(
    password_url: str, env: dict[str, str], tmp_path: Path
) -> None:
    """``pipeline status`` (table and JSON) and ``pipeline serve``'s start-up line at INFO
    name the Redis without its password, whether it is a ``?password=`` parameter or a
    cluster URL's userinfo (which made the redaction itself raise: status and serve crashed)."""
    cli_env = {
        **{k: v for k, v in env.items() if k != "PIPELINE_QUEUES"},  # one queue, any Redis
        "PIPELINE_ENDPOINT": "http://127.0.0.1:9",
        "PIPELINE_REDIS_URL": password_url,
        "PIPELINE_KEY_PREFIX": f"sec{uuid.uuid4().hex[:6]}:",
        "PIPELINE_FILES_DIR": str(tmp_path / "files"),
    }
    shown = redact_url(password_url)
    assert PASSWORD not in shown and "***" in shown
    for args in (["status", "--json"], ["status"]):
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline", *args],
            env=cli_env, cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert PASSWORD not in proc.stdout + proc.stderr
    assert f"redis: {shown}" in proc.stdout, proc.stdout  # the table's first line
    log = tmp_path / "serve.log"
    with open(log, "wb") as fh:
        serve = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "serve", "--port", str(free_port())],
            env=cli_env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until(
            lambda: serve.poll() is not None or "serving on" in log.read_text(),
            60,
            "pipeline serve's start-up line",
        )
    finally:
        serve.terminate()
        serve.wait(30)
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]
    [line] = [x for x in text.splitlines() if "serving on" in x]
    assert " INFO " in line and f"(redis {shown}," in line, line
    assert PASSWORD not in text
