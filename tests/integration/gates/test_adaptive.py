"""adaptive-concurrency against Redis: the limit is read in the acquire's own atomic step, a
lowered limit admits nothing (hand-overs included) until in-flight drains, the answers go into
a window one node closes, priority bands, leases like every slot gate's."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from pipeline.errors import ConfigError
from pipeline.gates import GateEnv, Observation, Verdict, build_gate
from pipeline.gates.adaptive import AdaptiveConcurrencyGate
from pipeline.gates.leases import split_holder

from .conftest import ctx, lapse


def adaptive(genv: GateEnv, node: str | None = None, **params: object) -> AdaptiveConcurrencyGate:
    env = genv if node is None else GateEnv(genv.client, genv.keys, node=node)
    gate = build_gate("adaptive-concurrency", dict(params), name="q", env=env)
    assert isinstance(gate, AdaptiveConcurrencyGate)
    return gate


def set_limit(genv: GateEnv, limit: int) -> None:
    """What the controller's move writes (gate_adaptive_move.lua), set directly."""
    genv.client.hset(genv.keys.gate_adaptive("q"), "limit", limit)


def test_needs_no_params_and_starts_at_its_initial_limit(genv: GateEnv) -> None:
    g = adaptive(genv)
    assert g.capacity() == 8 and not g.per_node
    held = [ctx() for _ in range(8)]
    assert all(g.acquire(c).admitted for c in held)
    full = g.acquire(ctx())
    assert (full.verdict, full.reason, full.wake_on_release) == (
        Verdict.REFUSE,
        "gate_closed",
        True,
    )
    for c in held:
        assert g.release(c.holder)
    assert g.in_flight() == 0


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"min": 0}, "min"),
        ({"min": 5, "max": 4}, "max"),
        ({"initial": 2000}, "initial"),
        ({"controller": "pid"}, "controller"),
        ({"metrics_url": "ftp://x/metrics"}, "metrics_url"),
        ({"priority_headroom": 0.9}, "priority_headroom"),
        ({"window_min": "10s", "window_max": "1s"}, "window_max"),
    ],
)
def test_a_bad_param_is_a_config_error_naming_it(params: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"param '{field}'"):
        build_gate("adaptive-concurrency", params, name="q")


def test_the_acquire_reads_the_limit_in_force_and_a_lower_one_admits_nothing_until_drained(
    genv: GateEnv,
) -> None:
    g = adaptive(genv, initial=4)
    held = [ctx() for _ in range(4)]
    assert all(g.acquire(c).admitted for c in held)
    set_limit(genv, 6)  # raised: room at once, no cache in the way of the acquire
    more = [ctx(), ctx()]
    assert all(g.acquire(c).admitted for c in more) and not g.acquire(ctx()).admitted
    set_limit(genv, 2)  # lowered below the 6 in flight
    for c in [*held, *more][:3]:
        g.release(c.holder)
        assert not g.acquire(ctx()).admitted  # 5, 4, 3 in flight: still above 2
    rest = [*held, *more][3:]
    g.release(rest[0].holder)  # 2 in flight: full, not over
    assert not g.acquire(ctx()).admitted
    g.release(rest[1].holder)
    assert g.acquire(last := ctx()).admitted
    for c in (rest[2], last):
        g.release(c.holder)


def test_a_hand_over_is_refused_while_in_flight_is_above_a_lowered_limit(genv: GateEnv) -> None:
    g = adaptive(genv, initial=3)
    a, b, c = ctx(), ctx(), ctx()
    for x in (a, b, c):
        assert g.acquire(x).admitted
    taker = ctx()
    assert g.transfer_calls(a.holder, taker, "q").run()  # at the limit: the slot passes
    set_limit(genv, 2)
    other = ctx()
    assert not g.transfer_calls(b.holder, other, "q").run()  # the giver's slot is freed only
    assert {split_holder(h["request_id"] + ":" + h["attempt"])[0] for h in g.holders()} == {
        c.request_id,
        taker.request_id,
    }
    for x in (c, taker):
        g.release(x.holder)


