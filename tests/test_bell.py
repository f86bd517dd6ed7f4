"""The release bell: a parked attempt wakes when a slot of its queue may have freed, in this
process (a direct ring) or in another (Redis Pub/Sub), and never misses a ring that came
between its gate call and its wait."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
import redis

from pipeline.bell import ReleaseBell

from .conftest import wait_for


@pytest.fixture
def bell(redis_url: str) -> Iterator[ReleaseBell]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    b = ReleaseBell(client, f"test-bell-{uuid.uuid4().hex[:8]}")
    yield b
    b.stop()


def waiter(bell: ReleaseBell, queue: str, gen: int, out: list[bool]) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(bell.wait(queue, gen, 10.0)), daemon=True)
    t.start()
    return t


def test_a_ring_before_the_wait_is_not_lost(bell: ReleaseBell) -> None:
    gen = bell.generation("q")  # read before asking the gate
    bell.ring("q")  # a release between the refusal and the wait
    assert bell.wait("q", gen, 10.0) is True


def test_a_wait_with_no_ring_times_out(bell: ReleaseBell) -> None:
    assert bell.wait("q", bell.generation("q"), 0.05) is False


def test_each_ring_wakes_one_waiter_of_its_queue(bell: ReleaseBell) -> None:
    woke: list[bool] = []
    gen = bell.generation("q")
    threads = [waiter(bell, "q", gen, woke) for _ in range(2)]
    wait_for(lambda: len(bell._cond("q")._waiters) == 2, 5, what="two waiters")  # type: ignore[attr-defined]
    other: list[bool] = []
    waiter(bell, "other", bell.generation("other"), other)
    bell.ring("q")
    wait_for(lambda: len(woke) == 1, 5, what="one waiter woken")
    assert len(bell._cond("q")._waiters) == 1  # type: ignore[attr-defined]
    bell.ring("q")
    wait_for(lambda: len(woke) == 2, 5, what="the second waiter woken")
    assert woke == [True, True] and other == []  # another queue's waiter slept on
    for t in threads:
        t.join(5)
    bell.ring("other")
    wait_for(lambda: other == [True], 5, what="the other queue's waiter")


def subscribed_waiter(bell: ReleaseBell) -> list[bool]:
    """A waiter on queue "q", returned once the bell's listener has subscribed."""
    woke: list[bool] = []
    waiter(bell, "q", bell.generation("q"), woke)
    wait_for(lambda: bell._subscribed.is_set(), 5, what="the subscription")
    return woke


def test_a_release_published_by_another_process_wakes_a_waiter(
    bell: ReleaseBell, redis_url: str
) -> None:
    publisher = redis.Redis.from_url(redis_url)
    woke = subscribed_waiter(bell)
    publisher.publish(bell.channel, "elsewhere")  # another queue: nobody here waits for it
    publisher.publish(bell.channel, "q")  # what finish.lua / requeue.lua publish
    wait_for(lambda: woke == [True], 5, what="the waiter woken over Pub/Sub")


def test_the_listener_reconnects_after_its_connection_is_killed(
    bell: ReleaseBell, redis_url: str
) -> None:
    admin = redis.Redis.from_url(redis_url)
    first = subscribed_waiter(bell)

    def subscribed() -> int:
        return int(dict(admin.pubsub_numsub(bell.channel))[bell.channel.encode()])

    assert subscribed() == 1
    bell._subscribed.clear()
    for c in admin.client_list(_type="pubsub"):
        if c["addr"] == bell.listener_address():
            admin.client_kill_filter(_id=c["id"])
    # everything published while away is lost: every waiter is woken to ask its gate again
    wait_for(lambda: first == [True], 5, what="waiters woken on the lost subscription")
    wait_for(lambda: bell._subscribed.is_set() and subscribed() == 1, 10, what="resubscribed")
    again: list[bool] = []
    waiter(bell, "q", bell.generation("q"), again)
    admin.publish(bell.channel, "q")
    wait_for(lambda: again == [True], 5, what="a wake-up after the reconnect")


def test_closing_the_bell_wakes_every_waiter_for_good(bell: ReleaseBell) -> None:
    woke: list[bool] = []
    threads = [waiter(bell, q, bell.generation(q), woke) for q in ("a", "a", "b")]
    wait_for(lambda: sum(len(c._waiters) for c in bell._conds.values()) == 3, 5, what="waiters")  # type: ignore[attr-defined]
    bell.close()
    wait_for(lambda: len(woke) == 3, 5, what="every waiter woken")
    for t in threads:
        t.join(5)
    assert bell.wait("a", bell.generation("a"), 10.0) is True  # returns at once from now on


def test_a_release_here_wakes_one_waiter_not_two_when_its_echo_arrives(
    bell: ReleaseBell, redis_url: str
) -> None:
    publisher = redis.Redis.from_url(redis_url)
    woke: list[bool] = []
    gen = bell.generation("q")
    waiter(bell, "q", gen, woke)
    waiter(bell, "q", gen, woke)
    wait_for(lambda: len(bell._cond("q")._waiters) == 2, 5, what="two waiters")  # type: ignore[attr-defined]
    wait_for(lambda: bell._subscribed.is_set(), 5, what="the subscription")
    bell.ring("q", echo=True)  # a release in this process ...
    publisher.publish(bell.channel, "q")  # ... and its own message from finish.lua
    wait_for(lambda: not bell._echoes["q"], 5, what="the echo swallowed")
    assert woke == [True]
    assert len(bell._cond("q")._waiters) == 1  # type: ignore[attr-defined]
    publisher.publish(bell.channel, "q")  # a release in another process
    wait_for(lambda: woke == [True, True], 5, what="the second waiter woken")
