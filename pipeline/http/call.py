"""The one HTTP client: an attempt's POST to a model server, a metric gate's GET. The request
is written in one ``sendall`` on a socket kept alive here; the response is parsed by llhttp
(Node.js's HTTP parser, via ``httptools``).

Hand-written: every HTTP library measured cost more worker CPU per request than the 5 % bound
``bench/overhead.py`` checks (figures: BENCHMARKS.md).

What this module keeps:

- One connection per (thread, scheme, host, port, TLS settings), kept alive; one the server
  closed while idle is found before reuse (its socket reads EOF) and replaced, so a request is
  never written into a dead connection nor sent twice. Two queues with different :class:`TLS`
  never share a connection. A child process opens its own after a fork.
- HTTPS verifies the server against the system CAs or a queue's CA file and presents a client
  certificate for mTLS: one ``ssl.SSLContext`` per settings value, kept until :func:`reset_tls`.
- ``timeout_s`` bounds the whole call: every connect (at most 10 s), send and read gets what
  is left of one deadline.
- What it cannot write it refuses before connecting (:class:`~pipeline.http.rules.Unsendable`,
  a ``ValueError``), by the rules of :mod:`pipeline.http.rules`, which ``submit`` checks too: a
  header name that is not a token, a value holding CR, LF, NUL or another control character
  or a character outside Latin-1 (a request's own headers cannot split the request), a URL
  holding a space, a control or a non-ASCII character, a head over ``MAX_HEAD_BYTES``.
  Content-Length is its own; the framing and connection headers it is given are dropped.
- Redirects are returned unless the caller follows them (a queue's ``follow_redirects``), and
  then only a 307/308, with the same method and body, at most 5, to the first URL's origin
  (scheme, host and port) or one the caller lists (a queue's ``redirect_origins``); to any
  other origin it is refused (:class:`RedirectRefused`). One to another origin goes without
  ``Authorization``, cookies and every header naming a key, token, secret or session
  (:func:`foreign_headers`), and without the client certificate; https -> http is refused.
- A response body over ``max_response_bytes`` ends the call (:class:`ResponseTooLarge`): on
  its ``Content-Length`` before reading, else as soon as that many bytes came.
- A call made under :func:`abortable` can be ended from another thread (:meth:`Abort.fire`,
  a cancel): its connection is shut down, which a model server (vLLM, SGLang, llama.cpp) takes
  as the client hanging up, and stops generating; the call raises :class:`CallAborted`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import SplitResult, urljoin, urlsplit

import httptools

from ..redact import redact_url
from .rules import (
    BAD_VALUE,
    CONNECTION_HEADERS,
    MAX_HEAD_BYTES,
    TOKEN,
    Unsendable,
    url_error,
    value_error,
)

MAX_REDIRECTS = 5
MAX_RESPONSE_BYTES = 16 * 1024 * 1024  # a queue's default max_response_bytes
CHUNK = 65536
MAX_HEAD = 65536  # bytes of status line + headers
SELECT_MAX_FD = 1024  # FD_SETSIZE: select() takes no descriptor from here on
# header names that carry a credential: never sent to another origin
_CREDENTIAL = re.compile(r"authorization|cookie|key|token|secret|session|passw|credential|auth")


class CallTimeout(Exception):
    """The call ran past its deadline."""


class CallAborted(OSError):
    """The call's :class:`Abort` fired: its connection was shut down."""


class RedirectRefused(ValueError):
    """A redirect that is not followed: to an origin neither the first URL's nor listed,
    https -> http, a scheme other than http(s), a URL it cannot write, or more than
    :data:`MAX_REDIRECTS` in a row."""


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


_ConnKey = tuple[str, str, int, TLS]


class Abort:
    """Ends the calls made under :func:`abortable` from any thread: :meth:`fire` shuts down the
    connection of the one in flight (a blocked read returns at once) and every later one
    raises :class:`CallAborted` before it sends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.fired = False

    def fire(self) -> bool:
        """Abort; True the first time."""
        with self._lock:
            if self.fired:
                return False
            self.fired = True
            sock = self._sock
        if sock is not None:  # closed already (OSError): the call is over
            with contextlib.suppress(OSError):  # the plain socket's, also under TLS
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
        return True

    def _attach(self, sock: socket.socket | None) -> None:
        with self._lock:
            if self.fired and sock is not None:
                raise CallAborted("the call was aborted")
            self._sock = sock


class _Local(threading.local):
    pid = 0
    conns: dict[_ConnKey, socket.socket]
    abort: Abort | None = None

    def __init__(self) -> None:
        self.conns = {}


_local = _Local()


# one context per settings value; a race builds two, one is kept
tls_context = functools.cache(TLS.context)


def reset_tls() -> None:
    """Forget the built contexts, so the next new connection loads the files again (after a
    certificate rotation and a config reload). Open connections are kept."""
    tls_context.cache_clear()


def close_all() -> None:
    """Close this thread's kept-alive connections."""
    for sock in _local.conns.values():
        sock.close()
    _local.conns = {}


