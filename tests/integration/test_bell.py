"""The release bell: a parked attempt wakes when a slot of its queue may have freed, in this
process (a direct ring) or in another (Redis Pub/Sub), and never misses a ring that came
between its gate call and its wait."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from pipeline.cli.services import wait_until
from pipeline.worker.bell import ReleaseBell, Ticket


@pytest.fixture
def bell(redis_url: str) -> Iterator[ReleaseBell]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    b = ReleaseBell(client, [f"test-bell-{uuid.uuid4().hex[:8]}"])
    yield b
    b.stop()


def rang(ticket: Ticket | None) -> bool:
    """Whether a park ended by a ring (None: it returned at once, the bell had rung)."""
    return ticket is None or ticket.rang or ticket.granted


def waiter(bell: ReleaseBell, queue: str, gen: int, out: list[bool]) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(rang(bell.park(queue, gen, 10.0))), daemon=True)
    t.start()
    return t


def test_a_ring_before_the_wait_is_not_lost(bell: ReleaseBell) -> None:
    gen = bell.generation("q")  # read before asking the gate
    bell.ring("q")  # a release between the refusal and the wait
    assert rang(bell.park("q", gen, 10.0)) is True


def test_a_wait_with_no_ring_times_out(bell: ReleaseBell) -> None:
    assert rang(bell.park("q", bell.generation("q"), 0.05)) is False


def test_each_ring_wakes_one_waiter_of_its_queue(bell: ReleaseBell) -> None:
    woke: list[bool] = []
    gen = bell.generation("q")
    threads = [waiter(bell, "q", gen, woke) for _ in range(2)]
    wait_until(lambda: bell.waiting("q") == 2, 5, "two waiters")
    other: list[bool] = []
    waiter(bell, "other", bell.generation("other"), other)
    bell.ring("q")
    wait_until(lambda: len(woke) == 1, 5, "one waiter woken")
    assert bell.waiting("q") == 1
    bell.ring("q")
    wait_until(lambda: len(woke) == 2, 5, "the second waiter woken")
    assert woke == [True, True] and other == []  # another queue's waiter slept on
    for t in threads:
        t.join(5)
    bell.ring("other")
    wait_until(lambda: other == [True], 5, "the other queue's waiter")


def subscribed_waiter(bell: ReleaseBell) -> list[bool]:
    """A waiter on queue "q", returned once the bell's listener has subscribed."""
    woke: list[bool] = []
    waiter(bell, "q", bell.generation("q"), woke)
    wait_until(lambda: bell._subscribed.is_set(), 5, "the subscription")
    return woke


def test_a_release_published_by_another_process_wakes_a_waiter(
    bell: ReleaseBell, redis_url: str
) -> None:
    publisher = redis.Redis.from_url(redis_url)
    woke = subscribed_waiter(bell)
    publisher.publish(bell.channels[0], "elsewhere")  # another queue: nobody here waits for it
    publisher.publish(bell.channels[0], "q")  # what finish.lua / requeue.lua publish
    wait_until(lambda: woke == [True], 5, "the waiter woken over Pub/Sub")


def test_the_listener_reconnects_after_its_connection_is_killed(
    bell: ReleaseBell, redis_url: str
) -> None:
    admin = redis.Redis.from_url(redis_url)
    first = subscribed_waiter(bell)

    def subscribed() -> int:
        return int(dict(admin.pubsub_numsub(bell.channels[0]))[bell.channels[0].encode()])

    assert subscribed() == 1
    bell._subscribed.clear()
    for c in admin.client_list(_type="pubsub"):
        if c["addr"] == bell.listener_address():
            admin.client_kill_filter(_id=c["id"])
    # everything published while away is lost: every waiter is woken to ask its gate again
    wait_until(lambda: first == [True], 5, "waiters woken on the lost subscription")
    wait_until(lambda: bell._subscribed.is_set() and subscribed() == 1, 10, "resubscribed")
    again: list[bool] = []
    waiter(bell, "q", bell.generation("q"), again)
    admin.publish(bell.channels[0], "q")
    wait_until(lambda: again == [True], 5, "a wake-up after the reconnect")


