"""Token budgets held back in the dispatcher, with the real dispatch script and the real token
gate (no worker: each test plays the attempts' admission, settlement and end by hand). A
tenant whose next request's estimate does not fit in its token budget's window is held back:
not dispatched, not looked at again, other tenants go on in their order. It is made ready
again when a request charged in that window leaves (its settlement may have made room) and
when the window has room by the server's clock. Each request the dispatcher sends is charged
its estimate in the window (``d<n>``), which the attempt's admission takes over.

The dispatcher's estimate is a Lua copy of pipeline/gates/tokens.py's rule: a Hypothesis test
holds the two to the same number. (With a worker and the simulator: gates/test_tokens.py and
bench/tokens.py.)"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.cli.services import wait_until
from pipeline.gates import AcquireContext, GateEnv, build_gate
from pipeline.gates.quota import TokenQuota
from pipeline.gates.tokens import estimate_tokens
from pipeline.store import Dispatched, holder

from .sched_harness import Bench, bench, check_consistent

QUEUES = [{"queue_name": "q"}]
HYPOTHESIS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture
def b(redis_url: str) -> Iterator[Bench]:
    with bench(redis_url, QUEUES) as it:
        it.index("q", False)
        yield it


@pytest.fixture(scope="module")
def shared(redis_url: str) -> Iterator[Bench]:
    """One bench for the Hypothesis tests (each example has tenants of its own)."""
    with bench(redis_url, QUEUES) as it:
        it.index("q", False)
        yield it


def token_gate(b: Bench, limit: int, window: float = 60, **extra: Any) -> TokenQuota:
    params = {"mode": "tokens", "attribute": "userid", "limit": limit, "window": window, **extra}
    gate = build_gate("redis-quota", params, name="tq", env=GateEnv(b.client, b.store.keys))
    assert isinstance(gate, TokenQuota)
    return gate


def submit(b: Bench, tenant: str, sizes: list[int], tag: str) -> list[str]:
    """Requests of ``tenant`` whose estimates are ``sizes`` (an empty prompt, max_tokens)."""
    items = [
        {
            "payload": {"prompt": "", "max_tokens": n},
            "id": f"{tag}{i}-{uuid.uuid4().hex[:6]}",
            "queue": "q",
            "metadata": {"userid": tenant},
            "timeout": 600,
        }
        for i, n in enumerate(sizes)
    ]
    return [r.id for r in b.pl.submit_many(items)]


def tick(b: Bench, gate: TokenQuota, free: int = 20) -> list[Dispatched]:
    res = b.tick({"q": {"tokens": tuple(gate.token_specs())}}, free)
    check_consistent(b, "q")
    return list(res.moved)


def charges(b: Bench, gate: TokenQuota, tenant: str) -> dict[str, str]:
    """Request id → its charge in the tenant's window."""
    found = b.client.hgetall(gate.tokens_keys(tenant)[1])
    return {h.rpartition(":")[0]: v for h, v in found.items()}


def held_by(b: Bench, tenant: str) -> str | None:
    return b.client.hget(b.store.keys.blocked("q"), tenant)  # type: ignore[return-value]


def window_key(b: Bench, gate: TokenQuota, tenant: str) -> str:
    """The window's name as the dispatcher holds tenants back by it (under the gate prefix)."""
    return gate.tokens_keys(tenant)[0].removeprefix(b.store.keys.gate_prefix())


def admission(b: Bench, d: Dispatched, tenant: str) -> AcquireContext:
    rec = b.pl.record(d.id)
    return AcquireContext(
        d.id, d.token, "q", "w1", 30.0, time.time() + 600, {"userid": tenant}, {}, rec["payload"]
    )


def server_now(b: Bench) -> float:
    sec, usec = b.client.time()
    return sec + usec / 1e6


def test_a_tenant_whose_window_is_full_is_held_back_while_others_go_on(b: Bench) -> None:
    gate = token_gate(b, 100)
    a = submit(b, "A", [40, 40, 40, 40], "a")
    bees = submit(b, "B", [30, 30], "b")
    before = server_now(b)
    moved = tick(b, gate)
    # A's two that fit (80 of 100), then A is held back at its third; B's own budget goes on
    assert [d.id for d in moved] == [a[0], a[1], *bees]
    assert charges(b, gate, "A") == {a[0]: "d40", a[1]: "d40"}
    assert charges(b, gate, "B") == {bees[0]: "d30", bees[1]: "d30"}
    key = window_key(b, gate, "A")
    assert held_by(b, "A") == key and held_by(b, "B") is None
    # it wakes by the clock when the first charge leaves the window (a minute), if not sooner
    ((_, due),) = b.client.zrange(b.store.keys.wakeups("q"), 0, -1, withscores=True)
    assert before + 60 <= due <= server_now(b) + 60
    held = [json.loads(line) for line in b.pl.record(a[2])["log"].splitlines()]
    assert held[-1]["e"] == "held" and held[-1]["key"] == key
    assert b.pl.inspect()["q"]["tenants"] == {"ready": 0, "held_back": 1}
    assert tick(b, gate) == []  # held back: not dispatched, not looked at
    assert int(b.pl.record(a[2]).get("dispatches") or 0) == 0


