"""The attempt's HTTP call (``pipeline.http.call``) over real sockets: keep-alive reuse, a
connection the server closed while idle replaced before use (never a request sent twice),
the whole-call deadline (also against a response that trickles in), URLs it refuses, every way
a response body is framed (length, chunked, the connection's close), interim 1xx responses, a
broken response as a retriable transport error, and what it cannot write (headers that would
split the request, values outside Latin-1, URLs with a space, a control or a non-ASCII
character, a head over 64 KiB): refused before connecting, never retried.
Redirects and the response-size limit: tests/integration/test_redirects.py."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httptools
import pytest

from pipeline.http import call as httpcall
from pipeline.http.classify import UNSENDABLE, Kind, send
from pipeline.http.rules import MAX_HEAD_BYTES, Unsendable
from pipeline.sim import SimConfig, SimServer
from tests.integration.tls import make_certs

BODY = json.dumps({"model": "m", "prompt": "hi"}).encode()
JSON = {"Content-Type": "application/json"}


def completions(sim: SimServer) -> str:
    return sim.url + "/v1/completions"


def local_port() -> int:
    (sock,) = httpcall._local.conns.values()
    return int(sock.getsockname()[1])


@pytest.fixture(autouse=True)
def _fresh_connections() -> Iterator[None]:
    httpcall.close_all()
    yield
    httpcall.close_all()


def test_keep_alive_reuses_one_connection(sim: SimServer) -> None:
    first = httpcall.request("POST", completions(sim), BODY, JSON, 5)
    port = local_port()
    second = httpcall.request("POST", completions(sim), BODY, JSON, 5)
    assert first.status == second.status == 200
    assert json.loads(second.text)["object"] == "text_completion"
    assert local_port() == port


def test_keep_alive_reuses_a_connection_numbered_past_1024(sim: SimServer) -> None:
    """A node at -c 1024 and more has sockets numbered past FD_SETSIZE (1024), where
    ``select()`` refuses to look: the idle check must still find the connection alive, not
    open a new one for every call."""
    spare = []
    try:
        while not spare or spare[-1] < 1100:  # push the next descriptors past 1024
            spare.append(os.open(os.devnull, os.O_RDONLY))
        httpcall.request("POST", completions(sim), BODY, JSON, 5)
        (sock,) = httpcall._local.conns.values()
        assert sock.fileno() > 1024
        port = local_port()
        assert httpcall.request("POST", completions(sim), BODY, JSON, 5).status == 200
        assert local_port() == port
    finally:
        for fd in spare:
            os.close(fd)


def _post_and_port(url: str) -> int:
    assert httpcall.request("POST", url, BODY, JSON, 5).status == 200
    return local_port()


def test_a_forked_child_opens_its_own_connection(sim: SimServer) -> None:
    """A child forked with the parent's kept connection in memory (a prefork pool) must not
    write into that socket: both would read each other's responses."""
    assert httpcall.request("POST", completions(sim), BODY, JSON, 5).status == 200
    port = local_port()
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply(_post_and_port, (completions(sim),)) != port
    assert httpcall.request("POST", completions(sim), BODY, JSON, 5).status == 200
    assert local_port() == port  # the parent's connection, untouched


def test_reset_tls_makes_new_connections_load_the_files_again(tmp_path: Path) -> None:
    """The CA file is rotated under a running worker: connections opened after ``reset_tls``
    (a config reload) use the new file; until then the built context, and open connections
    stay as they are."""
    certs = make_certs(tmp_path)
    ca = tmp_path / "rotating-ca.pem"
    shutil.copy(certs.ca, ca)
    tls = httpcall.TLS(str(ca))
    with SimServer(SimConfig(tls_cert_file=certs.server)) as server:
        url = completions(server)
        assert httpcall.request("POST", url, BODY, JSON, 5, tls).status == 200
        shutil.copy(certs.other_ca, ca)  # a CA that did not sign the server's certificate
        httpcall.close_all()
        assert httpcall.request("POST", url, BODY, JSON, 5, tls).status == 200  # the built context
        httpcall.reset_tls()
        assert (
            httpcall.request("POST", url, BODY, JSON, 5, tls).status == 200
        )  # the open connection
        httpcall.close_all()
        out = send(url, BODY.decode(), JSON, 5, tls)
        assert (out.kind, out.category) == (Kind.RETRY, "TLS")
        assert "certificate verify failed" in (out.error or "")