def test_closing_the_bell_wakes_every_waiter_for_good(bell: ReleaseBell) -> None:
    woke: list[bool] = []
    threads = [waiter(bell, q, bell.generation(q), woke) for q in ("a", "a", "b")]
    wait_until(lambda: bell.waiting("a") + bell.waiting("b") == 3, 5, "waiters")
    bell.close()
    wait_until(lambda: len(woke) == 3, 5, "every waiter woken")
    for t in threads:
        t.join(5)
    assert rang(bell.park("a", bell.generation("a"), 10.0)) is True  # returns at once from now on


def test_a_release_here_wakes_one_waiter_not_two_when_its_echo_arrives(
    bell: ReleaseBell, redis_url: str
) -> None:
    publisher = redis.Redis.from_url(redis_url)
    woke: list[bool] = []
    gen = bell.generation("q")
    waiter(bell, "q", gen, woke)
    waiter(bell, "q", gen, woke)
    wait_until(lambda: bell.waiting("q") == 2, 5, "two waiters")
    wait_until(lambda: bell._subscribed.is_set(), 5, "the subscription")
    bell.ring("q", echo=True)  # a release in this process ...
    publisher.publish(bell.channels[0], "q")  # ... and its own message from finish.lua
    wait_until(lambda: not bell._echoes["q"], 5, "the echo swallowed")
    assert woke == [True]
    assert bell.waiting("q") == 1
    publisher.publish(bell.channels[0], "q")  # a release in another process
    wait_until(lambda: woke == [True, True], 5, "the second waiter woken")


def parked(bell: ReleaseBell, queue: str, ctx: object, out: list[object]) -> threading.Thread:
    gen = bell.generation(queue)
    t = threading.Thread(target=lambda: out.append(bell.park(queue, gen, 10.0, ctx)), daemon=True)
    t.start()
    return t


def test_a_hand_over_grants_the_longest_parked_waiter_and_wakes_only_it(
    bell: ReleaseBell,
) -> None:
    first: list[object] = []
    second: list[object] = []
    parked(bell, "q", "ctx-1", first)
    wait_until(lambda: bell.waiting("q") == 1, 5, "the first waiter")
    parked(bell, "q", "ctx-2", second)
    wait_until(lambda: bell.waiting("q") == 2, 5, "the second waiter")
    gen = bell.generation("q")
    ticket = bell.hand_over(("q",))
    assert ticket is not None and ticket.ctx == "ctx-1" and ticket.granted and not ticket.rang
    wait_until(lambda: first == [ticket], 5, "the first waiter woken, granted")
    assert second == [] and bell.waiting("q") == 1
    assert bell.generation("q") == gen  # no slot was freed: nobody else is told to ask
    ticket.held = True
    ticket.transferred.set()
    bell.ring("q")  # a real release wakes the next one to ask its gate
    wait_until(lambda: len(second) == 1, 5, "the second waiter rang")
    (rang,) = second
    assert getattr(rang, "rang", False) and not getattr(rang, "granted", True)


def test_a_hand_over_on_several_bells_goes_to_the_first_with_a_taker(bell: ReleaseBell) -> None:
    """A holder behind a tenant's quota and a slot gate offers the slot gate's line first, then
    its key's: the ticket names where its taker parked (what the giver transfers)."""
    on_key: list[object] = []
    parked(bell, "quota:userid:u", "ctx-key", on_key)
    wait_until(lambda: bell.waiting("quota:userid:u") == 1, 5, "the waiter on the key")
    ticket = bell.hand_over(("q", "quota:userid:u"))  # nobody on "q": the key's waiter
    assert ticket is not None and ticket.ctx == "ctx-key" and ticket.bell == "quota:userid:u"
    wait_until(lambda: on_key == [ticket], 5, "the key's waiter woken, granted")
    on_queue: list[object] = []
    again: list[object] = []
    parked(bell, "quota:userid:u", "ctx-key-2", again)
    parked(bell, "q", "ctx-queue", on_queue)
    wait_until(lambda: bell.waiting("q") == bell.waiting("quota:userid:u") == 1, 5, "both")
    ticket = bell.hand_over(("q", "quota:userid:u"))
    assert ticket is not None and ticket.ctx == "ctx-queue" and ticket.bell == "q"
    assert bell.waiting("quota:userid:u") == 1  # still parked: the next release is its
    bell.close()


