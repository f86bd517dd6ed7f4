"""The ``adaptive-concurrency`` gate's controller as pure functions: one window's observations
(and, when the queue names them, the engine's own metrics) in, the next limit out. No Redis, no
clock, no HTTP: :mod:`.adaptive` feeds it and stores what it returns. docs/gates.md,
"adaptive-concurrency", says why each rule is what it is.

What marks the knee of a continuous-batching engine (its latency grows with the batch long
before its throughput stops growing, so latency against a no-load baseline alone stops far
below it):

- the engine's own queue and preemptions, when its ``/metrics`` are read (``engine``);
- from the answers alone, the delivery rate that stops growing when in-flight grows: by
  Little's law rate = in-flight / latency, so the rate's elasticity to in-flight is
  ``1 - d ln(latency per token) / d ln(in-flight)``. A probe moves the limit a step and keeps
  the step when the elasticity says the rate followed (up) or did not suffer (down);
- overload answers: 429 and 503 (with the in-flight count they came at: a hidden cap),
  ``Retry-After``, and an llm-d gateway's drop reasons.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

CONTROLLERS = ("knee", "aimd-baseline")

# signals (what the last decision acted on) and the reason codes of a move
SIGNAL_ANSWERS = "answers"
SIGNAL_ENGINE = "engine-metrics"
SIGNAL_OVERLOAD = "overload"


@dataclass(frozen=True)
class Config:
    """A gate's controller parameters (``gate_params``)."""

    min: int = 1
    max: int = 1000
    initial: int = 8
    controller: str = "knee"
    elasticity: float = 0.1  # below it the rate no longer follows in-flight: the knee
    exit_elasticity: float = 0.15  # slow start ends below it (a doubling that paid off little)
    hold_windows: int = 2  # windows held at a limit between two probes
    window_min_s: float = 0.25
    window_max_s: float = 30.0
    drift: float = 0.25  # latency per token this far off its reference at the same in-flight:
    # the engine changed (capacity, mix)


@dataclass(frozen=True)
class Window:
    """What the answers of one window said (the Lua aggregates, gate_adaptive_observe.lua).
    Latencies in seconds; in-flight counts are the gate's holders, the answering one included."""

    elapsed_s: float = 0.0
    answered: int = 0  # attempts that got an answer or a transport error
    ok: int = 0  # 2xx
    ok_latency_s: float = 0.0  # sum over the 2xx
    measured: int = 0  # 2xx admitted after the window began (they lived under its limit)
    latency_s: float = 0.0  # sum over the measured
    tokens: float = 0.0  # their completion tokens (1 for an answer without usage)
    tokens_sq: float = 0.0  # sum of tokens^2 over the measured
    latency_tokens: float = 0.0  # sum of latency x tokens over the measured
    in_flight_sum: float = 0.0  # sum over the answers of the in-flight count at each
    peak: int = 0  # the most in flight at an answer
    overload: int = 0  # 429 / 503 / rejected-saturated
    overload_in_flight: int = 0  # the least in flight at an overload answer (0: none)
    retry_after_s: float = 0.0  # the longest Retry-After of an overload answer
    ttl: int = 0  # dropped by the gateway: TTL expired in its queue
    evicted: int = 0  # dropped by the gateway: evicted from its queue
    errors: int = 0  # other 5xx, transport errors and time-outs
    retried: int = 0  # 2xx of a request that had been retried before
    refused: int = 0  # acquires refused at the limit (demand above it)

    @property
    def in_flight(self) -> float:
        """Mean in flight over the window (sampled at each answer)."""
        return self.in_flight_sum / self.answered if self.answered else 0.0

    def queue_line(self) -> tuple[float, float] | None:
        """(intercept s, slope s per token) of latency against completion tokens over the
        measured answers, when their lengths vary enough to fit a line: the slope is the
        engine's time per decode step, the intercept its prefill plus what a request waited
        in the engine's queue. None otherwise."""
        n = self.measured
        if n < LINE_SAMPLES:
            return None
        mx, my = self.tokens / n, self.latency_s / n
        var = self.tokens_sq / n - mx * mx
        if mx <= 0 or my <= 0 or var <= (LINE_SPREAD * mx) ** 2:
            return None
        slope = (self.latency_tokens / n - mx * my) / var
        if slope <= 0:
            return None
        return my - slope * mx, slope

    @property
    def per_token_s(self) -> float | None:
        """Latency per token of the measured answers (None: too few)."""
        if self.measured < MIN_SAMPLES or self.tokens <= 0 or self.latency_s <= 0:
            return None
        return self.latency_s / self.tokens


