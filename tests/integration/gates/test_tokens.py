"""redis-quota in tokens mode: a sliding window of token charges per key, on the real Redis.
One test per rule: charge the estimate, refuse with the time until the window frees enough,
settle to the usage, refund, drop what can never fit, classify, compose; a correction learned
from the answers' prompt tokens (``estimate_correction: usage``), held to the Python rule.

Then in the pipeline: a real worker node, the simulator over HTTP (its ``usage``: a token per
prompt word, ``max_tokens`` completion tokens) and the real Redis. Queues ``tokens`` (1,000
tokens per minute per userid) and ``tokens1s`` (100 per second), see ``tests/conftest.py``.
Queue ``tokenslearn`` is ``tokens`` with ``estimate_correction: usage``.
Every pipeline test ends in the ``pl`` leak check: no gate holds a reservation; here also no
charge is left unsettled. (The estimate and usage rules alone: tests/unit/test_tokens.py.)"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.errors import ConfigError
from pipeline.gates import AcquireContext, Gate, GateEnv, Settles, Verdict, build_gate, settle
from pipeline.gates.base import walk
from pipeline.gates.quota import SETTLE_POLL_S, TokenQuota
from pipeline.gates.tokens import LEARN_TTL_S, Learned
from pipeline.sim import SimServer
from tests.conftest import held

from .conftest import ctx, server_now

ALICE = {"userid": "alice"}
BOB = {"userid": "bob"}


def tokens(limit: int = 100, window: Any = 60, **extra: Any) -> dict[str, Any]:
    return {"mode": "tokens", "limit": limit, "window": window, **extra}


def req(
    max_tokens: int, prompt: str = "", metadata: dict[str, str] | None = None, queue: str = "q"
) -> AcquireContext:
    """A request whose estimate is ceil(len(prompt) / 4) + max_tokens."""
    c = ctx(metadata=metadata if metadata is not None else ALICE)
    payload = json.dumps({"prompt": prompt, "max_tokens": max_tokens})
    return AcquireContext(**{**c.__dict__, "payload": payload, "queue": queue})


def charges(genv: GateEnv, gate: Gate, value: str = "alice") -> dict[str, str]:
    _, hash_key = gate.tokens_keys(value)  # type: ignore[attr-defined]
    return dict(genv.client.hgetall(hash_key))


def test_admission_charges_the_estimate_until_the_limit(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("redis-quota", tokens(100))
    a, b, c = req(40, "x" * 8), req(50), req(10)  # 42, 50, 10
    assert gate.acquire(a).labels == {"classification": "reserved"}
    assert gate.acquire(b).admitted
    assert charges(genv, gate) == {a.holder: "e42", b.holder: "e50"}
    over = gate.acquire(c)  # 92 + 10 > 100
    assert over.verdict is Verdict.REFUSE and over.reason == "quota_exhausted"
    assert over.labels == {"classification": "overflow"}
    assert gate.acquire(req(8)).admitted  # 92 + 8 fits exactly
    assert gate.acquire(req(1, metadata=BOB)).admitted  # another key has its own budget
    assert gate.in_flight() == 0  # nothing is held: a charge is not a reservation


def test_the_same_holder_is_charged_once(genv: GateEnv, make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", tokens(100))
    a = req(60)
    assert gate.acquire(a).admitted and gate.acquire(a).admitted
    assert charges(genv, gate) == {a.holder: "e60"}
    assert not gate.acquire(req(60)).admitted


def stamps(genv: GateEnv, gate: Gate, *holders: str) -> list[float]:
    log_key, _ = gate.tokens_keys("alice")  # type: ignore[attr-defined]
    return [float(genv.client.zscore(log_key, h)) for h in holders]


def test_a_refusal_waits_until_enough_of_the_window_has_expired(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    """Charges settled at t0 (30) and t1 (50), limit 100, window 60 s: a request of 40 needs
    the first to expire, so its delay is t0 + 60 - now; one of 75 needs both: t1 + 60 - now."""
    gate = make("redis-quota", tokens(100))
    a, b = req(30), req(50)
    gate.acquire(a)
    gate.acquire(b)
    gate.settle(a, 30)  # settled: no settlement can make room sooner
    gate.settle(b, 50)
    t0, t1 = stamps(genv, gate, a.holder, b.holder)
    before = server_now(genv.client)
    small = gate.acquire(req(40))
    large = gate.acquire(req(75))
    after = server_now(genv.client)
    assert small.retry_after is not None and large.retry_after is not None
    assert t0 + 60 - after - 0.002 <= small.retry_after <= t0 + 60 - before + 0.002
    assert t1 + 60 - after - 0.002 <= large.retry_after <= t1 + 60 - before + 0.002


def test_a_refusal_asks_again_soon_when_charges_in_flight_could_settle_lower(
    make: Callable[..., Gate],
) -> None:
    gate = make("redis-quota", tokens(100))
    gate.acquire(req(90))  # an estimate, in flight
    refused = gate.acquire(req(20))
    assert refused.retry_after is not None and refused.retry_after <= SETTLE_POLL_S
    full = make("redis-quota", tokens(100), name="other")
    settled = req(90, metadata=BOB)
    full.acquire(settled)
    full.settle(settled, 90)
    refused = full.acquire(req(20, metadata=BOB))  # nothing left to settle: the window
    assert refused.retry_after is not None and refused.retry_after > 50


def test_the_window_expires_and_admits_again(make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", tokens(100, window="400ms"))
    first = req(100)
    assert gate.acquire(first).admitted
    gate.settle(first, 100)
    late = req(100)
    refused = gate.acquire(late)
    assert refused.retry_after is not None and 0 < refused.retry_after <= 0.4
    wait_until(lambda: gate.acquire(late).admitted, 3, "gate.acquire(late).admitted")


def test_settling_lower_makes_room_and_higher_takes_it(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("redis-quota", tokens(100))
    a = req(80)
    assert gate.acquire(a).admitted
    assert not gate.acquire(req(30)).admitted
    gate.settle(a, 20)  # the response said 20 tokens were used
    assert charges(genv, gate) == {a.holder: "20"}
    b = req(80)
    assert gate.acquire(b).admitted  # 20 + 80
    gate.settle(b, 95)  # used more than estimated: the window now holds 115
    assert not gate.acquire(req(1)).admitted


def test_a_settled_charge_counts_for_a_window_from_its_settlement(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    """Re-stamped when settled: the tokens the server received before the answer all lie in
    the windows the charge is counted in, however late the request reached the server."""
    gate = make("redis-quota", tokens(100))
    a = req(50)
    gate.acquire(a)
    (admitted,) = stamps(genv, gate, a.holder)
    before = server_now(genv.client)
    gate.settle(a, 40)
    (settled,) = stamps(genv, gate, a.holder)
    assert settled >= before > admitted
    for key in gate.tokens_keys("alice"):  # type: ignore[attr-defined]
        assert genv.client.pttl(key) > 60_000


def test_settling_to_none_keeps_the_estimate_as_settled(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    """An answer that never came (a time-out): the estimate stays charged, no longer open."""
    gate = make("redis-quota", tokens(100))
    a = req(70)
    gate.acquire(a)
    gate.settle(a, None)
    assert charges(genv, gate) == {a.holder: "70"}
    refused = gate.acquire(req(40))
    assert refused.retry_after is not None and refused.retry_after > 50  # nothing left open


def test_settle_is_idempotent_and_a_refund_removes_the_charge(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("redis-quota", tokens(100))
    a = req(100)
    assert gate.acquire(a).admitted
    gate.settle(a, 0)
    gate.settle(a, 0)
    assert charges(genv, gate) == {}
    gate.settle(a, 40)  # no charge any more: nothing to settle
    assert charges(genv, gate) == {}
    assert gate.acquire(req(100)).admitted
    gate.settle(req(5), 50)  # never charged: a no-op
    assert len(charges(genv, gate)) == 1


def test_an_estimate_above_the_whole_budget_is_dropped_saying_so(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("redis-quota", tokens(100, window="1m"))
    dropped = gate.acquire(req(99, "x" * 8))  # 2 + 99
    assert dropped.verdict is Verdict.DROP
    assert "101" in dropped.message and "100 tokens per 60 s" in dropped.message
    assert charges(genv, gate) == {}
    assert gate.acquire(req(100)).admitted  # the whole budget is not too big


def test_classifying_tokens_never_blocks(genv: GateEnv, make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", tokens(100, gating_mode="classifying"))
    got = [gate.acquire(r) for r in (req(60), req(60), req(500))]
    assert all(d.verdict is Verdict.CONTINUE for d in got)
    assert [d.labels["classification"] for d in got] == ["reserved", "overflow", "overflow"]
    assert len(charges(genv, gate)) == 1  # overflow is not charged


def test_without_the_attribute_it_passes_uncharged(make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", tokens(10))
    for _ in range(3):
        d = gate.acquire(req(10_000, metadata={}))
        assert d.admitted and d.labels == {}


def test_default_max_tokens_is_the_budget_of_a_body_without_max_tokens(
    make: Callable[..., Gate],
) -> None:
    gate = make("redis-quota", tokens(100, default_max_tokens=60))
    c = ctx(metadata=ALICE)
    no_max = AcquireContext(**{**c.__dict__, "payload": '{"prompt": "abcd"}'})
    assert gate.estimate(no_max) == 61  # type: ignore[attr-defined]
    assert gate.acquire(no_max).admitted
    assert not gate.acquire(req(40)).admitted


def test_release_renew_and_reap_hold_nothing(make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", tokens(100))
    a = req(50)
    assert gate.acquire(a).admitted
    assert gate.release(a.holder) is False
    gate.renew([a.holder], 30)
    assert gate.reap() == [] and gate.holders() == []
    assert not gate.acquire(req(60)).admitted  # the charge stays until settled or expired


def test_the_keys_expire_after_the_window(genv: GateEnv, make: Callable[..., Gate]) -> None:
    gate = make("redis-quota", tokens(100, window=2))
    gate.acquire(req(5))
    for key in gate.tokens_keys("alice"):  # type: ignore[attr-defined]
        assert 0 < genv.client.pttl(key) <= 3000


def test_concurrent_admissions_never_charge_past_the_limit(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("redis-quota", tokens(1000))
    sizes = [37, 91, 13, 120, 55, 8, 77, 64] * 5
    reqs = [req(n) for n in sizes]
    with ThreadPoolExecutor(8) as pool:
        admitted = list(pool.map(lambda r: gate.acquire(r).admitted, reqs))
    charged = sum(int(v[1:]) for v in charges(genv, gate).values())
    assert charged == sum(n for n, ok in zip(sizes, admitted, strict=True) if ok)
    assert charged <= 1000
    assert not all(admitted)  # the budget was the limit, not the requests


def test_a_composite_rollback_refunds_the_charge(genv: GateEnv, make: Callable[..., Gate]) -> None:
    params = {
        "gates": [
            {"gate_type": "redis-quota", "gate_params": tokens(100)},
            {"gate_type": "global-max-concurrency", "gate_params": {"limit": 1}},
        ]
    }
    gate = make("composite", params)
    assert any(isinstance(g, Settles) for g in walk(gate))
    first, second = req(30), req(30)
    assert gate.acquire(first).admitted
    refused = gate.acquire(second)  # charged by the quota, then the slot gate refused
    assert not refused.admitted
    inner = gate.gates[0]  # type: ignore[attr-defined]
    assert list(charges(genv, inner)) == [first.holder]  # the refused one was refunded
    settle(gate, first, 12)
    assert charges(genv, inner) == {first.holder: "12"}
    gate.release(first.holder)


def test_wrappers_pass_settle_through(genv: GateEnv, make: Callable[..., Gate]) -> None:
    gate = make("wait-on-refuse", {"gate": {"gate_type": "redis-quota", "gate_params": tokens(50)}})
    assert any(isinstance(g, Settles) for g in walk(gate))
    a = req(50)
    assert gate.acquire(a).admitted
    assert gate.acquire(req(1)).verdict is Verdict.WAIT
    settle(gate, a, 10)
    assert gate.acquire(req(40)).admitted


# -- a correction learned from the answers (estimate_correction: usage) ---------------------
LEARN = {"estimate_correction": "usage"}


def test_a_learned_correction_charges_what_the_answers_said(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("redis-quota", tokens(1000, **LEARN))
    assert isinstance(gate, TokenQuota) and gate.learned("q") == Learned()
    first = req(10, "x" * 40)  # prompt estimate 10: charged 20 before any answer
    assert gate.acquire(first).admitted
    gate.settle(first, 40, 30)  # the server counted 30 prompt tokens
    assert gate.learned("q") == Learned().learn(30, 10)
    second = req(10, "x" * 40)
    assert gate.acquire(second).admitted
    assert charges(genv, gate) == {first.holder: "40", second.holder: "e40"}  # 30 + 10
    assert gate.describe()["estimate_correction"] == "usage"


def test_a_templates_constant_is_learned_apart_from_the_prompts_size(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    """A template that adds 20 tokens to every prompt: a short prompt is charged its 20 more,
    and so is a long one (a ratio would have charged the long one 3 times its size)."""
    gate = make("redis-quota", tokens(10_000, **LEARN))
    assert isinstance(gate, TokenQuota)
    for size in (10, 100, 10, 100, 55):
        gate.settle(req(0, "x" * (4 * size)), None, size + 20)
    learned = gate.learned("q")
    assert learned.slope == pytest.approx(1.0, abs=0.05)
    assert learned.overhead == pytest.approx(20.0, abs=1.5)
    short, long = req(0, "x" * 20), req(0, "x" * 400)  # 5 and 100 estimated
    assert gate.acquire(short).admitted and gate.acquire(long).admitted
    found = charges(genv, gate)
    assert found[short.holder] == f"e{learned.charge(5)}" and 24 <= learned.charge(5) <= 26
    assert found[long.holder] == f"e{learned.charge(100)}" and 118 <= learned.charge(100) <= 122


def test_a_server_that_counts_less_does_not_lower_the_charge(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    """A server that counts fewer tokens than characters / 4: an over-estimate costs only
    while the request is in flight, an under-estimate the window."""
    gate = make("redis-quota", tokens(1000, **LEARN))
    gate.settle(req(0, "x" * 40), None, 5)  # 5 real for 10 estimated: an answer, no charge
    assert gate.learned("q").charge(10) == 10  # type: ignore[attr-defined]
    a = req(10, "x" * 40)
    assert gate.acquire(a).admitted
    assert charges(genv, gate) == {a.holder: "e20"}


def test_a_corrected_estimate_is_capped_at_the_limit_and_never_dropped(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    """What the correction adds is a guess: it never makes a request that fits the budget
    impossible. A plain estimate above the limit is still dropped."""
    gate = make("redis-quota", tokens(100, **LEARN))
    gate.settle(req(0, "x" * 4), None, 1000)  # 1000 for 1: counts as 16 × 1 + 1024
    assert gate.learned("q").charge(20) > 100  # type: ignore[attr-defined]
    big = req(10, "x" * 80)  # 20 + 10 plain
    assert gate.acquire(big).admitted
    assert charges(genv, gate) == {big.holder: "e100"}
    assert gate.acquire(req(101)).verdict is Verdict.DROP


def test_only_answers_with_prompt_tokens_teach_and_each_queue_learns_its_own(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("redis-quota", tokens(1000, **LEARN))
    assert isinstance(gate, TokenQuota)
    a = req(10, "x" * 40, queue="chat")
    gate.acquire(a)
    gate.settle(a, 0)  # refunded: no answer
    gate.settle(a, None)  # no usage
    gate.settle(req(10, "", queue="chat"), 10, 7)  # nothing was estimated for the prompt
    assert not genv.client.exists(gate.learned_key("chat"))
    gate.settle(a, 30, 20)
    assert gate.learned("chat") == Learned().learn(20, 10) and gate.learned("q") == Learned()
    assert 0 < genv.client.pttl(gate.learned_key("chat")) <= LEARN_TTL_S * 1000


def test_without_the_correction_prompt_tokens_teach_nothing(
    genv: GateEnv, make: Callable[..., Gate]
) -> None:
    gate = make("redis-quota", tokens(1000))
    a = req(10, "x" * 40)
    gate.acquire(a)
    gate.settle(a, 40, 30)
    assert list(genv.client.scan_iter(f"{genv.keys.prefix}*tokens-learned*")) == []
    assert charges(genv, gate) == {a.holder: "40"}
    assert gate.describe()["estimate_correction"] == "none"


def test_a_composite_passes_the_prompt_tokens_on(genv: GateEnv, make: Callable[..., Gate]) -> None:
    inner = {"gate_type": "redis-quota", "gate_params": tokens(100, **LEARN)}
    gate = make("wait-on-refuse", {"gate": inner})
    a = req(10, "x" * 40)
    assert gate.acquire(a).admitted
    settle(gate, a, 40, 20)
    quota = next(g for g in walk(gate) if isinstance(g, TokenQuota))
    assert quota.learned("q") == Learned().learn(20, 10)


answers = st.lists(
    st.tuples(st.integers(0, 5_000), st.integers(0, 400)), min_size=1, max_size=60
)  # (real prompt tokens, prompt estimate)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seq=answers, probe=st.integers(1, 400))
def test_what_redis_learns_is_the_python_rule(
    genv: GateEnv, make: Callable[..., Gate], seq: list[tuple[int, int]], probe: int
) -> None:
    """``gate_tokens_settle.lua`` learns exactly what ``Learned.learn`` says, answer by
    answer, and ``gate_tokens_acquire.lua`` charges exactly ``Learned.charge`` of it."""
    gate = make("redis-quota", tokens(1_000_000, **LEARN))
    assert isinstance(gate, TokenQuota)
    queue = uid("q")
    learned = Learned()
    for real, estimate in seq:
        gate.settle(req(0, "x" * (4 * estimate), queue=queue), None, real)
        learned = learned.learn(real, estimate)
        assert gate.learned(queue) == learned
    ask = req(3, "x" * (4 * probe), queue=queue)
    assert gate.acquire(ask).admitted
    _, hash_key = gate.tokens_keys("alice")
    assert genv.client.hget(hash_key, ask.holder) == f"e{learned.charge(probe) + 3}"
    gate.settle(ask, 0)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"mode": "tokens", "limit": 100, "window": 60, "estimate_correction": "tiktoken"},
         "estimate_correction"),
        ({"mode": "tokens", "limit": 100, "window": 60, "estimate_correction": 1},
         "estimate_correction"),
        ({"mode": "concurrency", "limit": 2, "estimate_correction": "usage"},
         "estimate_correction"),
        ({"mode": "tokens", "limit": 100}, "window"),
        ({"mode": "tokens", "limit": 0, "window": 60}, "limit"),
        ({"mode": "tokens", "limit": -5, "window": 60}, "limit"),
        ({"mode": "tokens", "limit": 100, "window": 0}, "window"),
        ({"mode": "tokens", "limit": 100, "window": 60, "default_max_tokens": -1}, "default_max"),
        ({"mode": "tokens", "limit": 100, "window": 60, "default_max_tokens": 1.5}, "default_max"),
        ({"mode": "concurrency", "limit": 2, "default_max_tokens": 10}, "default_max_tokens"),
        ({"limit": 2, "default_max_tokens": 10}, "default_max_tokens"),
    ],
)  # fmt: skip
def test_bad_tokens_params_are_config_errors_naming_the_field(
    params: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=field):
        build_gate("redis-quota", params, name="q")


# -- in the pipeline: a worker node, the simulator and the pl leak check ----------------------
def uid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def user() -> dict[str, str]:
    return {"userid": uid("u")}


def user_charges(pl: Pipeline, userid: str) -> dict[str, str]:
    """The user's charges in the ``tokens`` queue's budget: holder → "e<n>" (an estimate still
    open) or "<n>" (settled)."""
    gate = pl.gate("tokens")
    assert isinstance(gate, TokenQuota)
    return dict(pl.store.client.hgetall(gate.tokens_keys(userid)[1]))


def open_charges(pl: Pipeline) -> list[str]:
    """Charges of any token budget still open: an estimate nobody settled (``e<n>``), or the
    dispatcher's charge for an attempt that never asked (``d<n>``)."""
    out = []
    for store in pl.store.every_pool(pl.settings.pools()):
        pattern = f"{store.keys.prefix}gate:*:tokens:*:charges:*"
        for key in pl.store.client.scan_iter(pattern, count=10_000):
            out += [h for h, v in pl.store.client.hgetall(key).items() if v[:1] in "ed"]
    return out


