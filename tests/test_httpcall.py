"""The attempt's HTTP call (``pipeline.httpcall``) over real sockets: keep-alive reuse, a
connection the server closed while idle replaced before use (never a request sent twice),
the whole-call deadline, 307 redirects, and URLs it refuses."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from pipeline import httpcall
from pipeline.sim import SimServer

BODY = json.dumps({"model": "m", "prompt": "hi"}).encode()
JSON = {"Content-Type": "application/json"}


def completions(sim: SimServer) -> str:
    return sim.url + "/v1/completions"


def local_port() -> int:
    (conn,) = httpcall._local.conns.values()
    return int(conn.sock.getsockname()[1])


@pytest.fixture(autouse=True)
def _fresh_connections() -> Iterator[None]:
    for conn in httpcall._local.conns.values():
        conn.close()
    httpcall._local.conns = {}
    yield


def test_keep_alive_reuses_one_connection(sim: SimServer) -> None:
    first = httpcall.post(completions(sim), BODY, JSON, 5)
    port = local_port()
    second = httpcall.post(completions(sim), BODY, JSON, 5)
    assert first.status == second.status == 200
    assert json.loads(second.text)["object"] == "text_completion"
    assert local_port() == port


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
    assert httpcall.post(server.url, BODY, {}, 5).text == "ok"
    assert server.closed.wait(5)
    server.closed.clear()
    # the idle connection reads EOF: a new one is opened before the request is written
    assert httpcall.post(server.url, BODY, {}, 5).text == "ok"
    assert server.requests == 2  # each request sent exactly once
    server.sock.close()


def test_the_deadline_bounds_the_whole_call(sim: SimServer) -> None:
    stall = {**JSON, "x-sim-fail-first": "1", "x-sim-fail-mode": "stall"}
    with pytest.raises(httpcall.CallTimeout):
        httpcall.post(completions(sim), BODY, stall, 0.3)
    # the timed-out connection is dropped, the next call works
    assert httpcall.post(completions(sim), BODY, JSON, 5).status == 200


def test_a_307_is_followed_with_the_same_body(sim: SimServer) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def redirect() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        location = completions(sim).encode()
        conn.sendall(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: " + location)
        conn.sendall(b"\r\nContent-Length: 0\r\n\r\n")
        conn.close()

    threading.Thread(target=redirect, daemon=True).start()
    port = listener.getsockname()[1]
    resp = httpcall.post(f"http://127.0.0.1:{port}/old", BODY, JSON, 5)
    assert resp.status == 200 and json.loads(resp.text)["object"] == "text_completion"
    listener.close()


@pytest.mark.parametrize("url", ["ftp://example.com/x", "http:///nohost", "not a url"])
def test_urls_it_cannot_send_to(url: str) -> None:
    with pytest.raises(ValueError, match="unsupported URL"):
        httpcall.post(url, BODY, {}, 1)