MIN_SAMPLES = 3  # measured answers a window needs before its latency says anything
LINE_SAMPLES = 4  # ... before a line is fitted through them
LINE_SPREAD = 0.15  # ... whose lengths' coefficient of variation is at least this
QUEUE_SHARE = 0.1  # a queue wait above this share of the mean latency is congestion
QUEUE_TIME_SHARE = 0.2  # ... a mean queue time grown by this share (a prefill-bound engine's
# queue grows with its load before its throughput stops)
KV_ROOMY = 0.5  # ... this empty at the limit of the last congestion: the engine has grown
KV_FULL = 0.85  # a KV cache this full takes no more: the limit does not grow
KV_NEXT = 0.92  # ... nor when its fullest reading at this limit, plus one request, is this


@dataclass(frozen=True)
class Engine:
    """One reading of the engine's ``/metrics`` (summed over its series) taken when the window
    closed, with the gate's in-flight count just before and just after it."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None  # 0..1
    preemptions_total: float | None = None  # a counter
    # the queue-time and end-to-end latency histograms' (sum, count, sum, count), counters
    histograms: tuple[float, float, float, float] | None = None
    in_flight_before: int = 0
    in_flight_after: int = 0

    @property
    def credit(self) -> int:
        """Requests admitted while the reading was taken, which it cannot show yet
        (llm-d-router #2066's in-flight credit)."""
        return max(0, self.in_flight_after - self.in_flight_before)


@dataclass(frozen=True)
class Probe:
    """A step the controller is trying: from ``limit``, where it measured ``in_flight`` and
    ``per_token_s``; ``up`` or down."""

    limit: int
    in_flight: float
    per_token_s: float
    up: bool


@dataclass(frozen=True)
class State:
    """The controller's state, kept in Redis between windows (JSON)."""

    limit: int
    phase: str = "start"  # start (slow start: doubles) | steady (probes)
    step: int = 1  # the next probe's size
    hold: int = 0  # windows left before the next probe
    up_next: bool = True  # the direction of the next probe (answers alone)
    probe: Probe | None = None
    previous: tuple[float, float] | None = None  # slow start: the last window's (F, T)
    levels: dict[str, list[float]] = field(default_factory=dict)  # answers: see _record
    ceiling: int = 0  # the limit of the last congestion (probes past it step by 1)
    fails: int = 0  # congestions in a row at or below the ceiling (each doubles the hold)
    raised: int = 0  # what the last decision added to the limit (0: it did not raise it)
    intercept: float = 0.0  # answers: the least intercept of the latency line (prefill alone)
    wait_share: float = 0.0  # answers: the last window's queue wait over its mean latency
    streak: int = 0  # answers: moves in a row up (> 0) or down (< 0); widens the probes
    settled: int = 0  # answers: windows left at the best level before the next probe
    drifted: float = 1.0  # answers: the last window's latency per token over its level's
    closed_until: float = 0.0  # Retry-After: no increase before (Unix s, server clock)
    preemptions: float | None = None  # the engine's counter at the last reading
    histograms: tuple[float, float, float, float] | None = None  # ... and its histograms'
    least_wait: float = -1.0  # the least mean queue time seen (s; -1: none yet)
    roomy: int = 0  # readings in a row with the KV cache half empty below the ceiling
    answered: int = 0  # engine: 2xx since the limit last moved
    kv_peak: float = 0.0  # the fullest KV cache read at the limit kv_peak_at
    kv_peak_at: int = 0
    latency_s: float = 0.0  # smoothed mean latency of a 2xx (sizes the window)
    clean: int = 0  # aimd-baseline: 2xx since its last change
    signal: str = SIGNAL_ANSWERS  # what the last decision acted on
    reason: str = "initial"  # why the limit last moved (or held)
    moved_at: float = 0.0  # Unix s of the last change of the limit
    moves: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any, cfg: Config) -> State:
        """A state read back; anything unreadable starts over at ``cfg.initial``."""
        try:
            probe = data.get("probe")
            fields_ = {k: v for k, v in data.items() if k in _FIELDS}
            fields_["probe"] = Probe(**probe) if isinstance(probe, dict) else None
            for key in ("previous", "histograms"):
                value = fields_.get(key)
                fields_[key] = tuple(value) if isinstance(value, list | tuple) else None
            if not isinstance(fields_.get("levels", {}), dict):
                fields_["levels"] = {}
            state = cls(**fields_)
            if not isinstance(state.limit, int) or isinstance(state.limit, bool):
                raise TypeError("limit")
        except (AttributeError, TypeError, ValueError):
            return initial_state(cfg)
        return dataclasses.replace(state, limit=clamp(state.limit, cfg))