def by_request(found: dict[str, str]) -> dict[str, str]:
    """Charges keyed by request id (a holder is ``<request id>:<attempt token>``)."""
    return {h.rpartition(":")[0]: v for h, v in found.items()}


def body(words: int, max_tokens: int) -> dict[str, Any]:
    """A completion request of ``words`` 4-letter words: estimate ceil(5w / 4) + max_tokens,
    simulator usage w + max_tokens."""
    return {"model": "sim-model", "prompt": " ".join(["word"] * words), "max_tokens": max_tokens}


def test_a_success_settles_its_charge_to_the_usage(served: Pipeline, sim: SimServer) -> None:
    u = user()
    rid = served.submit(body(8, 20), queue="tokens", metadata=u, timeout=30).id
    res = served.wait(rid, 20)
    assert res.ok
    usage = json.loads(res.payload)["usage"]
    assert usage["total_tokens"] == 8 + 20  # the estimate was ceil(39 / 4) + 20 = 30
    assert by_request(user_charges(served, u["userid"])) == {rid: "28"}


def test_a_request_larger_than_the_whole_budget_is_dropped_unsent(
    served: Pipeline, sim: SimServer
) -> None:
    u = user()
    rid = served.submit(body(4, 996), queue="tokens", metadata=u, timeout=30).id  # 5 + 996
    res = served.wait(rid, 20)
    assert res.error_code == "GATE_DROPPED"
    assert res.error_message is not None
    assert "token estimate 1001 exceeds the whole budget of 1000 tokens per 60 s" in (
        res.error_message
    )
    assert res.attempts == 0
    assert sim.stats()["attempts_by_request_id"].get(rid) is None  # never sent
    assert user_charges(served, u["userid"]) == {}


