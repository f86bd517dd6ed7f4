"""Bad input at the HTTP door of ``pipeline serve``: every case gets OpenAI's error shape
with the status OpenAI uses, one WARNING line in the service's log (no traceback), and
nothing stored or half-written — no Redis key appeared, went or changed size
(``nothing_stored``), no file under the files directory. The requests are sent as raw bytes:
what a client puts on the wire (no Content-Type, a chunked body, a length it never sends) is
the point.

A batch runs on queue ``solo`` (nobody serves it) for the whole module: a cancel that got
through would change it."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pipeline.batch import Batches
from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.config import load_settings
from pipeline.serve.body import JSON_LIMIT, MAX_DEPTH
from pipeline.serve.upload import ENVELOPE_BYTES, MAX_PARTS
from pipeline.sim import SimServer
from tests.conftest import assert_idle, nothing_stored
from tests.integration.batch.conftest import ServeProc

MAX_FILE = 4096  # the services' PIPELINE_MAX_FILE_BYTES here
KEY = "sk-front-door-1"
ALLOWED = "batch.example.test"  # the keyed service's PIPELINE_ALLOWED_HOSTS
BOUNDARY = "d00r"


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def send(port: int, method: str, path: str, headers: dict[str, str] | None = None,
         body: bytes | None = None, chunks: list[bytes] | None = None,
         timeout: float = 30) -> Answer:  # fmt: skip
    """One request on its own connection, as bytes: ``body`` with its Content-Length (unless
    ``headers`` sets one), or ``chunks`` as a chunked body left open (no last chunk: a server
    must answer by then). Headers are sent as given: no Content-Type unless one is there."""
    head = {"host": f"127.0.0.1:{port}", "connection": "close", **(headers or {})}
    if body is not None and "content-length" not in head:
        head["content-length"] = str(len(body))
    if chunks is not None:
        head["transfer-encoding"] = "chunked"
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items())]
    wire = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")
    wire += b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks or [])
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(wire)
        got = b""
        while b"\r\n\r\n" not in got or len(got) < _end(got):
            data = s.recv(65536)  # the service answers, then closes (connection: close)
            if not data:
                break
            got += data
    top, _, rest = got.partition(b"\r\n\r\n")
    status_line, *header_lines = top.decode("latin-1").split("\r\n")
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in header_lines)}
    return Answer(int(status_line.split()[1]), hdrs, rest)


def _end(got: bytes) -> int:
    top, _, _ = got.partition(b"\r\n\r\n")
    for line in top.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            return len(top) + 4 + int(value)
    return 1 << 62  # read to the close


def multipart(*parts: tuple[str, str | None, bytes], end: bool = True) -> bytes:
    """A multipart/form-data body of (name, filename, value) parts."""
    out = b""
    for name, filename, value in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + value + b"\r\n"
    return out + (f"--{BOUNDARY}--\r\n".encode() if end else b"")


FORM = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
JSON = {"content-type": "application/json"}
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


@dataclass
class Door:
    """A service, what it serves from, and the module's running batch and uploaded file."""

    srv: ServeProc
    pl: Pipeline
    files_dir: Path
    batch_id: str = ""
    file_id: str = ""
    extra: dict[str, str] = field(default_factory=dict)  # headers every request carries

    def send(self, method: str, path: str, headers: dict[str, str] | None = None,
             **kw: Any) -> Answer:  # fmt: skip
        return send(self.srv.port, method, path, {**self.extra, **(headers or {})}, **kw)


def start(env: dict[str, str], tmp: Path, **extra: str) -> ServeProc:
    e = {**env, "PIPELINE_FILES_DIR": str(tmp / "files"), "PIPELINE_MAX_FILE_BYTES": str(MAX_FILE),
         "PIPELINE_BATCH_QUEUE": "solo", **extra}  # fmt: skip
    return ServeProc(e, tmp / "serve.log").start()


