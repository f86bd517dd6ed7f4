"""The engine model (pipeline/sim/engine.py) in virtual time: the step-time formula, queue
order, KV accounting in blocks, the cache filling, preemption, seats, holds and capacity
changes. Durations are binary fractions, so that expected times are exact."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.sim.engine import Engine, EngineConfig, Event, Sequence, block_hashes
from pipeline.sim.presets import PRESETS, engine_config

BASE, PER_SEQ, PER_TOKEN = 1.0, 0.5, 0.25


def config(**fields: object) -> EngineConfig:
    values: dict[str, object] = dict(
        step_base_s=BASE, step_per_seq_s=PER_SEQ, step_per_prefill_token_s=PER_TOKEN,
        kv_cache_tokens=16 * 1024, max_num_seqs=64, max_num_batched_tokens=4096,
    )  # fmt: skip
    values.update(fields)
    return EngineConfig(**values)  # type: ignore[arg-type]


def run(engine: Engine, until: float = math.inf) -> list[Event]:
    """Advance from event to event until idle (or ``until``); every event on the way."""
    events = engine.take_events()
    while (at := engine.next_event_at()) is not None and at <= until:
        engine.advance(at)
        events += engine.take_events()
    if until < math.inf:
        engine.advance(until)
        events += engine.take_events()
    return events


def times(events: Iterable[Event], kind: str) -> dict[object, float]:
    return {e.seq.rid: e.at for e in events if e.kind == kind}


def order(events: Iterable[Event], kind: str = "finish") -> list[object]:
    return [e.seq.rid for e in events if e.kind == kind]


def reference_blocks(engine: Engine, sequences: Iterable[Sequence]) -> int:
    """KV blocks in use, from each sequence's tokens: prompt + generated so far (+ the token
    the step in progress computes), ``ceil(tokens / block_size)`` each."""
    bs, in_progress = engine.config.block_size, engine.steps + 1
    total = 0
    for seq in sequences:
        if seq.state == "parked":
            total += -(-(seq.prompt_tokens + seq.output_tokens) // bs)
        elif seq.state == "running":
            tokens = seq.prompt_tokens + seq.generated + in_progress - seq.start_step + 1
            total += -(-tokens // bs)
    return total


def test_a_step_takes_base_plus_per_sequence_plus_per_prefill_token() -> None:
    engine = Engine(config())
    a = engine.add("a", 10, 3, now=0.0)
    assert engine.next_event_at() == 0.0  # an idle engine starts a step at once
    engine.advance(0.0)
    assert engine.next_event_at() == 1 + 0.5 + 0.25 * 10  # a's prefill step
    engine.advance(4.5)  # in a's second step (4.0 .. 5.5)
    engine.add("b", 4, 2, now=4.5)  # waits for the step in progress to end
    events = run(engine)
    # 5.5: b joins (prefill 4 tokens, two sequences): 1 + 0.5 x 2 + 0.25 x 4 = 3.0
    assert times(events, "first") == {"a": 4.0, "b": 8.5}
    assert times(events, "finish") == {"a": 8.5, "b": 10.0}
    assert a.scheduled_at == 0.0 and engine.steps == 4 and engine.running == 0
    assert config().step_time(3, 7) == 1 + 0.5 * 3 + 0.25 * 7


def test_an_idle_engine_starts_a_step_when_a_request_arrives() -> None:
    engine = Engine(config(), now=0.0)
    seq = engine.add("a", 0, 1, now=7.0)
    assert run(engine) == [Event("first", seq, 8.5), Event("finish", seq, 8.5)]


def test_fcfs_admits_in_arrival_order() -> None:
    engine = Engine(config(max_num_seqs=1))
    for rid in "abc":
        engine.add(rid, 1, 2, now=0.0)
    engine.advance(0.0)
    assert (engine.running, engine.waiting) == (1, 2)
    assert order(run(engine)) == ["a", "b", "c"]


def test_priority_admits_the_lowest_value_first_then_by_arrival() -> None:
    engine = Engine(config(max_num_seqs=1, scheduling_policy="priority"))
    engine.add("first", 1, 2, now=0.0, priority=9)  # alone: runs at once
    for rid, priority in [("late", 5), ("urgent", -1), ("b1", 1), ("b2", 1)]:
        engine.add(rid, 1, 2, now=0.1, priority=priority)
    assert order(run(engine)) == ["first", "urgent", "b1", "b2", "late"]


def test_fcfs_refuses_a_priority_as_vllm_does() -> None:
    with pytest.raises(ValueError, match="Got priority 3 but Priority scheduling is not enabled"):
        Engine(config()).add("a", 1, 1, now=0.0, priority=3)


def test_max_num_seqs_caps_the_running_batch() -> None:
    engine = Engine(config(max_num_seqs=3))
    for i in range(5):
        engine.add(i, 1, 4, now=0.0)
    engine.advance(0.0)
    assert (engine.running, engine.waiting) == (3, 2)
    events = run(engine)
    assert engine.counters.max_running == 3 and order(events) == [0, 1, 2, 3, 4]
    # the last two start when the first three finish: one step each, not four
    assert times(events, "first")[3] == times(events, "finish")[0] + 1 + 0.5 * 2 + 0.25 * 2


def test_the_token_budget_spreads_prefills_over_steps() -> None:
    """Prompts are admitted while they fit max_num_batched_tokens less the running decodes
    (the first of a step always: prefill is not chunked)."""
    engine = Engine(config(max_num_batched_tokens=100))
    for rid in "abc":
        engine.add(rid, 60, 2, now=0.0)
    first = times(run(engine), "first")
    assert first["a"] == 1 + 0.5 + 0.25 * 60  # alone in its step
    assert first["b"] == first["a"] + 1 + 0.5 * 2 + 0.25 * 60  # b, then c, a step each
    assert first["c"] > first["b"]


def test_a_request_waits_until_its_prompt_fits_the_cache() -> None:
    engine = Engine(config(kv_cache_tokens=64))  # 4 blocks of 16
    for rid in "abc":
        engine.add(rid, 31, 1, now=0.0)  # 31 + 1 tokens: 2 blocks each
    engine.advance(0.0)
    assert (engine.running, engine.waiting, engine.kv_blocks) == (2, 1, 4)
    assert engine.kv_usage == 1.0
    events = run(engine)
    assert times(events, "first")["c"] > times(events, "finish")["a"]
    assert engine.kv_blocks == 0 and engine.counters.preemptions == 0


def test_the_cache_overflowing_preempts_the_newest_which_recomputes() -> None:
    """Two sequences grow into a 4-block cache: when the next token would not fit, the newest
    loses its KV blocks (not its tokens), waits first in line, and is prefilled again, prompt
    and generated tokens, once the oldest finished (vLLM v1's recompute)."""
    engine = Engine(config(kv_cache_tokens=64))
    a = engine.add("a", 15, 40, now=0.0)
    engine.advance(0.1)
    b = engine.add("b", 15, 40, now=0.1)  # joins in step 2: a's first step is in progress
    events = run(engine, until=50.0)
    # step 18 would give a its 33rd token (a 3rd block) and b its 32nd: 5 blocks of 4
    assert [(e.kind, e.seq.rid) for e in events if e.kind == "preempt"] == [("preempt", "b")]
    assert (b.state, b.generated, b.preemptions, a.preemptions) == ("waiting", 16, 1, 0)
    assert (engine.kv_blocks, engine.running, engine.waiting) == (3, 1, 1)
    assert b.first_token_at is not None and b.first_token_at < events[-1].at  # sent before
    events = run(engine)
    assert order(events) == ["a", "b"] and b.generated == b.output_tokens
    assert engine.counters.prefill_tokens == 15 + 15 + (15 + 16)  # b's tokens, once more
    # a finishes in step 40; b is prefilled again in step 41 and makes 24 more tokens
    assert engine.steps == 41 + 24 - 1


def test_under_priority_the_lowest_priority_is_preempted() -> None:
    engine = Engine(config(kv_cache_tokens=64, scheduling_policy="priority"))
    engine.add("low", 15, 40, now=0.0, priority=5)
    engine.advance(0.1)
    engine.add("high", 15, 40, now=0.1, priority=0)  # newer, but more urgent
    events = run(engine)
    assert order(events, "preempt") == ["low"] and order(events) == ["high", "low"]


def test_kv_use_counts_blocks_as_sequences_grow() -> None:
    engine = Engine(config(block_size=16))
    seqs = [engine.add(i, p, 100, now=0.0) for i, p in enumerate([1, 15, 16, 17, 40])]
    for t in [0.5, 13.0, 20.25, 41.0, 77.7, 120.0]:
        engine.advance(t)
        engine.take_events()
        assert engine.kv_blocks == reference_blocks(engine, seqs), t
    run(engine)
    assert engine.kv_blocks == 0


def test_a_held_sequence_parks_at_its_last_token_until_released() -> None:
    """A held sequence keeps its seat and its blocks once it has generated everything, and
    no longer takes part in the steps, until it is released."""
    engine = Engine(config(max_num_seqs=1))
    held = engine.add("held", 20, 3, now=0.0, held=True)
    engine.add("x", 1, 2, now=0.0)  # no seat while held is parked
    events = run(engine)
    assert [(e.kind, e.at) for e in events] == [("first", 6.5), ("park", 9.5)]
    assert (engine.running, engine.parked, engine.waiting, engine.kv_blocks) == (1, 1, 1, 2)
    assert engine.next_event_at() is None  # nothing to step
    engine.release(held, now=100.0)
    events = run(engine)
    assert times(events, "finish") == {"held": 100.0, "x": 100.0 + 1.75 + 1.5}
    assert held.state == "finished"


def test_releasing_a_hold_before_the_end_finishes_as_usual() -> None:
    engine = Engine(config())
    seq = engine.add("a", 0, 3, now=0.0, held=True)
    engine.release(seq, now=0.5)
    assert order(run(engine)) == ["a"]


def test_an_aborted_sequence_frees_its_seat_and_blocks_at_once() -> None:
    engine = Engine(config(max_num_seqs=1))
    a = engine.add("a", 40, 100, now=0.0)
    b = engine.add("b", 40, 2, now=0.0)
    engine.advance(30.0)
    assert engine.abort(a, now=30.0) and a.state == "aborted"
    assert engine.kv_blocks == 0 and engine.running == 0  # b waits for the step in progress
    assert not engine.abort(a, now=30.0)
    assert order(run(engine)) == ["b"] and b.scheduled_at is not None and b.scheduled_at < 32
    c = engine.add("c", 1, 1, now=50.0)
    d = engine.add("d", 1, 1, now=50.0)  # would wait behind c
    assert engine.abort(d, now=50.0) and engine.waiting == 1 and order(run(engine)) == ["c"]
    assert engine.waiting == 0
    assert c.state == "finished" and engine.counters.aborted == 2


def test_a_capacity_change_moves_the_cache_the_seats_and_the_step_time() -> None:
    engine = Engine(config(kv_cache_tokens=16 * 64, max_num_seqs=4))
    seqs = [engine.add(i, 100, 200, now=0.0) for i in range(8)]
    engine.advance(110.0)  # step 1 (4 prefills) took 103 s; a step is 3 s now
    assert (engine.running, engine.waiting, engine.num_blocks, engine.kv_blocks) == (4, 4, 64, 28)
    engine.set_capacity(0.5, now=110.0)  # one replica of two lost
    assert (engine.config.max_num_seqs, engine.num_blocks) == (2, 32)
    assert engine.config.step_per_seq_s == 2 * PER_SEQ
    at = engine.next_event_at()  # the step in progress ends as it began
    assert at == 112.0
    engine.advance(at + 15)  # three steps of 1 + 1.0 x 4 s: the four at half capacity
    assert engine.steps == 4 + 3
    engine.advance(300.0)  # growing past 32 blocks, the newest are preempted
    assert engine.counters.preemptions >= 1 and engine.kv_blocks <= 32
    assert [s.preemptions for s in seqs[:4]][0] == 0
    engine.set_capacity(2.0, now=300.0)  # one added to two: twice the configured engine
    assert (engine.config.max_num_seqs, engine.num_blocks) == (8, 128)
    events = run(engine)
    assert sorted(order(events)) == list(range(8)) and engine.kv_blocks == 0
    assert engine.counters.max_running == 8
    with pytest.raises(ValueError, match="replicas"):
        engine.set_capacity(0, now=engine.now)


def test_a_request_the_shrunken_cache_cannot_hold_is_aborted() -> None:
    engine = Engine(config(kv_cache_tokens=16 * 8, max_num_seqs=1))
    engine.add("a", 2, 4, now=0.0)
    b = engine.add("b", 100, 10, now=0.0)  # 7 blocks: fits the whole cache, not half of it
    engine.set_capacity(0.5, now=0.5)
    events = run(engine)
    assert order(events, "abort") == ["b"] and order(events) == ["a"]
    assert b.state == "aborted" and engine.waiting == 0


def test_a_request_longer_than_the_model_allows_is_refused() -> None:
    engine = Engine(config(kv_cache_tokens=1024, max_model_len=100))
    with pytest.raises(ValueError, match="maximum context length of 100 tokens"):
        engine.add("a", 90, 11, now=0.0)
    assert engine.waiting == 0


def test_the_config_names_what_is_wrong() -> None:
    for fields, name in [
        ({"step_base_s": 0}, "step_base_s"), ({"step_per_seq_s": -1}, "step_per_seq_s"),
        ({"kv_cache_tokens": 8}, "kv_cache_tokens"), ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 10**9}, "max_model_len"), ({"preemption": "swap"}, "preemption"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"step_base_s": math.nan}, "step_base_s"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=name):
            config(**fields)