@contextmanager
def abortable(abort: Abort) -> Iterator[Abort]:
    """Calls this thread makes inside the block end when ``abort`` fires."""
    prev, _local.abort = _local.abort, abort
    try:
        yield abort
    finally:
        _local.abort = prev


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise CallTimeout()
    return left


def _idle(sock: socket.socket) -> bool:
    """An idle kept-alive connection is still usable: it has nothing to read (a connection
    that reads anything has seen EOF, or garbage). ``select`` refuses descriptors past 1024,
    which a node with thousands of slots has: ``poll`` looks at those."""
    try:
        if sock.fileno() < SELECT_MAX_FD:
            return not select.select([sock], [], [], 0)[0]
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return not poller.poll(0)
    except (OSError, ValueError):
        return False


def _connection(key: _ConnKey, deadline: float) -> socket.socket:
    """The thread's idle connection for ``key`` (taken out until the call puts it back), or a
    new one."""
    if _local.pid != os.getpid():
        _local.pid, _local.conns = os.getpid(), {}
    sock = _local.conns.pop(key, None)
    if sock is not None:
        if _idle(sock):
            return sock
        sock.close()
    scheme, host, port, tls = key
    sock = socket.create_connection((host, port), timeout=min(_left(deadline), 10.0))
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if scheme == "https":
            sock = tls_context(tls).wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise
    return sock


def _request(method: str, target: str, host: str, body: bytes, headers: dict[str, str]) -> bytes:
    """The request's bytes; :class:`Unsendable` for what breaks :mod:`pipeline.http.rules`."""
    lines = [f"{method} {target} HTTP/1.1"]
    if not any(k.lower() == "host" for k in headers):
        lines.append(f"Host: {host}")
    if body or method != "GET":
        lines.append(f"Content-Length: {len(body)}")
    for name, value in headers.items():
        value = str(value)
        if not TOKEN.fullmatch(name):
            raise Unsendable(f"invalid header name {name!r}")
        if not (value.isascii() and value.isprintable()) and BAD_VALUE.search(value):
            raise Unsendable(f"invalid value for header {name!r}: {value_error(value)}")
        if name.lower() in CONNECTION_HEADERS:
            continue
        lines.append(f"{name}: {value}")
    lines.append("\r\n")
    head = "\r\n".join(lines)
    if len(head) > MAX_HEAD_BYTES:
        raise Unsendable(f"request head of {len(head)} bytes, over {MAX_HEAD_BYTES}")
    return head.encode("latin-1") + body


class _Parsed:
    """llhttp's callbacks, keeping the final response's status, headers and body (an interim
    1xx passes by). They never raise (llhttp would wrap the error): a body over the limit is
    flagged ``over``, and :func:`_exchange` raises."""

    def __init__(self, limit: int) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.limit, self.status, self.size = limit, 0, 0
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.final = self.done = self.keep = self.over = False

    def on_message_begin(self) -> None:
        self.keep = False  # a message after the final response: the connection is not reused
        if not self.done:
            self.headers = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.done:
            self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if not self.done:
            self.status = self.parser.get_status_code()
            self.final = self.status >= 200
            self.over = self.final and int(self.headers.get("content-length", 0)) > self.limit

    def on_body(self, body: bytes) -> None:
        if not self.done:
            self.size += len(body)
            self.over = self.over or self.size > self.limit
            if not self.over:
                self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.final and not self.done:
            self.done, self.keep = True, self.parser.should_keep_alive()

    def ended_by_close(self) -> bool:
        """At EOF: whether the connection's close is what ends this body."""
        chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        return self.final and "content-length" not in self.headers and not chunked


def _exchange(key: _ConnKey, request: bytes, deadline: float, limit: int) -> _Parsed:
    """Send ``request`` on the thread's connection for ``key`` and read the response; the
    connection is kept for the next call when the response says it may be."""
    sock = _connection(key, deadline)
    out = _Parsed(limit)
    abort = _local.abort
    try:
        if abort is not None:
            abort._attach(sock)
        _round_trip(sock, request, deadline, out)
    except BaseException as exc:
        sock.close()
        if abort is not None and abort.fired:
            raise CallAborted("the call was aborted") from exc
        raise
    finally:
        if abort is not None:
            abort._attach(None)
    if out.keep and not (abort is not None and abort.fired):
        _local.conns[key] = sock
    else:
        sock.close()
    return out


