"""A small keep-alive HTTP/1.1 POST over a plain (or TLS) socket, for the one call an attempt
makes.

Why not httpx, or ``http.client``: the call sits on every request's critical path inside a
worker process that shares one GIL between its Celery consumer, its dispatcher and up to
hundreds of attempt threads. httpx cost 1.1 ms of CPU per call against the simulator,
``http.client`` 0.18-0.24 ms (its response headers go through the ``email`` parser); this
module writes the request in one ``sendall`` and parses the response itself: ~0.03 ms.

- One connection per (thread, scheme, host, port, TLS settings), kept alive and reused; a
  connection the server closed while idle is detected before reuse (its socket reads EOF) and
  replaced, so a request is never written into a dead connection and never sent twice. Two
  queues with different :class:`TLS` settings never share a connection, even to one server.
- HTTPS verifies the server against the system CAs, or a queue's own CA file; a client
  certificate is presented for mTLS (:class:`TLS`; one ``ssl.SSLContext`` per settings value,
  built once and kept until :func:`reset_tls`).
- ``timeout_s`` bounds the whole call: connect (at most 10 s of it), send and every read of the
  response, which is read in chunks against the same deadline.
- The response body is framed by ``Content-Length``, ``Transfer-Encoding: chunked`` or the
  connection's close; interim 1xx responses are skipped.
- Header names must be tokens and values must not hold CR, LF or NUL (``ValueError``), so a
  request's own headers cannot split the request.
- Redirects are returned, not followed, unless the caller asks (a queue's
  ``follow_redirects``): then a 307/308 is followed with the same method and body (at most 5).
  One to another origin (scheme, host or port) goes without ``Authorization``, cookies and
  every header that names a key, token, secret or session (:func:`foreign_headers`), and
  without the client certificate; https -> http is refused (:class:`RedirectRefused`).
- A response body over ``max_response_bytes`` ends the call (:class:`ResponseTooLarge`)
  before more than that is held in memory.
- Connections are per process: after a fork a child opens its own.
"""

from __future__ import annotations

import http.client
import os
import re
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from urllib.parse import SplitResult, urljoin, urlsplit

MAX_REDIRECTS = 5
MAX_RESPONSE_BYTES = 16 * 1024 * 1024  # a queue's default max_response_bytes
CHUNK = 65536
MAX_HEAD = 65536  # bytes of status line + headers
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\r\n\x00]")
# header names that carry a credential: never sent to another origin
_CREDENTIAL = re.compile(r"authorization|cookie|key|token|secret|session|passw|credential|auth")


class CallTimeout(Exception):
    """The call ran past its deadline."""


class RedirectRefused(ValueError):
    """A redirect that is not followed: https -> http, a scheme other than http(s), or more
    than :data:`MAX_REDIRECTS` in a row."""


class ResponseTooLarge(ValueError):
    """The response body is longer than the call's ``max_response_bytes``."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"response body larger than max_response_bytes ({limit} bytes)")


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    headers: dict[str, str]  # lower-cased names

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


class _Conn:
    """One keep-alive connection and the bytes read past the last response."""

    __slots__ = ("sock", "buf")

    def __init__(self, sock: socket.socket) -> None:
        self.sock: socket.socket | None = sock
        self.buf = b""

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None


@dataclass(frozen=True)
class TLS:
    """How an HTTPS connection is set up: the CA bundle that verifies the server (None: the
    system's), a client certificate and key (mTLS), or no verification at all."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure_skip_verify: bool = False

    def context(self) -> ssl.SSLContext:
        """A new context; ``ValueError`` naming the field (``tls_ca_file``, ``tls_cert_file``)
        when a file cannot be loaded."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"tls_ca_file: cannot load {self.ca_file}: {exc}") from None
        if self.cert_file:
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file)
            except (OSError, ssl.SSLError) as exc:
                files = " / ".join(f for f in (self.cert_file, self.key_file) if f)
                raise ValueError(
                    f"tls_cert_file / tls_key_file: cannot load {files}: {exc}"
                ) from None
        if self.insecure_skip_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


SYSTEM_TLS = TLS()
_ConnKey = tuple[str, str, int, TLS]


class _Local(threading.local):
    pid = 0
    conns: dict[_ConnKey, _Conn]

    def __init__(self) -> None:
        self.conns = {}


_local = _Local()
_contexts: dict[TLS, ssl.SSLContext] = {}
_contexts_lock = threading.Lock()


def tls_context(tls: TLS) -> ssl.SSLContext:
    """The process's context for ``tls`` (built on first use)."""
    ctx = _contexts.get(tls)
    if ctx is None:
        with _contexts_lock:
            ctx = _contexts.get(tls)
            if ctx is None:
                ctx = _contexts[tls] = tls.context()
    return ctx


def reset_tls() -> None:
    """Forget the built contexts, so the next new connection loads the files again (after a
    certificate rotation and a config reload). Open connections are kept."""
    with _contexts_lock:
        _contexts.clear()


def _dropped(conn: _Conn) -> bool:
    """True when an idle keep-alive connection was closed by the server (or never opened)."""
    sock = conn.sock
    if sock is None or conn.buf:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)  # an idle connection that reads anything has seen EOF or garbage


