"""The engine model's HTTP side: an :class:`~.engine.Engine` driven in real time on the
simulator's loop (its clock is ``time.monotonic()``), its requests' futures, vLLM's metrics
and streamed answers. Everything here runs on the simulator's loop."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .engine import Engine, EngineConfig, Event, block_hashes
from .engine import Sequence as EngineSequence

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ABORTED = "the request no longer fits the engine's KV cache (its capacity was reduced)"


def request_fields(payload: dict[str, Any], config: EngineConfig) -> tuple[int, bool, bool]:
    """The body's ``priority``, ``stream`` and ``stream_options.include_usage``, checked as
    vLLM checks them; ValueError naming the field."""
    priority = payload.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError("'priority' must be an integer")
    if priority and config.scheduling_policy != "priority":
        raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")
    stream, options = payload.get("stream", False), payload.get("stream_options")
    if not isinstance(stream, bool):
        raise ValueError("'stream' must be a boolean")
    if options is not None:
        if not isinstance(options, dict):
            raise ValueError("'stream_options' must be an object")
        if not stream:
            raise ValueError("'stream_options' is only allowed when 'stream' is true")
        if not isinstance(options.get("include_usage", False), bool):
            raise ValueError("'stream_options.include_usage' must be a boolean")
    return priority, stream, bool(options and options.get("include_usage"))


class Histogram:
    """A Prometheus histogram: cumulative buckets, sum and count."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                return

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            total += n
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {total}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.sum!r}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


@dataclass(eq=False, slots=True)
class Job:
    """One request in the engine, as the HTTP side waits for it."""

    seq: EngineSequence
    first: asyncio.Future[bool]  # its first token (or an abort)
    done: asyncio.Future[bool]  # its last token (or an abort)
    error: str | None = None


class EngineFront:
    """Drives the engine in real time: every call advances it to ``time.monotonic()``,
    settles what happened (futures, metrics) and sets a timer for its next step boundary.
    ``call_at(when, fn)`` runs ``fn`` on the loop at monotonic time ``when`` (never early)."""

    def __init__(self, config: EngineConfig, call_at: Callable[[float, Callable[[], None]], None]):
        self.engine = Engine(config, time.monotonic())
        self._call_at = call_at
        self._timers: list[float] = []  # when the timers set and not yet fired are due
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Counters and histograms start again (the sequences in the engine stay)."""
        c = self.engine.counters
        self._base = (c.preemptions, c.finished, c.aborted, self.engine.steps)
        self._prefix_base = (c.prefix_queries, c.prefix_hits)
        c.max_running, c.max_waiting = self.engine.running, self.engine.waiting
        self.prompt_tokens = self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue_time = Histogram(LATENCY_BUCKETS)

    # -- requests -----------------------------------------------------------------------------

    def too_long(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """vLLM's 400 message when the request exceeds the model's context, else None."""
        limit, total = self.engine.config.model_len, prompt_tokens + max_tokens
        if total <= limit:
            return None
        return (
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{total} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion."
        )

    def submit(
        self, prompt_tokens: int, output_tokens: int, priority: int, held: bool, text: str = ""
    ) -> Job:
        """Queue a request in the engine (``text``: its prompt, a token per word, for the
        prefix cache); ValueError if it never could run."""
        loop = asyncio.get_running_loop()
        rid = next(self._ids)
        cfg = self.engine.config
        hashes = block_hashes(text.split(), cfg.block_size) if cfg.enable_prefix_caching else ()
        seq = self.engine.add(
            rid, prompt_tokens, output_tokens, time.monotonic(), priority, held, hashes
        )
        job = self._jobs[rid] = Job(seq, loop.create_future(), loop.create_future())
        self._settle()
        return job

    def cancel(self, job: Job) -> None:
        """The client hung up: the sequence leaves the engine and frees what it held."""
        if self._jobs.pop(job.seq.rid, None) is not None:  # type: ignore[call-overload]
            self.engine.abort(job.seq, time.monotonic())
            self._settle()

    def release(self, job: Job) -> None:
        """The hold on ``job`` ended: it finishes now if parked, else when it is done."""
        if job.seq.rid in self._jobs:
            self.engine.release(job.seq, time.monotonic())
            self._settle()

    def set_capacity(self, replicas: float) -> None:
        """ValueError unless ``replicas`` is a number above 0."""
        self.engine.set_capacity(replicas, time.monotonic())
        self._settle()

    # -- the clock ----------------------------------------------------------------------------

    def _settle(self) -> None:
        for event in self.engine.take_events():
            self._dispatch(event)
        at = self.engine.next_event_at()
        if at is None or self._timers and self._timers[0] <= at:
            return  # idle, or an earlier timer will look again
        heapq.heappush(self._timers, at)
        self._call_at(at, lambda: self._fire(at))

    def _fire(self, at: float) -> None:
        while self._timers and self._timers[0] <= at:
            heapq.heappop(self._timers)
        self.engine.advance(time.monotonic())
        self._settle()

    def _dispatch(self, event: Event) -> None:
        seq = event.seq
        rid: int = seq.rid  # type: ignore[assignment]
        if event.kind == "first":
            self.ttft.observe(event.at - seq.arrival)
            if (job := self._jobs.get(rid)) is not None:
                _set(job.first)
        elif event.kind == "finish":
            self.e2e.observe(event.at - seq.arrival)
            queued = event.at if seq.scheduled_at is None else seq.scheduled_at
            self.queue_time.observe(queued - seq.arrival)
            self.prompt_tokens += seq.prompt_tokens
            self.generation_tokens += seq.output_tokens
            if (job := self._jobs.pop(rid, None)) is not None:
                _set(job.first)
                _set(job.done)
        elif event.kind == "abort" and (job := self._jobs.pop(rid, None)) is not None:
            job.error = ABORTED
            _set(job.first)
            _set(job.done)

    # -- what it shows ------------------------------------------------------------------------

    def _now(self) -> Engine:
        self.engine.advance(time.monotonic())
        self._settle()
        return self.engine

    def stats(self) -> dict[str, Any]:
        """The engine's state now and its counters since the last reset (``/sim/stats``)."""
        engine = self._now()
        cfg, c = engine.config, engine.counters
        preemptions, finished, aborted, steps = self._base
        return {
            "preset": cfg.name,
            "time_scale": cfg.time_scale,
            "replicas": engine.replicas,
            "scheduling_policy": cfg.scheduling_policy,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "kv_cache_tokens": cfg.num_blocks * cfg.block_size,
            "running": engine.running,  # parked ones included
            "parked": engine.parked,  # held at their last token (x-sim-hold)
            "waiting": engine.waiting,
            "kv_cache_usage": engine.kv_usage,
            "kv_blocks_used": engine.kv_blocks,
            "kv_blocks_total": engine.num_blocks,
            "steps": engine.steps - steps,
            "preemptions": c.preemptions - preemptions,
            "finished": c.finished - finished,
            "aborted": c.aborted - aborted,
            "max_running_observed": c.max_running,
            "max_waiting_observed": c.max_waiting,
            "prefix_caching": cfg.enable_prefix_caching,
            "prefix_cache_queries": c.prefix_queries - self._prefix_base[0],  # tokens
            "prefix_cache_hits": c.prefix_hits - self._prefix_base[1],
        }

    def metrics(self, model_name: str) -> list[str]:
        """vLLM's series (names, types and label ``model_name`` as vLLM's), as text lines."""
        engine = self._now()
        labels = f'model_name="{model_name}"'
        usage = engine.kv_usage
        preemptions = engine.counters.preemptions - self._base[0]
        rows: list[tuple[str, str, str, float]] = [
            ("num_requests_running", "gauge", "Number of requests in model execution batches.",
             engine.running),
            ("num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
             engine.waiting),
            ("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage),
            ("gpu_cache_usage_perc", "gauge",
             "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use "
             "vllm:kv_cache_usage_perc instead.", usage),
            ("num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
             preemptions),
            ("prompt_tokens_total", "counter", "Number of prefill tokens processed.",
             self.prompt_tokens),
            ("generation_tokens_total", "counter", "Number of generation tokens processed.",
             self.generation_tokens),
        ]  # fmt: skip
        if engine.config.enable_prefix_caching:  # vLLM's, in tokens
            c, (queries, hits) = engine.counters, self._prefix_base
            rows += [
                ("prefix_cache_queries_total", "counter",
                 "Prefix cache queries, in terms of number of queried tokens.",
                 c.prefix_queries - queries),
                ("prefix_cache_hits_total", "counter",
                 "Prefix cache hits, in terms of number of cached tokens.", c.prefix_hits - hits),
            ]  # fmt: skip
        lines = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP vllm:{name} {help_text}", f"# TYPE vllm:{name} {kind}"]
            lines.append(f"vllm:{name}{{{labels}}} {value}")
        histograms = [
            ("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
             self.ttft),
            ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
             self.e2e),
            ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
             self.queue_time),
        ]  # fmt: skip
        for name, help_text, histogram in histograms:
            lines += [f"# HELP vllm:{name} {help_text}", f"# TYPE vllm:{name} histogram"]
            lines += histogram.lines(f"vllm:{name}", labels)
        return lines


