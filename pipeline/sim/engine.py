"""A continuous-batching engine in virtual time, modelled on vLLM v1's scheduler: pure and
deterministic, driven by whoever owns the clock (the simulator in real time, the tests in
virtual seconds). docs/development.md, "The engine model", says what is modelled and what not.

A step runs one token for every running sequence plus the whole prefill of the prompts
admitted in it, and takes ``base + per_seq x running + per_prefill_token x prefill tokens``
seconds. KV use is counted in blocks of ``block_size`` tokens: a sequence holding ``x``
tokens (prompt + generated) holds ``ceil(x / block_size)`` blocks, allocated when the step
that needs them is scheduled. Between two events (a sequence finishing, the cache about to
overflow, an arrival, an abort, a capacity change) the batch does not change, so the engine
advances over many steps at once: each running sequence's token count is ``offset + step``,
the blocks it needs next depend only on ``offset mod block_size`` (16 counters), and the
finishing order comes from a heap keyed by the step a sequence completes. Every operation
costs O(block_size + log n), never O(running)."""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute",)  # vLLM v1's only mode; swapping is not modelled


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine (one replica); durations in seconds, already multiplied by ``time_scale``."""

    step_base_s: float  # a step's fixed cost (reading the weights once)
    step_per_seq_s: float  # per running sequence in the step
    step_per_prefill_token_s: float  # per prompt token prefilled in the step
    kv_cache_tokens: int  # the KV cache, in tokens (rounded down to whole blocks)
    max_num_seqs: int  # running sequences at most (vLLM's --max-num-seqs)
    max_num_batched_tokens: int  # tokens per step (vLLM's --max-num-batched-tokens)
    max_model_len: int = 0  # prompt + max_tokens at most; 0: the KV cache's size
    block_size: int = 16  # vLLM's default block size, in tokens
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" (lower "priority" value first)
    preemption: str = "recompute"
    # vLLM's automatic prefix caching (--enable-prefix-caching): a request's full prompt
    # blocks are kept by their hashes, shared by the running sequences that hold them and, once
    # none does, kept in free blocks (evicted least recently used first) until a new block needs
    # the room; a prompt whose leading blocks are cached skips their prefill
    enable_prefix_caching: bool = False
    name: str = "custom"
    time_scale: float = 1.0  # the factor already applied to the three durations

    def __post_init__(self) -> None:
        """ValueError naming the field."""
        for name in ("step_base_s", "time_scale"):
            if not _finite(getattr(self, name)) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a number above 0")
        for name in ("step_per_seq_s", "step_per_prefill_token_s"):
            if not _finite(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a number of at least 0")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError("kv_cache_tokens must hold at least one block")
        if self.max_model_len < 0 or self.max_model_len > self.kv_cache_tokens:
            raise ValueError("max_model_len must be between 0 and kv_cache_tokens")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}")

    @property
    def model_len(self) -> int:
        """The longest sequence accepted (prompt + max_tokens), tokens."""
        return self.max_model_len or self.kv_cache_tokens

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size

    def step_time(self, running: int, prefill_tokens: int = 0) -> float:
        """Seconds one step takes with ``running`` sequences and ``prefill_tokens`` to prefill."""
        return (
            self.step_base_s
            + self.step_per_seq_s * running
            + self.step_per_prefill_token_s * prefill_tokens
        )

    def scaled(self, factor: float) -> EngineConfig:
        """Every duration times ``factor`` (0.1: ten times faster; throughput x 10)."""
        if not _finite(factor) or factor <= 0:
            raise ValueError("time_scale must be a number above 0")
        return dataclasses.replace(
            self,
            step_base_s=self.step_base_s * factor,
            step_per_seq_s=self.step_per_seq_s * factor,
            step_per_prefill_token_s=self.step_per_prefill_token_s * factor,
            time_scale=self.time_scale * factor,
        )

    def with_replicas(self, replicas: float) -> EngineConfig:
        """``replicas`` copies of this engine as one: the cache, the seats and the token budget
        times ``replicas``; the per-sequence and per-token costs divided by it (the replicas
        share the batch); the fixed cost of a step unchanged (they step in parallel)."""
        if not _finite(replicas) or replicas <= 0:
            raise ValueError("replicas must be a number above 0")
        blocks = max(1, int(self.num_blocks * replicas))
        return dataclasses.replace(
            self,
            step_per_seq_s=self.step_per_seq_s / replicas,
            step_per_prefill_token_s=self.step_per_prefill_token_s / replicas,
            kv_cache_tokens=blocks * self.block_size,
            max_num_seqs=max(1, round(self.max_num_seqs * replicas)),
            max_num_batched_tokens=max(1, round(self.max_num_batched_tokens * replicas)),
            max_model_len=min(self.model_len, blocks * self.block_size),
        )


def block_hashes(tokens: list[str], block_size: int) -> list[int]:
    """The hashes of the full blocks of ``tokens``, each chained to the one before (vLLM's:
    a block's hash names every token up to its end, so equal hashes mean equal prefixes)."""
    out: list[int] = []
    parent = 0
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, *tokens[i : i + block_size]))
        out.append(parent)
    return out


