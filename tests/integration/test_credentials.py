"""Per-queue credentials: an API key named by ``api_key_env`` and sent as ``Authorization:
Bearer …``, a private CA (``tls_ca_file``), a client certificate (``tls_cert_file`` +
``tls_key_file``, mTLS) and ``tls_insecure_skip_verify`` — against the simulator serving HTTPS
with a CA and client certificate made by the test, a real worker node and a real Redis.

The key must reach the server and nowhere else: not Redis, not the result, not the worker's
log, not ``pipeline status``, not the metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.config import QueueConfig, Settings, parse_queues
from pipeline.errors import ConfigError
from pipeline.http import call as httpcall
from pipeline.http.classify import Kind, send
from pipeline.sim import SimConfig, SimServer
from pipeline.worker import check_endpoints
from tests.conftest import ROOT, WorkerProc, assert_idle
from tests.integration.tls import Certs, make_certs
from tests.observability import isolated, scrape, start_node

BODY = json.dumps({"model": "m", "prompt": "hi"})
KEY_VAR = "PIPELINE_TEST_GATEWAY_KEY"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def secret() -> str:
    return f"sk-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def tls_sim(certs: Certs, secret: str) -> Iterator[SimServer]:
    """HTTPS, client certificates signed by ``certs.ca`` required, ``Bearer <secret>`` too."""
    config = SimConfig(
        api_key=secret,
        tls_cert_file=certs.server,
        tls_client_ca_file=certs.ca,
    )
    with SimServer(config) as server:
        yield server


@pytest.fixture(autouse=True)
def _fresh_connections() -> Iterator[None]:
    httpcall.close_all()
    yield
    httpcall.close_all()


def mtls(certs: Certs, ca: str | None = None) -> httpcall.TLS:
    return httpcall.TLS(ca or certs.ca, certs.client_cert, certs.client_key)


# -- the queue fields ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"api_key_env": "not a name"}, "api_key_env"),
        ({"api_key_env": "1ST"}, "api_key_env"),
        ({"api_key_env": 7}, "api_key_env"),
        ({"tls_ca_file": ""}, "tls_ca_file"),
        ({"tls_cert_file": ["a.pem"]}, "tls_cert_file"),
        ({"tls_key_file": "k.pem"}, "tls_key_file needs tls_cert_file"),
        ({"tls_insecure_skip_verify": "yes"}, "tls_insecure_skip_verify"),
        ({"tls_ca_file": "ca.pem", "igw_base_url": "http://gw"}, "need an https igw_base_url"),
    ],
)
def test_bad_credential_fields_name_the_queue_and_field(extra: dict[str, Any], field: str) -> None:
    entry = {"queue_name": "gw", "igw_base_url": "https://gw", **extra}
    with pytest.raises(ConfigError, match=rf"\(gw\): .*{field}"):
        parse_queues([entry], "queues.json")


def settings_with(**fields: Any) -> Settings:
    q = QueueConfig(queue_name="gw", igw_base_url="https://gw.example", **fields)
    return Settings(queues={"gw": q})


def test_a_missing_key_variable_or_unloadable_file_names_the_queue(
    certs: Certs, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=f"queue 'gw': api_key_env: .*{KEY_VAR} is not set"):
        check_endpoints(settings_with(api_key_env=KEY_VAR), environ={})
    with pytest.raises(ConfigError, match=f"{KEY_VAR} is not set"):
        check_endpoints(settings_with(api_key_env=KEY_VAR), environ={KEY_VAR: ""})
    assert check_endpoints(settings_with(api_key_env=KEY_VAR), environ={KEY_VAR: "k"}) == []
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ConfigError, match=f"queue 'gw': tls_ca_file: cannot load {missing}"):
        check_endpoints(settings_with(tls_ca_file=missing))
    not_pem = tmp_path / "garbage.pem"
    not_pem.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="queue 'gw': tls_cert_file / tls_key_file"):
        check_endpoints(settings_with(tls_cert_file=str(not_pem)))
    # the client's key without its certificate, the other way round, does not load either
    with pytest.raises(ConfigError, match="tls_cert_file / tls_key_file"):
        check_endpoints(settings_with(tls_cert_file=certs.client_key))
    assert (
        check_endpoints(
            settings_with(
                tls_ca_file=certs.ca, tls_cert_file=certs.client_cert, tls_key_file=certs.client_key
            )  # fmt: skip
        )
        == []
    )
    (warning,) = check_endpoints(settings_with(tls_insecure_skip_verify=True))
    assert "'gw'" in warning and "tls_insecure_skip_verify" in warning


# -- the HTTP call --------------------------------------------------------------------------
def test_connections_are_kept_apart_by_tls_settings(
    tls_sim: SimServer, certs: Certs, secret: str
) -> None:
    """One thread, one server: a connection made with the right CA is never reused by a call
    whose settings name the wrong one — that call fails its own handshake, clearly."""
    url = tls_sim.url + "/v1/completions"
    auth = {"Authorization": f"Bearer {secret}"}
    before = tls_sim.stats()["connections"]
    assert send(url, BODY, auth, 5, mtls(certs)).status_code == 200
    wrong = send(url, BODY, auth, 5, mtls(certs, certs.other_ca))
    assert wrong.kind is Kind.RETRY and wrong.category == "TLS", wrong
    assert wrong.error is not None
    assert wrong.error.startswith(f"TLS certificate verify failed for 127.0.0.1:{tls_sim.port}")
    assert send(url, BODY, auth, 5, mtls(certs)).status_code == 200
    assert tls_sim.stats()["connections"] - before == 1  # the right CA's, kept alive


def test_mtls_needs_the_client_certificate(tls_sim: SimServer, certs: Certs, secret: str) -> None:
    url = tls_sim.url + "/v1/completions"
    auth = {"Authorization": f"Bearer {secret}"}
    out = send(url, BODY, auth, 5, httpcall.TLS(certs.ca))  # no client certificate
    assert out.kind is Kind.RETRY and not out.responded, out
    assert send(url, BODY, auth, 5, mtls(certs)).status_code == 200


def test_insecure_skip_verify_accepts_a_server_of_an_unknown_ca(
    tls_sim: SimServer, certs: Certs, secret: str
) -> None:
    url = tls_sim.url + "/v1/completions"
    auth = {"Authorization": f"Bearer {secret}"}
    # the system's CAs do not know the test's CA
    assert (
        send(url, BODY, auth, 5, httpcall.TLS(None, certs.client_cert, certs.client_key)).category
        == "TLS"
    )
    skip = httpcall.TLS(None, certs.client_cert, certs.client_key, insecure_skip_verify=True)
    assert send(url, BODY, auth, 5, skip).status_code == 200


def test_the_simulator_refuses_a_missing_or_wrong_key(tls_sim: SimServer, certs: Certs) -> None:
    url = tls_sim.url + "/v1/completions"
    before = tls_sim.stats()["unauthorized"]
    for headers in ({}, {"Authorization": "Bearer nope"}):
        out = send(url, BODY, headers, 5, mtls(certs))
        assert out.status_code == 401 and out.kind is Kind.FATAL
    assert tls_sim.stats()["unauthorized"] - before == 2


# -- through a worker node -----------------------------------------------------------------
def redis_holds(client: redis.Redis, needle: bytes) -> list[str]:
    """Keys of the whole database whose value contains ``needle`` (every type read whole).

    Pipelined in chunks: the shared test database may hold many keys of earlier runs, and a
    round trip per key would take a minute there."""
    read = {
        b"string": lambda p, k: p.get(k),
        b"hash": lambda p, k: p.hgetall(k),
        b"list": lambda p, k: p.lrange(k, 0, -1),
        b"set": lambda p, k: p.smembers(k),
        b"zset": lambda p, k: p.zrange(k, 0, -1),
        b"stream": lambda p, k: p.xrange(k),
    }
    found: list[str] = []
    keys = list(client.scan_iter(count=10_000))
    for i in range(0, len(keys), 5_000):
        chunk = keys[i : i + 5_000]
        with client.pipeline(transaction=False) as pipe:
            for key in chunk:
                pipe.type(key)
            kinds = pipe.execute()
        with client.pipeline(transaction=False) as pipe:
            readable = [(k, t) for k, t in zip(chunk, kinds, strict=True) if t in read]
            for key, kind in readable:
                read[kind](pipe, key)
            values = pipe.execute()
        for (key, _), value in zip(readable, values, strict=True):
            if needle in _flatten(value):
                found.append(key.decode(errors="replace"))
    return found


def _flatten(value: Any) -> bytes:
    """The bytes of a reply of any shape, joined (a hash's keys and values, a list's items)."""
    if value is None:
        return b""
    if isinstance(value, bytes):
        return value
    if isinstance(value, dict):
        return b"\0".join(_flatten(k) + b"=" + _flatten(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        return b"\0".join(_flatten(v) for v in value)
    return str(value).encode()


def test_api_key_and_mtls_reach_the_server_and_nothing_else(
    env: dict[str, str],
    tls_sim: SimServer,
    certs: Certs,
    secret: str,
    start_worker: Callable[..., WorkerProc],
    tmp_path: Path,
) -> None:
    creds = {"tls_ca_file": certs.ca, "tls_cert_file": certs.client_cert,
             "tls_key_file": certs.client_key}  # fmt: skip
    iso = isolated(
        env,
        tmp_path,
        [
            {"queue_name": "gw", "igw_base_url": tls_sim.url, "api_key_env": KEY_VAR, **creds},
            # the same server through the wrong CA: never sent, whatever the open connections
            {
                "queue_name": "wrongca",
                "igw_base_url": tls_sim.url,
                "api_key_env": KEY_VAR,
                **creds,
                "tls_ca_file": certs.other_ca,
            },  # fmt: skip
        ],
    )
    assert KEY_VAR not in iso.env  # the client submits without the key
    # one slot: every call goes out of the same thread, past the same open connections
    w, port = start_node(start_worker, iso, concurrency=1, extra_env={KEY_VAR: secret})
    pl, gw = iso.pl, iso.queue("gw")
    refused = tls_sim.stats()["unauthorized"]
    marker = f"prompt-{uuid.uuid4().hex}"
    # the caller's own Authorization (in any letter case) loses to the queue's key
    first = pl.submit({"prompt": marker}, queue=gw, headers={"aUtHoRiZaTiOn": "Bearer mine"})
    res = first.result(timeout=20)
    assert res.ok and res.status_code == 200, res
    late = pl.submit({"prompt": marker}, queue=iso.queue("wrongca"), timeout=3)
    failed = late.result(timeout=20)
    assert failed.error_code == "DEADLINE_EXCEEDED", failed
    assert "TLS certificate verify failed for 127.0.0.1" in (failed.error_message or ""), failed
    assert failed.attempts >= 2, failed  # a TLS failure is retried like any transport error
    again = pl.submit({"prompt": marker}, queue=gw).result(timeout=20)
    assert again.ok, again
    assert tls_sim.stats()["unauthorized"] == refused  # every call carried the queue's key
    assert_idle(pl)

    needle = secret.encode()
    client = redis.Redis.from_url(iso.env["PIPELINE_REDIS_URL"])
    assert redis_holds(client, needle) == []
    for r in (res, failed, again):
        assert secret not in json.dumps(r.to_dict())
    status = subprocess.run(
        [sys.executable, "-m", "pipeline", "status"], env={**iso.env, "COLUMNS": "200"},
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    as_json = subprocess.run(
        [sys.executable, "-m", "pipeline", "status", "--json"], env=iso.env,
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert gw in status.stdout and gw in as_json.stdout
    metrics = scrape(port)
    assert metrics
    w.stop()
    log = w.log.read_text()
    assert "pipeline dispatcher started" in log
    for text in (status.stdout, status.stderr, as_json.stdout, log, json.dumps(metrics)):
        assert secret not in text


def test_a_missing_key_variable_stops_the_worker_naming_the_queue(
    env: dict[str, str], sim: SimServer, tmp_path: Path
) -> None:
    iso = isolated(env, tmp_path, [{"queue_name": "gw", "igw_base_url": sim.url,
                                    "api_key_env": KEY_VAR}])  # fmt: skip
    worker_env = {k: v for k, v in iso.env.items() if k != KEY_VAR}
    out = subprocess.run(
        [sys.executable, "-m", "pipeline", "worker", "--pools", iso.pool(), "-c", "1"],
        env=worker_env, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"pipeline: queue {iso.queue('gw')!r}: api_key_env: the environment variable "
        f"{KEY_VAR} is not set (or empty) in this worker"
    )
    assert KEY_VAR not in os.environ


def test_pipeline_sim_serves_https_with_client_certificates_and_a_key(
    certs: Certs, secret: str
) -> None:
    """``pipeline sim --tls-cert --tls-client-ca --api-key-env``: the command-line form."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "sim", "--port", "0", "--tls-cert", certs.server,
         "--tls-client-ca", certs.ca, "--api-key-env", KEY_VAR],
        env={**os.environ, KEY_VAR: secret}, cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("simulator listening on https://127.0.0.1:"), line
        url = line.rpartition(" ")[2] + "/v1/completions"
        assert (
            send(url, BODY, {"Authorization": f"Bearer {secret}"}, 5, mtls(certs)).status_code
            == 200
        )
        assert send(url, BODY, {}, 5, mtls(certs)).status_code == 401
        assert (
            send(url, BODY, {"Authorization": f"Bearer {secret}"}, 5, httpcall.TLS(certs.ca)).kind
            is Kind.RETRY
        )
    finally:
        proc.terminate()
        proc.wait(10)
    missing = subprocess.run(
        [sys.executable, "-m", "pipeline", "sim", "--api-key-env", KEY_VAR],
        env={k: v for k, v in os.environ.items() if k != KEY_VAR}, cwd=ROOT,
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert missing.returncode != 0 and f"{KEY_VAR} is not set" in missing.stderr
