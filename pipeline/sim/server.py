"""The OpenAI-compatible model-server simulator: a starlette app served by uvicorn on its own
loop. Its endpoints, fault headers, holds and options are in docs/development.md, "The
simulator"; times are monotonic seconds unless a name ends in ``_ms``."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import functools
import heapq
import itertools
import json
import math
import os
import random
import signal
import ssl
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from threading import current_thread
from typing import Any, Concatenate, ParamSpec, TypeVar

import orjson
import uvicorn
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.server import ServerState

from . import engine_cli
from .engine import EngineConfig
from .engine_http import EngineFront, Job, StreamReply, request_fields

MODEL_NAME = "sim-model"
STALL_CAP_S = 600.0  # a stalled attempt is dropped after this many seconds
HOLD_CAP_S = 120.0  # a held request is answered after this many seconds if nobody released it
RECORD_CAP = 1000  # calls whose headers are kept (x-sim-record-headers) until the next reset
# a scripted fault: an error status, a stall, a dropped connection, or a 200 whose body is
# not JSON (BAD_BODIES: nested deeper than a parser goes, cut off, an HTML page)
FAULT_MODES = ("status", "stall", "drop", "nested", "truncated", "html")
NESTING = 100_000  # the depth of a "nested" body: far past any JSON parser's recursion limit
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
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
_P = ParamSpec("_P")
_T = TypeVar("_T")
_Peer = tuple[str, int] | None  # a client's address: one connection, one request at a time


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
    # a chat template's prompt tokens, as a real server counts them in usage.prompt_tokens:
    # this many per message (role markers) plus this many per chat prompt (the reply's header)
    template_message_tokens: int = 0
    template_prompt_tokens: int = 0
    model_name: str = MODEL_NAME
    api_key: str | None = None  # inference calls must carry "Authorization: Bearer <api_key>"
    tls_cert_file: str | None = None  # serve HTTPS with this certificate (PEM) ...
    tls_key_file: str | None = None  # ... and its key
    tls_client_ca_file: str | None = None  # require client certificates signed by this CA
    # model a continuous-batching engine (pipeline/sim/engine.py): requests that pass the
    # faults above are answered by it, and latency_ms, jitter_ms and itl_ms must be 0
    engine: EngineConfig | None = None


@dataclass(frozen=True, slots=True)
class _Fault:
    fail_first: int
    status: int = 503
    retry_after: str | None = None
    mode: str = "status"
    dropped_reason: str | None = None

    def __post_init__(self) -> None:
        """One check for faults set by header, API and ``POST /sim/faults``: ValueError."""
        if self.mode not in FAULT_MODES:
            raise ValueError(f"mode must be one of {FAULT_MODES}, not {self.mode!r}")
        if self.dropped_reason is not None and any(c in self.dropped_reason for c in "\r\n\0"):
            raise ValueError("a header value must not contain CR, LF or NUL")


@dataclass(slots=True)
class _Call:
    """One inference request, as parsed, and whether it holds a concurrency slot."""

    arrival: float
    rid: str | None
    peer: _Peer
    attempt: int = 1
    chat: bool = False
    model: str = MODEL_NAME
    prompt: str = ""
    template_tokens: int = 0  # the chat template's share of the prompt tokens
    max_tokens: int = 16
    fault: _Fault | None = None
    latency_ms: float | None = None  # x-sim-latency-ms: the whole delay
    hold: str | None = None  # x-sim-hold: answer the 200 when this name is released
    admitted: float = 0.0  # when a queued request got its slot
    slot: bool = False
    faulted: bool = False  # a scripted drop or stall ran out: the simulator closes it
    # with an engine: the body's "priority", "stream" and "stream_options.include_usage"
    priority: int = 0
    stream: bool = False
    include_usage: bool = False
    on_end: Callable[[], None] | None = None  # run once its answer is written or abandoned
    # x-sim-hangup-notice: write: a hang-up is noticed only when its answer is written (as a
    # server that learns of a closed connection on its next write); ``gone``: it hung up
    late_notice: bool = False
    gone: bool = False


class _BadRequest(Exception):
    pass


@dataclass(frozen=True, slots=True)
class _Asgi:
    """An ASGI app as a route endpoint (starlette takes a bare method for request -> response)."""

    app: Callable[[Scope, Receive, Send], Awaitable[None]]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def _json(obj: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status, headers, media_type="application/json")


def _error(
    status: int, message: str, retry_after: str | None = None, dropped: str | None = None
) -> Response:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    if dropped is not None:
        headers[DROPPED_REASON_HEADER] = dropped
    return _json({"error": {"message": message, "type": kind, "code": status}}, status, headers)


def _bad_body(mode: str) -> Response:
    """A 200 whose body is not JSON, as a faulty server or proxy sends: ``nested`` (arrays
    nested :data:`NESTING` deep: valid JSON no parser reads), ``truncated`` (a completion cut
    off), ``html`` (a proxy's error page)."""
    if mode == "html":
        page = "<html><head><title>502</title></head><body><h1>Bad Gateway</h1></body></html>"
        return Response(page, 200, media_type="text/html")
    if mode == "nested":
        return Response("[" * NESTING + "]" * NESTING, 200, media_type="application/json")
    body = '{"id": "cmpl-cut", "object": "text_completion", "choices": [{"text": "the mo'
    return Response(body, 200, media_type="application/json")


def _get(fn: Callable[[], object]) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return _json(fn())

    return endpoint


def _fake_text(prompt: str, n: int) -> str:
    """Deterministic ``n`` fake tokens derived from the prompt."""
    h = zlib.crc32(prompt.encode())
    return "".join(" " + _VOCAB[(h + i * 7919) % len(_VOCAB)] for i in range(n))


def _usage(prompt_tokens: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}  # fmt: skip


def _finish(call: _Call, completion: int) -> str:
    """``length`` when it stopped at max_tokens, else ``stop``."""
    return "length" if completion == call.max_tokens else "stop"


def _peer(addr: Any) -> _Peer:
    return (str(addr[0]), int(addr[1])) if addr else None


def _wake(fut: asyncio.Future[bool], value: bool = True) -> None:
    if not fut.done():
        fut.set_result(value)


_Method = Callable[Concatenate["SimServer", _P], _T]


def _on_loop(fn: _Method[_P, _T]) -> _Method[_P, _T]:
    """Run the method on the simulator's loop (so state is read and changed atomically)."""

    @functools.wraps(fn)
    def method(self: SimServer, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive() or thread is current_thread():
            return fn(self, *args, **kwargs)  # not serving, or already on the loop

        async def run() -> _T:
            return fn(self, *args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=10.0)

    return method


class _Clock:
    """Runs callbacks on the loop at monotonic times, to within about 0.1 ms, never early: the
    loop's own timers round to whole milliseconds (docs/development.md, "The simulator")."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="sim-clock", daemon=True)
        self.thread.start()

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        with self.cond:
            heapq.heappush(self.heap, (when, next(self.seq), fn))
            if self.heap[0][2] is fn:
                self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.heap.clear()
            self.cond.notify()

    def _run(self) -> None:
        with self.cond:
            while not self.closed:
                delay = self.heap[0][0] - time.monotonic() if self.heap else None
                if delay is None or delay > 0:
                    self.cond.wait(delay)
                    continue
                now, due = time.monotonic(), []
                while self.heap and self.heap[0][0] <= now:
                    due.append(heapq.heappop(self.heap)[2])
                try:
                    self.loop.call_soon_threadsafe(self._fire, due)
                except RuntimeError:  # the loop is closed
                    return

    @staticmethod
    def _fire(due: list[Callable[[], None]]) -> None:
        for fn in due:
            fn()


class SimServer:
    """The simulator, served on its own loop in a daemon thread; its public methods may be
    called from any thread: ``with SimServer(SimConfig(latency_ms=5)) as sim: ...``"""

    def __init__(self, config: SimConfig | None = None, host: str = "127.0.0.1", port: int = 0):
        self.config = config = config if config is not None else SimConfig()
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._clock: _Clock | None = None
        self._fail_rng = random.Random(config.seed)
        self._jitter_rng = random.Random(config.seed + 1)
        self._length_rng = random.Random(config.seed + 2)
        self._ids = itertools.count(1)
        self._transports: dict[_Peer, asyncio.Transport] = {}
        self._waiting: dict[_Peer, asyncio.Future[bool]] = {}  # what a connection's call awaits
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiters: deque[asyncio.Future[bool]] = deque()  # queued for a slot, oldest first
        self._faults: dict[str, _Fault] = {}
        self._holds: dict[str, set[asyncio.Future[bool]]] = {}  # name -> held requests
        self._released: set[str] = set()  # names released since the last reset
        self._held_jobs: dict[asyncio.Future[bool], Job] = {}  # held in the engine
        self._in_flight = 0
        self._late: dict[_Peer, _Call] = {}  # late-notice calls waiting, by connection
        self._gone = 0  # calls in flight whose client hung up, not noticed yet (late notice)
        self._max_live = 0  # the most in flight at once whose client still waited
        self._engine: EngineFront | None = None
        if config.engine is not None:
            if config.latency_ms or config.jitter_ms or config.itl_ms:
                raise ValueError("latency_ms, jitter_ms and itl_ms do not apply with an engine")
            self._engine = EngineFront(config.engine, self._call_at)

        async def metrics(request: Request) -> Response:
            return Response(self._metrics(), media_type="text/plain; version=0.0.4")

        model = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "sim"}
        # starlette's router without the application's middleware, which the simulator does
        # not use and which costs CPU per request (bench/sim_throughput.py)
        self.app = Router(
            routes=[
                Route("/v1/completions", _Asgi(self._inference)),
                Route("/v1/chat/completions", _Asgi(self._inference)),
                Route("/health", _get(lambda: {"status": "ok"})),
                Route("/v1/models", _get(lambda: {"object": "list", "data": [model]})),
                Route("/metrics", metrics),
                Route("/sim/stats", _get(self.stats)),
                Route("/sim/reset", _get(self.reset), methods=["POST"]),
                Route("/sim/arrivals", _get(lambda: self._arrivals)),
                Route("/sim/tokens", _get(lambda: self._token_log)),
                Route("/sim/hangups", _get(lambda: self._hangups)),
                Route("/sim/headers", self._get_headers),
                Route("/sim/faults", self._post_fault, methods=["POST"]),
                Route("/sim/release", self._post_release, methods=["POST"]),
                Route("/sim/engine", self._engine_endpoint, methods=["GET", "POST"]),
            ],
            default=_error(404, "no such route"),
        )
        self.reset()

    @property
    def url(self) -> str:
        return f"{'https' if self.config.tls_cert_file else 'http'}://{self.host}:{self.port}"

    # -- the control API (also over HTTP) ---------------------------------------------------

    @_on_loop
    def reset(self) -> dict[str, bool]:
        """Answer every held request, then forget everything since the last reset."""
        self.release_all()
        self._released.clear()
        self._requests = self._dropped = self._stalled = self._connections = 0
        self._unauthorized = self._prompt_tokens = self._completion_tokens = 0
        self._by_status: dict[int, int] = {}
        self._attempts: dict[str, int] = {}
        self._faults.clear()
        self._arrivals: list[tuple[float, float, str | None]] = []
        self._token_log: list[tuple[float, int, int, str | None]] = []
        self._hangups: list[tuple[float, str | None, float]] = []
        self._recorded: dict[str, list[list[tuple[str, str]]]] = {}
        self._recorded_calls = 0
        self._max_in_flight = self._in_flight
        self._max_live = self._in_flight - self._gone
        if self._engine is not None:
            self._engine.reset()
        return {"ok": True}

    @_on_loop
    def stats(self) -> dict[str, Any]:
        """Counters since the last reset (``GET /sim/stats``)."""
        return {
            "requests": self._requests,
            "by_status": {str(k): v for k, v in sorted(self._by_status.items())},
            "in_flight": self._in_flight,
            "waiting": len(self._waiters),
            "max_concurrency_observed": self._max_in_flight,
            # the same, less calls whose client had hung up unnoticed (x-sim-hangup-notice)
            "max_live_concurrency_observed": self._max_live,
            "unnoticed_hangups": self._gone,
            "attempts_by_request_id": dict(self._attempts),
            "dropped": self._dropped,
            "stalled": self._stalled,
            "held": {name: len(held) for name, held in self._holds.items()},
            "connections": self._connections,
            "unauthorized": self._unauthorized,
            "hangups": len(self._hangups),  # calls whose client closed before the answer
            # usage of the 200s generated (held ones too, and ones whose client hung up)
            "prompt_tokens": self._prompt_tokens,
            "completion_tokens": self._completion_tokens,
            **({"engine": self._engine.stats()} if self._engine is not None else {}),
        }

    @_on_loop
    def engine_stats(self) -> dict[str, Any]:
        """The engine's state and counters (``GET /sim/engine``); LookupError without one."""
        return self._need_engine().stats()

    @_on_loop
    def set_capacity(self, replicas: float) -> dict[str, Any]:
        """Give the engine ``replicas`` times its configured capacity from its next step on
        (``POST /sim/engine {"replicas": R}``): 0.5 when one of two replicas is lost, 1.5 when
        one is added to two. Its KV cache, seats (max_num_seqs) and token budget scale by R,
        the per-sequence and per-token step costs by 1/R; ValueError unless R > 0."""
        self._need_engine().set_capacity(replicas)
        return self.engine_stats()

    def _need_engine(self) -> EngineFront:
        if self._engine is None:
            raise LookupError("the simulator has no engine (start it with --engine)")
        return self._engine

    @_on_loop
    def tokens(self) -> list[tuple[float, int, int, str | None]]:
        """(arrival, prompt tokens, completion tokens, x-request-id) per 200 generated."""
        return list(self._token_log)

    @_on_loop
    def hangups(self) -> list[tuple[float, str | None, float]]:
        """(Unix time, x-request-id, Unix time it arrived) per call whose client hung up
        before it was answered (``GET /sim/hangups``): a cancel that closed the connection."""
        return list(self._hangups)

    @_on_loop
    def received_headers(self, name: str) -> list[list[tuple[str, str]]]:
        """The headers, as received (every one, in order, names lower-cased, duplicates
        kept), of each call carrying ``x-sim-record-headers: <name>`` since the last reset
        (``GET /sim/headers?name=<name>``); at most ``RECORD_CAP`` calls are kept."""
        return [list(call) for call in self._recorded.get(name, ())]

    @_on_loop
    def script_fault(
        self,
        request_id: str,
        fail_first: int,
        status: int = 503,
        retry_after: float | None = None,
        mode: str = "status",
        dropped_reason: str | None = None,
    ) -> None:
        """Make the first ``fail_first`` attempts of ``request_id`` fail (``POST /sim/faults``)."""
        retry = None if retry_after is None else f"{retry_after:g}"
        self._faults[request_id] = _Fault(fail_first, status, retry, mode, dropped_reason)

    @_on_loop
    def release(self, name: str) -> int:
        """Answer every request held under ``name`` and let later ones pass; how many were held."""
        self._released.add(name)
        held = [fut for fut in self._holds.pop(name, ()) if not fut.done()]
        for fut in held:
            self._let_go(fut)
        return len(held)

    def _let_go(self, hold: asyncio.Future[bool]) -> None:
        """End a hold (and the engine's hold on its sequence: it finishes now)."""
        _wake(hold)
        if (job := self._held_jobs.pop(hold, None)) is not None and self._engine is not None:
            self._engine.release(job)

    @_on_loop
    def release_all(self) -> int:
        return sum(self.release(name) for name in list(self._holds))

    @_on_loop
    def held(self, name: str) -> int:
        return len(self._holds.get(name, ()))

    def wait_held(self, name: str, n: int = 1, timeout_s: float = 30.0) -> None:
        """Return once at least ``n`` requests are held under ``name``; else TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while (got := self.held(name)) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{got} of {n} requests held under {name!r}")
            time.sleep(0.005)

    def _metrics(self) -> str:
        rows = [
            ("num_requests_running", "gauge", "Requests currently running.", self._in_flight),
            ("num_requests_waiting", "gauge", "Requests waiting for a slot.", len(self._waiters)),
            ("request_success_total", "counter", "Successful requests.", self._by_status.get(200)),
        ]  # fmt: skip
        lines = []
        if self._engine is not None:  # the engine's running and waiting, and its series
            lines, rows = self._engine.metrics(self.config.model_name), rows[2:]
        for name, kind, help_text, value in rows:
            lines += [f"# HELP vllm:{name} {help_text}", f"# TYPE vllm:{name} {kind}"]
            lines.append(f'vllm:{name}{{model_name="{self.config.model_name}"}} {value or 0}')
        return "\n".join(lines) + "\n"

    async def _post_fault(self, request: Request) -> Response:
        try:
            spec = json.loads(await request.body())
            retry, dropped = spec.get("retry_after"), spec.get("dropped_reason")
            self.script_fault(
                str(spec["id"]), int(spec.get("fail_first", 1)), int(spec.get("status", 503)),
                None if retry is None else float(retry), str(spec.get("mode", "status")),
                None if dropped is None else str(dropped),
            )  # fmt: skip
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            return _error(400, f"bad fault spec: {exc!r}")
        return _json({"ok": True})

    async def _engine_endpoint(self, request: Request) -> Response:
        if self._engine is None:
            return _error(404, "the simulator has no engine (start it with --engine)")
        if request.method == "POST":
            try:
                replicas = orjson.loads(await request.body())["replicas"]
                if isinstance(replicas, bool) or not isinstance(replicas, int | float):
                    raise ValueError("'replicas' must be a number")
                self.set_capacity(float(replicas))
            except (ValueError, TypeError, KeyError) as exc:
                return _error(400, f'bad engine spec, want {{"replicas": R}} with R > 0: {exc}')
        return _json(self.engine_stats())

    async def _get_headers(self, request: Request) -> Response:
        return _json(self.received_headers(request.query_params.get("name", "")))

    async def _post_release(self, request: Request) -> Response:
        try:
            name = json.loads(await request.body())["name"]
        except (ValueError, TypeError, KeyError) as exc:
            return _error(400, f'bad release spec, want {{"name": ...}}: {exc!r}')
        if not isinstance(name, str) or not name:
            return _error(400, "'name' must be a non-empty string")
        return _json({"released": self.release(name)})

    # -- an inference call --------------------------------------------------------------------

    async def _inference(self, scope: Scope, receive: Receive, send: Send) -> None:
        """An inference call, as an ASGI app: its slot is freed once its answer is written."""
        if scope["method"] != "POST":
            return await _error(405, "use POST")(scope, receive, send)
        request = Request(scope, receive)
        rid = request.headers.get("x-request-id")
        call = _Call(time.monotonic(), rid, _peer(scope.get("client")))
        try:
            reply = await self._answer(call, request)
            if isinstance(reply, StreamReply):  # counts its 200 before its last event
                await reply(scope, receive, send)
                reply = reply if reply.completed else None
            elif reply is not None:
                self._by_status[reply.status_code] = self._by_status.get(reply.status_code, 0) + 1
                await reply(scope, receive, send)
            if reply is not None:  # None: the client hung up, or the connection was dropped
                if self.config.record_arrivals:
                    self._arrivals.append((call.arrival, time.monotonic(), rid))
            elif not call.faulted:  # the client hung up first: generation stops (as vLLM's)
                now = time.time()
                self._hangups.append((now, rid, now - (time.monotonic() - call.arrival)))
        finally:
            self._free(call)
            if call.on_end is not None:
                call.on_end()

    async def _answer(self, call: _Call, request: Request) -> Response | None:
        """Count and check ``call``, then admit it (or queue it, or turn it away) and run it."""
        self._requests += 1
        if call.rid is not None:
            call.attempt = self._attempts[call.rid] = self._attempts.get(call.rid, 0) + 1
        record = request.headers.get("x-sim-record-headers")
        if record is not None and self._recorded_calls < RECORD_CAP:
            self._recorded_calls += 1
            raw = request.scope["headers"]
            got = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw]
            self._recorded.setdefault(record, []).append(got)
        cfg = self.config
        if cfg.api_key and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            self._unauthorized += 1
            return _error(401, "missing or wrong API key")
        try:
            self._parse(call, request, await request.body())
        except ClientDisconnect:
            return None
        except _BadRequest as exc:
            return _error(400, str(exc))
        if cfg.max_concurrency and self._in_flight >= cfg.max_concurrency:
            if cfg.overload != "queue":
                retry = f"{cfg.overload_retry_after_s:g}"
                status = 503 if cfg.overload == "503" else 429
                return _error(status, "server overloaded", retry, cfg.overload_dropped_reason)
            waiter = self._future()
            self._waiters.append(waiter)
            if not await self._until(call, waiter):
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                return None
            call.admitted = time.monotonic()  # a finishing request handed its slot over
        else:
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)
            self._max_live = max(self._max_live, self._in_flight - self._gone)
        call.slot = True
        fault = call.fault
        if fault is not None and call.attempt <= fault.fail_first:
            return await self._fail(call, fault)
        if cfg.failure_rate and self._fail_rng.random() < cfg.failure_rate:
            return _error(cfg.failure_status, "simulated random failure")
        return await self._complete(call)

    async def _fail(self, call: _Call, fault: _Fault) -> Response | None:
        if fault.mode == "status":
            msg = f"simulated failure (attempt {call.attempt} of {fault.fail_first})"
            return _error(fault.status, msg, fault.retry_after, fault.dropped_reason)
        if fault.mode in ("nested", "truncated", "html"):
            return _bad_body(fault.mode)
        if fault.mode == "stall":
            self._stalled += 1
            if not await self._until(call, self._future(), STALL_CAP_S):
                return None  # the client hung up first (a hang-up, as for a 200)
        else:
            self._dropped += 1
        call.faulted = True  # the simulator ends the connection
        if (transport := self._transports.get(call.peer)) is not None:
            transport.close()
            await self._until(call, self._future())  # until the connection is gone
        return None

    async def _complete(self, call: _Call) -> Response | None:
        """A 200 once it is due (or released); None if the client hangs up first."""
        cfg = self.config
        completion = call.max_tokens
        if cfg.completion_min_ratio < 1.0 and completion > 0:
            low = math.ceil(max(0.0, cfg.completion_min_ratio) * completion)
            completion = self._length_rng.randint(low, completion)
        if self._engine is not None:
            return await self._generate(self._engine, call, completion)
        delay_ms = call.latency_ms
        if delay_ms is None:
            delay_ms = cfg.latency_ms + cfg.itl_ms * completion
            if cfg.jitter_ms:
                delay_ms += self._jitter_rng.uniform(0.0, cfg.jitter_ms)
        reply = self._completion(call, completion)
        if call.hold is not None and call.hold not in self._released:
            held = self._future()
            self._holds.setdefault(call.hold, set()).add(held)
            try:
                return reply if await self._until(call, held, HOLD_CAP_S) else None
            finally:
                if (others := self._holds.get(call.hold)) is not None:
                    others.discard(held)
                    if not others:
                        del self._holds[call.hold]
        if delay_ms > 0:
            timer = self._future()
            if self._clock is None:
                self._clock = _Clock(asyncio.get_running_loop())
            due = max(call.arrival, call.admitted) + delay_ms / 1000
            self._clock.call_at(due, functools.partial(_wake, timer))
            if not await self._until(call, timer):
                return None
        return reply

    async def _generate(self, front: EngineFront, call: _Call, completion: int) -> Response | None:
        """Through the engine: a 200 once its sequence generated ``completion`` tokens, or a
        stream of them; None if the client hangs up first (its sequence leaves the engine). A
        held request runs as any other and stays in the engine at its last token, keeping its
        seat and KV blocks, until its hold is released."""
        prompt_tokens = self._prompt_tokens_of(call)
        if (too_long := front.too_long(prompt_tokens, call.max_tokens)) is not None:
            return _error(400, too_long)
        held = call.hold is not None and call.hold not in self._released
        job = front.submit(prompt_tokens, completion, call.priority, held)
        if held and call.hold is not None:
            name, hold = call.hold, self._future()
            self._holds.setdefault(name, set()).add(hold)
            self._held_jobs[hold] = job
            cap = asyncio.get_running_loop().call_later(HOLD_CAP_S, self._let_go, hold)

            def unhold() -> None:
                cap.cancel()
                self._held_jobs.pop(hold, None)
                if (others := self._holds.get(name)) is not None:
                    others.discard(hold)
                    if not others:
                        del self._holds[name]

            call.on_end = unhold
        if call.stream:
            usage = _usage(prompt_tokens, completion) if call.include_usage else None

            def done() -> None:
                self._by_status[200] = self._by_status.get(200, 0) + 1
                self._count_usage(call, prompt_tokens, completion)

            return StreamReply(
                front, job, functools.partial(self._until, call), self._head(call, "chunk"),
                _fake_text(call.prompt, completion), _finish(call, completion), usage, done,
            )  # fmt: skip
        if not await self._until(call, job.done):
            front.cancel(job)
            return None
        if job.error is not None:
            return _error(503, job.error)
        return self._completion(call, completion)

    def _call_at(self, when: float, fn: Callable[[], None]) -> None:
        if self._clock is None:
            self._clock = _Clock(asyncio.get_running_loop())
        self._clock.call_at(when, fn)

    @staticmethod
    def _future() -> asyncio.Future[bool]:
        return asyncio.get_running_loop().create_future()

    async def _until(
        self, call: _Call, fut: asyncio.Future[bool], timeout: float | None = None
    ) -> bool:
        """Wait for ``fut``: True when it fires (or after ``timeout`` s), False if the client
        hangs up first (``connection_lost`` settles it; with late notice, once ``fut`` fires:
        the answer's write finds the connection closed)."""
        if call.late_notice:
            return await self._until_written(call, fut, timeout)
        if call.peer not in self._transports:
            return False
        self._waiting[call.peer] = fut
        loop = asyncio.get_running_loop()
        cap = None if timeout is None else loop.call_later(timeout, _wake, fut)
        try:
            return await fut
        finally:
            self._waiting.pop(call.peer, None)
            if cap is not None:
                cap.cancel()

    async def _until_written(
        self, call: _Call, fut: asyncio.Future[bool], timeout: float | None
    ) -> bool:
        """:meth:`_until` for a late-notice call: its hang-up only marks it ``gone``."""
        if call.peer not in self._transports:
            call.gone = True
            self._gone += 1
        else:
            self._late[call.peer] = call
        loop = asyncio.get_running_loop()
        cap = None if timeout is None else loop.call_later(timeout, _wake, fut)
        try:
            await fut
        finally:
            self._late.pop(call.peer, None)
            if cap is not None:
                cap.cancel()
        return not call.gone

    def _hung_up(self, peer: _Peer) -> None:
        """``peer``'s connection closed: its late-notice call, if any, goes on unknowing."""
        call = self._late.pop(peer, None)
        if call is not None and not call.gone:
            call.gone = True
            self._gone += 1

    def _free(self, call: _Call) -> None:
        """Give ``call``'s slot straight to the oldest queued request, or back."""
        if call.gone:
            call.gone = False
            self._gone -= 1
        if not call.slot:
            return
        call.slot = False
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                return
        self._in_flight -= 1

    def _parse(self, call: _Call, request: Request, body: bytes) -> None:
        try:
            payload = orjson.loads(body)
        except ValueError as exc:
            raise _BadRequest(f"invalid JSON body: {exc}") from None
        if not isinstance(payload, dict):
            raise _BadRequest("JSON body must be an object")
        call.chat = request.scope["path"].endswith("/chat/completions")
        if call.chat:
            messages = payload.get("messages")
            if not isinstance(messages, list):
                raise _BadRequest("'messages' must be a list")
            call.prompt = "\n".join(
                str(m.get("content", "")) for m in messages if isinstance(m, dict)
            )
            per_message, per_prompt = self._template(request)
            call.template_tokens = per_message * len(messages) + per_prompt
        else:
            raw = payload.get("prompt", "")
            call.prompt = raw if isinstance(raw, str) else json.dumps(raw)
        max_tokens = payload.get("max_tokens", payload.get("max_completion_tokens", 16))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise _BadRequest("'max_tokens' must be a non-negative integer")
        call.max_tokens = max_tokens
        call.model = str(payload.get("model") or self.config.model_name)
        h = request.headers
        call.hold = h.get("x-sim-hold") or None
        call.late_notice = h.get("x-sim-hangup-notice") == "write"
        call.fault = self._faults.get(call.rid or "")
        try:
            if "x-sim-latency-ms" in h:
                call.latency_ms = float(h["x-sim-latency-ms"])
            if "x-sim-fail-first" in h:
                call.fault = _Fault(
                    int(h["x-sim-fail-first"]), int(h.get("x-sim-fail-status", "503")),
                    h.get("x-sim-retry-after"), h.get("x-sim-fail-mode", "status"),
                    h.get("x-sim-dropped-reason"),
                )  # fmt: skip
        except ValueError as exc:
            raise _BadRequest(f"bad x-sim-* header: {exc}") from None
        if self._engine is not None:
            if call.latency_ms is not None:
                raise _BadRequest("x-sim-latency-ms does not apply to a simulator with an engine")
            try:
                call.priority, call.stream, call.include_usage = request_fields(
                    payload, self._engine.engine.config
                )
            except ValueError as exc:
                raise _BadRequest(str(exc)) from None

    def _template(self, request: Request) -> tuple[int, int]:
        """The chat template's tokens (per message, per prompt): ``x-sim-template-tokens:
        M[,P]`` or the config's."""
        header = request.headers.get("x-sim-template-tokens")
        if header is None:
            return self.config.template_message_tokens, self.config.template_prompt_tokens
        try:
            m, _, p = header.partition(",")
            got = int(m), int(p or 0)
        except ValueError:
            raise _BadRequest(f"bad x-sim-template-tokens header: {header!r}") from None
        if min(got) < 0:
            raise _BadRequest(f"bad x-sim-template-tokens header: {header!r}")
        return got

    def _completion(self, call: _Call, completion: int) -> Response:
        """A 200 with ``completion`` tokens, counted."""
        text = _fake_text(call.prompt, completion)
        prompt_tokens = self._prompt_tokens_of(call)
        self._count_usage(call, prompt_tokens, completion)
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(call, completion)}
        if call.chat:
            choice["message"] = {"role": "assistant", "content": text.lstrip()}
        else:
            choice["text"] = text
        usage = _usage(prompt_tokens, completion)
        return _json({**self._head(call), "choices": [choice], "usage": usage})

    @staticmethod
    def _prompt_tokens_of(call: _Call) -> int:
        """A prompt token is a word, plus a chat template's tokens."""
        return len(call.prompt.split()) + call.template_tokens

    def _count_usage(self, call: _Call, prompt_tokens: int, completion: int) -> None:
        self._prompt_tokens += prompt_tokens
        self._completion_tokens += completion
        if self.config.record_arrivals:
            self._token_log.append((call.arrival, prompt_tokens, completion, call.rid))

    def _head(self, call: _Call, suffix: str = "") -> dict[str, Any]:
        """An answer's id, object (``suffix`` "chunk": a streamed one's), created and model."""
        kind = "chat.completion" if call.chat else "text_completion"
        return {
            "id": f"{'chatcmpl' if call.chat else 'cmpl'}-sim{next(self._ids)}",
            "object": f"{kind}.{suffix}" if suffix and call.chat else kind,
            "created": int(time.time()),
            "model": call.model,
        }

    # -- serving ------------------------------------------------------------------------------

    def start_in_thread(self, timeout_s: float = 10.0) -> SimServer:
        if self._thread is None:
            started = concurrent.futures.Future[None]()
            self._thread = threading.Thread(
                target=self._main, args=(started,), name=f"sim-{self.port}", daemon=True
            )
            self._thread.start()
            started.result(timeout=timeout_s)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)

    def __enter__(self) -> SimServer:
        return self.start_in_thread()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _main(self, started: concurrent.futures.Future[None]) -> None:
        try:  # a uvloop loop when uvloop is installed
            import uvloop

            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(self._listen())
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits
            loop.close()
            started.set_exception(exc)
            return
        self.port = server.sockets[0].getsockname()[1]
        started.set_result(None)
        try:
            loop.run_forever()
            server.close()  # stop: drop every connection and end the calls still open
            if self._clock is not None:
                self._clock.close()
            for transport in list(self._transports.values()):
                transport.abort()
            for task in list(self._tasks):
                task.cancel()
            loop.run_until_complete(asyncio.gather(*self._tasks, return_exceptions=True))
        finally:
            loop.close()

    async def _listen(self) -> asyncio.Server:
        """Serve the app with uvicorn's HTTP protocol (httptools' parser when installed)."""
        cfg, sim = self.config, self

        class Protocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
            """uvicorn's protocol; the simulator keeps each transport to count connections,
            drop one (``x-sim-fail-mode: drop``), see its client go and close all at stop()."""

            def connection_made(self, transport: asyncio.Transport) -> None:
                super().connection_made(transport)
                sim._connections += 1
                self.peer = _peer(transport.get_extra_info("peername"))
                sim._transports[self.peer] = transport

            def connection_lost(self, exc: Exception | None) -> None:
                sim._transports.pop(self.peer, None)
                sim._hung_up(self.peer)
                if (fut := sim._waiting.pop(self.peer, None)) is not None:
                    _wake(fut, False)
                super().connection_lost(exc)

        config = uvicorn.Config(
            self.app, http=Protocol, lifespan="off", log_config=None, access_log=False,
            proxy_headers=False, timeout_keep_alive=86_400,  # idle connections stay open
            ssl_certfile=cfg.tls_cert_file, ssl_keyfile=cfg.tls_key_file,
            ssl_ca_certs=cfg.tls_client_ca_file,
            ssl_cert_reqs=ssl.CERT_REQUIRED if cfg.tls_client_ca_file else ssl.CERT_NONE,
        )  # fmt: skip
        config.load()
        state = ServerState()
        self._tasks = state.tasks
        return await asyncio.get_running_loop().create_server(
            lambda: Protocol(config=config, server_state=state, app_state={}),
            self.host, self.port, ssl=config.ssl, backlog=1024,
        )  # fmt: skip


# -- CLI ----------------------------------------------------------------------------------------


def _ranged(cast: Callable[[str], Any], lo: float, hi: float, kind: str) -> Callable[[str], Any]:
    """An argparse type: a finite number in [lo, hi]; the message names the range."""

    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and lo <= value <= hi):
            raise argparse.ArgumentTypeError(f"must be {kind}, not {text!r}")
        return value

    return parse