def test_a_failed_attempt_is_refunded_and_its_retry_charged_its_usage(
    served: Pipeline, sim: SimServer
) -> None:
    u = user()
    fail = {"x-sim-fail-first": "1", "x-sim-fail-status": "503"}
    rid = served.submit(body(2, 30), queue="tokens", metadata=u, timeout=30, headers=fail).id
    res = served.wait(rid, 20)
    assert res.ok and res.attempts == 2
    # the 503's charge was refunded; the retry's settled to its usage (2 + 30)
    found = user_charges(served, u["userid"])
    assert by_request(found) == {rid: "32"} and len(found) == 1


def log_events(pl: Pipeline, rid: str) -> list[dict[str, Any]]:
    """The request's decision log, oldest first."""
    return [json.loads(line) for line in (pl.record(rid).get("log") or "").splitlines()]


def test_over_the_budget_a_request_is_held_back_in_the_queue_until_the_window_frees(
    served: Pipeline, sim: SimServer
) -> None:
    """tokens1s: 100 tokens per second. The first request (61 tokens) is held at the simulator;
    the second (61) does not fit beside it, so the dispatcher holds its tenant back: it stays
    queued, never dispatched (no refusal, no retry). Once the first is answered its charge
    counts a window from the answer; the second is dispatched once, when that window has
    room, and reaches the simulator a window after the first."""
    u = user()
    hold = uid("hold")
    first = served.submit(body(1, 60), queue="tokens1s", metadata=u, timeout=30, headers=held(hold))
    sim.wait_held(hold)
    second = served.submit(body(1, 60), queue="tokens1s", metadata=u, timeout=30)
    wait_until(
        lambda: any(e["e"] == "held" for e in log_events(served, second.id)),
        10,
        "the second's tenant held back",
    )
    record = served.record(second.id)
    assert record["state"] == "queued" and int(record.get("dispatches") or 0) == 0
    assert served.inspect()["tokens1s"]["tenants"]["held_back"] >= 1
    sim.release(hold)
    assert served.wait(first.id, 20).ok and served.wait(second.id, 20).ok
    arrivals = {rid: at for at, _, _, rid in sim.tokens()}
    assert arrivals[second.id] - arrivals[first.id] >= 0.9  # the window (1 s), less jitter
    record = served.record(second.id)
    assert int(record["attempts"]) == 1 and int(record["dispatches"]) == 1
    assert [e["e"] for e in log_events(served, second.id)].count("refused") == 0


