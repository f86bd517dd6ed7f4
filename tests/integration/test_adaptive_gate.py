"""The adaptive-concurrency gate end to end (real Redis, real worker nodes, the simulator):
invariant 1, a test per exit path, each ending with no reservation held (``assert_idle``
after every test); invariant 2 while the limit moves, across two nodes; the controller
finding a hidden cap; and its limit, signal and reason in status, explain and Prometheus."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.observability.status import render
from pipeline.sim import SimConfig, SimServer
from tests.conftest import held
from tests.integration.test_release_paths import (
    dispatches,
    finished,
    sim_attempts,
    stall_first,
    uid,
    wait_running,
)
from tests.observability import isolated, scrape, series, start_node, total


@pytest.fixture(scope="module")
def adapt_node(start_worker: Any) -> Iterator[Any]:
    """One node for the ``adapt`` pool (limit 2, its wait-on-refuse and tier-drop variants);
    a look-ahead attempt parks 0.3 s before it goes back to the queue."""
    w = start_worker(pools="adapt", concurrency=6, extra_env={"PIPELINE_PARK_S": "0.3"})
    yield w
    w.stop()


@pytest.fixture
def served(pl: Pipeline, adapt_node: Any) -> Pipeline:
    return pl


def hold(pl: Pipeline, sim: SimServer, queue: str) -> str:
    """A request of ``queue`` held at the simulator (its slot taken) until released."""
    rid = uid("holder")
    pl.submit({"p": 1}, id=rid, queue=queue, timeout=30, headers=held(rid))
    sim.wait_held(rid)
    return rid


# -- invariant 1: one test per exit path ------------------------------------------------------
def test_success(served: Pipeline) -> None:
    rid = served.submit({"p": 1}, id=uid("ok"), queue="adapt", timeout=30).id
    assert finished(served, "adapt", rid).ok


def test_failure(served: Pipeline) -> None:
    headers = {"x-sim-fail-first": "9", "x-sim-fail-status": "422"}
    rid = served.submit({"p": 1}, id=uid("4xx"), queue="adapt", timeout=30, headers=headers).id
    res = finished(served, "adapt", rid)
    assert res.status_code == 422 and res.attempts == 1


@pytest.mark.parametrize("status", ["503", "429"])
def test_retry(served: Pipeline, status: str) -> None:
    headers = {"x-sim-fail-first": "2", "x-sim-fail-status": status, "x-sim-retry-after": "0"}
    rid = served.submit({"p": 1}, id=uid("retry"), queue="adapt", timeout=30, headers=headers).id
    res = finished(served, "adapt", rid)
    assert res.ok and res.attempts == 3


def test_refuse(served: Pipeline, sim: SimServer) -> None:
    """At the limit a look-ahead attempt is refused, parks 0.3 s holding nothing, goes back to
    the queue and is dispatched again; a refusal is not an attempt."""
    first, second = hold(served, sim, "adapt"), hold(served, sim, "adapt")
    third = served.submit({"p": 3}, id=uid("refused"), queue="adapt", timeout=30).id
    wait_until(lambda: dispatches(served, third) >= 2, 10, "a refusal and a new dispatch")
    assert sim_attempts(sim, third) == 0
    for rid in (first, second):
        sim.release(rid)
    res = finished(served, "adapt", third)
    assert res.ok and res.attempts == 1
    for rid in (first, second):
        assert finished(served, "adapt", rid).ok


def test_wait_times_out_and_requeues(served: Pipeline, sim: SimServer) -> None:
    first = hold(served, sim, "adaptwait")
    second = served.submit({"p": 2}, id=uid("waiter"), queue="adaptwait", timeout=30).id
    # waits on the gate, times out after PIPELINE_GATE_WAIT_TIMEOUT_S=1 and is requeued
    wait_until(lambda: dispatches(served, second) >= 2, 10, "requeue after the wait timed out")
    assert sim_attempts(sim, second) == 0
    sim.release(first)
    assert finished(served, "adaptwait", first).ok
    res = finished(served, "adaptwait", second)
    assert res.ok and res.attempts == 1


def test_drop(served: Pipeline, sim: SimServer) -> None:
    """tier-priority-admission over the adaptive gate: an interactive overflow request finding
    it full is dropped with a 429 of the gate's own, never sent, holding nothing."""
    first = hold(served, sim, "adaptdrop")
    second = served.submit({"p": 2}, id=uid("dropped"), queue="adaptdrop", timeout=30).id
    res = served.wait(second, 20)
    assert res.status_code == 429 and res.attempts == 0 and sim_attempts(sim, second) == 0
    assert served.inspect()["adaptdrop"]["gate"]["in_flight"] == 1  # the first one's only
    sim.release(first)
    assert finished(served, "adaptdrop", first).ok
    assert finished(served, "adaptdrop", second) == res