@pytest.fixture(scope="module")
def door(
    env: dict[str, str], sim: SimServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Door]:
    """The default service (no keys, loopback) with a batch in progress on queue ``solo``
    and an uploaded file. Afterwards a POST with no body and no Content-Type cancels the
    batch (the SDK's and curl's form of a cancel)."""
    tmp = tmp_path_factory.mktemp("door")
    p = Pipeline(load_settings(env))
    srv = start(env, tmp)
    d = Door(srv, p, tmp / "files")
    try:
        up = d.send("POST", "/v1/files", FORM, body=multipart(
            ("purpose", None, b"batch"), ("file", "in.jsonl", LINE)))  # fmt: skip
        assert up.status == 200, up
        d.file_id = up.json()["id"]
        lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "m", "messages": []}} for i in range(3)]  # fmt: skip
        d.batch_id = Batches(p).submit_batch(lines, queue="solo").id
        assert Batches(p).get(d.batch_id).status == "in_progress"
        yield d
        cancel = d.send("POST", f"/v1/batches/{d.batch_id}/cancel")
        assert cancel.status == 200 and cancel.json()["status"] == "cancelling", cancel
        wait_until(lambda: Batches(p).get(d.batch_id).status == "cancelled", 30, "cancelled")
        assert_idle(p)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def locked(
    env: dict[str, str], door: Door, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Door]:
    """A service with API keys and PIPELINE_ALLOWED_HOSTS, on the same Redis as ``door``."""
    tmp = tmp_path_factory.mktemp("locked")
    keys = tmp / "keys"
    keys.write_text(f"{KEY} tenant-a\n")
    srv = start(env, tmp, PIPELINE_API_KEYS=str(keys), PIPELINE_ALLOWED_HOSTS=ALLOWED)
    try:
        yield Door(srv, door.pl, tmp / "files", door.batch_id, door.file_id,
                   {"host": f"{ALLOWED}:{srv.port}"})  # fmt: skip
    finally:
        srv.stop()


def refused(d: Door, status: int, param: str | None = None, code: str | None = None,
            **request: Any) -> Answer:  # fmt: skip
    """Send ``request`` (method, path, headers, body...); check the refusal and that it stored
    nothing, and left one log line."""
    logged = d.srv.log.read_text()
    files = sorted(d.files_dir.iterdir())
    with nothing_stored(d.pl):
        got = d.send(**request)
    assert got.status == status, (got.status, got.body[:300])
    error = got.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert (error["param"], error["code"]) == (param, code), error
    assert got.headers["x-content-type-options"] == "nosniff"
    assert sorted(d.files_dir.iterdir()) == files  # no file, no temporary one left
    new = d.srv.log.read_text()[len(logged) :].splitlines()
    assert len(new) == 1 and f": {status} " in new[0] and "WARNING" in new[0], new
    assert Batches(d.pl).get(d.batch_id).status == "in_progress"
    return got


def batch_body(d: Door, **extra: Any) -> bytes:
    return json.dumps({"input_file_id": d.file_id, "endpoint": "/v1/chat/completions",
                       "completion_window": "24h", **extra}).encode()  # fmt: skip


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth - 1):
        value = {"a": value}
    return value


# -- content types: JSON POSTs take application/json, the upload multipart ------------------
@pytest.mark.parametrize(
    "headers",
    [{"content-type": "text/plain"}, {}, {"content-type": "application/x-www-form-urlencoded"}],
    ids=["text/plain", "none", "form-urlencoded"],
)
def test_create_takes_only_json(door: Door, headers: dict[str, str]) -> None:
    refused(door, 415, code="unsupported_media_type", method="POST", path="/v1/batches",
            headers=headers, body=batch_body(door))  # fmt: skip


@pytest.mark.parametrize(
    "headers",
    [{"content-type": "text/plain"}, FORM, {}],
    ids=["text/plain (a form)", "multipart", "none with a body"],
)
def test_cancel_takes_only_json(door: Door, headers: dict[str, str]) -> None:
    refused(door, 415, code="unsupported_media_type", method="POST",
            path=f"/v1/batches/{door.batch_id}/cancel", headers=headers,
            body=b'{"running": "abort", "x": "="}\r\n')  # fmt: skip


@pytest.mark.parametrize("headers", [JSON, {}], ids=["json", "none"])
def test_upload_takes_only_multipart(door: Door, headers: dict[str, str]) -> None:
    refused(door, 415, code="unsupported_media_type", method="POST", path="/v1/files",
            headers=headers, body=b'{"purpose": "batch"}')  # fmt: skip