def _set(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(True)


class StreamReply(Response):
    """An answer streamed as OpenAI's server-sent events: the first token once the engine
    prefilled the prompt, the rest (with the finish reason) once the sequence is done, the
    usage chunk when asked (``stream_options.include_usage``), then ``data: [DONE]``.
    ``wait(fut)`` is False if the client hung up first; then the sequence is cancelled."""

    def __init__(
        self,
        front: EngineFront,
        job: Job,
        wait: Callable[[asyncio.Future[bool]], Awaitable[bool]],
        head: dict[str, Any],
        text: str,
        finish_reason: str,
        usage: dict[str, Any] | None,
        on_done: Callable[[], None],
    ) -> None:
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache")]  # fmt: skip
        self.front, self.job, self.wait = front, job, wait
        cut = text.find(" ", 1)  # the first token: text is " token token ..."
        first, rest = (text, "") if cut < 0 else (text[:cut], text[cut:])
        self.chat = head["object"] == "chat.completion.chunk"
        self.head, self.finish_reason = head, finish_reason
        self.pieces = (first.lstrip() if self.chat else first, rest)
        self.usage, self.on_done = usage, on_done
        self.completed = False  # every event was written

    def _chunk(self, text: str, finish_reason: str | None, first: bool = False) -> bytes:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        body = {**self.head, "choices": [choice]}
        if self.usage is not None:
            body["usage"] = None
        return b"data: " + orjson.dumps(body) + b"\n\n"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        job, first, rest = self.job, *self.pieces
        if not await self.wait(job.first):
            return self.front.cancel(job)
        if job.error is None and job.seq.output_tokens:
            await _body(send, self._chunk(first, None, first=True))
        if not await self.wait(job.done):
            return self.front.cancel(job)
        if job.error is not None:
            error = {"error": {"message": job.error, "type": "server_error", "code": 503}}
            await _body(send, b"data: " + orjson.dumps(error) + b"\n\n")
        else:
            self.on_done()
            await _body(send, self._chunk(rest, self.finish_reason, not job.seq.output_tokens))
            if self.usage is not None:
                usage = {**self.head, "choices": [], "usage": self.usage}
                await _body(send, b"data: " + orjson.dumps(usage) + b"\n\n")
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        self.completed = True


async def _body(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})
