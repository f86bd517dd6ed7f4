"""OpenAI-compatible model-server simulator for tests, the demo and benchmarks.

A single-threaded asyncio HTTP/1.1 server (hand-written parser on ``asyncio.Protocol``;
keep-alive, ``Connection: close`` and in-order answers to pipelined requests). It serves
``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, vLLM-style
``/metrics`` and the control endpoints ``/sim/stats``, ``/sim/reset``, ``/sim/faults``,
``/sim/release``, ``/sim/arrivals`` and ``/sim/tokens``.

Request life cycle for an inference call: count it (and its attempt per ``x-request-id``), parse
the JSON body (400 if invalid), admit it (above ``max_concurrency``: 429/503 with
``Retry-After``, or wait in a FIFO queue), then apply a scripted fault for that attempt, then
the random ``failure_rate``, else sleep the simulated latency and answer 200. A request counts
as ``in_flight`` from admission until its response is written or its connection is gone.
Failures are answered at once; stalled attempts hold their slot until the client hangs up.
All times are monotonic seconds unless a name ends in ``_ms`` (milliseconds).

Per-request fault headers (they pass through any client unchanged):
``x-sim-fail-first: N`` fails the first N attempts of the ``x-request-id`` (without that header
every request is a first attempt) with ``x-sim-fail-status`` (503), adding ``Retry-After`` from
``x-sim-retry-after`` and, like an llm-d gateway whose flow control shed the request,
``x-llm-d-request-dropped-reason`` from ``x-sim-dropped-reason``; ``x-sim-fail-mode:
stall|drop`` hangs (up to ``STALL_CAP_S``) or closes the connection instead.
``x-sim-latency-ms`` replaces the whole simulated delay. ``POST /sim/faults`` ``{"id",
"fail_first", "status", "retry_after", "mode", "dropped_reason"}`` scripts the same for an
id; headers win. ``SimConfig.overload_dropped_reason`` adds the drop-reason header to overload
rejections.

Held requests (for tests that need N requests in flight, without racing a latency):
``x-sim-hold: NAME`` keeps an admitted request that would answer 200 open — in flight, holding
its concurrency slot, as a slow request would — until the name is released:
``SimServer.release(NAME)`` in process, ``POST /sim/release {"name": NAME}`` from another.
Releasing answers every request held under the name (200, the usual body) and opens the name:
later requests carrying it (a retry) are not held, until ``reset()``. ``SimServer.wait_held``
(or ``held`` in ``/sim/stats``) tells how many are held. Bounds: ``reset()`` releases every
name, ``stop()`` closes the connections, and a request is never held longer than
``HOLD_CAP_S`` (then answered as if released).

Credentials, like a gateway's: with ``api_key`` set, an inference call without
``Authorization: Bearer <api_key>`` is answered 401 (counted in ``unauthorized``; the CLI
reads the key from an environment variable, ``--api-key-env``, never from its arguments).
With ``tls_cert_file`` / ``tls_key_file`` it serves HTTPS; with ``tls_client_ca_file`` too, it
requires a client certificate signed by that CA (mTLS) and refuses the handshake without one.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import heapq
import itertools
import json
import math
import os
import random
import signal
import ssl
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from types import TracebackType
from typing import Any, TypeVar

MODEL_NAME = "sim-model"
STALL_CAP_S = 600.0  # a stalled attempt is dropped after this many seconds
HOLD_CAP_S = 120.0  # a held request is answered after this many seconds if nobody released it
MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
FAULT_MODES = ("status", "stall", "drop")
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
_VOCAB = ("the", "model", "token", "quick", "signal", "river", "stone", "light", "cloud",
          "vector", "amber", "orbit", "delta", "pixel", "harbor", "forest", "echo", "metal",
          "spark", "field", "ocean", "quartz", "ember", "lattice", "north", "summit", "cedar",
          "prism", "canyon", "meadow", "falcon", "tide")  # fmt: skip
_JSON = "Content-Type: application/json\r\n"
_TEXT = "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
_Reply = tuple[int, bytes, str]  # (status, body, extra header lines each ending in CRLF)
_T = TypeVar("_T")


@dataclass
class SimConfig:
    """Simulator behaviour. Latency of a 200 = latency_ms + U(0, jitter_ms) + itl_ms * tokens."""

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    itl_ms: float = 0.0  # per generated (fake) token
    max_concurrency: int = 0  # 0 = unlimited
    overload: str = "429"  # "429" | "503" | "queue"
    overload_retry_after_s: float = 1.0  # Retry-After of overload rejections, seconds
    # x-llm-d-request-dropped-reason of overload rejections (as a gateway's flow control sends)
    overload_dropped_reason: str | None = None
    failure_rate: float = 0.0  # probability of a random failure per admitted request
    failure_status: int = 503
    seed: int = 0  # seeds the failure, jitter and completion-length RNGs
    # keep (arrival_s, finish_s, request_id) per answered request (/sim/arrivals), and
    # (arrival_s, prompt_tokens, completion_tokens, request_id) per 200 (/sim/tokens)
    record_arrivals: bool = False
    # completion tokens of a 200: max_tokens when 1.0 (finish_reason "length"); else drawn
    # uniformly from [ceil(ratio * max_tokens), max_tokens] (below max_tokens: "stop")
    completion_min_ratio: float = 1.0
    model_name: str = MODEL_NAME
    api_key: str | None = None  # inference calls must carry "Authorization: Bearer <api_key>"
    tls_cert_file: str | None = None  # serve HTTPS with this certificate (PEM) ...
    tls_key_file: str | None = None  # ... and its key
    tls_client_ca_file: str | None = None  # require client certificates signed by this CA

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server-side TLS context, or None to serve plain HTTP."""
        if not self.tls_cert_file:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        if self.tls_client_ca_file:
            ctx.load_verify_locations(self.tls_client_ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


@dataclass(frozen=True, slots=True)
class _Fault:
    fail_first: int
    status: int = 503
    retry_after: str | None = None
    mode: str = "status"
    dropped_reason: str | None = None


@dataclass(slots=True)
class _Job:
    chat: bool
    model: str
    prompt: str
    max_tokens: int
    fault: _Fault | None
    latency_ms: float | None  # per-request override of the whole delay
    attempt: int
    hold: str | None = None  # x-sim-hold: answer the 200 when this name is released


@dataclass(slots=True)
class _Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Pending:
    """One request's place in its connection's in-order response queue."""

    __slots__ = (
        "keep_alive", "arrival", "admitted", "reply", "held", "task", "waiter", "inference", "rid",
        "hold",
    )  # fmt: skip

    def __init__(self, keep_alive: bool) -> None:
        self.keep_alive = keep_alive
        self.arrival = time.monotonic()
        self.admitted = 0.0  # when it got its concurrency slot, if it waited for one
        self.reply: _Reply | None = None
        self.held = False  # owns a concurrency slot (counted in in_flight)
        self.task: asyncio.Task[None] | _Timer | asyncio.TimerHandle | None = None
        self.waiter: asyncio.Future[None] | None = None  # set while queued for a slot
        self.inference = False
        self.rid: str | None = None
        self.hold: str | None = None  # the name it is held under, while held


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Status"


def _fmt_s(seconds: float) -> str:
    return f"{seconds:g}"


def _json(status: int, obj: object, extra: str = "") -> _Reply:
    return status, json.dumps(obj, separators=(",", ":")).encode(), _JSON + extra


DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"


def _error(
    status: int, message: str, retry_after: str | None = None, dropped: str | None = None
) -> _Reply:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    extra = f"Retry-After: {retry_after}\r\n" if retry_after is not None else ""
    if dropped is not None:
        extra += f"{DROPPED_REASON_HEADER}: {dropped}\r\n"
    return _json(status, {"error": {"message": message, "type": kind, "code": status}}, extra)


def _encode(reply: _Reply, keep_alive: bool) -> bytes:
    status, body, extra = reply
    conn = "keep-alive" if keep_alive else "close"
    head = (
        f"HTTP/1.1 {status} {_reason(status)}\r\nContent-Length: {len(body)}\r\n"
        f"{extra}Connection: {conn}\r\n\r\n"
    )
    return head.encode("latin-1") + body


def _parse(buf: bytearray) -> _Request | None:
    """Remove and return one complete request from ``buf``; None if it is not complete yet."""
    while buf[:2] == b"\r\n":
        del buf[:2]
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > MAX_HEAD_BYTES:
            raise _HttpError(431, "request head too large")
        return None
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise _HttpError(400, "malformed request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise _HttpError(400, "malformed header line")
        headers[name.strip().lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise _HttpError(501, "Transfer-Encoding is not supported; send Content-Length")
    length = headers.get("content-length", "0")
    if not length.isdigit() or int(length) > MAX_BODY_BYTES:
        raise _HttpError(400 if not length.isdigit() else 413, "bad Content-Length")
    total = end + 4 + int(length)
    if len(buf) < total:
        return None
    body = bytes(buf[end + 4 : total])
    del buf[:total]
    token = headers.get("connection", "").lower()
    keep = "close" not in token if parts[2] == "HTTP/1.1" else "keep-alive" in token
    return _Request(parts[0], parts[1].partition("?")[0], headers, body, keep)


def _fake_text(prompt: str, n: int) -> str:
    """Deterministic ``n`` fake tokens derived from the prompt."""
    h = zlib.crc32(prompt.encode())
    return "".join(" " + _VOCAB[(h + i * 7919) % len(_VOCAB)] for i in range(n))


def _header_value(value: str) -> str:
    """A value safe to echo in a response header (no CR, LF or NUL)."""
    if any(c in value for c in "\r\n\0"):
        raise ValueError("a header value must not contain CR, LF or NUL")
    return value


class _Timer:
    """A callback due at a monotonic time on the simulator's loop; ``cancel()`` drops it."""

    __slots__ = ("fn", "args", "cancelled")

    def __init__(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _Clock:
    """Runs callbacks on the loop at monotonic times, to within about 0.1 ms.

    asyncio's own timers wake from ``epoll_wait``, whose timeout is whole milliseconds rounded
    up, so a 100 ms latency came out as 100.5-101 ms: a benchmark against the simulator was
    charged for the simulator's clock. Here a helper thread sleeps on a condition (a nanosecond
    timeout) until the earliest due time and hands what is due to the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.heap: list[tuple[float, int, _Timer]] = []
        self.seq = itertools.count()
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="sim-clock", daemon=True)
        self.thread.start()

    def call_at(self, when: float, fn: Callable[..., None], *args: Any) -> _Timer:
        timer = _Timer(fn, args)
        with self.cond:
            heapq.heappush(self.heap, (when, next(self.seq), timer))
            if self.heap[0][2] is timer:
                self.cond.notify()
        return timer

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.heap.clear()
            self.cond.notify()

    def _run(self) -> None:
        with self.cond:
            while not self.closed:
                if not self.heap:
                    self.cond.wait()
                    continue
                delay = self.heap[0][0] - time.monotonic()
                if delay > 0:
                    self.cond.wait(delay)
                    continue
                now = time.monotonic()
                due = []
                while self.heap and self.heap[0][0] <= now:
                    due.append(heapq.heappop(self.heap)[2])
                try:
                    self.loop.call_soon_threadsafe(self._fire, due)
                except RuntimeError:  # the loop is closed
                    return

    @staticmethod
    def _fire(due: list[_Timer]) -> None:
        for timer in due:
            if not timer.cancelled:
                timer.fn(*timer.args)


class _Conn(asyncio.Protocol):
    """One client connection: parses requests and writes their responses in arrival order."""

    def __init__(self, sim: _Sim) -> None:
        self.sim = sim
        self.buf = bytearray()
        self.pending: deque[_Pending] = deque()
        self.transport: asyncio.Transport | None = None
        self.closing = False  # no more requests are read
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.sim.conns.add(self)
        self.sim.connections += 1

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while not self.closing:
            try:
                req = _parse(self.buf)
            except _HttpError as exc:
                self.closing = True
                p = _Pending(keep_alive=False)
                self.pending.append(p)
                self.sim.answer(self, p, _error(exc.status, str(exc)))
                return
            if req is None:
                return
            p = _Pending(req.keep_alive)
            self.pending.append(p)
            self.closing = not req.keep_alive
            self.sim.dispatch(self, p, req)

    def flush(self) -> None:
        """Write every finished response at the head of the queue."""
        while self.pending and self.pending[0].reply is not None and not self.lost:
            p = self.pending.popleft()
            assert self.transport is not None and p.reply is not None
            self.sim.written(p)  # same loop callback as the write: nobody sees in between
            self.transport.write(_encode(p.reply, p.keep_alive))
            if not p.keep_alive:
                self.transport.close()
                self.abandon()

    def drop(self) -> None:
        """Close the connection without answering anything still pending."""
        self.closing = True
        if self.transport is not None:
            self.transport.close()
        self.abandon()

    def abandon(self) -> None:
        self.lost = True
        while self.pending:
            p = self.pending.popleft()
            self.sim.forget(p)
            if p.task is not None and p.task is not asyncio.current_task():
                p.task.cancel()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.abandon()
        self.sim.conns.discard(self)


class _Sim:
    """Simulator state and request handling; lives on (and is only touched from) one loop."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self._clock: _Clock | None = None
        self.fail_rng = random.Random(config.seed)
        self.jitter_rng = random.Random(config.seed + 1)
        self.length_rng = random.Random(config.seed + 2)
        self.ids = itertools.count(1)
        self.conns: set[_Conn] = set()
        self.waiters: deque[_Pending] = deque()
        self.faults: dict[str, _Fault] = {}
        self.holds: dict[str, dict[_Pending, tuple[_Conn, _Reply]]] = {}  # name -> held requests
        self.released: set[str] = set()  # names released since the last reset
        self.in_flight = 0
        self.routes: dict[tuple[str, str], Callable[[_Request], _Reply]] = {
            ("GET", "/health"): lambda r: _json(200, {"status": "ok"}),
            ("GET", "/v1/models"): self._models,
            ("GET", "/metrics"): lambda r: (200, self.metrics().encode(), _TEXT),
            ("GET", "/sim/stats"): lambda r: _json(200, self.stats()),
            ("POST", "/sim/reset"): lambda r: _json(200, self.reset()),
            ("GET", "/sim/arrivals"): lambda r: _json(200, self.arrivals),
            ("GET", "/sim/tokens"): lambda r: _json(200, self.token_log),
            ("POST", "/sim/faults"): self._post_fault,
            ("POST", "/sim/release"): self._post_release,
        }
        self.reset()

    def reset(self) -> dict[str, bool]:
        """Answer every held request, then zero counters, per-id attempts, scripted faults,
        released hold names and recorded arrivals."""
        self.release_all()
        self.released.clear()
        self.requests = self.dropped = self.stalled = self.connections = self.unauthorized = 0
        self.by_status: dict[int, int] = {}
        self.attempts: dict[str, int] = {}
        self.faults.clear()
        self.arrivals: list[tuple[float, float, str | None]] = []
        self.token_log: list[tuple[float, int, int, str | None]] = []
        self.prompt_tokens = self.completion_tokens = 0
        self.max_in_flight = self.in_flight
        return {"ok": True}

    def stats(self) -> dict[str, Any]:
        """Counters since the last reset; ``by_status`` keys are status codes as strings."""
        return {
            "requests": self.requests,
            "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
            "in_flight": self.in_flight,
            "waiting": len(self.waiters),
            "max_concurrency_observed": self.max_in_flight,
            "attempts_by_request_id": dict(self.attempts),
            "dropped": self.dropped,
            "stalled": self.stalled,
            "held": {name: len(held) for name, held in self.holds.items()},
            "connections": self.connections,
            "unauthorized": self.unauthorized,
            # usage of the 200s generated (held ones too, and ones whose client hung up)
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }

    def metrics(self) -> str:
        """Prometheus text exposition in vLLM naming."""
        label = f'{{model_name="{self.config.model_name}"}}'
        rows = [
            ("num_requests_running", "gauge", "Requests currently running.", self.in_flight),
            ("num_requests_waiting", "gauge", "Requests waiting for a slot.", len(self.waiters)),
            (
                "request_success_total",
                "counter",
                "Successful requests.",
                self.by_status.get(200, 0),
            ),
        ]
        lines = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP vllm:{name} {help_text}", f"# TYPE vllm:{name} {kind}"]
            lines.append(f"vllm:{name}{label} {value}")
        return "\n".join(lines) + "\n"

    def clock(self) -> _Clock:
        if self._clock is None:
            self._clock = _Clock(asyncio.get_running_loop())
        return self._clock

    def close(self) -> None:
        if self._clock is not None:
            self._clock.close()
            self._clock = None

    def script_fault(self, rid: str, fault: _Fault) -> None:
        if fault.mode not in FAULT_MODES:
            raise ValueError(f"mode must be one of {FAULT_MODES}, not {fault.mode!r}")
        self.faults[rid] = fault

    def release(self, name: str) -> int:
        """Answer every request held under ``name`` (200, the usual body) and let later ones
        carrying it pass; returns how many were held."""
        self.released.add(name)
        held = self.holds.pop(name, {})
        answered = 0
        for p, (conn, reply) in list(held.items()):
            if p.hold != name:  # its connection went away while an earlier one was answered
                continue
            self._unhold(p)
            self.answer(conn, p, reply)
            answered += 1
        return answered

    def release_all(self) -> int:
        """Release every name that holds a request; returns how many requests were held."""
        return sum(self.release(name) for name in list(self.holds))

    def _hold(self, conn: _Conn, p: _Pending, name: str, reply: _Reply) -> None:
        p.hold = name
        self.holds.setdefault(name, {})[p] = (conn, reply)
        p.task = asyncio.get_running_loop().call_later(HOLD_CAP_S, self._hold_expired, p)

    def _unhold(self, p: _Pending) -> tuple[_Conn, _Reply] | None:
        """Take ``p`` out of its hold (and cancel its cap); returns what it was held with."""
        name, p.hold = p.hold, None
        if name is None:
            return None
        if isinstance(p.task, asyncio.TimerHandle):
            p.task.cancel()
            p.task = None
        held = self.holds.get(name)
        entry = held.pop(p, None) if held is not None else None
        if held is not None and not held:
            del self.holds[name]
        return entry

    def _hold_expired(self, p: _Pending) -> None:
        entry = self._unhold(p)
        if entry is not None:
            self.answer(entry[0], p, entry[1])

    def _models(self, req: _Request) -> _Reply:
        model = {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "sim"}
        return _json(200, {"object": "list", "data": [model]})

    def _post_fault(self, req: _Request) -> _Reply:
        try:
            spec = json.loads(req.body)
            retry = spec.get("retry_after")
            dropped = spec.get("dropped_reason")
            fault = _Fault(int(spec.get("fail_first", 1)), int(spec.get("status", 503)),
                           None if retry is None else _fmt_s(float(retry)),
                           str(spec.get("mode", "status")),
                           None if dropped is None else _header_value(str(dropped)))  # fmt: skip
            self.script_fault(str(spec["id"]), fault)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            return _error(400, f"bad fault spec: {exc!r}")
        return _json(200, {"ok": True})

    def _post_release(self, req: _Request) -> _Reply:
        try:
            name = json.loads(req.body)["name"]
        except (ValueError, TypeError, KeyError) as exc:
            return _error(400, f'bad release spec, want {{"name": ...}}: {exc!r}')
        if not isinstance(name, str) or not name:
            return _error(400, "'name' must be a non-empty string")
        return _json(200, {"released": self.release(name)})

    # -- request flow -------------------------------------------------------------------------

    def dispatch(self, conn: _Conn, p: _Pending, req: _Request) -> None:
        if req.path in ("/v1/completions", "/v1/chat/completions"):
            if req.method == "POST":
                self._inference(conn, p, req)
            else:
                self.answer(conn, p, _error(405, "use POST"))
            return
        route = self.routes.get((req.method, req.path))
        if route is not None:
            self.answer(conn, p, route(req))
        elif any(path == req.path for _, path in self.routes):
            self.answer(conn, p, _error(405, f"method {req.method} not allowed"))
        else:
            self.answer(conn, p, _error(404, f"no route for {req.path}"))

    def answer(self, conn: _Conn, p: _Pending, reply: _Reply) -> None:
        if p.inference:
            self.by_status[reply[0]] = self.by_status.get(reply[0], 0) + 1
        p.reply = reply
        conn.flush()

    def written(self, p: _Pending) -> None:
        """``p``'s response is being written now: record its arrival, free its slot."""
        if p.inference and self.config.record_arrivals:
            self.arrivals.append((p.arrival, time.monotonic(), p.rid))
        self.forget(p)

    def forget(self, p: _Pending) -> None:
        """Release whatever ``p`` holds: its hold, its queue place or its concurrency slot."""
        if p.hold is not None:
            self._unhold(p)
        if p.waiter is not None:
            if not p.held and p in self.waiters:
                self.waiters.remove(p)
            p.waiter.cancel()  # no-op once the slot was handed over
            p.waiter = None
        if not p.held:
            return
        p.held = False
        while self.waiters:  # hand the slot straight to the oldest live waiter
            nxt = self.waiters.popleft()
            if nxt.waiter is not None and not nxt.waiter.done():
                nxt.held = True
                nxt.admitted = time.monotonic()
                nxt.waiter.set_result(None)
                return
        self.in_flight -= 1

    def _acquire(self, p: _Pending) -> None:
        p.held = True
        self.in_flight += 1
        if self.in_flight > self.max_in_flight:
            self.max_in_flight = self.in_flight

    def _inference(self, conn: _Conn, p: _Pending, req: _Request) -> None:
        self.requests += 1
        p.inference = True
        p.rid = req.headers.get("x-request-id")
        attempt = 1
        if p.rid is not None:
            attempt = self.attempts[p.rid] = self.attempts.get(p.rid, 0) + 1
        key = self.config.api_key
        if key and req.headers.get("authorization") != f"Bearer {key}":
            self.unauthorized += 1
            self.answer(conn, p, _error(401, "missing or wrong API key"))
            return
        try:
            job = self._job(req, attempt)
        except _HttpError as exc:
            self.answer(conn, p, _error(exc.status, str(exc)))
            return
        cfg = self.config
        if cfg.max_concurrency and self.in_flight >= cfg.max_concurrency:
            if cfg.overload != "queue":
                retry = _fmt_s(cfg.overload_retry_after_s)
                status = 503 if cfg.overload == "503" else 429
                reply = _error(status, "server overloaded", retry, cfg.overload_dropped_reason)
                self.answer(conn, p, reply)
                return
            p.waiter = asyncio.get_running_loop().create_future()
            self.waiters.append(p)
            p.task = asyncio.ensure_future(self._queued(conn, p, job))
            return
        self._acquire(p)
        self._run(conn, p, job)

    async def _queued(self, conn: _Conn, p: _Pending, job: _Job) -> None:
        assert p.waiter is not None
        await p.waiter  # forget() of a finishing request hands us its slot (p.held is set)
        p.waiter = None
        self._run(conn, p, job)

    def _job(self, req: _Request, attempt: int) -> _Job:
        try:
            payload = json.loads(req.body)
        except ValueError as exc:
            raise _HttpError(400, f"invalid JSON body: {exc}") from None
        if not isinstance(payload, dict):
            raise _HttpError(400, "JSON body must be an object")
        chat = req.path.endswith("/chat/completions")
        if chat:
            messages = payload.get("messages")
            if not isinstance(messages, list):
                raise _HttpError(400, "'messages' must be a list")
            prompt = "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        else:
            raw = payload.get("prompt", "")
            prompt = raw if isinstance(raw, str) else json.dumps(raw)
        max_tokens = payload.get("max_tokens", payload.get("max_completion_tokens", 16))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise _HttpError(400, "'max_tokens' must be a non-negative integer")
        model = payload.get("model") or self.config.model_name
        fault, latency = self._header_overrides(req)
        if fault is None:
            fault = self.faults.get(req.headers.get("x-request-id", ""))
        hold = req.headers.get("x-sim-hold") or None
        return _Job(chat, str(model), prompt, max_tokens, fault, latency, attempt, hold)

    @staticmethod
    def _header_overrides(req: _Request) -> tuple[_Fault | None, float | None]:
        h = req.headers
        try:
            latency = float(h["x-sim-latency-ms"]) if "x-sim-latency-ms" in h else None
            if "x-sim-fail-first" not in h:
                return None, latency
            status = int(h.get("x-sim-fail-status", "503"))
            mode = h.get("x-sim-fail-mode", "status")
            dropped = h.get("x-sim-dropped-reason")
            fault = _Fault(
                int(h["x-sim-fail-first"]),
                status,
                h.get("x-sim-retry-after"),
                mode,
                None if dropped is None else _header_value(dropped),
            )
        except ValueError as exc:
            raise _HttpError(400, f"bad x-sim-* header: {exc}") from None
        if fault.mode not in FAULT_MODES:
            raise _HttpError(400, f"x-sim-fail-mode must be one of {FAULT_MODES}")
        return fault, latency

    def _run(self, conn: _Conn, p: _Pending, job: _Job) -> None:
        """Act on an admitted request (``p`` holds a slot)."""
        cfg = self.config
        fault = job.fault
        if fault is not None and job.attempt <= fault.fail_first:
            if fault.mode == "drop":
                self.dropped += 1
                conn.drop()
            elif fault.mode == "stall":
                self.stalled += 1
                p.task = asyncio.ensure_future(self._stall(conn))
            else:
                msg = f"simulated failure (attempt {job.attempt} of {fault.fail_first})"
                reply = _error(fault.status, msg, fault.retry_after, fault.dropped_reason)
                self.answer(conn, p, reply)
            return
        if cfg.failure_rate and self.fail_rng.random() < cfg.failure_rate:
            self.answer(conn, p, _error(cfg.failure_status, "simulated random failure"))
            return
        completion = self._completion_tokens(job.max_tokens)
        delay_ms = job.latency_ms
        if delay_ms is None:
            delay_ms = cfg.latency_ms + cfg.itl_ms * completion
            if cfg.jitter_ms:
                delay_ms += self.jitter_rng.uniform(0.0, cfg.jitter_ms)
        reply = self._completion(job, completion, p)
        if job.hold is not None and job.hold not in self.released:
            self._hold(conn, p, job.hold, reply)
        elif delay_ms > 0:
            due = max(p.arrival, p.admitted) + delay_ms / 1000.0
            p.task = self.clock().call_at(due, self.answer, conn, p, reply)
        else:
            self.answer(conn, p, reply)

    async def _stall(self, conn: _Conn) -> None:
        await asyncio.sleep(STALL_CAP_S)
        conn.drop()

    def _completion_tokens(self, max_tokens: int) -> int:
        ratio = self.config.completion_min_ratio
        if ratio >= 1.0 or max_tokens == 0:
            return max_tokens
        return self.length_rng.randint(math.ceil(max(0.0, ratio) * max_tokens), max_tokens)

    def _completion(self, job: _Job, completion: int, p: _Pending) -> _Reply:
        """A 200 with ``completion`` generated tokens; its usage is counted (and logged with
        the request's arrival time when ``record_arrivals``): the prompt's tokens are its
        whitespace-separated words (for chat: of the messages' contents)."""
        text = _fake_text(job.prompt, completion)
        text = text.lstrip() if job.chat else text
        prompt_tokens = len(job.prompt.split())
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion
        if self.config.record_arrivals:
            self.token_log.append((p.arrival, prompt_tokens, completion, p.rid))
        finish = "length" if completion == job.max_tokens else "stop"
        body: dict[str, Any] = {
            "id": f"{'chatcmpl' if job.chat else 'cmpl'}-sim{next(self.ids)}",
            "object": "chat.completion" if job.chat else "text_completion",
            "created": int(time.time()),
            "model": job.model,
        }
        if job.chat:
            msg = {"role": "assistant", "content": text}
            body["choices"] = [{"index": 0, "message": msg, "finish_reason": finish}]
        else:
            body["choices"] = [{"index": 0, "text": text, "finish_reason": finish}]
        body["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }
        return _json(200, body)


# -- running it ---------------------------------------------------------------------------------


def _new_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed, else the default asyncio loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


async def _listen(sim: _Sim, host: str, port: int) -> asyncio.Server:
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        lambda: _Conn(sim), host, port, backlog=1024, ssl=sim.config.ssl_context()
    )


def _scheme(config: SimConfig) -> str:
    return "https" if config.tls_cert_file else "http"


async def _shutdown(server: asyncio.Server, sim: _Sim) -> None:
    """Stop listening, drop every client connection and cancel the simulator's own tasks."""
    server.close()
    sim.close()
    for conn in list(sim.conns):
        conn.drop()
        if conn.transport is not None:
            conn.transport.abort()
    await asyncio.sleep(0)  # let the cancelled tasks finish


async def serve(
    config: SimConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    on_listening: Callable[[str], None] | None = None,
) -> None:
    """Serve until cancelled; ``on_listening(url)`` is called once the socket is bound."""
    sim = _Sim(config)
    server = await _listen(sim, host, port)
    try:
        if on_listening is not None:
            port = server.sockets[0].getsockname()[1]
            on_listening(f"{_scheme(config)}://{host}:{port}")
        await server.serve_forever()
    finally:
        await _shutdown(server, sim)


class SimServer:
    """The simulator on its own event loop in a daemon thread.

    ``with SimServer(SimConfig(latency_ms=5)).start_in_thread() as sim: httpx.get(sim.url)``
    """

    def __init__(self, config: SimConfig | None = None, host: str = "127.0.0.1", port: int = 0):
        self.config = config if config is not None else SimConfig()
        self.host = host
        self._port = port
        self._sim = _Sim(self.config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound TCP port (the real one once started, even when constructed with 0)."""
        return self._port

    @property
    def url(self) -> str:
        """Base URL without a trailing slash, e.g. ``http://127.0.0.1:40123`` (``https://``
        when it serves TLS)."""
        return f"{_scheme(self.config)}://{self.host}:{self._port}"

    def start_in_thread(self, timeout_s: float = 10.0) -> SimServer:
        """Start listening on a fresh loop in a daemon thread; returns once bound."""
        if self._thread is not None:
            return self
        started = concurrent.futures.Future[None]()
        self._thread = threading.Thread(
            target=self._thread_main, args=(started,), name=f"sim-{self._port}", daemon=True
        )
        self._thread.start()
        started.result(timeout=timeout_s)
        return self

    def _thread_main(self, started: concurrent.futures.Future[None]) -> None:
        loop = self._loop = _new_loop()
        asyncio.set_event_loop(loop)
        try:
            self._server = loop.run_until_complete(_listen(self._sim, self.host, self._port))
        except BaseException as exc:
            started.set_exception(exc)
            loop.close()
            return
        self._port = self._server.sockets[0].getsockname()[1]
        started.set_result(None)
        try:
            loop.run_forever()
            loop.run_until_complete(_shutdown(self._server, self._sim))
        finally:
            loop.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the listener and every client connection, then end the thread. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)

    def _call(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on the server loop (so state is read/changed atomically)."""
        loop, thread = self._loop, self._thread
        if (
            loop is None
            or thread is None
            or not thread.is_alive()
            or thread is threading.current_thread()
        ):
            return fn()
        fut = concurrent.futures.Future[_T]()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return fut.result(timeout=10.0)

    def stats(self) -> dict[str, Any]:
        """Same dict as ``GET /sim/stats``."""
        return self._call(self._sim.stats)

    def tokens(self) -> list[tuple[float, int, int, str | None]]:
        """Same as ``GET /sim/tokens`` (needs ``record_arrivals``): per 200 generated,
        (arrival time, monotonic s; prompt tokens; completion tokens; x-request-id)."""
        return self._call(lambda: list(self._sim.token_log))

    def reset(self) -> None:
        """Same as ``POST /sim/reset`` (answers every held request first)."""
        self._call(self._sim.reset)

    def release(self, name: str) -> int:
        """Same as ``POST /sim/release {"name": name}``: answer every request held under
        ``name`` (``x-sim-hold``) and let later ones pass; returns how many were held."""
        return self._call(lambda: self._sim.release(name))

    def release_all(self) -> int:
        """Release every name that holds a request (``reset()`` does too, and zeroes the
        counters); returns how many requests were held."""
        return self._call(self._sim.release_all)

    def held(self, name: str) -> int:
        """How many requests are held under ``name`` now."""
        return self._call(lambda: len(self._sim.holds.get(name, ())))

    def wait_held(self, name: str, n: int = 1, timeout_s: float = 30.0) -> None:
        """Return once at least ``n`` requests are held under ``name``; TimeoutError after
        ``timeout_s`` seconds (polls every 5 ms)."""
        deadline = time.monotonic() + timeout_s
        while (got := self.held(name)) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{got} of {n} requests held under {name!r}")
            time.sleep(0.005)

    def script_fault(
        self,
        request_id: str,
        fail_first: int,
        status: int = 503,
        retry_after: float | None = None,
        mode: str = "status",
        dropped_reason: str | None = None,
    ) -> None:
        """Make the first ``fail_first`` attempts of ``request_id`` fail; mode status|stall|drop;
        ``dropped_reason`` is sent as ``x-llm-d-request-dropped-reason``."""
        retry = None if retry_after is None else _fmt_s(retry_after)
        fault = _Fault(fail_first, status, retry, mode, dropped_reason)
        self._call(lambda: self._sim.script_fault(request_id, fault))

    def __enter__(self) -> SimServer:
        return self.start_in_thread()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# -- CLI ----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the simulator's options (times in milliseconds unless noted)."""
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="bind address")
    add("--port", type=int, default=8000, help="TCP port (0 = any free port)")
    add("--latency-ms", type=float, default=0.0, help="base latency per request, ms")
    add("--jitter-ms", type=float, default=0.0, help="extra uniform random latency, ms")
    add("--itl-ms", type=float, default=0.0, help="latency per generated token, ms")
    add("--max-concurrency", type=int, default=0, help="admitted at once (0 = unlimited)")
    add("--overload", choices=("429", "503", "queue"), default="429", help="above the limit")
    add("--retry-after", type=float, default=1.0, help="Retry-After on overload, seconds")
    add("--dropped-reason", default=None, help="x-llm-d-request-dropped-reason on overload")
    add("--failure-rate", type=float, default=0.0, help="random failure probability, 0..1")
    add("--failure-status", type=int, default=503, help="status of random failures")
    add("--seed", type=int, default=0, help="RNG seed for failures, jitter and lengths")
    add(
        "--record-arrivals",
        action="store_true",
        help="record arrivals (GET /sim/arrivals) and tokens (GET /sim/tokens)",
    )
    add(
        "--completion-min-ratio",
        type=float,
        default=1.0,
        help="completion tokens drawn from [ratio x max_tokens, max_tokens] (1 = max_tokens)",
    )
    add("--api-key-env", metavar="VAR", help="require 'Authorization: Bearer $VAR' (else 401)")
    add("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate")
    add("--tls-key", metavar="PEM", help="the certificate's private key")
    add("--tls-client-ca", metavar="PEM", help="require client certificates signed by this CA")


def _api_key(var: str | None) -> str | None:
    if not var:
        return None
    key = os.environ.get(var)
    if not key:
        raise SystemExit(f"pipeline sim: --api-key-env: {var} is not set (or empty)")
    return key


def run_from_args(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; prints ``simulator listening on URL`` once bound."""
    config = SimConfig(
        latency_ms=args.latency_ms,
        jitter_ms=args.jitter_ms,
        itl_ms=args.itl_ms,
        max_concurrency=args.max_concurrency,
        overload=args.overload,
        overload_retry_after_s=args.retry_after,
        overload_dropped_reason=args.dropped_reason,
        failure_rate=args.failure_rate,
        failure_status=args.failure_status,
        seed=args.seed,
        record_arrivals=args.record_arrivals,
        completion_min_ratio=args.completion_min_ratio,
        api_key=_api_key(args.api_key_env),
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        tls_client_ca_file=args.tls_client_ca,
    )
    if args.tls_client_ca and not args.tls_cert:
        raise SystemExit("pipeline sim: --tls-client-ca needs --tls-cert (and --tls-key)")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        announce: Callable[[str], None] = lambda url: print(  # noqa: E731
            f"simulator listening on {url}", flush=True
        )
        try:
            await serve(config, args.host, args.port, on_listening=announce)
        except asyncio.CancelledError:
            pass

    with asyncio.Runner(loop_factory=_new_loop) as runner:
        runner.run(main())
    return 0