# -- JSON bodies -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [b'{"input_file_id": ', b"[" * 100_000 + b"]" * 100_000, b"[]", b'"text"', b"\xff\xfe{}",
     b'{"running": ' + b"1" * 5000 + b"}"],
    ids=["truncated", "nested 100000", "array", "string", "not utf-8", "5000-digit number"],
)  # fmt: skip
def test_create_refuses_a_body_that_is_not_a_json_object(door: Door, body: bytes) -> None:
    refused(door, 400, method="POST", path="/v1/batches", headers=JSON, body=body)


def test_json_nested_past_the_depth_limit_is_refused(door: Door) -> None:
    """Within Python's recursion limit, but deeper than MAX_DEPTH, in a field the service
    ignores: the batch would be created otherwise."""
    body = batch_body(door, extra=nested(MAX_DEPTH + 1))
    got = refused(door, 400, method="POST", path="/v1/batches", headers=JSON, body=body)
    assert f"more than {MAX_DEPTH} deep" in got.json()["error"]["message"]


@pytest.mark.parametrize("running", ['"now"', '["abort"]', "null"])
def test_cancel_names_a_bad_running(door: Door, running: str) -> None:
    refused(door, 400, "running", method="POST", path=f"/v1/batches/{door.batch_id}/cancel",
            headers=JSON, body=b'{"running": %s}' % running.encode())  # fmt: skip


# -- query parameters -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "param"),
    [("/v1/batches?limit=%C2%B2", "limit"), ("/v1/batches?limit=0", "limit"),
     ("/v1/batches?limit=101", "limit"), ("/v1/files?limit=1e3", "limit"),
     ("/v1/files?limit=" + "9" * 5000, "limit"), ("/v1/files?order=x", "order"),
     ("/v1/batches?after=junk%00", "after"), ("/v1/files?after=file-nope", "after")],
    ids=["superscript two", "zero", "over the most", "1e3", "5000 digits", "order",
         "after (batches)", "after (files)"],
)  # fmt: skip
def test_bad_query_parameters_are_named(door: Door, path: str, param: str) -> None:
    refused(door, 400, param, method="GET", path=path)


# -- unknown ids and URLs, wrong methods ------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/batches/batch_nope"), ("POST", "/v1/batches/batch_nope/cancel"),
     ("GET", "/v1/files/file-nope"), ("GET", "/v1/files/file-nope/content"),
     ("DELETE", "/v1/files/file-nope"),
     ("GET", "/v1/requests/nope"), ("GET", "/v1/requests/nope/explain")],
)  # fmt: skip
def test_unknown_ids_are_404(door: Door, method: str, path: str) -> None:
    refused(door, 404, "id", method=method, path=path)


def test_an_unknown_input_file_is_named(door: Door) -> None:
    body = batch_body(door, input_file_id="file-nope")
    refused(door, 400, "input_file_id", method="POST", path="/v1/batches", headers=JSON,
            body=body)  # fmt: skip


def test_an_unknown_url_is_404_in_openai_shape(door: Door) -> None:
    refused(door, 404, code="unknown_url", method="GET", path="/v1/nothing")


@pytest.mark.parametrize(
    ("method", "path"),
    [("PUT", "/v1/batches"), ("DELETE", f"/v1/batches/{'{id}'}"), ("GET", "/v1/batches/x/cancel")],
)
def test_a_wrong_method_is_405_in_openai_shape(door: Door, method: str, path: str) -> None:
    got = refused(door, 405, method=method, path=path.replace("{id}", door.batch_id))
    assert got.headers["allow"]