class OneShotServer:
    """Answers one request per connection with keep-alive headers, then closes it: what a
    server does to an idle keep-alive connection it times out."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.requests = 0
        self.closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/x"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            data = b""
            while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < len(BODY):
                data += conn.recv(65536)
            self.requests += 1
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok"
            )
            conn.close()
            self.closed.set()


def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    server = OneShotServer()
    assert httpcall.request("POST", server.url, BODY, {}, 5).text == "ok"
    assert server.closed.wait(5)
    server.closed.clear()
    # the idle connection reads EOF: a new one is opened before the request is written
    assert httpcall.request("POST", server.url, BODY, {}, 5).text == "ok"
    assert server.requests == 2  # each request sent exactly once
    server.sock.close()


def test_the_deadline_bounds_the_whole_call(sim: SimServer) -> None:
    stall = {**JSON, "x-sim-fail-first": "1", "x-sim-fail-mode": "stall"}
    with pytest.raises(httpcall.CallTimeout):
        httpcall.request("POST", completions(sim), BODY, stall, 0.3)
    # the timed-out connection is dropped, the next call works
    assert httpcall.request("POST", completions(sim), BODY, JSON, 5).status == 200


def test_a_trickling_response_ends_at_the_deadline() -> None:
    """A server that sends a byte every 20 ms never lets one read time out: the call still
    ends at its deadline (0.5 s), not after the 20 s the body would take."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        with contextlib.suppress(OSError):
            while not done.wait(0.02):
                conn.sendall(b"x")
        conn.close()

    threading.Thread(target=trickle, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/x"
    try:
        with pytest.raises(httpcall.CallTimeout):
            httpcall.request("POST", url, BODY, {}, 0.5)
    finally:
        done.set()
        listener.close()


@pytest.mark.parametrize("url", ["ftp://example.com/x", "http:///nohost", "not a url"])
def test_urls_it_cannot_send_to(url: str) -> None:
    with pytest.raises(ValueError, match="unsupported URL"):
        httpcall.request("POST", url, BODY, {}, 1)


class ScriptedServer:
    """Reads each request (head + Content-Length body) of one connection and answers it with
    the next scripted raw response; closes the connection after the last one. Records the
    raw requests."""

    def __init__(self, *responses: bytes) -> None:
        self.responses = list(responses)
        self.requests: list[bytes] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/x?a=1"

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        data = b""
        for response in self.responses:
            while True:
                head, sep, rest = data.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                if sep and len(rest) >= length:
                    break
                data += conn.recv(65536)
            self.requests.append(head + sep + rest[:length])
            data = rest[length:]
            conn.sendall(response)
        conn.close()
        self.sock.close()


@pytest.mark.parametrize(
    ("raw", "body"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", b"hello"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3;ext=1\r\nhel\r\n2\r\nlo\r\n0\r\nX-Trailer: t\r\n\r\n",
            b"hello",
        ),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello, until close", b"hello, until close"),
        (b"HTTP/1.0 200 OK\r\n\r\nhello", b"hello"),
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
            b"ok",
        ),
        (b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n", b""),
    ],
    ids=["length", "chunked", "close", "http-1.0", "interim-100", "no-content"],
)
def test_every_way_a_body_is_framed(raw: bytes, body: bytes) -> None:
    server = ScriptedServer(raw)
    resp = httpcall.request("POST", server.url, BODY, {"X-Mine": "1"}, 5)
    assert resp.body == body
    assert resp.status in (200, 201, 204)
    head = server.requests[0]
    assert head.startswith(b"POST /x?a=1 HTTP/1.1\r\n")
    assert f"Content-Length: {len(BODY)}".encode() in head and b"X-Mine: 1" in head
    assert head.endswith(b"\r\n\r\n" + BODY)