def _finite(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


@dataclass(slots=True, eq=False)
class Sequence:
    """One request in the engine. Times are the engine's (virtual) seconds."""

    rid: Hashable
    prompt_tokens: int
    output_tokens: int  # tokens it generates before it finishes
    priority: int
    arrival: float
    order: int  # arrival order, the tie-break of every queue
    held: bool = False  # park at the last token until released (instead of finishing)
    state: str = "waiting"  # waiting | running | parked | finished | aborted
    generated: int = 0  # tokens generated before the current run (kept across preemptions)
    preemptions: int = 0
    scheduled_at: float | None = None  # first admitted
    first_token_at: float | None = None  # end of its first prefill step
    finished_at: float | None = None
    offset: int = 0  # while running: tokens held once step s is allocated = offset + s
    start_step: int = 0  # while running: the step that prefills it
    finish_step: int = 0  # while running: the step that generates its last token
    epoch: int = 0  # bumped at every admission, preemption and abort (stale heap entries)
    parked_blocks: int = 0  # while parked: the blocks it keeps (its own, not the shared ones)
    # its full prompt blocks' hashes (each one naming the whole prefix up to its end)
    block_hashes: tuple[Hashable, ...] = ()
    pool_blocks: int = 0  # while it runs or parks: its blocks kept in the prefix cache
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache

    @property
    def tokens_left(self) -> int:
        return self.output_tokens - self.generated


class Event(NamedTuple):
    """What happened to ``seq`` at engine time ``at``: ``first`` (its first token, end of its
    prefill), ``preempt``, ``park`` (held at its last token), ``finish``, or ``abort`` (it can
    never fit the cache: only after a capacity change)."""

    kind: str
    seq: Sequence
    at: float


@dataclass(slots=True)
class Counters:
    """Totals since the engine started (the caller keeps baselines for a reset)."""

    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    prefill_tokens: int = 0  # prompt tokens prefilled, recomputed ones included
    max_running: int = 0
    max_waiting: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (at each admission)
    prefix_hits: int = 0  # of those, the tokens found there (not prefilled)


@dataclass(slots=True)
class _Segment:
    """``steps`` steps of ``tau`` seconds from ``start``, after ``done`` completed steps; the
    batch does not change inside it."""

    start: float = 0.0
    tau: float = 0.0
    steps: int = 0  # 0: idle (nothing to step)
    done: int = 0
    prefilled: list[Sequence] = field(default_factory=list)  # their first token at its end

    @property
    def end(self) -> float:
        return self.start + self.steps * self.tau


class Engine:
    """The engine's state at its own clock ``now``. Every method that takes ``now`` first
    advances the engine to it (``now`` never goes back); what happened is collected as
    :class:`Event` s for :meth:`take_events`. Not thread-safe: one owner drives it.

    The owner calls :meth:`advance` when :meth:`next_event_at` is due. A request, an abort,
    a release or a capacity change at time T is seen by the step that starts at T (several at
    the same T by the same step): an idle engine starts a step when something arrives, a busy
    one at the end of the step in progress."""

    def __init__(self, config: EngineConfig, now: float = 0.0) -> None:
        self.base_config = config
        self.config = config
        self.replicas = 1.0
        self.now = now
        self.counters = Counters()
        self._bs = config.block_size
        self._num_blocks = config.num_blocks
        self._blocks = 0  # allocated through step self._alloc
        self._alloc = 0
        self._running: dict[Hashable, Sequence] = {}  # admission order; parked ones too
        self._active = 0  # running and not parked: the sequences a step runs
        self._phase = [0] * self._bs  # active sequences by offset mod block_size
        self._finishing: list[tuple[int, int, int, Sequence]] = []  # (step, order, epoch, seq)
        self._fcfs: deque[Sequence] = deque()
        self._heap: list[tuple[int, int, Sequence]] = []  # (priority, order, seq)
        self._waiting = 0
        self._order = 0
        self._seg = _Segment()
        self._due: float | None = None  # idle, with a step to plan at this time
        self._events: list[Event] = []
        # the prefix cache: blocks in use by hash (how many sequences hold each), and the free
        # blocks that still hold a prefix, least recently freed first
        self._refs: dict[Hashable, int] = {}
        self._lru: OrderedDict[Hashable, None] = OrderedDict()

    # -- what the owner calls ----------------------------------------------------------------

    def add(
        self,
        rid: Hashable,
        prompt_tokens: int,
        output_tokens: int,
        now: float,
        priority: int = 0,
        held: bool = False,
        block_hashes: Iterable[Hashable] = (),
    ) -> Sequence:
        """Queue a request; ValueError if it could never run (longer than the model allows,
        or a priority under the fcfs policy, as vLLM refuses). ``block_hashes``: its full
        prompt blocks' (see :func:`block_hashes`), for the prefix cache."""
        if prompt_tokens < 0 or output_tokens < 0:
            raise ValueError("prompt and output tokens must not be negative")
        if prompt_tokens + output_tokens > self.config.model_len:
            raise ValueError(
                f"{prompt_tokens} + {output_tokens} tokens exceed the model's maximum context "
                f"length of {self.config.model_len} tokens"
            )
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")
        self._catch_up(now)
        self._order += 1
        seq = Sequence(rid, prompt_tokens, output_tokens, priority, self.now, self._order, held)
        if self.config.enable_prefix_caching:
            seq.block_hashes = tuple(block_hashes)[: prompt_tokens // self._bs]
        self._push_waiting(seq, front=False)
        self._poke()
        return seq

    def abort(self, seq: Sequence, now: float) -> bool:
        """Take ``seq`` out (its client hung up): its seat and blocks are free at once; False
        if it had already finished or gone."""
        self._catch_up(now)
        if seq.state == "waiting":
            self._waiting -= 1  # its queue entry is skipped when it comes up
        elif seq.state in ("running", "parked"):
            self._cut()
            self._blocks -= self._blocks_of(seq) + self._unpool(seq)
            if seq.state == "running":
                self._deactivate(seq)
            del self._running[seq.rid]
        else:
            return False
        seq.state, seq.epoch = "aborted", seq.epoch + 1
        self.counters.aborted += 1
        self._poke()
        return True

    def release(self, seq: Sequence, now: float) -> None:
        """End ``seq``'s hold: a parked sequence finishes now, one still generating finishes
        as usual."""
        self._catch_up(now)
        seq.held = False
        if seq.state == "parked":
            self._blocks -= seq.parked_blocks + self._unpool(seq)
            del self._running[seq.rid]
            self._finish(seq, self.now)
            self._poke()

    def set_capacity(self, replicas: float, now: float) -> None:
        """``replicas`` times the configured engine from the next step on (a replica lost:
        0.5 of two; one added: 1.5): cache, seats and step costs move
        (:meth:`EngineConfig.with_replicas`). Running sequences the smaller cache cannot hold
        are preempted at the next step, newest first."""
        config = self.base_config.with_replicas(replicas)
        self._catch_up(now)
        self._cut()
        self.config, self.replicas, self._num_blocks = config, replicas, config.num_blocks
        self._poke()

    def advance(self, now: float) -> None:
        """Run every step that ends by ``now`` and plan the ones that start by then."""
        self._catch_up(now, strict=False)

    def next_event_at(self) -> float | None:
        """When the next step boundary with something to do is (None: idle)."""
        return self._seg.end if self._seg.steps else self._due

    def _catch_up(self, now: float, strict: bool = True) -> None:
        """Advance to ``now``; ``strict``: leave a boundary at ``now`` itself for later, so
        that what arrives at ``now`` is planned with it."""
        while True:
            at = self.next_event_at()
            if at is None or at > now or strict and at == now:
                break
            if self._seg.steps:
                self._end_segment()
            else:
                self._due = None
                self._plan(at)
        self.now = max(self.now, now)

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    # -- what it looks like now ----------------------------------------------------------------

    @property
    def running(self) -> int:
        """Sequences holding a seat (parked ones too), as ``vllm:num_requests_running``."""
        return len(self._running)

    @property
    def parked(self) -> int:
        return len(self._running) - self._active

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def steps(self) -> int:
        """Steps completed by ``now``."""
        seg = self._seg
        return seg.done + (self._steps_done(self.now) if seg.steps else 0)

    @property
    def kv_blocks(self) -> int:
        """Blocks in use at ``now`` (those of the step in progress included)."""
        seg = self._seg
        if not seg.steps:
            return self._blocks
        return self._blocks + self._growth(self._alloc, seg.done + self._steps_done(self.now) + 1)

    @property
    def kv_usage(self) -> float:
        """Share of the cache in use, 0..1 (above 1 only just after the cache shrank)."""
        return self.kv_blocks / self._num_blocks

    # -- the scheduler --------------------------------------------------------------------------

    def _steps_done(self, now: float) -> int:
        """Steps of the current segment completed by ``now`` (fewer than all of them)."""
        seg = self._seg
        return min(seg.steps - 1, max(0, int((now - seg.start) / seg.tau)))

    def _cut(self) -> None:
        """End the current segment with the step in progress, so that the next step is planned
        afresh (with whatever changed). Cutting never changes the outcome."""
        seg = self._seg
        if seg.steps <= 1:
            return
        done = self._steps_done(self.now)
        if done:
            self._grow_to(seg.done + done + 1)
            seg.start += done * seg.tau
            seg.done += done
        seg.steps = 1

    def _poke(self) -> None:
        """Something changed: plan now if idle, else at the end of the step in progress."""
        if self._seg.steps:
            self._cut()
        elif self._due is None:
            self._due = self.now

    def _end_segment(self) -> None:
        seg = self._seg
        at = seg.end
        done = seg.done + seg.steps
        self._grow_to(done)
        self._trim_cache(self._blocks)  # the steps' new blocks took the oldest free ones
        seg.done, seg.steps = done, 0
        for seq in seg.prefilled:
            if seq.state in ("running", "parked") and seq.first_token_at is None:
                seq.first_token_at = at
                self._events.append(Event("first", seq, at))
        seg.prefilled = []
        heap = self._finishing
        while heap and heap[0][0] <= done:
            _, _, epoch, seq = heapq.heappop(heap)
            if epoch == seq.epoch and seq.state == "running":
                self._last_token(seq, at)
        self._plan(at)

    def _last_token(self, seq: Sequence, at: float) -> None:
        """``seq`` generated its last token in the step that ended at ``at``."""
        blocks = self._blocks_of(seq)
        self._deactivate(seq)
        seq.generated = seq.output_tokens
        if seq.held:
            seq.state, seq.parked_blocks = "parked", blocks
            self._events.append(Event("park", seq, at))
            return
        self._blocks -= blocks + self._unpool(seq)
        del self._running[seq.rid]
        self._finish(seq, at)

    def _finish(self, seq: Sequence, at: float) -> None:
        seq.state, seq.finished_at = "finished", at
        self.counters.finished += 1
        self._events.append(Event("finish", seq, at))

    def _plan(self, at: float) -> None:
        """Schedule the step after ``self._seg.done`` starting at ``at``: make room for the
        running sequences' next tokens (preempting if the cache would overflow), admit waiting
        requests (not in a step that preempted, as vLLM), then run as many steps as nothing
        changes."""
        seg, cfg, bs = self._seg, self.config, self._bs
        done = seg.done
        need = self._phase[-done % bs] if self._active else 0
        preempted = False
        while self._active and self._blocks + need > self._num_blocks:
            victim = self._victim()
            if (victim.offset + done) % bs == 0:
                need -= 1
            self._preempt(victim, done, at)
            preempted = True
        admitted: list[Sequence] = []
        prefill = 0
        if not preempted:
            budget = cfg.max_num_batched_tokens - self._active
            while self._waiting and len(self._running) < cfg.max_num_seqs and budget > 0:
                seq = self._peek_waiting()
                tokens = seq.prompt_tokens + seq.generated
                blocks = -(-(tokens + 1) // bs)
                if blocks > self._num_blocks:  # not even alone: only after a capacity change
                    self._pop_waiting()
                    seq.state, seq.epoch = "aborted", seq.epoch + 1
                    self.counters.aborted += 1
                    self._events.append(Event("abort", seq, at))
                    continue
                cached, new = self._lookup(seq, tokens, blocks, need)
                if self._blocks + need + new > self._num_blocks:
                    break
                if tokens - cached > budget and admitted:
                    break
                self._pop_waiting()
                self._admit(seq, done + 1, tokens, at)
                if seq.block_hashes:
                    self._pool(seq, cached, tokens)
                self._blocks += new
                budget -= tokens - cached
                prefill += tokens - cached
                admitted.append(seq)
        self._blocks += need
        self._alloc = done + 1
        self.counters.max_running = max(self.counters.max_running, len(self._running))
        if not self._active:
            self._alloc = done
            seg.steps = 0
            if preempted:  # it preempted everything: try the queue again at once
                self._due = at
            return
        steps = 1
        if not (admitted or preempted):
            steps = min(self._next_finish() - done, self._steps_until_overflow())
        seg.start, seg.tau, seg.steps = at, cfg.step_time(self._active, prefill), steps
        seg.prefilled = [s for s in admitted if s.first_token_at is None and s.tokens_left > 0]
        self.counters.prefill_tokens += prefill

    def _admit(self, seq: Sequence, step: int, tokens: int, at: float) -> None:
        seq.state, seq.epoch = "running", seq.epoch + 1
        seq.start_step = step
        seq.offset = tokens + 1 - step  # it holds tokens + 1 once its first step is allocated
        seq.finish_step = step + max(seq.tokens_left, 1) - 1
        if seq.scheduled_at is None:
            seq.scheduled_at = at
        self._running[seq.rid] = seq
        self._active += 1
        self._phase[seq.offset % self._bs] += 1
        heapq.heappush(self._finishing, (seq.finish_step, seq.order, seq.epoch, seq))

    def _preempt(self, seq: Sequence, done: int, at: float) -> None:
        """Recompute: free ``seq``'s blocks, keep its tokens, put it first in the queue."""
        self._blocks -= -(-(seq.offset + done) // self._bs) - seq.pool_blocks
        self._blocks -= self._unpool(seq)
        self._deactivate(seq)
        del self._running[seq.rid]
        seq.generated += done - seq.start_step + 1
        seq.state, seq.epoch = "waiting", seq.epoch + 1
        seq.preemptions += 1
        self.counters.preemptions += 1
        self._push_waiting(seq, front=True)
        self._events.append(Event("preempt", seq, at))

    def _victim(self) -> Sequence:
        """vLLM's: the newest running sequence (fcfs), or the one with the largest
        (priority, arrival) (priority); parked sequences are never preempted."""
        if self.config.scheduling_policy == "priority":
            active = (s for s in self._running.values() if s.state == "running")
            return max(active, key=lambda s: (s.priority, s.order))
        for seq in reversed(self._running.values()):
            if seq.state == "running":
                return seq
        raise AssertionError("no running sequence to preempt")

    def _deactivate(self, seq: Sequence) -> None:
        self._active -= 1
        self._phase[seq.offset % self._bs] -= 1

    def _blocks_of(self, seq: Sequence) -> int:
        """The blocks ``seq`` holds of its own (the prefix cache's shared ones not counted)."""
        if seq.state == "parked":
            return seq.parked_blocks
        return -(-(seq.offset + self._alloc) // self._bs) - seq.pool_blocks

    # -- the prefix cache ---------------------------------------------------------------------

    def _trim_cache(self, used: int) -> None:
        """Evict the least recently freed cached blocks that ``used`` blocks in use leave no
        room for (a new block takes the oldest free one: evicting lazily, when the cache is
        next read, gives the same cache, since in use only grows between two reads)."""
        lru, room = self._lru, max(0, self._num_blocks - used)
        while len(lru) > room:
            lru.popitem(last=False)

    def _lookup(self, seq: Sequence, tokens: int, blocks: int, need: int) -> tuple[int, int]:
        """What admitting ``seq`` (``tokens`` to compute, ``blocks`` held) finds in the cache
        and what it takes: (tokens cached, at least one left to compute; blocks to allocate:
        its own, plus its prompt blocks no running sequence holds)."""
        if not seq.block_hashes:
            return 0, blocks
        self._trim_cache(self._blocks + need)
        cached = min(self._cached_blocks(seq) * self._bs, tokens - 1)
        return cached, blocks - len(seq.block_hashes) + self._uncached(seq)

    def _cached_blocks(self, seq: Sequence) -> int:
        """``seq``'s leading prompt blocks found in the cache (in use or free)."""
        n = 0
        for h in seq.block_hashes:
            if h not in self._refs and h not in self._lru:
                break
            n += 1
        return n

    def _uncached(self, seq: Sequence) -> int:
        """``seq``'s prompt blocks no running sequence holds: those it allocates."""
        refs = self._refs
        return sum(1 for h in seq.block_hashes if h not in refs)

    def _pool(self, seq: Sequence, cached: int, tokens: int) -> None:
        """``seq`` (just admitted, ``cached`` of its ``tokens`` found) holds its prompt
        blocks in the cache."""
        refs, lru = self._refs, self._lru
        for h in seq.block_hashes:
            if h in refs:
                refs[h] += 1
            else:
                lru.pop(h, None)
                refs[h] = 1
        seq.pool_blocks = len(seq.block_hashes)
        self.counters.prefix_queries += tokens
        self.counters.prefix_hits += cached
        if seq.preemptions == 0:
            seq.cached_tokens = cached

    def _unpool(self, seq: Sequence) -> int:
        """``seq`` lets go of its cached blocks; the blocks no sequence holds any more (now
        free, their prefix kept: the last block first to go, as vLLM frees them)."""
        if not seq.pool_blocks:
            return 0
        refs, lru, freed = self._refs, self._lru, 0
        self._trim_cache(self._blocks)
        for h in reversed(seq.block_hashes):
            if refs[h] > 1:
                refs[h] -= 1
            else:
                del refs[h]
                lru[h] = None
                freed += 1
        seq.pool_blocks = 0
        return freed

    def _growth(self, start: int, stop: int) -> int:
        """Blocks the active sequences add from allocating step ``start`` to step ``stop``."""
        n = stop - start
        if n <= 0 or not self._active:
            return 0
        cycles, rest = divmod(n, self._bs)
        phase, bs = self._phase, self._bs
        return cycles * self._active + sum(phase[-(start + j) % bs] for j in range(rest))

    def _grow_to(self, step: int) -> None:
        self._blocks += self._growth(self._alloc, step)
        self._alloc = max(self._alloc, step)

    def _steps_until_overflow(self) -> int:
        """Steps that can run before the next one would not fit the cache (at least 1)."""
        free = self._num_blocks - self._blocks
        if self._active == 0:
            return 1 << 62
        n = free // self._active * self._bs  # whole cycles: each adds one block per sequence
        grown = self._growth(self._alloc, self._alloc + n)
        while True:
            grown += self._phase[-(self._alloc + n) % self._bs]
            if grown > free:
                return n + 1
            n += 1

    def _next_finish(self) -> int:
        heap = self._finishing
        while True:
            step, _, epoch, seq = heap[0]
            if epoch == seq.epoch and seq.state == "running":
                return step
            heapq.heappop(heap)

    def _push_waiting(self, seq: Sequence, front: bool) -> None:
        self._waiting += 1
        self.counters.max_waiting = max(self.counters.max_waiting, self._waiting)
        if self.config.scheduling_policy == "priority":
            heapq.heappush(self._heap, (seq.priority, seq.order, seq))
        elif front:
            self._fcfs.appendleft(seq)
        else:
            self._fcfs.append(seq)

    def _peek_waiting(self) -> Sequence:
        if self.config.scheduling_policy == "priority":
            while self._heap[0][2].state != "waiting":
                heapq.heappop(self._heap)
            return self._heap[0][2]
        while self._fcfs[0].state != "waiting":
            self._fcfs.popleft()
        return self._fcfs[0]

    def _pop_waiting(self) -> None:
        self._waiting -= 1
        if self.config.scheduling_policy == "priority":
            heapq.heappop(self._heap)
        else:
            self._fcfs.popleft()
