"""global-max-concurrency: one limit for every node together, held in Redis."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pipeline.gates import GateEnv, Verdict, build_gate

from .conftest import ctx, lapse


def test_the_limit_counts_every_node_together(genv: GateEnv) -> None:
    other = GateEnv(genv.client, genv.keys, node="node-b")
    g1 = build_gate("global-max-concurrency", {"limit": 2}, name="q", env=genv)
    g2 = build_gate("global-max-concurrency", {"limit": 2}, name="q", env=other)
    assert g1.capacity() == 2 and not g1.per_node  # the dispatcher counts it cluster-wide
    a, b = ctx(), ctx()
    assert g1.acquire(a).admitted and g2.acquire(b).admitted
    full = g2.acquire(ctx())  # node b is empty, but the cluster is at the limit
    assert (full.verdict, full.reason, full.wake_on_release) == (
        Verdict.REFUSE,
        "gate_closed",
        True,
    )
    assert g1.in_flight() == 2 == g2.in_flight() and g1.budget() == 0.0
    assert g2.release(a.holder) is True  # released on another node than it was acquired
    assert g2.acquire(c := ctx()).admitted
    for h in (b, c):
        assert g1.release(h.holder)
    assert g1.in_flight() == 0 and g2.budget() == 1.0


def test_blocking_mode_waits_and_a_dead_nodes_lease_is_reaped_anywhere(genv: GateEnv) -> None:
    dead = GateEnv(genv.client, genv.keys, node="node-dead")
    g_dead = build_gate("global-max-concurrency", {"limit": 1}, name="q", env=dead)
    g_live = build_gate(
        "global-max-concurrency", {"limit": 1, "gating_mode": "blocking"}, name="q", env=genv
    )
    c = ctx()
    assert g_dead.acquire(c).admitted
    assert g_live.acquire(ctx()).verdict is Verdict.WAIT
    lapse(genv, c.holder)
    assert g_live.reap() == [c.holder]
    assert g_live.in_flight() == 0


def test_concurrent_acquires_never_exceed_the_limit(genv: GateEnv) -> None:
    gates = [
        build_gate(
            "global-max-concurrency",
            {"limit": 3},
            name="q",
            env=GateEnv(genv.client, genv.keys, f"n{i}"),
        )
        for i in range(4)
    ]
    contexts = [ctx() for _ in range(40)]
    with ThreadPoolExecutor(16) as pool:
        decisions = list(
            pool.map(lambda i: gates[i % 4].acquire(contexts[i]), range(len(contexts)))
        )
    admitted = [c for c, d in zip(contexts, decisions, strict=True) if d.admitted]
    assert len(admitted) == 3 and gates[0].in_flight() == 3
    for c in admitted:
        gates[1].release(c.holder)