def test_two_responses_on_one_connection_are_read_apart() -> None:
    server = ScriptedServer(
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nX-N: 1\r\n\r\none",
        b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\nX-N: 2\r\n\r\n3\r\ntwo\r\n0\r\n\r\n",
    )
    first = httpcall.request("POST", server.url, BODY, {}, 5)
    second = httpcall.request("POST", server.url, BODY, {}, 5)
    assert (first.status, first.body, first.headers["x-n"]) == (200, b"one", "1")
    assert (second.status, second.body, second.headers["x-n"]) == (503, b"two", "2")
    assert len(server.requests) == 2


@pytest.mark.parametrize(
    "raw",
    [b"", b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", b"garbage\r\n\r\n"],
    ids=["no-response", "short-body", "bad-status-line"],
)
def test_a_broken_response_is_a_transport_error(raw: bytes) -> None:
    with pytest.raises((OSError, httptools.HttpParserError)):
        httpcall.request("POST", ScriptedServer(raw).url, BODY, {}, 5)
    out = send(ScriptedServer(raw).url, BODY.decode(), {}, 5)
    assert (out.kind, out.category, out.status_code) == (Kind.RETRY, "TRANSPORT", None)


@pytest.mark.parametrize(
    "headers",
    [
        {"X-A": "1\r\nX-Injected: 1"},
        {"X-A": "1\nX-Injected: 1"},
        {"Bad Name": "1"},
        {"X-A\r\n": "1"},
        {"Authorization": "Bearer sk-1\r\nX-Injected: 1"},
    ],
)
def test_headers_that_would_split_the_request_are_refused(headers: dict[str, str]) -> None:
    """Refused before connecting (port 9 listens to nobody), naming the header, never quoting
    its value (a key)."""
    with pytest.raises(ValueError, match="header") as refused:
        httpcall.request("POST", "http://127.0.0.1:9/x", BODY, {"X-Ok": "1", **headers}, 1)
    (name,) = headers
    assert repr(name) in str(refused.value) and "sk-1" not in str(refused.value)


@pytest.mark.parametrize(
    "headers",
    [
        {"X-A": "中文"},  # not Latin-1: encoding it raised UnicodeEncodeError mid-call
        {"x-request-id": "请求-1"},
        {"X-A": "bell\x07"},
        {"X-A": "nul\x00"},
        {"X-Big": "h" * MAX_HEAD_BYTES},
    ],
    ids=["not-latin-1", "id-not-latin-1", "control", "nul", "head-over-64k"],
)
def test_what_it_cannot_write_is_unsendable(headers: dict[str, str]) -> None:
    with pytest.raises(Unsendable, match="header|head") as refused:
        httpcall.request("POST", "http://127.0.0.1:9/x", BODY, headers, 1)
    assert "中文" not in str(refused.value) and "请求" not in str(refused.value)
    out = send("http://127.0.0.1:9/x", BODY.decode(), headers, 1)
    assert (out.kind, out.category, out.status_code) == (Kind.FATAL, UNSENDABLE, None)


@pytest.mark.parametrize(
    "path",
    ["/v1/a b", "/v1/comp\r\nletions", "/v1/comp\nletions", "/v1/comp\tletions", "/v1/é"],
    ids=["space", "crlf", "lf", "tab", "non-ascii"],
)
def test_a_url_it_cannot_write_is_unsendable(sim: SimServer, path: str) -> None:
    """``urlsplit`` drops CR, LF and TAB: the request went out to another path than given."""
    before = sim.stats()["requests"]
    with pytest.raises(Unsendable, match="URL"):
        httpcall.request("POST", sim.url + path, BODY, JSON, 5)
    assert sim.stats()["requests"] == before


def test_a_tab_inside_a_value_and_latin_1_text_go_out(sim: SimServer) -> None:
    resp = httpcall.request("POST", completions(sim), BODY, {**JSON, "X-Note": "naïve\tok"}, 5)
    assert resp.status == 200
