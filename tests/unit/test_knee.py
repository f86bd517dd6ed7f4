"""The adaptive gate's controller (pipeline/gates/knee.py) as pure functions: bounds and the
direction of each rule, property-checked with Hypothesis; and the whole loop against the
engine model in virtual time (bench/adaptive_model.py), deterministic, no clock."""

from __future__ import annotations

import dataclasses
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.adaptive_model import Loop, Scenario, run
from pipeline.gates import knee
from pipeline.gates.engine_metrics import NoEngineMetrics, parse

CFG = knee.Config(min=2, max=200, initial=8)

windows = st.builds(
    knee.Window,
    elapsed_s=st.floats(0, 60),
    answered=st.integers(0, 500),
    ok=st.integers(0, 500),
    ok_latency_s=st.floats(0, 1e4),
    measured=st.integers(0, 500),
    latency_s=st.floats(0, 1e4),
    tokens=st.floats(0, 1e6),
    tokens_sq=st.floats(0, 1e9),
    latency_tokens=st.floats(0, 1e9),
    in_flight_sum=st.floats(0, 1e5),
    peak=st.integers(0, 500),
    overload=st.integers(0, 50),
    overload_in_flight=st.integers(0, 500),
    retry_after_s=st.floats(0, 60),
    ttl=st.integers(0, 5),
    evicted=st.integers(0, 5),
    errors=st.integers(0, 50),
    retried=st.integers(0, 50),
    refused=st.integers(0, 50),
)
engines = st.none() | st.builds(
    knee.Engine,
    waiting=st.none() | st.floats(0, 500),
    running=st.none() | st.floats(0, 500),
    kv_usage=st.none() | st.floats(0, 1),
    preemptions_total=st.none() | st.floats(0, 1e6),
    histograms=st.none() | st.tuples(*[st.floats(0, 1e6)] * 4),
    in_flight_before=st.integers(0, 500),
    in_flight_after=st.integers(0, 500),
)
controllers = st.sampled_from(knee.CONTROLLERS)


def run_windows(cfg: knee.Config, wins: list[knee.Window], readings: list[knee.Engine | None]):
    state = knee.initial_state(cfg)
    now = 1_000.0
    out = []
    for w, e in zip(wins, readings, strict=False):
        now += max(w.elapsed_s, 0.01)
        state = knee.decide(state, w, cfg, now, e).state
        out.append(state)
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(windows, min_size=1, max_size=12),
    st.lists(engines, min_size=12, max_size=12),
    controllers,
)
def test_the_limit_stays_within_min_and_max(wins, readings, controller) -> None:
    cfg = dataclasses.replace(CFG, controller=controller)
    for state in run_windows(cfg, wins, readings):
        assert cfg.min <= state.limit <= cfg.max
        # and the state survives its trip through Redis
        back = knee.State.from_json(json.loads(json.dumps(state.to_json())), cfg)
        assert back == state


@settings(max_examples=300, deadline=None)
@given(st.lists(windows, min_size=1, max_size=6), windows, engines, controllers)
def test_an_overload_answer_never_raises_the_limit(before, win, engine, controller) -> None:
    cfg = dataclasses.replace(CFG, controller=controller)
    state = knee.initial_state(cfg)
    for s in run_windows(cfg, before, [None] * len(before)):
        state = s
    overloaded = dataclasses.replace(win, overload=max(1, win.overload))
    after = knee.decide(state, overloaded, cfg, 2_000.0, engine).state
    assert after.limit <= state.limit