def most_in_a_window(arrivals: list[tuple[float, int]], window: float) -> int:
    """The most tokens arriving within ``window`` s of one another (windows that start at an
    arrival; ``arrivals``: (time, tokens), sorted)."""
    return max(sum(n for u, n in arrivals if t <= u < t + window) for t, _ in arrivals)


def test_a_backlog_over_the_budget_is_dispatched_once_per_request_and_kept_in_the_window(
    served: Pipeline, sim: SimServer
) -> None:
    """Two users, 8 requests each of 25 tokens estimated (24 served) at once behind 100 tokens
    per second each: every request is dispatched exactly once (a tenant at its budget waits in
    the queue, not in refusals), both users progress, the tokens reaching the simulator in any
    second stay within the budget, and nothing is left charged open (nor does any gate hold a
    reservation: the pl fixture)."""
    users = [user(), user()]
    sub: dict[str, Any] = {"queue": "tokens1s", "timeout": 60}
    ids = {
        u["userid"]: [r.id for r in served.submit_many([
            {"payload": body(4, 20), "metadata": u, **sub} for _ in range(8)
        ])]
        for u in users
    }  # fmt: skip
    every = [rid for mine in ids.values() for rid in mine]
    assert all(served.wait(rid, 30).ok for rid in every)
    records = {rid: served.record(rid) for rid in every}
    assert {int(r["dispatches"]) for r in records.values()} == {1}
    assert {int(r["attempts"]) for r in records.values()} == {1}
    served_at = {rid: (at, p + c) for at, p, c, rid in sim.tokens()}
    for mine in ids.values():
        arrivals = sorted(served_at[rid] for rid in mine)
        assert all(n == 24 for _, n in arrivals)  # under its estimate: no error to allow for
        assert most_in_a_window(arrivals, 1.0) <= 100
        assert arrivals[-1][0] - arrivals[0][0] >= 1.0  # 8 x 24 tokens take two windows
    assert open_charges(served) == []