def test_no_hand_over_without_a_waiter_that_can_take_one(bell: ReleaseBell) -> None:
    assert bell.hand_over(("q",)) is None  # nobody parked: the slot is released instead
    out: list[object] = []
    parked(bell, "q", None, out)  # parked on a gate that does not hand over
    wait_until(lambda: bell.waiting("q") == 1, 5, "the waiter")
    assert bell.hand_over(("q",)) is None and bell.waiting("q") == 1
    bell.close()
    wait_until(lambda: len(out) == 1, 5, "woken by close")
    assert bell.hand_over(("q",)) is None  # closed: nobody is granted anything


def test_a_waiter_that_timed_out_is_not_granted(bell: ReleaseBell) -> None:
    ticket = bell.park("q", bell.generation("q"), 0.05, "ctx")
    assert ticket is not None and not ticket.granted and not ticket.rang
    assert bell.waiting("q") == 0 and bell.hand_over(("q",)) is None


def test_the_bell_keeps_a_bounded_number_of_names() -> None:
    """Quota keys are unbounded in number: generations are kept only for names read lately
    (at most MAX_NAMES, never one a waiter is parked on), never for a name only rung, and a
    waiter line goes when it empties."""
    import redis as redis_mod

    from pipeline.worker import bell as bell_module

    b = bell_module.ReleaseBell(redis_mod.Redis(), ["unused"])
    b._listen = lambda: None  # type: ignore[method-assign]  # no Pub/Sub needed here
    for i in range(3 * bell_module.MAX_NAMES):
        b.ring(f"quota:userid:u{i}")
    assert len(b._gen) == 0
    gen = b.generation("quota:userid:w")
    tickets: list[Any] = []
    waiter = threading.Thread(target=lambda: tickets.append(b.park("quota:userid:w", gen, 10)))
    waiter.start()
    wait_until(lambda: b.waiting("quota:userid:w") == 1, 5, "the waiter parked")
    for i in range(2 * bell_module.MAX_NAMES):
        b.generation(f"quota:userid:v{i}")
    assert len(b._gen) <= bell_module.MAX_NAMES + 1 and "quota:userid:w" in b._gen
    b.ring("quota:userid:w")
    waiter.join(5)
    assert tickets and tickets[0].rang
    assert not b._waiters


def test_a_cancel_notice_wakes_only_the_waiters_of_the_cancelled_requests(
    bell: ReleaseBell,
) -> None:
    """``!cancel\\n<id>...`` published on the channel (by cancel.lua / batch_cancel_lines.lua)
    wakes the waiters parked for those requests, marked ``cancelled``, and is remembered for
    an attempt that was between two parks; other waiters of the queue sleep on."""
    tickets: dict[str, Any] = {}

    def park(rid: str) -> None:
        tickets[rid] = bell.park("q", gen, 10.0, rid=rid)

    gen = bell.generation("q")
    threads = [threading.Thread(target=park, args=(r,), daemon=True) for r in ("a", "b", "c")]
    for t in threads:
        t.start()
    wait_until(lambda: bell.waiting("q") == 3, 5, "three waiters")
    assert not bell.cancelled("a")
    bell.client.publish(bell.channels[0], "!cancel\na\nc\nnot-parked")
    wait_until(lambda: "a" in tickets and "c" in tickets, 5, "the cancelled waiters woken")
    assert tickets["a"].cancelled and tickets["c"].cancelled
    assert not (tickets["a"].rang or tickets["a"].granted)
    assert bell.waiting("q") == 1 and "b" not in tickets  # b sleeps on
    assert bell.cancelled("not-parked") and not bell.cancelled("b")
    assert bell.generation("q") == gen  # no slot was freed: nobody else is woken
    bell.ring("q")
    wait_until(lambda: "b" in tickets, 5, "b woken by a ring")
    assert tickets["b"].rang and not tickets["b"].cancelled