@settings(max_examples=200, deadline=None)
@given(windows, st.integers(2, 200), st.integers(1, 500))
def test_an_overload_at_a_cap_below_the_limit_lowers_it_to_the_cap(win, limit, at) -> None:
    """429s that came at ``at`` in flight (the answering one included) while the limit was
    above: the server's cap is at - 1; the limit moves to it, by at least one, at most half."""
    state = dataclasses.replace(knee.initial_state(CFG), limit=limit, phase="steady")
    win = dataclasses.replace(win, overload=1, overload_in_flight=at)
    after = knee.decide(state, win, CFG, 10.0).state
    if at - 1 < limit:
        assert after.limit == max(CFG.min, limit // 2, min(limit - 1, at - 1))
        assert after.signal == knee.SIGNAL_OVERLOAD and after.reason.startswith("overload")
    else:  # admitted under an earlier, higher limit: held, not lowered again
        assert after.limit == limit


def test_retry_after_holds_increases_until_it_passed() -> None:
    state = dataclasses.replace(knee.initial_state(CFG), limit=10, phase="steady")
    over = knee.Window(answered=3, overload=1, overload_in_flight=11, retry_after_s=30.0)
    state = knee.decide(state, over, CFG, 100.0).state
    clean = knee.Window(answered=40, ok=40, measured=10, latency_s=10, tokens=100,
                        in_flight_sum=400, refused=5)  # fmt: skip
    for t in (101.0, 110.0, 120.0, 129.0):
        state = dataclasses.replace(state, hold=0)
        assert knee.decide(state, clean, CFG, t).state.limit <= state.limit


def clean_engine(in_flight: int, kv: float | None = None) -> knee.Engine:
    return knee.Engine(waiting=0, running=in_flight, kv_usage=kv, preemptions_total=0,
                       in_flight_before=in_flight, in_flight_after=in_flight)  # fmt: skip


def busy(limit: int) -> knee.Window:
    """A window whose demand is above the limit (acquires were refused at it)."""
    return knee.Window(answered=limit, ok=limit, in_flight_sum=limit * limit, refused=3)


def test_with_engine_metrics_it_doubles_until_a_queue_then_runs_what_the_engine_runs() -> None:
    state = knee.initial_state(CFG)
    limits = []
    for _ in range(3):
        state = knee.decide(state, busy(state.limit), CFG, 1.0, clean_engine(state.limit)).state
        limits.append(state.limit)
    assert limits == [16, 32, 64]
    queued = dataclasses.replace(clean_engine(64), waiting=14, running=50)
    for _ in range(2):  # a queue in two readings in a row (one can be a burst)
        state = knee.decide(state, busy(64), CFG, 2.0, queued).state
    assert state.limit == 50 and state.signal == knee.SIGNAL_ENGINE
    assert knee.reason_code(state.reason) == "engine-queue"


def test_on_the_metrics_a_slow_start_window_needs_no_answer() -> None:
    """A reading is of the moment: in slow start on the engine's metrics a window closes after
    window_min with nothing answered, and the reading's in-flight says the limit binds."""
    engine_start = knee.initial_state(CFG, engine=True)
    assert knee.quick_windows(engine_start)
    assert knee.window_closes(CFG.window_min_s, 0, 64, CFG, quick=True)
    assert not knee.window_closes(CFG.window_min_s / 2, 0, 64, CFG, quick=True)
    assert not knee.window_closes(CFG.window_min_s, 0, 64, CFG, quick=False)
    empty = knee.Window(elapsed_s=CFG.window_min_s)  # no answer, no refusal counted
    state = knee.decide(engine_start, empty, CFG, 1.0, clean_engine(8)).state
    assert state.limit == 16 and knee.reason_code(state.reason) == "slow-start"
    idle = dataclasses.replace(clean_engine(2), in_flight_before=2, in_flight_after=2)
    assert knee.decide(engine_start, empty, CFG, 1.0, idle).state.limit == 8  # demand below


def test_a_filling_kv_cache_slows_the_start_and_stops_growth() -> None:
    state = knee.initial_state(CFG)  # 8
    state = knee.decide(state, busy(8), CFG, 1.0, clean_engine(8, kv=0.5)).state
    assert state.limit == 13  # 8 x 0.85 / 0.5: what fills the cache to 85 % at this use
    after = knee.decide(state, busy(13), CFG, 2.0, clean_engine(13, kv=0.9)).state
    assert after.limit == 13 and knee.reason_code(after.reason) == "kv-full"


def test_the_fullest_kv_reading_at_a_limit_plus_one_request_must_fit() -> None:
    """13 in flight filled the cache to 87 % once: 14 would reach ~94 %, past KV_NEXT, so a
    later reading of 84 % does not let the limit grow; a half-empty reading (the engine grew)
    forgets that peak."""
    state = dataclasses.replace(knee.initial_state(CFG, engine=True), limit=13, phase="steady")
    for kv in (0.87, 0.84, 0.84):
        state = knee.decide(state, busy(13), CFG, 1.0, clean_engine(13, kv=kv)).state
        assert state.limit == 13 and knee.reason_code(state.reason) == "kv-full", kv
    state = knee.decide(state, busy(13), CFG, 2.0, clean_engine(13, kv=0.45)).state
    assert state.limit == 14


def test_a_preemption_gives_back_the_raise_that_caused_it() -> None:
    state = dataclasses.replace(knee.initial_state(CFG), limit=13, phase="steady", preemptions=0)
    state = knee.decide(state, busy(13), CFG, 1.0, clean_engine(13)).state
    assert state.limit == 14 and state.raised == 1
    preempted = dataclasses.replace(clean_engine(14), preemptions_total=4)
    state = knee.decide(state, busy(14), CFG, 2.0, preempted).state
    assert state.limit == 13 and knee.reason_code(state.reason) == "preemption"
    assert state.hold > 0  # and it waits before it tries 14 again


def test_a_preemption_burst_goes_to_what_the_engine_still_runs() -> None:
    """More preempted than the last raise explains: the engine lost room, and the limit goes
    to what it runs at once (not 10 % down a window)."""
    state = dataclasses.replace(knee.initial_state(CFG), limit=13, phase="steady", preemptions=0)
    lost = dataclasses.replace(clean_engine(13), running=6, waiting=7, preemptions_total=7)
    state = knee.decide(state, busy(13), CFG, 1.0, lost).state
    assert state.limit == 6 and knee.reason_code(state.reason) == "preemption"


def test_slow_start_sizes_the_kv_cache_by_what_the_engine_runs() -> None:
    """2 of 8 admitted hold 12 % of the cache (the others not yet there): 85 % fits 14."""
    state = knee.initial_state(CFG, engine=True)
    early = dataclasses.replace(clean_engine(8, kv=0.12), running=2)
    assert knee.decide(state, busy(8), CFG, 1.0, early).state.limit == 14


def test_queue_times_are_read_a_cohort_at_a_time() -> None:
    """Past slow start the queue-time histograms are read once half the in-flight finished
    since the last reading used (a few answers of a quick window are noise): until then the
    baseline is kept and the limit grows; then the cohort's queue time lowers it."""
    state = dataclasses.replace(
        knee.initial_state(CFG, engine=True), limit=20, phase="steady", least_wait=0.1,
        histograms=(0.0, 0.0, 0.0, 0.0), preemptions=0)  # fmt: skip
    few = dataclasses.replace(clean_engine(20), histograms=(2 * 3.0, 2, 2 * 10.0, 2))
    state = knee.decide(state, busy(20), CFG, 1.0, few).state
    assert state.histograms == (0.0, 0.0, 0.0, 0.0) and state.limit == 21
    cohort = dataclasses.replace(clean_engine(21), histograms=(11 * 3.0, 11, 11 * 10.0, 11))
    state = knee.decide(state, busy(21), CFG, 2.0, cohort).state
    assert knee.reason_code(state.reason) == "engine-queue-time" and state.limit < 21


def test_past_slow_start_a_raise_on_the_metrics_waits_for_half_a_limit_of_answers() -> None:
    """Quick windows show a queue at once, a cache that fills as requests decode only over
    their life: the limit grows once half of it was answered at it."""
    state = dataclasses.replace(knee.initial_state(CFG, engine=True), limit=12, phase="steady",
                                preemptions=0)  # fmt: skip
    few = knee.Window(answered=2, ok=2, in_flight_sum=24, refused=3)
    limits = []
    for _ in range(4):
        state = knee.decide(state, few, CFG, 1.0, clean_engine(12, kv=0.5)).state
        limits.append(state.limit)
    assert limits == [12, 12, 13, 13]  # 2, 4, 6 answered: the 6th of 12 raises it


def test_no_growth_while_the_demand_is_below_the_limit() -> None:
    state = dataclasses.replace(knee.initial_state(CFG), limit=40, phase="steady")
    idle = knee.Window(answered=20, ok=20, in_flight_sum=20 * 10, refused=0)
    for reading in (None, clean_engine(10)):
        after = knee.decide(state, idle, CFG, 1.0, reading).state
        assert after.limit == 40 and knee.reason_code(after.reason) == "demand"


def test_the_batch_gateways_aimd_halves_on_loss_and_adds_one_per_clean_window() -> None:
    cfg = knee.Config(min=5, max=100, initial=100, controller="aimd-baseline")
    state = knee.initial_state(cfg)
    state = knee.decide(state, knee.Window(answered=99, ok=99), cfg, 1.0).state
    assert state.limit == 100  # a window of 100 clean answers is not complete yet
    state = knee.decide(state, knee.Window(answered=9, ok=8, errors=1), cfg, 2.0).state
    assert state.limit == 50
    state = knee.decide(state, knee.Window(answered=50, ok=50), cfg, 3.0).state
    assert state.limit == 51
    for t in range(10):
        state = knee.decide(state, knee.Window(answered=5, overload=5), cfg, 4.0 + t).state
    assert state.limit == 5  # its floor
    # a queueing engine sends no loss: it never moves (the llm-d batch gateway's #491)
    queueing = knee.Engine(waiting=300, running=100, in_flight_before=400, in_flight_after=400)
    state = knee.decide(knee.initial_state(cfg), knee.Window(answered=10, ok=10), cfg, 1.0,
                        queueing).state  # fmt: skip
    assert state.limit == 100


def test_the_latency_line_finds_a_queue_from_the_answers_alone() -> None:
    """Answers of 100..500 tokens at 10 ms a token: 1 s intercept; then the same with 9 s more
    (a wait in the engine's queue) in two windows: the limit drops by the share of the wait."""

    def window(wait: float) -> knee.Window:
        toks = [100.0, 200.0, 300.0, 400.0, 500.0] * 2
        lats = [1.0 + wait + 0.01 * x for x in toks]
        return knee.Window(answered=10, ok=10, ok_latency_s=sum(lats), measured=10,
                           latency_s=sum(lats), tokens=sum(toks),
                           tokens_sq=sum(x * x for x in toks),
                           latency_tokens=sum(x * y for x, y in zip(toks, lats, strict=True)),
                           in_flight_sum=10 * 20, refused=2)  # fmt: skip

    line = window(0.0).queue_line()
    assert line is not None and abs(line[0] - 1.0) < 1e-6 and abs(line[1] - 0.01) < 1e-9
    state = dataclasses.replace(knee.initial_state(CFG), limit=20, phase="steady")
    state = knee.decide(state, window(0.0), CFG, 1.0).state
    state = dataclasses.replace(state, hold=0, raised=0)
    state = knee.decide(state, window(9.0), CFG, 2.0).state  # 69 % of the latency: at once
    assert state.limit == 10 and knee.reason_code(state.reason) == "answers-queue"
    state = knee.decide(state, window(9.0), CFG, 3.0).state  # measured at 20 in flight:
    assert state.limit == 10 and state.reason == "draining to a lowered limit"  # stale


# -- against the engine model, in virtual time ------------------------------------------------
def best_static(preset: str, levels: tuple[int, ...], scale: float) -> float:
    return max(run(Scenario(preset, 600, static=n), scale).throughput for n in levels)


def test_on_the_kv_bound_engine_with_its_metrics_it_settles_at_the_knee() -> None:
    """The KV-bound preset flattens at 13 in flight and preempts from 14: with the engine's
    metrics the gate finds it from a cold start of 8."""
    scale = 0.02
    res = run(Scenario("kv-bound", 1000, engine_metrics=True), scale)
    best = best_static("kv-bound", (12, 13, 14, 16), scale)
    assert res.throughput >= 0.93 * best
    assert res.preemptions <= 0.03 * 1000
    assert 12 <= res.trace[-1][1] <= 14


def test_on_the_kv_bound_engine_its_probes_do_not_preempt() -> None:
    """Past the knee's 13 the engine preempts: 2,000 requests from a cold start, none."""
    res = run(Scenario("kv-bound", 2000, engine_metrics=True), 0.02)
    assert res.preemptions <= 0.01 * 2000


def test_preemptions_stop_within_10_s_when_the_engines_capacity_halves() -> None:
    """The KV-bound engine loses half its cache 1,500 model s in (at the bench's time scale,
    windows of 12.5 model s): the gate reads the preemptions in the next window and goes to
    what the engine still runs; nothing is preempted 10 s after the loss (the loss itself
    preempts what no longer fits)."""
    sc = Scenario("kv-bound", 1200, engine_metrics=True, capacity=((1500.0, 0.5),))
    loop = Loop(sc, 0.02)
    at: list[float] = []
    advance = loop.engine.advance

    def counted(now: float) -> None:
        before = loop.engine.counters.preemptions
        advance(now)
        at.extend([now] * (loop.engine.counters.preemptions - before))

    loop.engine.advance = counted  # type: ignore[method-assign]
    loop.run()
    assert any(t >= 1500 for t in at) and all(not t >= 1510 for t in at)


def test_an_engine_with_no_limit_gets_every_slot() -> None:
    """The H100 preset's throughput grows past the 64 slots: the limit opens to them (it stops
    where in-flight no longer follows it: the slots are the bound, not the engine)."""
    res = run(Scenario("h100", 1500), 0.25)
    assert 64 <= res.trace[-1][1] <= 128
    assert res.throughput >= 0.9 * run(Scenario("h100", 1500, static=64), 0.25).throughput


def test_a_hidden_cap_is_found_from_429s() -> None:
    res = run(Scenario("h100", 1500, cap=24), 0.25)
    static = run(Scenario("h100", 1500, cap=24, static=24), 0.25)
    assert res.throughput >= 0.95 * static.throughput
    assert {lim for _, lim, _ in res.trace[len(res.trace) // 2 :]} <= {23, 24, 25}


def test_the_engine_metrics_page_is_read_under_each_servers_names() -> None:
    vllm = """# HELP vllm:num_requests_waiting x
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="n"} 1.0
vllm:num_requests_running{model_name="m"} 12.0
vllm:kv_cache_usage_perc{model_name="m"} 0.93
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{model_name="m"} 7.0
vllm:request_queue_time_seconds_sum{model_name="m"} 2.5
vllm:request_queue_time_seconds_count{model_name="m"} 10.0
vllm:request_queue_time_seconds_bucket{le="0.3",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 50.0
vllm:e2e_request_latency_seconds_count{model_name="m"} 10.0
"""
    r = parse(vllm)
    assert (r.waiting, r.running, r.kv_usage, r.preemptions) == (4.0, 12.0, 0.93, 7.0)
    assert r.histograms == (2.5, 10.0, 50.0, 10.0)
    sglang = "sglang:num_queue_reqs 2\nsglang:num_running_reqs 8\nsglang:token_usage 0.5\n"
    r = parse(sglang)
    assert (r.waiting, r.running, r.kv_usage, r.preemptions, r.histograms) == (
        2.0, 8.0, 0.5, None, None)  # fmt: skip
    llama = "llamacpp:requests_processing 4\nllamacpp:requests_deferred 1\n"
    assert (parse(llama).waiting, parse(llama).running) == (1.0, 4.0)
    try:
        parse("up 1\n")
    except NoEngineMetrics as exc:
        assert "waiting" in str(exc)
    else:
        raise AssertionError("a page without a waiting series must be refused")


def test_with_engine_metrics_it_follows_the_engines_capacity_halving_and_doubling() -> None:
    """The KV-bound engine loses half its capacity, or gains as much again, 1,500 model seconds
    in (30 s of wall clock at the bench's time scale): after it, the rate is at least 0.9 of
    the best static limit for the new engine."""
    t = 1500.0
    for replicas, levels in ((0.5, (5, 6, 7)), (2.0, (24, 26, 28))):
        res = run(Scenario("kv-bound", 2500, engine_metrics=True, capacity=((t, replicas),)), 0.02)
        best = max(
            run(Scenario("kv-bound", 1500, static=n, capacity=((0.0, replicas),)), 0.02).throughput
            for n in levels
        )
        assert res.rate_between(t, max(res.finishes)) >= 0.9 * best, replicas