def test_the_attempts_admission_takes_the_dispatchers_charge_over(b: Bench) -> None:
    """The attempt asks its gate as usual: the dispatcher's charge for it is replaced by the
    admission's own (its estimate, counted from the admission); asking again charges nothing
    more; a settlement settles it."""
    gate = token_gate(b, 100)
    (rid,) = submit(b, "A", [70], "a")
    (d,) = tick(b, gate)
    log_key = gate.tokens_keys("A")[0]
    stamped = float(b.client.zscore(log_key, holder(d.id, d.token)))
    ctx = admission(b, d, "A")
    assert gate.acquire(ctx).admitted
    assert charges(b, gate, "A") == {rid: "e70"}
    assert float(b.client.zscore(log_key, ctx.holder)) >= stamped
    assert gate.acquire(ctx).admitted and charges(b, gate, "A") == {rid: "e70"}
    gate.settle(ctx, 55)
    assert charges(b, gate, "A") == {rid: "55"}


def test_a_leave_whose_settlement_made_room_wakes_the_tenant(b: Bench) -> None:
    gate = token_gate(b, 100)
    a = submit(b, "A", [40, 40, 40, 40], "a")
    moved = tick(b, gate)
    assert [d.id for d in moved] == a[:2]
    first, second = moved
    # the first attempt is admitted and answered with less than it estimated (10): A wakes,
    # and the next tick sends its third (10 + 40 + 40 = 90), not its fourth
    ctx = admission(b, first, "A")
    assert gate.acquire(ctx).admitted
    gate.settle(ctx, 10)
    assert b.store.finish(first.id, first.token, attempted=True, status_code=200, payload="{}")
    assert held_by(b, "A") is None
    assert [d.id for d in tick(b, gate)] == [a[2]]
    assert held_by(b, "A") == window_key(b, gate, "A")
    # the second ends with nothing served (a refund: it had not asked yet): room for the
    # fourth (10 + 40 + 40)
    gate.settle(admission(b, second, "A"), 0)
    assert b.store.requeue(second.id, second.token, delay=60, attempted=False)
    assert [d.id for d in tick(b, gate)] == [a[3]]


def test_a_leave_that_made_no_room_dispatches_nothing(b: Bench) -> None:
    gate = token_gate(b, 100)
    a = submit(b, "A", [60, 60], "a")
    (first,) = tick(b, gate)
    ctx = admission(b, first, "A")
    assert gate.acquire(ctx).admitted
    gate.settle(ctx, 60)  # it used what it estimated: the window stays full
    assert b.store.finish(first.id, first.token, attempted=True, status_code=200, payload="{}")
    assert tick(b, gate) == []  # looked at again, held back again: not dispatched
    assert held_by(b, "A") == window_key(b, gate, "A")
    assert int(b.pl.record(a[1]).get("dispatches") or 0) == 0


def test_the_window_frees_by_the_clock(b: Bench) -> None:
    """A window of 1 s: the held tenant's next request goes once the charge ahead of it has
    left the window, and the tick says when to look again (its next event)."""
    gate = token_gate(b, 100, window=1)
    a = submit(b, "A", [60, 60], "a")
    (first,) = tick(b, gate)
    (stamp,) = [
        float(s) for _, s in b.client.zrange(gate.tokens_keys("A")[0], 0, -1, withscores=True)
    ]
    res = b.tick({"q": {"tokens": tuple(gate.token_specs())}}, 20)
    assert res.moved == [] and res.next_event is not None and res.next_event <= 1.0
    got: list[Dispatched] = []

    def sent() -> bool:
        got.extend(tick(b, gate))
        return bool(got)

    wait_until(sent, 5, "the second dispatched once the window has room")
    assert [d.id for d in got] == [a[1]]
    assert server_now(b) >= stamp + 1
    assert held_by(b, "A") is None
    assert b.client.zcard(b.store.keys.wakeups("q")) == 0


def test_a_request_larger_than_the_whole_budget_goes_uncharged(b: Bench) -> None:
    """It can never fit: holding it back would hold its tenant for ever. It is dispatched
    without a charge, and its attempt's admission drops it unsent (gates/test_tokens.py)."""
    gate = token_gate(b, 100)
    a = submit(b, "A", [101, 30], "a")
    assert [d.id for d in tick(b, gate)] == a
    assert charges(b, gate, "A") == {a[1]: "d30"}


@pytest.mark.parametrize(
    ("extra", "held_back"),
    [({}, True), ({"gating_mode": "classifying"}, False), ({"address": "redis://h:1"}, False)],
)
def test_which_budgets_the_dispatcher_holds_tenants_back_by(
    extra: dict[str, str], held_back: bool
) -> None:
    """A blocking budget whose window is in the pipeline's Redis; not a classifying one (it
    never refuses), nor one on a Redis of its own (the dispatch script cannot read it)."""
    params = {"mode": "tokens", "limit": 100, "window": 60, **extra}
    assert bool(build_gate("redis-quota", params, name="tq", env=None).token_specs()) == held_back