def test_cancel_with_abort(served: Pipeline, sim: SimServer) -> None:
    rid = hold(served, sim, "adapt")
    assert served.cancel(rid, running="abort")
    res = finished(served, "adapt", rid)
    assert res.error_code == "CANCELLED"
    wait_until(lambda: sim.stats()["hangups"] >= 1, 10, "the call's connection closed")


def test_lease_reaped_after_sigkill(pl: Pipeline, start_worker: Any, sim: SimServer) -> None:
    """Nothing runs on the killed node: its holder's lease expires and another node's reaper
    frees it; the request is requeued and completes."""
    w = start_worker(pools="adaptcrash", concurrency=4)
    rid = pl.submit(
        {"p": 1}, id=uid("node"), queue="adaptcrash", timeout=60, headers=stall_first(1)
    ).id
    wait_running(pl, rid)
    wait_until(lambda: pl.inspect()["adaptcrash"]["gate"]["in_flight"] == 1, 10, "slot held")
    w.proc.kill()
    w.proc.wait()
    survivor = start_worker(pools="adaptcrash", concurrency=4)
    try:
        res = finished(pl, "adaptcrash", rid, timeout=30)  # after one lease (3 s) at most
        assert res.ok and sim_attempts(sim, rid) == 2
    finally:
        survivor.stop()


# -- invariant 2 while the limit moves, two nodes --------------------------------------------
@pytest.fixture
def own_sim() -> Iterator[SimServer]:
    server = SimServer(SimConfig()).start_in_thread()
    yield server
    server.stop()


def at_sim(sim: SimServer) -> int:
    return int(sim.stats()["in_flight"])


def test_two_nodes_never_exceed_the_limit_in_force_and_a_lowered_one_drains_first(
    env: dict[str, str], tmp_path: Path, start_worker: Any, own_sim: SimServer
) -> None:
    """The limit is moved as the controller would (its state in Redis) while 24 requests,
    each held at the simulator under its own name, wait on two nodes whose parked attempts
    re-ask every 0.5 s and take released slots by hand-over: at 4 the server sees 4; raised to
    8, 8; lowered to 3 it sees no new request while the 8 drain to 2, then one more."""
    frozen = {"initial": 4, "max": 16, "window_min": "1h", "window_max": "1h"}  # no window ends
    entry = {"queue_name": "a", "igw_base_url": own_sim.url,
             "gate_type": "adaptive-concurrency", "gate_params": frozen}  # fmt: skip
    iso = isolated(env, tmp_path, [entry])
    pl, q = iso.pl, iso.queue("a")
    nodes = [start_node(start_worker, iso, concurrency=8)[0] for _ in range(2)]
    state = pl.store_of(q).keys.gate_adaptive(q)
    try:
        tag = uuid.uuid4().hex[:6]
        ids = [f"{tag}-{i}" for i in range(24)]
        for rid in ids:
            pl.submit({"p": rid}, id=rid, queue=q, timeout=120, headers=held(rid))

        def held_now() -> list[str]:
            return [name for name, n in own_sim.stats()["held"].items() if n]

        def parked() -> bool:  # started attempts beyond those at the server: parked at a node
            return pl.inspect()[q]["running"] > at_sim(own_sim)

        wait_until(lambda: at_sim(own_sim) == 4 and parked(), 20, "4 at the server, more parked")
        assert at_sim(own_sim) == 4
        pl.store.client.hset(state, "limit", 8)
        wait_until(lambda: at_sim(own_sim) == 8 and parked(), 20, "8 at the server")
        pl.store.client.hset(state, "limit", 3)
        for k in range(5):  # 8 -> 3 in flight: nobody is admitted, hand-overs refused
            own_sim.release(held_now()[0])
            wait_until(lambda k=k: pl.inspect()[q]["gate"]["in_flight"] == 7 - k, 20, "release")
            assert at_sim(own_sim) == 7 - k
        before = set(held_now())
        own_sim.release(sorted(before)[0])  # 2 in flight: one more is admitted
        wait_until(lambda: len(set(held_now()) - before) == 1, 20, "one admitted under 3")
        assert at_sim(own_sim) == 3
        assert own_sim.stats()["max_concurrency_observed"] == 8
        for rid in ids:  # the held and those still to come pass
            own_sim.release(rid)
        results = list(pl.iter_results(ids))
        assert len(results) == 24 and all(r.ok for r in results)
        assert own_sim.stats()["max_concurrency_observed"] == 8
    finally:
        own_sim.release_all()
        for w in nodes:
            w.stop()