def test_time_scale_multiplies_every_duration() -> None:
    scaled = config().scaled(0.125)
    assert (scaled.step_base_s, scaled.step_per_seq_s, scaled.step_per_prefill_token_s) == (
        0.125, 0.0625, 0.03125)  # fmt: skip
    assert scaled.time_scale == 0.125 and scaled.kv_cache_tokens == config().kv_cache_tokens
    engine = Engine(scaled)
    engine.add("a", 10, 3, now=0.0)
    assert times(run(engine), "finish") == {"a": 7.0 * 0.125}


def test_presets_are_valid_and_overridable() -> None:
    for name, preset in PRESETS.items():
        cfg = engine_config(name, 0.5)
        assert cfg.name == name and cfg.time_scale == 0.5
        work = preset.workload
        assert work.prompt_tokens + work.max_tokens <= cfg.model_len
    small = engine_config("h100", kv_cache_tokens=4096, scheduling_policy="priority")
    assert small.model_len == 4096 and small.scheduling_policy == "priority"
    with pytest.raises(ValueError, match="unknown engine preset 'a100'"):
        engine_config("a100")
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_config("h100", max_num_seqs=0)


# -- properties --------------------------------------------------------------------------------

request = st.tuples(
    st.integers(0, 40),  # arrival, in eighths of a second after the previous one
    st.integers(0, 80),  # prompt tokens
    st.integers(0, 40),  # output tokens
    st.integers(0, 2),  # priority
)
engines = st.builds(
    lambda blocks, seqs, budget, policy: config(
        kv_cache_tokens=16 * blocks,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        scheduling_policy=policy,
        max_model_len=min(16 * blocks, 121),
    ),  # fmt: skip
    st.integers(8, 40),
    st.integers(1, 8),
    st.integers(1, 200),
    st.sampled_from(["fcfs", "priority"]),
)


