"""A hand-over whose giver's lease lapsed (issue 48, item 2): the process was stopped or cut off
past its lease, the reaper freed its slot and another node took it. When the giver finishes
and hands its slot to an attempt of its own process parked for one, Redis refuses the
transfer; the parked attempt must not go on (send) before Redis recorded it, or the server
would hold one call more than the limit. It is rung instead and asks its gate again."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from pipeline.cli.services import wait_until
from pipeline.config import Settings, parse_queues
from pipeline.gates import AcquireContext, Decision
from pipeline.worker import Runtime
from pipeline.worker.handover import Handover
from pipeline.worker.reservation import Reservation


def global_limit(n: int) -> dict[str, Any]:
    return {"gate_type": "global-max-concurrency", "gate_params": {"limit": n}}


@pytest.fixture
def rt(env: dict[str, str]) -> Any:
    prefix = f"plho{uuid.uuid4().hex[:6]}:"
    entry = {"queue_name": "q", "igw_base_url": "http://127.0.0.1:9", **global_limit(1)}
    settings = Settings(
        redis_url=env["PIPELINE_REDIS_URL"],
        key_prefix=prefix,
        lease_s=30,
        queues=parse_queues([entry], "q.json"),
    )
    runtime = Runtime(settings)
    yield runtime
    runtime.stop()
    runtime.store.client.delete(*runtime.store.client.keys(prefix + "*") or ["-"])


def ctx(rid: str) -> AcquireContext:
    return AcquireContext(rid, "t", "q", "w@test", 30.0, time.time() + 60)


def reservation(rt: Runtime, rid: str) -> Reservation:
    res = Reservation(rt, "q", f"{rid}:t", rt.gate("q"))
    res.bind(ctx(rid))
    return res


def park(rt: Runtime, taker: Reservation, refused: Decision) -> list[Any]:
    """``taker`` parks for a slot in a thread; the list gets its ticket and whether it went
    on admitted (as ``Attempt._park`` would, to send)."""
    out: list[Any] = []

    def run() -> None:
        ticket = taker.wait(refused, 10.0)
        out.append((ticket, taker.admitted))

    threading.Thread(target=run, daemon=True).start()
    wait_until(lambda: rt.bell.waiting("q") == 1, 5, "the parked attempt")
    return out


def finish_of(rt: Runtime, rid: str) -> Any:
    def finish(handover: Handover) -> Any:
        return rt.store.finish_call(rid, "t", attempted=False, status_code=None, payload="")

    return finish


def test_a_refused_hand_over_does_not_admit_the_parked_attempt(rt: Runtime) -> None:
    gate = rt.gate("q")
    giver = reservation(rt, "giver")
    assert giver.ask().admitted
    # its lease lapsed while it was stopped: the reaper freed it, another node took the slot
    gate.release("giver:t")
    assert gate.acquire(ctx("elsewhere")).admitted
    giver.proof -= 3600.0  # and no renewal since, as after a SIGSTOP (the lease guard's count)
    taker = reservation(rt, "taker")
    refused = taker.ask()
    assert not refused.admitted
    parked = park(rt, taker, refused)
    giver.release_with(finish_of(rt, "giver"))  # hands over: Redis refuses the transfer
    wait_until(lambda: parked, 10, "the parked attempt back")
    ((ticket, admitted),) = parked
    assert not ticket.granted and ticket.rang and not admitted  # it asks again, unsent
    assert [h["request_id"] for h in gate.holders()] == ["elsewhere"]
    gate.release("elsewhere:t")
    assert gate.in_flight() == 0


def test_a_hand_over_admits_the_parked_attempt_once_recorded(rt: Runtime) -> None:
    gate = rt.gate("q")
    giver = reservation(rt, "giver")
    assert giver.ask().admitted
    taker = reservation(rt, "taker")
    refused = taker.ask()
    assert not refused.admitted
    parked = park(rt, taker, refused)
    giver.release_with(finish_of(rt, "giver"))
    wait_until(lambda: parked, 10, "the parked attempt admitted")
    ((ticket, admitted),) = parked
    assert ticket.granted and ticket.held and admitted
    assert [h["request_id"] for h in gate.holders()] == ["taker"]
    taker.release()
    assert gate.in_flight() == 0