# -- the controller finds a hidden cap, and shows what it did --------------------------------
def test_the_limit_learns_a_hidden_cap_and_status_explain_metrics_show_it(
    env: dict[str, str], tmp_path: Path, start_worker: Any
) -> None:
    """An engine that answers 429 above 3 in flight: the gate, started at 8, moves to the cap
    (3, or 4 while it probes) from the 429s alone; afterwards status, explain and the node's
    /metrics show its limit, the signal it acts on and why it last moved."""
    cfg = SimConfig(latency_ms=40, max_concurrency=3, overload="429", overload_retry_after_s=0)
    sim = SimServer(cfg).start_in_thread()
    params = {"initial": 8, "window_min": "0.1s", "window_max": "1h"}  # no window while idle
    entry = {"queue_name": "a", "igw_base_url": sim.url,
             "gate_type": "adaptive-concurrency", "gate_params": params}  # fmt: skip
    iso = isolated(env, tmp_path, [entry])
    pl, q = iso.pl, iso.queue("a")
    node, port = start_node(start_worker, iso, concurrency=8)
    try:
        ids = [r.id for r in pl.submit_many(
            [{"payload": {"i": i}, "queue": q, "timeout": 120} for i in range(150)]
        )]  # fmt: skip
        results = list(pl.iter_results(ids))
        assert len(results) == 150 and all(r.ok for r in results)
        gate = pl.inspect()[q]["gate"]
        view = gate["adaptive"]
        # at the cap, or a probe above it; one below when a busy machine slowed the answers
        assert view["limit"] in (2, 3, 4) and gate["limit"] == view["limit"], view
        assert view["moved_at"] is not None and view["windows"] > 0
        assert sim.stats()["by_status"].get("429", 0) < 150  # it paced, it did not hammer
        # status: the gate's signal and reason under its type, the limit in "in flight / limit"
        console = Console(width=220, record=True)
        console.print(render(pl))
        text = console.export_text()
        assert f"{view['signal']}: {view['reason'][:30]}" in text.replace("\n", " ")
        assert f"0 / {view['limit']}" in text
        # explain: a request held at the server shows the gate's limit, signal and reason
        rid = uid("explained")
        pl.submit({"p": 1}, id=rid, queue=q, timeout=60, headers={"x-sim-hold": rid})
        sim.wait_held(rid)
        e = pl.explain(rid)
        assert e.gate is not None and e.gate["adaptive"]["limit"] == view["limit"]
        assert e.gate["adaptive"]["signal"] == view["signal"]
        assert f"adaptive limit {view['limit']} ({view['signal']}" in e.to_text()
        # Prometheus: the limit labelled with its signal and the code of its reason
        samples = scrape(port)
        labels = series(samples, "pipeline_gate_adaptive_limit", queue_name=q)
        assert [(lab["signal"], lab["reason"]) for lab in labels] == [
            (view["signal"], view["reason_code"])
        ]
        value = [v for n, lab, v in samples if n == "pipeline_gate_adaptive_limit"]
        assert value == [view["limit"]]
        moved = total(samples, "pipeline_gate_adaptive_moved_seconds", queue_name=q)
        assert moved == pytest.approx(view["moved_at"])
        assert (
            total(samples, "pipeline_gate_adaptive_windows_total", queue_name=q) == view["windows"]
        )
        sim.release(rid)
        assert pl.wait(rid, 30).ok
    finally:
        node.stop()
        sim.stop()
    json.dumps(view)  # plain data


