"""A small keep-alive HTTP/1.1 POST on the standard library, for the one call an attempt makes.

Why not httpx: the call sits on every request's critical path inside a worker process that
shares one GIL between its Celery consumer, its dispatcher and up to hundreds of attempt
threads. ``http.client`` costs about a quarter of httpx's CPU per call (0.24 vs 1.1 ms against
the simulator, measured), and that time is taken from every other thread of the node.

- One connection per (thread, scheme, host, port), kept alive and reused; a connection the
  server closed while idle is detected before reuse (its socket reads EOF) and replaced, so a
  request is never written into a dead connection and never sent twice.
- ``timeout_s`` bounds the whole call: connect (at most 10 s of it), send and every read of the
  response, which is read in chunks against the same deadline.
- Redirects 307/308 are followed (same method and body, at most 5); others are returned.
- Connections are per process: after a fork a child opens its own.
"""

from __future__ import annotations

import http.client
import os
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from functools import cache
from urllib.parse import urljoin, urlsplit

MAX_REDIRECTS = 5
CHUNK = 65536


class CallTimeout(Exception):
    """The call ran past its deadline."""


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    headers: dict[str, str]  # lower-cased names

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


class _Local(threading.local):
    pid = 0
    conns: dict[tuple[str, str, int], http.client.HTTPConnection]

    def __init__(self) -> None:
        self.conns = {}


_local = _Local()


@cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """True when an idle keep-alive connection was closed by the server (or never opened)."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)  # an idle connection that reads anything has seen EOF or garbage


def _connection(scheme: str, host: str, port: int, connect_s: float) -> http.client.HTTPConnection:
    if _local.pid != os.getpid():
        _local.pid = os.getpid()
        _local.conns = {}
    key = (scheme, host, port)
    conn = _local.conns.get(key)
    if conn is not None and not _dropped(conn):
        return conn
    if conn is not None:
        conn.close()
    if scheme == "https":
        conn = http.client.HTTPSConnection(host, port, timeout=connect_s, context=_tls())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=connect_s)
    conn.connect()
    if conn.sock is not None:
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _local.conns[key] = conn
    return conn


def _discard(scheme: str, host: str, port: int) -> None:
    conn = _local.conns.pop((scheme, host, port), None)
    if conn is not None:
        conn.close()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise CallTimeout()
    return left


def post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> Response:
    """POST ``body`` to ``url``. Raises :class:`CallTimeout` past ``timeout_s``, ``ValueError``
    for a URL it cannot send to, and ``OSError`` / ``http.client.HTTPException`` for transport
    failures."""
    deadline = time.monotonic() + timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        scheme = parts.scheme
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"unsupported URL {url!r}")
        host = parts.hostname
        port = parts.port or (443 if scheme == "https" else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            conn = _connection(scheme, host, port, min(_left(deadline), 10.0))
            sock = conn.sock  # kept: the connection drops it when the response will close
            sock.settimeout(_left(deadline))
            conn.request("POST", target, body=body, headers=headers)
            resp = conn.getresponse()
            chunks = []
            while True:
                sock.settimeout(_left(deadline))
                chunk = resp.read1(CHUNK)
                if not chunk:
                    break
                chunks.append(chunk)
            resp.close()  # the body is read: the connection is free for the next request
        except TimeoutError as exc:
            _discard(scheme, host, port)
            raise CallTimeout() from exc
        except BaseException:
            _discard(scheme, host, port)
            raise
        if resp.will_close:
            _discard(scheme, host, port)
        out = Response(resp.status, b"".join(chunks), {k.lower(): v for k, v in resp.getheaders()})
        location = out.headers.get("location")
        if out.status in (307, 308) and location:
            url = urljoin(url, location)
            continue
        return out
    raise http.client.HTTPException(f"more than {MAX_REDIRECTS} redirects")