def _connection(key: _ConnKey, connect_s: float) -> _Conn:
    if _local.pid != os.getpid():
        _local.pid = os.getpid()
        _local.conns = {}
    scheme, host, port, tls = key
    conn = _local.conns.get(key)
    if conn is not None and not _dropped(conn):
        return conn
    if conn is not None:
        conn.close()
    sock = socket.create_connection((host, port), timeout=connect_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if scheme == "https":
            sock = tls_context(tls).wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise
    conn = _local.conns[key] = _Conn(sock)
    return conn


def _discard(key: _ConnKey) -> None:
    conn = _local.conns.pop(key, None)
    if conn is not None:
        conn.close()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise CallTimeout()
    return left


def _request(target: str, host: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"POST {target} HTTP/1.1"]
    if not any(k.lower() == "host" for k in headers):
        lines.append(f"Host: {host}")
    lines.append(f"Content-Length: {len(body)}")
    for name, value in headers.items():
        value = str(value)
        if not _TOKEN.fullmatch(name):
            raise ValueError(f"invalid header name {name!r}")
        if _BAD_VALUE.search(value):
            raise ValueError(f"invalid value for header {name!r}")
        if name.lower() in ("content-length", "transfer-encoding"):
            continue
        lines.append(f"{name}: {value}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("latin-1") + body


class _Reader:
    """Reads a response off a connection against a deadline."""

    def __init__(self, conn: _Conn, deadline: float, max_body: int) -> None:
        assert conn.sock is not None
        self.conn = conn
        self.sock = conn.sock
        self.deadline = deadline
        self.max_body = max_body

    def _check(self, size: int) -> None:
        if size > self.max_body:
            raise ResponseTooLarge(self.max_body)

    def _more(self) -> bytes:
        self.sock.settimeout(_left(self.deadline))
        return self.sock.recv(CHUNK)

    def until(self, mark: bytes, limit: int) -> bytes:
        """Bytes up to ``mark`` (consumed, not returned)."""
        conn = self.conn
        while True:
            i = conn.buf.find(mark)
            if i >= 0:
                out, conn.buf = conn.buf[:i], conn.buf[i + len(mark) :]
                return out
            if len(conn.buf) > limit:
                raise http.client.LineTooLong("response head")
            data = self._more()
            if not data:
                if conn.buf:
                    raise http.client.IncompleteRead(conn.buf)
                raise http.client.RemoteDisconnected(
                    "Remote end closed connection without response"
                )
            conn.buf += data

    def exactly(self, n: int) -> bytes:
        conn = self.conn
        while len(conn.buf) < n:
            data = self._more()
            if not data:
                raise http.client.IncompleteRead(conn.buf, n - len(conn.buf))
            conn.buf += data
        out, conn.buf = conn.buf[:n], conn.buf[n:]
        return out

    def to_close(self) -> bytes:
        chunks = [self.conn.buf]
        size = len(self.conn.buf)
        self.conn.buf = b""
        while data := self._more():
            size += len(data)
            self._check(size)
            chunks.append(data)
        self._check(size)
        return b"".join(chunks)

    def chunked(self) -> bytes:
        chunks: list[bytes] = []
        total = 0
        while True:
            size_line = self.until(b"\r\n", 1024).split(b";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                raise http.client.HTTPException(f"bad chunk size {size_line[:20]!r}") from None
            if size == 0:
                while self.until(b"\r\n", MAX_HEAD):  # trailers, then the blank line
                    pass
                return b"".join(chunks)
            total += size
            self._check(total)
            chunks.append(self.exactly(size))
            self.exactly(2)


def _read_response(conn: _Conn, deadline: float, max_body: int) -> tuple[Response, bool]:
    """The response and whether the connection must close after it."""
    reader = _Reader(conn, deadline, max_body)
    while True:
        head = reader.until(b"\r\n\r\n", MAX_HEAD).decode("latin-1")
        status_line, _, rest = head.partition("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise http.client.BadStatusLine(status_line[:100])
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in rest.split("\r\n") if rest else ():
            name, sep, value = line.partition(":")
            if not sep:
                raise http.client.HTTPException(f"bad header line {line[:100]!r}")
            headers[name.strip().lower()] = value.strip()
        if 100 <= status < 200:
            continue  # an interim response (100 Continue, 103 Early Hints)
        break
    connection = headers.get("connection", "").lower()
    close = "close" in connection or (parts[0] == "HTTP/1.0" and "keep-alive" not in connection)
    if status in (204, 304):
        body = b""
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        body = reader.chunked()
    elif "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise http.client.HTTPException("bad Content-Length") from None
        reader._check(length)
        body = reader.exactly(length)
    else:
        body, close = reader.to_close(), True
    return Response(status, body, headers), close


def foreign_headers(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` without the ones a redirect must not carry to another origin:
    ``Authorization``, ``Proxy-Authorization``, ``Cookie`` and any whose name holds key, token,
    secret, session, password, credential or auth (``api-key``, ``x-api-key``,
    ``x-auth-token``, ...), in any letter case."""
    return {k: v for k, v in headers.items() if not _CREDENTIAL.search(k.lower())}


def _origin(parts: SplitResult) -> tuple[str, str, int]:
    scheme = parts.scheme
    return scheme, parts.hostname or "", parts.port or (443 if scheme == "https" else 80)


def post(
    url: str,
    body: bytes,
    headers: dict[str, str],
    timeout_s: float,
    tls: TLS | None = None,
    *,
    follow_redirects: bool = False,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
) -> Response:
    """POST ``body`` to ``url`` (an https URL with ``tls``, default: verified against the
    system's CAs). Raises :class:`CallTimeout` past ``timeout_s``; ``ValueError`` for a URL it
    cannot send to or TLS files it cannot load, :class:`RedirectRefused` and
    :class:`ResponseTooLarge` (both ``ValueError``); and ``OSError`` (``ssl.SSLError``
    included) / ``http.client.HTTPException`` for transport failures. A 3xx is returned as it
    came unless ``follow_redirects`` (see the module's notes)."""
    deadline = time.monotonic() + timeout_s
    tls = tls or SYSTEM_TLS
    first = urlsplit(url)
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        scheme = parts.scheme
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"unsupported URL {url!r}")
        _, host, port = _origin(parts)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = _request(target, parts.netloc.rpartition("@")[2], body, headers)
        key = (scheme, host, port, tls)
        try:
            conn = _connection(key, min(_left(deadline), 10.0))
            assert conn.sock is not None
            conn.sock.settimeout(_left(deadline))
            conn.sock.sendall(request)
            out, close = _read_response(conn, deadline, max_response_bytes)
        except TimeoutError as exc:
            _discard(key)
            raise CallTimeout() from exc
        except BaseException:
            _discard(key)
            raise
        if close:
            _discard(key)
        location = out.headers.get("location")
        if not (follow_redirects and out.status in (307, 308) and location):
            return out
        url = urljoin(url, location)
        to = urlsplit(url)
        if to.scheme not in ("http", "https"):
            raise RedirectRefused(f"redirect to a {to.scheme or 'relative'} URL refused")
        if scheme == "https" and to.scheme != "https":
            where = f"{to.hostname}:{to.port or 80}"
            raise RedirectRefused(f"redirect from https to plain http ({where}) refused")
        if _origin(to) != _origin(first):
            headers = foreign_headers(headers)
            tls = TLS(tls.ca_file)  # no client certificate, and the new server is verified
    raise RedirectRefused(f"more than {MAX_REDIRECTS} redirects")