_FIELDS = {f.name for f in dataclasses.fields(State)}


REASON_CODES = (  # (what a reason starts with, its code: a metric label of few values)
    ("slow start", "slow-start"),
    ("overload", "overload"),
    ("ttl", "ttl-expired"),
    ("engine queue time", "engine-queue-time"),
    ("engine queue (from the answers)", "answers-queue"),
    ("engine queue: ", "engine-queue"),
    ("engine preempted", "preemption"),
    ("latency per token up", "latency-up"),
    ("latency per token down", "latency-down"),
    ("latency per token", "hold"),
    ("retry-after", "retry-after"),
    ("demand below", "demand"),
    ("KV cache", "kv-full"),
    ("too few", "no-data"),
    ("below the last congestion", "hold"),
    ("aimd", "aimd"),
    ("initial", "initial"),
    ("no congestion", "probe"),
    ("prob", "probe"),
    ("up to", "probe"),
    ("down to", "probe"),
)


def reason_code(reason: str) -> str:
    """The code of a reason (``hold`` for the ones that kept the limit where it was)."""
    return next((code for head, code in REASON_CODES if reason.startswith(head)), "hold")


def initial_state(cfg: Config, engine: bool = False) -> State:
    """The state before the first window (``engine``: the gate reads the engine's metrics)."""
    limit = clamp(cfg.initial, cfg)
    phase = "steady" if cfg.controller == "aimd-baseline" else "start"
    return State(limit=limit, phase=phase, signal=SIGNAL_ENGINE if engine else SIGNAL_ANSWERS)


def clamp(limit: float, cfg: Config) -> int:
    return int(max(cfg.min, min(cfg.max, math.floor(limit))))


def quick_windows(state: State) -> bool:
    """On the engine's metrics: a reading is of the moment (what the engine runs, holds
    waiting and fills of its KV cache now), so a window need not wait for any answer (the
    answers' latencies lag a request's life: a capacity lost would preempt for that long)."""
    return state.signal == SIGNAL_ENGINE