def drive(
    cfg: EngineConfig,
    requests: list[tuple[int, int, int, int]],
    pokes: Iterable[float] = (),
    aborts: Iterable[int] = (),
) -> tuple[Engine, list[Sequence], list[Event]]:
    """Run ``requests`` (gap, prompt, output, priority) to the end, checking the invariants at
    every event; ``pokes``: times at which a no-op capacity change cuts the plan; ``aborts``:
    indexes of requests whose client hangs up 3 s after they arrive."""
    engine, seqs, events = Engine(cfg), [], []
    actions: list[tuple[float, int, int]] = []  # (time, kind, index): add 0, abort 1, poke 2
    t = 0.0
    for i, (gap, *_rest) in enumerate(requests):
        t += gap / 8 + 1 / 1024  # never on a step boundary: durations are whole quarters
        actions.append((t, 0, i))
    actions += [(actions[i][0] + 3, 1, i) for i in set(aborts) if i < len(requests)]
    actions += [(p, 2, 0) for p in pokes]
    actions.sort()

    def check() -> None:
        events.extend(engine.take_events())
        assert engine.kv_blocks <= engine.num_blocks
        assert engine.kv_blocks == reference_blocks(engine, seqs)
        assert engine.running <= cfg.max_num_seqs

    for when, kind, i in actions:
        while (at := engine.next_event_at()) is not None and at <= when:
            engine.advance(at)
            check()
        if kind == 0:
            _, prompt, output, priority = requests[i]
            if cfg.scheduling_policy == "fcfs":
                priority = 0
            seqs.append(engine.add(i, prompt, output, now=when, priority=priority))
        elif kind == 1:
            engine.abort(seqs[i], now=when)
        else:
            engine.set_capacity(1.0, now=when)
        check()
    while (at := engine.next_event_at()) is not None:
        engine.advance(at)
        check()
    return engine, seqs, events