def _round_trip(sock: socket.socket, request: bytes, deadline: float, out: _Parsed) -> None:
    """Write ``request`` and feed the response to ``out`` until it is complete."""
    sock.settimeout(_left(deadline))
    sock.sendall(request)
    head = 0
    while not out.done:
        sock.settimeout(_left(deadline))
        data = sock.recv(CHUNK)
        if not data:
            if out.ended_by_close():
                break
            raise ConnectionError("the server closed the connection before the response ended")
        try:
            out.parser.feed_data(data)
        except httptools.HttpParserError:
            if not out.done:
                raise
            out.keep = False  # bytes after the final response: the connection goes
        if out.over:
            raise ResponseTooLarge(out.limit)
        if not out.final and (head := head + len(data)) > MAX_HEAD:
            raise httptools.HttpParserError(f"response head over {MAX_HEAD} bytes")


def foreign_headers(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` without the ones a redirect must not carry to another origin:
    ``Authorization``, ``Proxy-Authorization``, ``Cookie`` and any whose name holds key, token,
    secret, session, password, credential or auth (``api-key``, ``x-api-key``,
    ``x-auth-token``, ...), in any letter case."""
    return {k: v for k, v in headers.items() if not _CREDENTIAL.search(k.lower())}


def _origin(parts: SplitResult) -> tuple[str, str, int]:
    scheme = parts.scheme
    return scheme, parts.hostname or "", parts.port or (443 if scheme == "https" else 80)


def request(
    method: str,
    url: str,
    body: bytes,
    headers: dict[str, str],
    timeout_s: float,
    tls: TLS | None = None,
    *,
    follow_redirects: bool = False,
    redirect_origins: Sequence[str] = (),
    max_response_bytes: int = MAX_RESPONSE_BYTES,
) -> Response:
    """Send ``method`` (an attempt's POST, a metric gate's GET) with ``body`` to ``url`` (an
    https URL with ``tls``, default: verified against the system's CAs). Raises
    :class:`CallTimeout` past ``timeout_s``; ``ValueError`` for a URL it cannot send to or
    TLS files it cannot load, :class:`~pipeline.http.rules.Unsendable` for a request it cannot
    write, :class:`RedirectRefused` and :class:`ResponseTooLarge` (all ``ValueError``); and
    ``OSError`` (``ssl.SSLError`` included) / ``httptools.HttpParserError`` for transport
    failures. A 3xx is returned as it came unless ``follow_redirects``, and then followed only
    to ``url``'s origin or one of ``redirect_origins`` (``scheme://host[:port]``; see the
    module's notes)."""
    deadline = time.monotonic() + timeout_s
    tls = tls or TLS()
    first = urlsplit(url)
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"unsupported URL {redact_url(url)!r}")
        wrong = url_error(url)
        if wrong is not None:
            raise Unsendable(f"URL {url_text(url)} {wrong}")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        data = _request(method, target, parts.netloc.rpartition("@")[2], body, headers)
        try:
            out = _exchange((*_origin(parts), tls), data, deadline, max_response_bytes)
        except TimeoutError as exc:
            raise CallTimeout() from exc
        location = out.headers.get("location")
        if not (follow_redirects and out.status in (307, 308) and location):
            body = b"".join(out.chunks)
            out.chunks.clear()  # out and its parser hold each other: freed only by the cyclic GC
            return Response(out.status, body, out.headers)
        url = urljoin(url, location)
        to = urlsplit(url)
        if to.scheme not in ("http", "https"):
            raise RedirectRefused(f"redirect to a {to.scheme or 'relative'} URL refused")
        where = f"{to.hostname}:{_origin(to)[2]}"
        if parts.scheme == "https" and to.scheme != "https":
            raise RedirectRefused(f"redirect from https to plain http ({where}) refused")
        if url_error(url) is not None:
            raise RedirectRefused(f"redirect to a URL it cannot send ({where}) refused")
        if _origin(to) != _origin(first):
            if _origin(to) not in {_origin(urlsplit(o)) for o in redirect_origins}:
                raise RedirectRefused(
                    f"redirect to another origin ({to.scheme}://{where}) refused: not in the "
                    "queue's redirect_origins"
                )
            # no credential, and no ``Host`` of the caller's (the new origin's own is sent)
            headers = {k: v for k, v in foreign_headers(headers).items() if k.lower() != "host"}
            tls = TLS(tls.ca_file)  # no client certificate, and the new server is verified
    raise RedirectRefused(f"more than {MAX_REDIRECTS} redirects")


def url_text(url: str) -> str:
    """``url`` for a message: its credentials hidden (:func:`redact_url`), cut at 200
    characters."""
    return repr(redact_url(url)[:200])