def window_closes(
    elapsed_s: float, measured: int, in_flight: int, cfg: Config, quick: bool = False
) -> bool:
    """A window is over once half the requests in flight have been admitted in it and answered
    (so its latencies are of requests that lived under its limit, queueing included: a window
    of fixed length would see a queue's latency only after it), after at least
    ``window_min_s``; or after ``window_max_s`` whatever it has. ``quick`` (on the engine's
    metrics): after ``window_min_s``, answered or not."""
    if elapsed_s >= cfg.window_max_s:
        return True
    want = 0 if quick else max(MIN_SAMPLES, -(-in_flight // 2))
    return elapsed_s >= cfg.window_min_s and measured >= want


def elasticity(f0: float, t0: float, f1: float, t1: float) -> float | None:
    """How much of an in-flight change from ``f0`` to ``f1`` the rate followed, from the
    latencies per token ``t0`` and ``t1`` (Little's law): 1 all of it, 0 none (pure queueing),
    below 0 the rate fell. None when in-flight did not move enough to tell."""
    if f0 <= 0 or f1 <= 0 or t0 <= 0 or t1 <= 0 or abs(math.log(f1 / f0)) < 0.03:
        return None
    return 1.0 - math.log(t1 / t0) / math.log(f1 / f0)


@dataclass(frozen=True)
class Decision:
    state: State
    raised: bool  # the limit went up (wake what waits for it)


def decide(
    state: State, win: Window, cfg: Config, now: float, engine: Engine | None = None
) -> Decision:
    """The next state after window ``win`` (``engine``: the reading of the engine's metrics,
    None when the queue names none or it failed). Never leaves [cfg.min, cfg.max]; an overload
    answer never raises the limit."""
    s = _smoothed(state, win)
    if cfg.controller == "aimd-baseline":
        new = _aimd(s, win, cfg)
    else:
        new = _knee(s, win, cfg, now, engine)
    limit = clamp(new.limit, cfg)
    new = dataclasses.replace(new, raised=max(0, limit - state.limit))
    if limit != state.limit:
        new = dataclasses.replace(new, moved_at=now, moves=state.moves + 1, answered=0)
    return Decision(dataclasses.replace(new, limit=limit), limit > state.limit)


def _smoothed(state: State, win: Window) -> State:
    if not win.ok:
        return state
    mean = win.ok_latency_s / win.ok
    latency = mean if state.latency_s <= 0 else 0.7 * state.latency_s + 0.3 * mean
    return dataclasses.replace(state, latency_s=latency)


# -- the knee controller ---------------------------------------------------------------------


def _knee(s: State, win: Window, cfg: Config, now: float, engine: Engine | None) -> State:
    if win.overload:
        return _overloaded(s, win, cfg, now)
    if win.ttl:  # the gateway's queue held our requests past their TTL: a gentle decrease
        return _congested(s, cfg, math.floor(s.limit * 0.9), SIGNAL_OVERLOAD, "ttl-expired")
    binding = win.refused > 0 or win.in_flight >= 0.8 * s.limit
    if engine is not None and engine.waiting is not None:
        # a window without answers (slow start on the metrics) has the reading's in-flight
        binding = binding or engine.in_flight_before >= 0.8 * s.limit
        return _by_engine(s, win, cfg, now, engine, binding)
    return _by_answers(s, win, cfg, now, binding)


def _congested(s: State, cfg: Config, to: int, signal: str, reason: str) -> State:
    """A decrease to ``to`` (at least one less, at most half). Probing starts over from there
    after a hold that doubles with each congestion in a row at or below the last one's limit,
    so that a knee found is not hit again every few windows."""
    to = max(s.limit // 2, min(s.limit - 1, to))
    again = bool(s.ceiling) and s.limit <= s.ceiling
    fails = s.fails + 1 if again else 1
    return dataclasses.replace(
        s,
        limit=max(1, to),
        phase="steady",
        step=1,
        hold=cfg.hold_windows * 2 ** min(fails, 5),
        fails=fails,
        probe=None,
        previous=None,
        ceiling=s.limit,
        signal=signal,
        reason=reason,
    )


def _overloaded(s: State, win: Window, cfg: Config, now: float) -> State:
    """429 / 503 / rejected-saturated: the server's cap is the in-flight count the first one
    came at, less itself (at most halving, at least one less). One that came at more in flight
    than the limit now allows was admitted under an earlier, higher limit: it holds, it does
    not lower the limit again. ``Retry-After`` holds any increase until it has passed."""
    cap = win.overload_in_flight - 1 if win.overload_in_flight > 0 else s.limit - 1
    closed = max(s.closed_until, now + win.retry_after_s) if win.retry_after_s else s.closed_until
    reason = f"overload: {win.overload} answered 429/503 at {win.overload_in_flight} in flight"
    if win.retry_after_s:
        reason += f", Retry-After {win.retry_after_s:g} s"
    if cap >= s.limit and s.raised == 0:
        return _hold(s, SIGNAL_OVERLOAD, reason + " (under an earlier limit)", closed_until=closed)
    new = _congested(s, cfg, cap, SIGNAL_OVERLOAD, reason)
    return dataclasses.replace(new, closed_until=closed)


def _hold(s: State, signal: str, reason: str, **changes: Any) -> State:
    return dataclasses.replace(s, signal=signal, reason=reason, **changes)


def _by_engine(
    s: State, win: Window, cfg: Config, now: float, engine: Engine, binding: bool
) -> State:
    """With the engine's metrics the knee is where it starts to hold more than it runs: a
    preemption; requests waiting in its queue beyond ``QUEUE_SHARE`` of those running (counting
    what was admitted while the reading was taken) in two readings in a row (a burst waiting
    for the step in progress is no queue: one reading holds) while the mean queue time grew by
    half that share; or a mean queue time since the last reading above its least by
    ``QUEUE_TIME_SHARE`` of the mean latency (a prefill-bound engine always queues a little,
    and more as its load grows). Without any, grow. A reading taken with more in flight than
    a lowered limit allows shows what that limit is draining: it holds."""
    preempted = 0.0
    if engine.preemptions_total is not None and s.preemptions is not None:
        preempted = max(0.0, engine.preemptions_total - s.preemptions)
    # the queue times are of the requests finished since the last reading used: a cohort's
    # worth (half in flight) before they are read, else they wait for the next reading
    half = -(-engine.in_flight_before // 2)
    cohort = MIN_SAMPLES if s.phase == "start" else max(MIN_SAMPLES, half)
    waits = _queue_wait(s.histograms, engine.histograms, cohort)
    base, read = s.histograms, engine.histograms
    short = waits is None and base is not None and read is not None
    kept = base if short and 0 <= read[1] - base[1] < cohort else read  # type: ignore[index]
    least = s.least_wait
    if waits is not None:
        least = waits[0] if least < 0 else min(waits[0], least * 1.01 + 1e-6)
    waiting = (engine.waiting or 0.0) + (engine.credit if engine.waiting else 0)
    running = engine.running if engine.running is not None else engine.in_flight_before
    share = waiting / max(1.0, running)
    before = s.wait_share
    s = dataclasses.replace(
        s,
        preemptions=engine.preemptions_total,
        histograms=kept,
        least_wait=least,
        wait_share=share,
    )
    excess = None if waits is None else (waits[0] - least) / waits[1]
    queued = excess is None or excess > QUEUE_SHARE / 2  # and that waiting costs time
    # with its KV cache far from full the wait is for compute (a prefill-bound engine takes a
    # few prompts a step): more in flight still adds throughput; the queue time rule is its
    full = engine.kv_usage is None or engine.kv_usage >= KV_FULL - 0.15
    congested = waiting >= 1 and share > QUEUE_SHARE and queued and full
    slower = excess is not None and excess > QUEUE_TIME_SHARE
    stale = _stale(s, max(engine.in_flight_before, win.peak))
    if (congested or slower or preempted > 0) and stale:
        return _hold(s, SIGNAL_ENGINE, "draining to a lowered limit")
    if congested and before > QUEUE_SHARE:
        to = engine.in_flight_before - math.ceil(waiting)
        return _congested(s, cfg, to, SIGNAL_ENGINE, f"engine queue: {waiting:g} waiting")
    if waits is not None and excess is not None and slower:
        to = math.floor(engine.in_flight_before * (1.0 - excess))
        reason = f"engine queue time up {waits[0] - least:.3g} s ({excess:.0%} of its latency)"
        return _congested(s, cfg, to, SIGNAL_ENGINE, reason)
    if preempted > 0:  # to what it runs now (what fits), at most the raise that did it back
        to = s.limit - s.raised if s.raised else math.floor(s.limit * 0.9)
        if engine.running is not None:  # more preempted than the last raise: it lost room
            fits = math.floor(engine.running)
            to = fits if preempted > max(1, s.raised) else max(to, min(s.limit - 1, fits))
        return _congested(s, cfg, to, SIGNAL_ENGINE, f"engine preempted {preempted:g}")
    if congested:
        return _hold(s, SIGNAL_ENGINE, f"confirming an engine queue: {waiting:g} waiting")
    kv = engine.kv_usage
    s, no_room = _kv_full(s, engine)
    if no_room:
        return _hold(s, SIGNAL_ENGINE, no_room)
    roomy = kv is not None and kv < KV_ROOMY and 0 < s.ceiling <= s.limit + 1
    s = dataclasses.replace(s, roomy=s.roomy + 1 if roomy else 0)
    if s.roomy >= 2:  # below the last congestion's limit, its cache twice half empty: it grew
        s = dataclasses.replace(s, ceiling=0, fails=0, hold=0, step=1, roomy=0)
    # past slow start a raise waits for half its limit's worth of answers at it: a quick
    # window shows a queue or a preemption at once, a cache that fills as requests decode
    # only over their life
    s = dataclasses.replace(s, answered=s.answered + win.ok)
    if s.phase != "start" and s.answered < -(-s.limit // 2) and binding:
        return _hold(s, SIGNAL_ENGINE, f"settling: {s.answered} answered at this limit")
    # slow start grows no further than what fills the cache to KV_FULL at this use per request
    # running (those admitted but not yet at the engine hold none of it yet)
    share = 1.0 if engine.running is None else min(1.0, engine.running / max(1, s.limit))
    factor = 2.0 if kv is None else max(1.0, min(4.0, KV_FULL * share / max(kv, 0.01)))
    return _grow(s, win, cfg, now, binding, SIGNAL_ENGINE, factor)


def _kv_full(s: State, engine: Engine) -> tuple[State, str]:
    """The fullest KV cache reading at this limit kept (a half-empty one: the engine grew,
    forget it), and why the cache takes no more ('' when it does): it is ``KV_FULL``, or its
    fullest reading here, with one request more, would reach ``KV_NEXT`` (a reading is one
    sample of a cache that fills as its requests decode: one under the mark is no room)."""
    kv = engine.kv_usage
    if kv is None:
        return s, ""
    peak = max(kv, s.kv_peak) if s.kv_peak_at == s.limit and kv >= KV_ROOMY else kv
    s = dataclasses.replace(s, kv_peak=peak, kv_peak_at=s.limit)
    if kv >= KV_FULL:  # more would wait or evict
        return s, f"KV cache {kv:.0%} full: holding"
    busy = max(1, s.limit, engine.in_flight_before)
    if s.phase != "start" and peak * (busy + 1) / busy >= KV_NEXT:
        return s, f"KV cache up to {peak:.0%} full: holding"
    return s, ""


def _stale(s: State, in_flight: float) -> bool:
    """Evidence gathered with more in flight than the limit now allows (the last decision
    lowered it, in-flight is still draining): it says nothing of the new limit."""
    return s.raised == 0 and in_flight > s.limit + 0.5


def _queue_wait(
    before: tuple[float, float, float, float] | None,
    after: tuple[float, float, float, float] | None,
    least: int = MIN_SAMPLES,
) -> tuple[float, float] | None:
    """(mean queue time, mean end-to-end latency), s, of the requests the engine finished
    between two readings of its histograms (queue sum, count, e2e sum, count)."""
    if before is None or after is None:
        return None
    qs, qn, es, en = (a - b for a, b in zip(after, before, strict=True))
    if qn < least or en < least or es <= 0 or qs < 0:
        return None
    return qs / qn, es / en


def _grow(
    s: State,
    win: Window,
    cfg: Config,
    now: float,
    binding: bool,
    signal: str,
    factor: float = 2.0,
) -> State:
    """No congestion: grow in slow start by ``factor``; else by a step that doubles with each
    success, but one at a time near the last congestion's limit (the ceiling), which is
    tried again only after a hold below it that doubles with each congestion there."""
    if not binding:
        return _hold(s, signal, "demand below the limit")
    if now < s.closed_until:
        return _hold(s, SIGNAL_OVERLOAD, "retry-after: holding")
    if s.phase == "start":
        to = max(s.limit + 1, math.floor(s.limit * factor))
        if to < s.limit * 1.25:  # the start is over: steps from here
            s = dataclasses.replace(s, phase="steady")
        else:
            return _hold(s, signal, f"slow start: x{to / s.limit:.2g}", limit=min(cfg.max, to))
    # a quarter past the ceiling without a congestion, the engine has changed: steps double
    cleared = s.limit >= s.ceiling * CLEAR_PAST
    if not cleared and s.limit + 1 >= s.ceiling and s.hold > 0:
        return _hold(s, signal, "below the last congestion's limit: holding", hold=s.hold - 1)
    if s.raised and signal == SIGNAL_ANSWERS:  # a raise's cost shows in answers a latency late
        return _hold(s, signal, f"settling after +{s.raised}")
    # and no more than what fills the KV cache to KV_FULL (factor; 2 when it is not known)
    step = max(1, min(s.step, math.floor(s.limit * (factor - 1)))) if cleared else 1
    return _hold(
        s,
        signal,
        f"no congestion: +{step}",
        limit=s.limit + step,
        step=min(2 * step, max(1, s.limit // 4)) if cleared else 1,
        ceiling=0 if cleared else s.ceiling,
        fails=0 if cleared else s.fails,
    )


CLEAR_PAST = 1.25  # a limit this far past the last congestion's forgets it


def _by_answers(s: State, win: Window, cfg: Config, now: float, binding: bool) -> State:
    """From the answers alone. When their lengths vary, the latency line's intercept shows the
    engine's queue (:func:`_by_line`); else slow start until the rate stops following the
    doublings, then a hill climb on each level's averaged latency per token (:func:`_climb`).
    A latency per token that drifted at the same level (the engine lost or gained capacity,
    or the mix changed) moves the limit at once."""
    line = win.queue_line()
    if line is not None:
        return _by_line(s, win, cfg, now, binding, line)
    t = win.per_token_s
    if not binding:
        return _hold(s, SIGNAL_ANSWERS, "demand below the limit", probe=None)
    if t is None:
        return _hold(s, SIGNAL_ANSWERS, "too few answers to measure")
    if s.phase == "start":
        return _slow_start(s, cfg, now, binding, win.in_flight, t)
    drifted = _drift(s, cfg, t)
    if drifted is not None:
        return drifted
    levels = _record(s.levels, s.limit, t)
    if s.probe is not None:  # back to the center after one window away
        limit = s.probe.limit
        return _hold(s, SIGNAL_ANSWERS, "probe measured", limit=limit, probe=None, levels=levels)
    if s.hold > 0:  # after a congestion
        return _hold(s, SIGNAL_ANSWERS, "holding", hold=s.hold - 1, levels=levels)
    s = dataclasses.replace(s, levels=levels)
    return _climb(s, cfg, now, win.in_flight, t)


def _neighbours(s: State, cfg: Config) -> tuple[int, int]:
    """The levels a probe step below and above the limit (the step widens with moves in a row;
    near the last congestion's limit one above)."""
    center = s.limit
    step = max(1, round(center * PROBE_STEP * 2 ** min(abs(s.streak), 2)))
    up, down = center + step, center - step
    if s.ceiling and center < s.ceiling * CLEAR_PAST:
        up = center + 1
    return (center if down < cfg.min else down), (center if up > cfg.max else up)


def _climb(s: State, cfg: Config, now: float, f: float, t: float) -> State:
    """The limit moves to whichever of itself and its two neighbours scores best once all
    three are known, score = (1 - elasticity) ln L - ln T (the rate, less what the extra
    in-flight costs: one window is too noisy to judge a step by, a level's decayed average
    is not); else the neighbour known least is probed for a window."""
    center = s.limit
    down, up = _neighbours(s, cfg)
    known = {lv: s.levels.get(str(lv)) for lv in (down, center, up)}
    if all(v is not None and v[0] >= LEVEL_SAMPLES for v in known.values()):
        scores = {lv: _score(lv, v[1], cfg) for lv, v in known.items() if v is not None}
        best = max(scores, key=lambda lv: scores[lv])
        if best != center and scores[best] - scores[center] > SCORE_MARGIN:
            if best > center and now < s.closed_until:
                return _hold(s, SIGNAL_OVERLOAD, "retry-after: holding")
            sign = 1 if best > center else -1
            streak = s.streak + sign if s.streak * sign > 0 else sign
            return _hold(
                s,
                SIGNAL_ANSWERS,
                f"{'up' if sign > 0 else 'down'} to the best scoring of {down}, {center}, {up}",
                limit=best,
                streak=streak,
            )
        if s.settled > 0:
            return _hold(s, SIGNAL_ANSWERS, "at the best level", settled=s.settled - 1, streak=0)
    nu = (known[up] or (0.0, 0.0))[0]
    nd = (known[down] or (0.0, 0.0))[0]
    to = up if nu <= nd and up != center and now >= s.closed_until else down
    if to == center:
        return _hold(s, SIGNAL_ANSWERS, "at a bound")
    return _hold(
        s,
        SIGNAL_ANSWERS,
        f"probing {to - center:+d}",
        limit=to,
        probe=Probe(center, f, t, to > center),
        settled=cfg.hold_windows,
    )


def _by_line(
    s: State, win: Window, cfg: Config, now: float, binding: bool, line: tuple[float, float]
) -> State:
    """The answers' lengths vary: latency = intercept + slope x tokens, and the intercept above
    its least value is the time a request waited in the engine's queue, the engine's own sign
    that it holds more than it runs (as ``vllm:num_requests_waiting`` is with its metrics). By
    Little's law it runs F x (1 - wait / latency) of the F in flight. One window's intercept is
    noisy: a wait above ``QUEUE_SHARE`` of the latency in two windows in a row (or three times
    that in one) is congestion, growth needs it under half that share."""
    intercept = line[0]
    base = intercept if s.intercept <= 0 else min(intercept, s.intercept * 1.01)
    mean = win.latency_s / win.measured
    share = max(0.0, intercept - base) / mean
    before, s = s.wait_share, dataclasses.replace(s, intercept=base, wait_share=share, levels={})
    strong = share > 3 * QUEUE_SHARE
    if (strong or share > QUEUE_SHARE) and _stale(s, win.in_flight):
        return _hold(s, SIGNAL_ANSWERS, "draining to a lowered limit")
    if strong or (share > QUEUE_SHARE and before > QUEUE_SHARE):
        to = math.floor(win.in_flight * (1.0 - share))
        reason = f"engine queue (from the answers): ~{share * mean:.3g} s a request"
        new = _congested(s, cfg, to, SIGNAL_ANSWERS, reason)
        return dataclasses.replace(new, wait_share=0.0)
    if share > QUEUE_SHARE / 2 or before > QUEUE_SHARE:
        return _hold(s, SIGNAL_ANSWERS, f"near the knee: waits ~{share * mean:.3g} s")
    return _grow(s, win, cfg, now, binding, SIGNAL_ANSWERS)


LEVEL_SAMPLES = 0.8  # a level's decayed count of windows before it is compared
PROBE_STEP = 0.12  # a probe's step, a share of the limit (at least 1)
LEVEL_DECAY = 0.85  # every window, each level's evidence counts this much less
SCORE_MARGIN = 0.01  # a neighbour must score this much better (ln) to move there


def _score(level: int, log_t: float, cfg: Config) -> float:
    return (1.0 - cfg.elasticity) * math.log(level) - log_t


def _record(levels: dict[str, list[float]], level: int, t: float) -> dict[str, list[float]]:
    """Each level's (decayed count of windows, mean ln latency per token), with this window's
    sample added at ``level``; levels with little evidence left are forgotten."""
    out = {k: [n * LEVEL_DECAY, m] for k, (n, m) in levels.items() if n * LEVEL_DECAY >= 0.05}
    n, m = out.get(str(level), [0.0, 0.0])
    out[str(level)] = [n + 1.0, (m * n + math.log(t)) / (n + 1.0)]
    if len(out) > MAX_LEVELS:
        keep = sorted(out, key=lambda k: abs(int(k) - level))[:MAX_LEVELS]
        out = {k: out[k] for k in keep}
    return out


MAX_LEVELS = 12


def _slow_start(s: State, cfg: Config, now: float, binding: bool, f: float, t: float) -> State:
    """Double while the rate followed the last doubling by ``exit_elasticity``; else settle
    where the two windows put the knee: latency flat up to K, then growing with in-flight,
    gives K = F x T_before / T."""
    if not binding:
        return _hold(s, SIGNAL_ANSWERS, "demand below the limit", previous=(f, t))
    e = None
    if s.previous is not None:
        f0, t0 = s.previous
        e = elasticity(f0, t0, f, t)
        if e is not None and f > f0 and e < cfg.exit_elasticity:
            # the rate still followed a little: the level before; it fell: where the
            # latency's growth puts the knee (flat up to K, then with in-flight: F x T0 / T)
            knee = f0 if e >= 0 else f * t0 / t
            return dataclasses.replace(
                s,
                limit=max(1, round(knee)),
                phase="steady",
                step=1,
                hold=0,
                previous=None,
                levels={},
                signal=SIGNAL_ANSWERS,
                reason=f"slow start ended: elasticity {e:.2f} at {f:.0f} in flight",
            )
    if now < s.closed_until:
        return _hold(s, SIGNAL_OVERLOAD, "retry-after: holding", previous=(f, t))
    # the latency per token did not move with the last growth: four times, else twice
    factor = 4 if e is not None and e >= FLAT_ELASTICITY else 2
    return _hold(
        s,
        SIGNAL_ANSWERS,
        f"slow start: x{factor}",
        limit=min(cfg.max, s.limit * factor),
        previous=(f, t),
    )


FLAT_ELASTICITY = 0.9  # a slow-start step this well followed: the next one is twice as large


def _drift(s: State, cfg: Config, t: float) -> State | None:
    """The latency per token moved at the same level in two windows in a row (one can be a
    busy client machine): the engine's capacity or the mix changed. Slower: down at once in
    proportion (Vegas); faster: slow start again."""
    known = s.levels.get(str(s.limit))
    if known is None or known[0] < LEVEL_SAMPLES:
        return None
    ratio = t / math.exp(known[1])
    before = s.drifted
    if not (ratio > 1 + cfg.drift or ratio < 1 - cfg.drift):
        return None if before == 1.0 else dataclasses.replace(s, drifted=1.0)
    if (ratio > 1) != (before > 1) or before == 1.0:  # once: see whether it lasts
        return _hold(
            s, SIGNAL_ANSWERS, f"latency per token {ratio:.2f}x: confirming", drifted=ratio
        )
    s = dataclasses.replace(s, drifted=1.0)
    if ratio > 1:
        to = math.floor(s.limit / min(ratio, before))
        new = _congested(s, cfg, to, SIGNAL_ANSWERS, f"latency per token up {ratio:.2f}x")
        return dataclasses.replace(new, levels={})
    return dataclasses.replace(
        s,
        phase="start",
        previous=(float(s.limit), t),
        levels={},
        probe=None,
        ceiling=0,
        signal=SIGNAL_ANSWERS,
        reason=f"latency per token down {ratio:.2f}x: slow start",
    )


# -- the batch gateway's AIMD (llm-d-batch-gateway #394), a baseline for comparison ----------


def _aimd(s: State, win: Window, cfg: Config) -> State:
    """Halve on a 429, a 5xx or a 2xx that needed retries; +1 once ``limit`` clean 2xx came
    in a row (its window = the current limit). Loss is its only signal."""
    bad = win.overload + win.errors + win.retried + win.ttl
    if bad:
        return dataclasses.replace(
            s,
            limit=s.limit // 2,
            clean=0,
            signal=SIGNAL_OVERLOAD,
            reason=f"aimd: {bad} bad answer(s): halved",
        )
    clean = s.clean + win.ok
    if clean >= s.limit:
        return dataclasses.replace(
            s, limit=s.limit + 1, clean=0, signal=SIGNAL_ANSWERS, reason="aimd: clean window +1"
        )
    return dataclasses.replace(s, clean=clean, reason="aimd: counting clean answers")


__all__ = [
    "CONTROLLERS",
    "Config",
    "Decision",
    "Engine",
    "Probe",
    "State",
    "Window",
    "decide",
    "elasticity",
    "initial_state",
    "reason_code",
    "quick_windows",
    "window_closes",
]