# -- Host, Origin, Sec-Fetch-Site -------------------------------------------------------------
@pytest.mark.parametrize(
    "host",
    ["evil.test:{port}", "127.0.0.1:1", "localhost", "127.0.0.1:{port}@evil.test", ""],
    ids=["another name", "another port", "no port", "userinfo", "empty"],
)
def test_only_loopback_names_on_its_own_port_are_served(door: Door, host: str) -> None:
    """A DNS-rebound name reaches the service with its own Host: refused, even for a GET."""
    got = refused(door, 400, code="invalid_host", method="GET", path="/v1/batches",
                  headers={"host": host.format(port=door.srv.port)})  # fmt: skip
    assert door.batch_id not in got.body.decode()


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [("POST", "/v1/batches/{b}/cancel", {"origin": "http://127.0.0.1:1", **JSON}),
     ("POST", "/v1/batches/{b}/cancel", {"origin": "null", **JSON}),
     ("POST", "/v1/batches", {"sec-fetch-site": "cross-site", **JSON}),
     ("POST", "/v1/files", {"sec-fetch-site": "same-site", **FORM}),
     ("GET", "/v1/batches", {"sec-fetch-site": "cross-site", "sec-fetch-mode": "no-cors"})],
    ids=["cancel, another origin", "cancel, origin null", "create, cross-site",
         "upload, same-site (another port)", "list, a cross-site fetch"],
)  # fmt: skip
def test_cross_origin_browser_requests_are_refused(
    door: Door, method: str, path: str, headers: dict[str, str]
) -> None:
    body = None
    if method == "POST":
        body = batch_body(door) if path == "/v1/batches" else b'{"running": "abort"}'
        if path == "/v1/files":
            body = multipart(("purpose", None, b"batch"), ("file", "x.jsonl", LINE))
    refused(door, 403, code="cross_origin_request", method=method,
            path=path.format(b=door.batch_id), headers=headers, body=body)  # fmt: skip


def test_the_page_and_a_navigation_to_it_are_answered_with_security_headers(door: Door) -> None:
    """A link from another site opens the page (a top-level navigation is no attack: the
    page only reads, with its own origin's fetches); its policy runs no inline script."""
    got = door.send("GET", "/", {"sec-fetch-site": "cross-site", "sec-fetch-mode": "navigate"})
    assert got.status == 200
    assert got.headers["content-security-policy"].startswith("default-src 'self'")
    assert got.headers["x-frame-options"] == "DENY"
    assert got.headers["referrer-policy"] == "no-referrer"
    assert got.headers["x-content-type-options"] == "nosniff"
    assert b"<script>" not in got.body and b"<style>" not in got.body
    same = door.send("GET", "/ui/batches", {"sec-fetch-site": "same-origin"})
    assert same.status == 200 and same.headers["x-content-type-options"] == "nosniff"


# -- sizes ------------------------------------------------------------------------------------
def test_a_json_body_declared_too_large_is_refused_before_it_is_sent(door: Door) -> None:
    """Only the headers are sent: the answer comes without waiting for the body."""
    headers = {**JSON, "content-length": str(JSON_LIMIT + 1)}
    refused(door, 413, code="request_too_large", method="POST", path="/v1/batches",
            headers=headers, body=b"", timeout=10)  # fmt: skip