@HYPOTHESIS
@given(
    limit=st.integers(1, 300),
    sizes=st.lists(st.integers(1, 320), min_size=1, max_size=12),
)
def test_the_dispatcher_sends_what_fits_in_order_and_never_charges_past_the_limit(
    shared: Bench, limit: int, sizes: list[int]
) -> None:
    """Whatever the estimates: ticks with no leave send the tenant's requests in order while
    each fits (one larger than the whole budget goes uncharged), charge exactly those, and
    hold the tenant back at the first that does not fit."""
    b = shared
    gate = token_gate(b, limit)
    tenant = f"h-{uuid.uuid4().hex[:8]}"
    ids = submit(b, tenant, sizes, "p")
    expected, charged = [], {}
    total = 0
    for rid, n in zip(ids, sizes, strict=True):
        if n > limit:
            expected.append(rid)
        elif total + n <= limit:
            expected.append(rid)
            charged[rid] = f"d{n}"
            total += n
        else:
            break
    sent = [d.id for d in tick(b, gate)] + [d.id for d in tick(b, gate)]
    assert sent == expected
    assert charges(b, gate, tenant) == charged
    assert held_by(b, tenant) == (window_key(b, gate, tenant) if len(sent) < len(ids) else None)


# -- the dispatcher's estimate is the gate's ---------------------------------------------------
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)  # (no lone surrogate)
INT = st.integers(0, 5000)
CONTENT = st.one_of(
    TEXT,
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
            st.fixed_dictionaries({"type": st.just("image_url"), "image_url": TEXT}),
        ),
        max_size=4,
    ),
    st.none(),
)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": CONTENT})
OPTIONAL = {
    "max_tokens": st.one_of(
        INT, st.booleans(), st.floats(0.5, 99.5).filter(lambda x: x != int(x)), TEXT
    ),
    "max_completion_tokens": INT,
    "n": st.integers(0, 4),
}
BODY = st.one_of(
    st.fixed_dictionaries(
        {
            "prompt": st.one_of(
                TEXT,
                st.lists(TEXT, max_size=3),
                st.lists(st.integers(0, 50_000), max_size=20),
                st.lists(st.lists(st.integers(0, 50_000), max_size=8), max_size=3),
            )
        },
        optional=OPTIONAL,
    ),
    st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=4)}, optional=OPTIONAL),
    st.fixed_dictionaries({}, optional=OPTIONAL),
)


@HYPOTHESIS
@given(body=BODY, default_max_tokens=st.integers(0, 1000))
def test_the_dispatchers_estimate_is_the_gates(
    shared: Bench, body: dict[str, Any], default_max_tokens: int
) -> None:
    """What the dispatcher charges for a request is the estimate its admission charges
    (pipeline/gates/tokens.py): prompts of text, token ids or both, chat messages with text or
    content parts, any max_tokens / max_completion_tokens / n, non-ASCII text. (JSON cannot
    tell the Lua side 2.0 from 2: a float that is a whole number is left out.)"""
    b = shared
    gate = token_gate(b, 10**9, default_max_tokens=default_max_tokens)
    tenant = f"e-{uuid.uuid4().hex[:8]}"
    item = {"payload": body, "queue": "q", "metadata": {"userid": tenant}, "timeout": 600}
    rid = b.pl.submit_many([item])[0].id
    assert [d.id for d in tick(b, gate)] == [rid]
    want = estimate_tokens(b.pl.record(rid)["payload"], default_max_tokens)
    assert charges(b, gate, tenant) == {rid: f"d{want}"}


def test_a_reload_that_removes_the_budget_frees_the_tenants_it_held(redis_url: str) -> None:
    """A fair-share queue whose token budget a reload removes stays indexed; a tenant the
    budget held back (by the clock alone: nothing of it in flight) is made ready again."""
    from dataclasses import replace

    from pipeline.dispatch.dispatcher import Dispatcher

    params = {"mode": "tokens", "attribute": "userid", "limit": 100, "window": 60}
    queue = {"queue_name": "q", "fair_share": True, "gate_type": "redis-quota"}
    with bench(redis_url, [{**queue, "gate_params": params}]) as b:
        sent: list[Dispatched] = []
        d = Dispatcher(b.pl.settings, ["p"], node="n1", slots=4, send=sent.extend)
        try:
            d.setup_queues()
            a = submit(b, "A", [60, 60], "a")
            d.tick()
            assert [m.id for m in sent] == a[:1]
            assert held_by(b, "A") is not None
            # its first ends: nothing of A in flight, the window still full for a minute
            assert b.store.finish(sent[0].id, sent[0].token, attempted=False, status_code=None,
                                  payload="{}", error_code="CANCELLED")  # fmt: skip
            d.tick()
            assert held_by(b, "A") is not None and len(sent) == 1
            open_gate = replace(b.pl.settings.queues["q"], gate_type="constant", gate_params={})
            d.apply(replace(b.pl.settings, queues={"q": open_gate}))
            check_consistent(b, "q")
            assert held_by(b, "A") is None
            d.tick()
            assert [m.id for m in sent] == a
        finally:
            for gate in d.gates.values():
                gate.close()
