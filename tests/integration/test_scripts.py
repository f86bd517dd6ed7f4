"""Script calls over a thread's own connection (pipeline.store.scripts), against a real Redis:
one connection per thread and per process, redis-py's path when that one cannot answer
(NOSCRIPT, a killed connection), and no reply ever read by the wrong call."""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from pipeline.store import connect
from pipeline.store.scripts import Script, ScriptCall, ThreadConnection, run_batch

ECHO = "return {ARGV[1], redis.call('INCR', KEYS[1])}"
BOOM = "return redis.error_reply('boom ' .. ARGV[1])"


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = connect(redis_url)
    yield c
    c.close()


@pytest.fixture
def key(client: redis.Redis) -> Iterator[str]:
    k = f"test:scripts:{uuid.uuid4().hex}"
    yield k
    client.delete(k)


def connection_id(client: redis.Redis) -> int:
    """CLIENT ID of the calling thread's own connection."""
    conn = ThreadConnection.of(client).get()
    conn.send_command("CLIENT", "ID")
    return int(conn.read_response())


def test_each_thread_calls_over_its_own_connection(client: redis.Redis, key: str) -> None:
    echo = Script(client, ECHO)
    assert echo(keys=[key], args=["a"]) == ["a", 1]
    mine = connection_id(client)
    seen: dict[str, Any] = {}

    def other() -> None:
        seen["reply"] = echo(keys=[key], args=["b"])
        seen["id"] = connection_id(client)

    t = threading.Thread(target=other)
    t.start()
    t.join(10)
    assert seen["reply"] == ["b", 2]
    assert seen["id"] != mine and connection_id(client) == mine
    assert client.connection_pool.connection_kwargs["decode_responses"] is True


def _child(client: redis.Redis, echo: Script, key: str, parent_id: int, out: Any) -> None:
    # the parent's client and script, inherited by fork: the main thread's connection too
    out.put((echo(keys=[key], args=["child"]), connection_id(client) != parent_id))


def test_a_forked_child_makes_its_own_connection(client: redis.Redis, key: str) -> None:
    echo = Script(client, ECHO)
    echo(keys=[key], args=["parent"])
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(client, echo, key, connection_id(client), out))
    proc.start()
    assert out.get(timeout=20) == (["child", 2], True)
    proc.join(10)
    assert echo(keys=[key], args=["parent"]) == ["parent", 3]


def test_a_script_the_server_lost_is_loaded_again(client: redis.Redis, key: str) -> None:
    echo = Script(client, ECHO)
    assert echo(keys=[key], args=["x"]) == ["x", 1]
    client.script_flush()
    assert echo(keys=[key], args=["y"]) == ["y", 2]  # NOSCRIPT, then redis-py's path loads it
    assert echo(keys=[key], args=["z"]) == ["z", 3]


def test_a_killed_connection_is_replaced_and_the_call_still_runs(
    client: redis.Redis, key: str
) -> None:
    echo = Script(client, ECHO)
    echo(keys=[key], args=["x"])
    before = connection_id(client)
    client.client_kill_filter(_id=before)
    assert echo(keys=[key], args=["y"]) == ["y", 2]
    assert echo(keys=[key], args=["z"]) == ["z", 3]
    assert connection_id(client) != before


def test_a_scripts_own_error_is_raised_and_the_connection_stays_in_step(
    client: redis.Redis, key: str
) -> None:
    boom, echo = Script(client, BOOM), Script(client, ECHO)
    echo(keys=[key], args=["x"])
    before = connection_id(client)
    with pytest.raises(redis.ResponseError, match="boom 1"):
        boom(args=["1"])
    assert echo(keys=[key], args=["y"]) == ["y", 2]
    assert connection_id(client) == before


def test_an_interrupted_call_drops_the_connection_so_no_late_reply_is_misread(
    client: redis.Redis, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    echo = Script(client, ECHO)
    echo(keys=[key], args=["x"])
    conn = ThreadConnection.of(client).get()

    def interrupted(*_: Any, **__: Any) -> Any:
        raise KeyboardInterrupt  # e.g. a time limit raised between the send and the read

    monkeypatch.setattr(conn, "read_response", interrupted)
    with pytest.raises(KeyboardInterrupt):
        echo(keys=[key], args=["lost"])
    monkeypatch.undo()
    # the reply to "lost" was never read; the next call must get its own reply, not that one
    assert echo(keys=[key], args=["next"]) == ["next", 3]


def test_a_batch_answers_in_order_with_errors_in_place(client: redis.Redis, key: str) -> None:
    echo, boom = Script(client, ECHO), Script(client, BOOM)
    echo(keys=[key], args=["load"])
    with pytest.raises(redis.ResponseError):
        boom(args=["load"])  # loads it
    calls = [
        ScriptCall(echo, [key], ["a"]),
        ScriptCall(boom, [], ["2"]),
        ScriptCall(echo, [key], ["b"]),
    ]
    replies = run_batch(client, calls)
    assert replies[0] == ["a", 2] and replies[2] == ["b", 3]
    assert isinstance(replies[1], redis.ResponseError) and "boom 2" in str(replies[1])
    # a script the server lost did not run in the batch; it runs again on its own (loaded)
    client.script_flush()
    assert run_batch(client, [ScriptCall(echo, [key], ["c"])]) == [["c", 4]]
    assert int(client.get(key) or 0) == 4


def test_a_batch_on_a_killed_connection_still_runs_each_call_in_order(
    client: redis.Redis, key: str
) -> None:
    echo = Script(client, ECHO)
    echo(keys=[key], args=["x"])
    client.client_kill_filter(_id=connection_id(client))
    replies = run_batch(client, [ScriptCall(echo, [key], ["a"]), ScriptCall(echo, [key], ["b"])])
    assert replies == [["a", 2], ["b", 3]]