@settings(max_examples=150, deadline=None)
@given(engines, st.lists(request, min_size=1, max_size=30), st.sets(st.integers(0, 29)))
def test_every_request_ends_exactly_once_within_the_cache(
    cfg: EngineConfig, requests: list[tuple[int, int, int, int]], aborts: set[int]
) -> None:
    """KV use never exceeds the cache (and is the sum of the sequences' blocks), the batch
    never exceeds max_num_seqs, and every request ends exactly once: finished with all its
    tokens, or aborted by its client; the engine ends empty."""
    engine, seqs, events = drive(cfg, requests, aborts=aborts)
    ends = [e.seq.rid for e in events if e.kind == "finish"]
    assert len(ends) == len(set(ends))
    for seq in seqs:
        assert seq.state in ("finished", "aborted")
        assert (seq.rid in ends) == (seq.state == "finished")
        if seq.state == "finished":
            assert seq.generated == seq.output_tokens
            assert seq.finished_at is not None and seq.scheduled_at is not None
            assert seq.arrival <= seq.scheduled_at < seq.finished_at
            if seq.output_tokens:
                assert seq.first_token_at is not None
                assert seq.scheduled_at < seq.first_token_at <= seq.finished_at
    assert (engine.running, engine.waiting, engine.kv_blocks) == (0, 0, 0)