def test_concurrent_acquires_on_several_nodes_never_exceed_the_limit_while_it_moves(
    genv: GateEnv,
) -> None:
    gates = [adaptive(genv, node=f"n{i}", initial=5) for i in range(4)]
    limits = iter([5, 3, 7, 2, 6, 4] * 50)
    over: list[tuple[int, int]] = []
    lock = threading.Lock()
    holders: list[str] = []

    def one(i: int) -> None:
        g = gates[i % 4]
        c = ctx()
        if i % 7 == 0:
            with lock:
                set_limit(genv, next(limits))
        limit_before = int(genv.client.hget(genv.keys.gate_adaptive("q"), "limit") or 5)
        if g.acquire(c).admitted:
            n = g.in_flight()
            limit_after = int(genv.client.hget(genv.keys.gate_adaptive("q"), "limit") or 5)
            if n > max(limit_before, limit_after, 7):
                over.append((n, limit_before))
            with lock:
                holders.append(c.holder)
                if len(holders) > 3:
                    g.release(holders.pop(0))

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(one, range(300)))
    assert not over
    assert gates[0].in_flight() <= 7
    for h in holders:
        gates[1].release(h)


def test_priority_bands_keep_headroom_for_a_higher_priority_that_asked(genv: GateEnv) -> None:
    g = adaptive(genv, initial=10, priority_headroom=0.2)
    low = [dataclasses.replace(ctx(), priority=0) for _ in range(10)]
    assert all(g.acquire(c).admitted for c in low)  # alone, priority 0 has the whole limit
    for c in low[8:]:
        g.release(c.holder)
    high = dataclasses.replace(ctx(), priority=9)
    assert g.acquire(high).admitted  # 9 in flight < 10
    # now a priority 9 asked: priority 0's ceiling is 10 x (1 - 0.2) = 8 (9 in flight)
    assert not g.acquire(dataclasses.replace(ctx(), priority=0)).admitted
    mid = dataclasses.replace(ctx(), priority=5)  # its band: 10 x (1 - 0.2 x 4/9) = 9
    assert not g.acquire(mid).admitted
    assert g.acquire(high2 := dataclasses.replace(ctx(), priority=9)).admitted  # 10
    for c in [*low[:8], high, high2]:
        g.release(c.holder)


def test_a_dead_holders_lease_is_reaped(genv: GateEnv) -> None:
    g = adaptive(genv, initial=1)
    c = ctx()
    assert g.acquire(c).admitted
    lapse(genv, c.holder)
    assert g.reap() == [c.holder]
    assert g.acquire(d := ctx()).admitted
    g.release(d.holder)


def observe(g: AdaptiveConcurrencyGate, holder: str, o: Observation) -> None:
    for call in g.observe_calls(holder, o):
        call()


def test_answers_fill_a_window_one_node_closes_and_an_overload_lowers_the_limit(
    genv: GateEnv,
) -> None:
    a = adaptive(genv, initial=8, window_min="0s")
    b = adaptive(genv, node="node-b", initial=8, window_min="0s")
    assert a.control() is None  # the first call only starts the first window
    held = [ctx() for _ in range(6)]
    for c in held:
        assert a.acquire(c).admitted
    # two 429s at 6 in flight: the server's cap is 5
    observe(a, held[0].holder, Observation("over", 0.01, retry_after_s=0.0))
    observe(a, held[1].holder, Observation("over", 0.01))
    for c in held[2:]:
        observe(a, c.holder, Observation("ok", 0.5, 10))
    outcomes = [a.control(), b.control()]
    assert outcomes.count(False) == 1 and outcomes.count(None) == 1  # one mover: no raise
    view = b.controller_view()
    assert view["limit"] == 5 and view["signal"] == "overload" and "429" in view["reason"]
    assert view["moved_at"] is not None and view["windows"] == 1
    assert a.capacity() == 5 and b.describe()["adaptive"]["limit"] == 5
    for c in held:
        a.release(c.holder)


@pytest.mark.parametrize("up", [True, False])
def test_the_mover_reads_the_engines_metrics_and_decides_without_them_when_they_fail(
    genv: GateEnv, up: bool
) -> None:
    """With metrics_url the window's decision reads the engine's own page (vLLM's names, here
    the engine model's): the signal is the engine's; a page that cannot be read (nothing
    listens) is decided on from the answers (and logged once)."""
    from pipeline.sim import SimConfig, SimServer
    from pipeline.sim.presets import engine_config

    sim = SimServer(SimConfig(engine=engine_config("h100", time_scale=0.01))).start_in_thread()
    url = f"{sim.url}/metrics" if up else "http://127.0.0.1:9/metrics"
    g = adaptive(genv, initial=4, window_min="0s", metrics_url=url)
    try:
        assert g.control() is None  # starts the first window
        held = [ctx() for _ in range(4)]
        for c in held:
            assert g.acquire(c).admitted
        for c in held:
            observe(g, c.holder, Observation("ok", 0.2, 16))
        assert g.control() is not None
        view = g.controller_view()
        assert view["signal"] == ("engine-metrics" if up else "answers"), view
        assert view["metrics_url"] == url
        for c in held:
            g.release(c.holder)
    finally:
        sim.stop()