def test_every_outcome_settles_or_refunds_and_no_gate_holds_a_reservation(
    served: Pipeline, sim: SimServer
) -> None:
    """Success, a terminal 4xx, a 503 then success, a 429 with Retry-After, a drop: afterwards
    (the ``pl`` fixture) every queue is idle and no gate holds a reservation; no charge is
    left open, the 4xx was refunded, the successes hold their usage."""
    u = user()
    sub: dict[str, Any] = {"queue": "tokens", "metadata": u, "timeout": 30}
    ok = served.submit(body(3, 10), **sub).id
    bad = served.submit(
        body(3, 10), headers={"x-sim-fail-first": "9", "x-sim-fail-status": "422"}, **sub
    ).id
    retried = served.submit(
        body(3, 10), headers={"x-sim-fail-first": "1", "x-sim-fail-status": "503"}, **sub
    ).id
    shed = served.submit(
        body(3, 10),
        headers={
            "x-sim-fail-first": "1",
            "x-sim-fail-status": "429",
            "x-sim-retry-after": "0.1",
        },
        **sub,
    ).id
    dropped = served.submit(body(3, 5000), **sub).id
    results = {rid: served.wait(rid, 20) for rid in (ok, bad, retried, shed, dropped)}
    assert results[ok].ok and results[retried].ok and results[shed].ok
    assert results[bad].status_code == 422
    assert results[dropped].error_code == "GATE_DROPPED"
    assert open_charges(served) == []
    settled = user_charges(served, u["userid"])
    assert by_request(settled) == {rid: "13" for rid in (ok, retried, shed)}
    assert len(settled) == 3