@settings(max_examples=150, deadline=None)
@given(engines, st.lists(request, min_size=1, max_size=30), st.lists(st.floats(0, 200)))
def test_where_the_engine_cuts_its_plan_never_changes_the_outcome(
    cfg: EngineConfig, requests: list[tuple[int, int, int, int]], pokes: list[float]
) -> None:
    """Advancing over many steps at once gives what advancing one plan at a time gives: the
    same tokens at the same times, the same preemptions."""
    plain = drive(cfg, requests)[1]
    poked = drive(cfg, requests, pokes=pokes)[1]
    for a, b in zip(plain, poked, strict=True):
        assert (a.preemptions, a.generated) == (b.preemptions, b.generated)
        for field in ("scheduled_at", "first_token_at", "finished_at"):
            x, y = getattr(a, field), getattr(b, field)
            assert x == y or math.isclose(x, y, rel_tol=1e-9), (field, a.rid)


@settings(max_examples=100, deadline=None)
@given(
    engines,
    st.lists(request, min_size=1, max_size=25),
    st.lists(st.tuples(st.floats(0, 150), st.sampled_from([0.25, 0.5, 1.0, 1.5, 3.0]))),
)
def test_capacity_changes_lose_nothing(
    cfg: EngineConfig,
    requests: list[tuple[int, int, int, int]],
    changes: list[tuple[float, float]],
) -> None:
    """Through any capacity changes every request finishes once, or is aborted because it
    cannot fit the cache any more; the engine ends empty."""
    engine = Engine(cfg)
    seqs: list[Sequence] = []
    actions = sorted(
        [(sum(r[0] for r in requests[: i + 1]) / 8 + 1 / 1024, 0, i) for i in range(len(requests))]
        + [(when, 1, j) for j, (when, _) in enumerate(changes)]
    )
    events: list[Event] = []
    for when, kind, i in actions:
        events += run(engine, until=when)
        if kind == 0:
            _, prompt, output, priority = requests[i]
            priority = priority if cfg.scheduling_policy == "priority" else 0
            if prompt + output > engine.config.model_len:
                continue  # refused at the door (the server answers 400)
            seqs.append(engine.add(i, prompt, output, now=when, priority=priority))
        else:
            engine.set_capacity(changes[i][1], now=when)
    events += run(engine)
    ended = [e.seq.rid for e in events if e.kind in ("finish", "abort")]
    assert sorted(ended) == sorted(s.rid for s in seqs)  # each once
    assert (engine.running, engine.waiting, engine.kv_blocks) == (0, 0, 0)
    for seq in seqs:
        if seq.state == "aborted":  # only when a smaller cache could never hold it
            blocks = -(-(seq.prompt_tokens + seq.generated + 1) // cfg.block_size)
            assert any(blocks > int(cfg.num_blocks * r) for _, r in changes)
        else:
            assert seq.state == "finished" and seq.generated == seq.output_tokens


def test_dataclass_fields_of_the_config_are_the_cli_options() -> None:
    """Every knob the CLI exposes is a field of EngineConfig (pipeline sim --kv-cache-tokens
    ... pass them by name)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert {"kv_cache_tokens", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
            "scheduling_policy", "preemption"} <= names  # fmt: skip


# -- the prefix cache ------------------------------------------------------------------------
def words(prefix: str, n: int, suffix: str = "") -> list[str]:
    """``n`` tokens (a token is a word): ``prefix`` words, the last 20 ``suffix`` ones."""
    keep = n if not suffix else max(0, n - 20)
    return [f"{prefix}{i}" for i in range(keep)] + [f"{suffix}{i}" for i in range(n - keep)]


def cached_config(**fields: object) -> EngineConfig:
    return config(enable_prefix_caching=True, **fields)


def add(engine: Engine, rid: str, tokens: list[str], out: int, now: float) -> Sequence:
    bs = engine.config.block_size
    return engine.add(rid, len(tokens), out, now, block_hashes=block_hashes(tokens, bs))


def test_a_cached_prefix_skips_its_prefill_and_is_reported() -> None:
    engine = Engine(cached_config())
    a = add(engine, "a", words("s", 100, "a"), 2, 0.0)  # 6 full blocks, the 7th partial
    run(engine)
    assert a.cached_tokens == 0 and engine.counters.prefix_hits == 0
    # b shares a's first 80 tokens (5 blocks); its 6th block (80..95) has its own words
    b = add(engine, "b", words("s", 100, "b"), 2, engine.now)
    start = engine.now
    events = run(engine)
    assert b.cached_tokens == 5 * 16
    assert times(events, "first")["b"] == start + BASE + PER_SEQ + PER_TOKEN * (100 - 80)
    c = engine.counters
    assert (c.prefix_queries, c.prefix_hits) == (200, 80)
    assert c.prefill_tokens == 100 + 20


def test_a_prompt_found_whole_still_computes_one_token() -> None:
    engine = Engine(cached_config())
    tokens = words("s", 64)  # exactly 4 blocks
    add(engine, "a", tokens, 1, 0.0)
    run(engine)
    b = add(engine, "b", tokens, 1, engine.now)
    run(engine)
    assert b.cached_tokens == 63 and engine.counters.prefill_tokens == 64 + 1


def test_running_sequences_share_their_prefix_blocks() -> None:
    engine = Engine(cached_config())
    a = add(engine, "a", words("s", 100, "a"), 50, 0.0)
    b = add(engine, "b", words("s", 100, "b"), 50, 0.0)
    engine.advance(0.0)
    engine.advance(engine.next_event_at() or 0.0)  # both prefilled in one step
    # shared: blocks 0-4 (80 tokens); each: its 6th block and its partial 7th (+1 token)
    assert engine.kv_blocks == 5 + 2 * 2
    assert a.cached_tokens == 0 and b.cached_tokens == 5 * 16  # in the same step, as vLLM v1
    run(engine)
    assert engine.kv_blocks == 0 and engine.running == 0


def test_without_prefix_caching_nothing_is_cached() -> None:
    engine = Engine(config())
    tokens = words("s", 100)
    add(engine, "a", tokens, 1, 0.0)
    run(engine)
    b = add(engine, "b", tokens, 1, engine.now)
    run(engine)
    assert b.cached_tokens == 0 and engine.counters.prefix_queries == 0
    assert engine.counters.prefill_tokens == 200


def test_the_least_recently_freed_prefix_is_evicted_first() -> None:
    """A cache of 16 blocks; three 4-block prompts free in turn (A, B, C); a 10-block
    prompt then takes room from the free blocks: A's go first (its tail first), C stays."""
    engine = Engine(cached_config(kv_cache_tokens=16 * 16))
    for rid in "ABC":
        add(engine, rid, words(rid, 64), 1, engine.now)
        run(engine)
    add(engine, "big", words("x", 160), 1, engine.now)  # 11 blocks: 2 left free
    engine.advance(engine.now)
    assert engine.kv_blocks == 11
    # 5 free blocks, 12 cached: the 7 oldest freed (all of A's, 3 of B's, tail first) evicted
    hits = {}
    for rid in "CBA":
        seq = add(engine, rid + "2", words(rid, 64), 1, engine.now)
        run(engine)
        hits[rid] = seq.cached_tokens
    assert hits == {"C": 63, "B": 16, "A": 0}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 200), st.integers(0, 40), st.booleans()),
        min_size=1,
        max_size=24,
    ),
    st.integers(12, 40),
)
def test_the_prefix_cache_keeps_the_block_count(
    reqs: list[tuple[int, int, int, bool]], blocks: int
) -> None:
    """Whatever shares what: blocks in use are each running sequence's own blocks plus the
    shared ones counted once, never more than the cache (but after the last step's
    admission check), every request finishes, and the cache ends empty of blocks in use."""
    engine = Engine(cached_config(kv_cache_tokens=blocks * 16, max_num_batched_tokens=256))
    seqs = []
    t = 0.0
    for i, (prefix, n, out, wait) in enumerate(reqs):
        n = min(n, blocks * 16 - out - 1)
        seqs.append(add(engine, i, words(f"p{prefix}-", n, f"r{i}-" if n > 8 else ""), out, t))
        if wait:
            t += 1.0
            run(engine, t)
        engine.advance(engine.now)
        held = [s for s in seqs if s.state in ("running", "parked")]
        shared = {h for s in held for h in s.block_hashes}
        own = sum(engine._blocks_of(s) for s in held)
        assert engine._blocks <= engine.num_blocks
        assert len(engine._refs) == len(shared) and engine._blocks == own + len(shared)
    run(engine)
    assert all(s.state == "finished" for s in seqs)
    assert engine.kv_blocks == 0 and not engine._refs
    c = engine.counters
    assert 0 <= c.prefix_hits <= c.prefix_queries