# -- priority under saturation ----------------------------------------------------------------
def test_a_high_priority_request_finds_a_slot_a_low_priority_backlog_cannot_take(
    env: dict[str, str], tmp_path: Path, start_worker: Any, own_sim: SimServer
) -> None:
    """Limit 4, headroom 0.25: a priority-0 backlog fills the 4 slots alone; once a priority-9
    request has asked, priority 0's band is 3, so the slot a priority-0 holder releases goes to
    the priority-9 request (though priority-0 attempts were parked there longer), and priority
    0 never holds more than 3 while it is around."""
    frozen = {"initial": 4, "max": 4, "window_min": "1h", "window_max": "1h",
              "priority_headroom": 0.25}  # fmt: skip
    entry = {"queue_name": "a", "igw_base_url": own_sim.url,
             "gate_type": "adaptive-concurrency", "gate_params": frozen}  # fmt: skip
    iso = isolated(env, tmp_path, [entry])
    pl, q = iso.pl, iso.queue("a")
    node = start_node(start_worker, iso, concurrency=8)[0]
    tag = uuid.uuid4().hex[:6]
    low = [f"{tag}-low{i}" for i in range(10)]
    high = f"{tag}-high"
    try:
        for rid in low:
            pl.submit({"p": rid}, id=rid, queue=q, timeout=120, headers=held(rid))

        def at(names: list[str]) -> list[str]:
            return [n for n, c in own_sim.stats()["held"].items() if c and n in names]

        wait_until(lambda: len(at(low)) == 4 and pl.inspect()[q]["running"] > 4, 20, "4 held")
        pl.submit({"p": high}, id=high, queue=q, timeout=120, priority=9, headers=held(high))
        wait_until(lambda: pl.state(high) == "running", 20, "the priority-9 attempt asked")
        own_sim.release(at(low)[0])
        wait_until(lambda: at([high]) == [high], 20, "the priority-9 request at the server")
        assert len(at(low)) == 3 and at_sim(own_sim) == 4
        own_sim.release(at(low)[0])  # 3 in flight: priority 0 may hold 3 again
        wait_until(lambda: len(at(low)) == 3 and at_sim(own_sim) == 4, 20, "a low one back")
        for rid in [*low, high]:
            own_sim.release(rid)
        results = list(pl.iter_results([*low, high]))
        assert all(r.ok for r in results)
    finally:
        for rid in [*low, high]:
            own_sim.release(rid)
        node.stop()


def test_engine_priority_sends_the_requests_priority_in_vllms_field(
    env: dict[str, str], tmp_path: Path, start_worker: Any
) -> None:
    """A first-come-first-served engine refuses a non-zero ``priority`` as vLLM does (400): the
    queue with ``engine_priority`` sends it (as -priority), the other does not; priority 0
    adds nothing."""
    from pipeline.sim.presets import engine_config

    sim = SimServer(SimConfig(engine=engine_config("h100", time_scale=0.01))).start_in_thread()
    base = {"igw_base_url": sim.url, "gate_type": "adaptive-concurrency", "gate_params": {}}
    iso = isolated(env, tmp_path, [{"queue_name": "prio", "engine_priority": True, **base},
                                   {"queue_name": "plain", **base}])  # fmt: skip
    pl = iso.pl
    node = start_node(start_worker, iso, concurrency=4)[0]
    body = {"model": "m", "prompt": "hello", "max_tokens": 4}
    try:
        sent = pl.submit(body, queue=iso.queue("prio"), priority=7, timeout=60).id
        zero = pl.submit(body, queue=iso.queue("prio"), priority=0, timeout=60).id
        plain = pl.submit(body, queue=iso.queue("plain"), priority=7, timeout=60).id
        refused = pl.wait(sent, 30)
        assert refused.status_code == 400 and "Priority scheduling" in refused.payload
        assert pl.wait(zero, 30).ok and pl.wait(plain, 30).ok
    finally:
        node.stop()
        sim.stop()