_port = _ranged(int, 0, 65535, "a TCP port 0-65535 (0: any free port)")
_count = _ranged(int, 0, 2**31, "an integer >= 0")
_ms = _ranged(float, 0, 1e9, "a number of ms >= 0")
_seconds = _ranged(float, 0, 1e9, "a number of s >= 0")
_ratio = _ranged(float, 0, 1, "a number 0..1")
_status = _ranged(int, 100, 599, "an HTTP status 100-599")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Each option's ``dest`` is the :class:`SimConfig` field it sets."""
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="bind address")
    add("--port", type=_port, default=8000, help="TCP port (0 = any free port)")
    add("--latency-ms", type=_ms, default=0.0, help="base latency per request, ms")
    add("--jitter-ms", type=_ms, default=0.0, help="extra uniform random latency, ms")
    add("--itl-ms", type=_ms, default=0.0, help="latency per generated token, ms")
    add("--max-concurrency", type=_count, default=0, help="admitted at once (0 = unlimited)")
    add("--overload", choices=("429", "503", "queue"), default="429", help="above the limit")
    add("--retry-after", dest="overload_retry_after_s", type=_seconds, default=1.0,
        help="Retry-After on overload, seconds")  # fmt: skip
    add("--dropped-reason", dest="overload_dropped_reason",
        help="x-llm-d-request-dropped-reason on overload")  # fmt: skip
    add("--failure-rate", type=_ratio, default=0.0, help="random failure probability, 0..1")
    add("--failure-status", type=_status, default=503, help="status of random failures")
    add("--seed", type=int, default=0, help="RNG seed for failures, jitter and lengths")
    add("--record-arrivals", action="store_true",
        help="record arrivals (GET /sim/arrivals) and tokens (GET /sim/tokens)")  # fmt: skip
    add("--completion-min-ratio", type=_ratio, default=1.0,
        help="completion tokens drawn from [ratio x max_tokens, max_tokens]")  # fmt: skip
    add("--template-message-tokens", type=_count, default=0, metavar="N",
        help="chat prompt tokens a template adds per message")  # fmt: skip
    add("--template-prompt-tokens", type=_count, default=0, metavar="N",
        help="chat prompt tokens a template adds per prompt")  # fmt: skip
    add("--api-key-env", metavar="VAR", help="require 'Authorization: Bearer $VAR' (else 401)")
    add("--tls-cert", dest="tls_cert_file", metavar="PEM", help="serve HTTPS with this cert")
    add("--tls-key", dest="tls_key_file", metavar="PEM", help="the certificate's private key")
    add("--tls-client-ca", dest="tls_client_ca_file", metavar="PEM",
        help="require client certificates signed by this CA")  # fmt: skip
    engine_cli.add_arguments(parser)


def _bad_argument(message: str) -> None:
    """A bad argument: exit status 2 with one line, as argparse's own."""
    print(f"pipeline sim: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_from_args(args: argparse.Namespace) -> int:
    if args.tls_client_ca_file and not args.tls_cert_file:
        _bad_argument("--tls-client-ca needs --tls-cert (and --tls-key)")
    for option in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        path = getattr(args, option)
        if path and not os.path.isfile(path):
            _bad_argument(f"--{option.removesuffix('_file').replace('_', '-')}: no file {path}")
    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    if args.api_key_env and not key:
        _bad_argument(f"--api-key-env: {args.api_key_env} is not set (or empty)")
    engine = engine_cli.config_from_args(args)
    fields = {f.name for f in dataclasses.fields(SimConfig)} & vars(args).keys()
    values = {name: getattr(args, name) for name in fields}
    config = SimConfig(**values, api_key=key, engine=engine)
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # the server's threads inherit the mask
    with SimServer(config, args.host, args.port) as server:
        print(f"simulator listening on {server.url}", flush=True)
        signal.sigwait(stop)
    return 0