def test_a_chunked_json_body_is_cut_off_at_the_limit(door: Door) -> None:
    """No Content-Length: the service counts as it reads and answers once the body passes
    the limit, without the last chunk."""
    block = b" " * (64 * 1024)
    chunks = [block] * (JSON_LIMIT // len(block)) + [b"{"]
    refused(door, 413, code="request_too_large", method="POST",
            path=f"/v1/batches/{door.batch_id}/cancel", headers=JSON, chunks=chunks,
            timeout=10)  # fmt: skip


def test_an_upload_declared_too_large_is_refused_before_it_is_sent(door: Door) -> None:
    headers = {**FORM, "content-length": str(MAX_FILE + ENVELOPE_BYTES + 1)}
    refused(door, 413, "file", "file_too_large", method="POST", path="/v1/files",
            headers=headers, body=b"", timeout=10)  # fmt: skip


def test_a_chunked_upload_past_the_file_limit_is_cut_off(door: Door) -> None:
    body = multipart(("purpose", None, b"batch"), ("file", "x.jsonl", LINE * 100), end=False)
    refused(door, 413, "file", "file_too_large", method="POST", path="/v1/files", headers=FORM,
            chunks=[body], timeout=10)  # fmt: skip


def test_every_byte_of_an_upload_counts(door: Door) -> None:
    """A small file, then junk after the closing boundary, chunked: the whole body counts
    against the limit (plus the envelope), not only the file part."""
    body = multipart(("purpose", None, b"batch"), ("file", "x.jsonl", LINE))
    most = MAX_FILE + ENVELOPE_BYTES
    junk = b"\r\n" * ((most - len(body)) // 2 + 1)
    refused(door, 413, "file", "file_too_large", method="POST", path="/v1/files", headers=FORM,
            chunks=[body, junk], timeout=10)  # fmt: skip


def test_an_upload_of_many_small_fields_is_cut_off(door: Door) -> None:
    """381 MB of small fields once took the service from 197 to 448 MB: past MAX_PARTS parts
    it answers (without the rest of the body)."""
    parts = [(f"f{i}", None, b"v" * 100) for i in range(MAX_PARTS + 1)]
    got = refused(door, 400, method="POST", path="/v1/files", headers=FORM,
                  chunks=[multipart(*parts, end=False)], timeout=10)  # fmt: skip
    assert f"more than {MAX_PARTS} parts" in got.json()["error"]["message"]


def test_a_long_form_field_is_named(door: Door) -> None:
    body = multipart(("purpose", None, b"b" * 5000), ("file", "x.jsonl", LINE))
    refused(door, 400, "purpose", method="POST", path="/v1/files", headers=FORM, body=body)


# -- API keys: the key is checked before any body is read --------------------------------------
@pytest.mark.parametrize(
    ("path", "headers"),
    [("/v1/batches/{b}/cancel", JSON), ("/v1/batches/{b}/cancel", {"content-type": "text/plain"}),
     ("/v1/batches", JSON), ("/v1/files", FORM)],
    ids=["cancel", "cancel, text/plain", "create", "upload"],
)  # fmt: skip
def test_without_a_key_is_401_before_the_body(
    locked: Door, path: str, headers: dict[str, str]
) -> None:
    """The headers announce a body that never comes: the 401 cannot have waited for it."""
    headers = {**headers, "content-length": "100000"}
    refused(locked, 401, code="invalid_api_key", method="POST", path=path.format(b=locked.batch_id),
            headers=headers, body=b"", timeout=10)  # fmt: skip


def test_a_wrong_key_is_401_before_the_body(locked: Door) -> None:
    headers = {"authorization": "Bearer sk-wrong-key", "content-type": "text/plain"}
    refused(locked, 401, code="invalid_api_key", method="POST",
            path=f"/v1/batches/{locked.batch_id}/cancel", headers=headers,
            body=b'{"running": "abort"}')  # fmt: skip


def test_with_keys_the_allowed_hosts_are_served(locked: Door) -> None:
    """PIPELINE_ALLOWED_HOSTS set: its names (and loopback ones on the port) are served,
    other names are not — even with a valid key."""
    auth = {"authorization": f"Bearer {KEY}"}
    assert locked.send("GET", "/v1/batches", auth).status == 200
    port = locked.srv.port
    assert locked.send("GET", "/v1/batches", {**auth, "host": f"127.0.0.1:{port}"}).status == 200
    refused(locked, 400, code="invalid_host", method="GET", path="/v1/batches",
            headers={**auth, "host": f"other.example.test:{port}"})  # fmt: skip
    # with a key, a cross-site request of a browser (basic auth remembered) is refused too
    refused(locked, 403, code="cross_origin_request", method="POST",
            path=f"/v1/batches/{locked.batch_id}/cancel",
            headers={**auth, **JSON, "sec-fetch-site": "cross-site"},
            body=b'{"running": "abort"}')  # fmt: skip


def test_a_cancel_with_an_empty_json_body_is_accepted(door: Door) -> None:
    """What the OpenAI SDK sends for ``batches.cancel(id)``: Content-Type application/json and
    no body. (On a batch of its own: the module's batch must keep running.)"""
    b = Batches(door.pl).submit_batch(
        [{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
          "body": {"model": "m", "messages": []}}], queue="solo",
        batch_id=f"batch_door{uuid.uuid4().hex[:8]}")  # fmt: skip
    got = door.send("POST", f"/v1/batches/{b.id}/cancel", {**JSON, "content-length": "0"})
    assert got.status == 200 and got.json()["status"] == "cancelling", got
    wait_until(lambda: Batches(door.pl).get(b.id).status == "cancelled", 30, "cancelled")