def test_a_request_the_window_cannot_fit_before_its_deadline_ends_deadline_exceeded(
    served: Pipeline, sim: SimServer
) -> None:
    """The budget is spent for the next minute: a request refused with that long a delay
    still ends at its deadline, unsent (it waits in the delayed set, which the deadline sweep
    covers)."""
    u = user()
    first = served.submit(body(1, 990), queue="tokens", metadata=u, timeout=30).id
    assert served.wait(first, 20).ok  # 991 of 1,000 tokens charged for a minute
    late = served.submit(body(1, 60), queue="tokens", metadata=u, timeout=3).id
    res = served.wait(late, 20)
    assert res.error_code == "DEADLINE_EXCEEDED" and res.attempts == 0
    assert sim.stats()["attempts_by_request_id"].get(late) is None


def chat(words: int, max_tokens: int) -> dict[str, Any]:
    """A chat request of one message of ``words`` 4-letter words: prompt estimate
    ceil((5w - 1) / 4) + 4 (the message's overhead); at the simulator with a template of
    (5, 3), w + 5 + 3 prompt tokens."""
    text = " ".join(["word"] * words)
    return {"model": "sim-model", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens}  # fmt: skip


def test_a_queue_learns_its_templates_overhead_from_the_answers(
    served: Pipeline, sim: SimServer
) -> None:
    """``tokenslearn`` behind a chat template that adds 5 tokens per message and 3 per prompt
    (the simulator's ``x-sim-template-tokens``): the first answer teaches the correction, and
    the next request is charged its estimate corrected by it while in flight, then its usage."""
    gate = served.gate("tokenslearn")
    assert isinstance(gate, TokenQuota)
    u, template = user(), {"x-sim-template-tokens": "5,3"}
    sub: dict[str, Any] = {"queue": "tokenslearn", "metadata": u, "timeout": 30,
                           "endpoint": "/v1/chat/completions"}  # fmt: skip
    served.store.client.delete(gate.learned_key("tokenslearn"))  # a fresh start
    first = served.submit(chat(8, 20), headers=template, **sub).id
    res = served.wait(first, 20)
    assert res.ok and json.loads(res.payload)["usage"]["prompt_tokens"] == 8 + 5 + 3
    estimate = 10 + 4  # ceil(39 / 4) + 4
    learned = Learned().learn(16, estimate)
    assert gate.learned("tokenslearn") == learned
    hold = uid("hold")
    second = served.submit(chat(8, 20), headers={**template, **held(hold)}, **sub).id
    sim.wait_held(hold)
    charged = by_request(user_charges_of(served, "tokenslearn", u["userid"]))
    assert charged[second] == f"e{learned.charge(estimate) + 20}" == "e36"  # not 14 + 20
    sim.release(hold)
    assert served.wait(second, 20).ok
    assert by_request(user_charges_of(served, "tokenslearn", u["userid"])) == {
        first: "36",
        second: "36",
    }
    assert open_charges(served) == []


def user_charges_of(pl: Pipeline, queue: str, userid: str) -> dict[str, str]:
    gate = pl.gate(queue)
    assert isinstance(gate, TokenQuota)
    return dict(pl.store.client.hgetall(gate.tokens_keys(userid)[1]))
