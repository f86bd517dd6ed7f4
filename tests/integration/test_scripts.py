"""Script calls over the process's shared connections (pipeline.store.scripts ``Lanes``),
against a real Redis: at most a few connections whatever the number of threads, one set per
process, redis-py's path when a connection cannot answer (NOSCRIPT, a killed connection), and
no reply ever read by the wrong call."""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from pipeline.cli.services import wait_until
from pipeline.store import connect
from pipeline.store.connect import CLIENT_POOL
from pipeline.store.scripts import Lanes, Script, ScriptCall, run_batch

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
    """CLIENT ID of the connection the next script call of this thread borrows (the one given
    back last: a lone thread gets the same one again)."""
    with Lanes.of(client).lent() as conn:
        assert conn is not None
        conn.send_command("CLIENT", "ID")
        return int(conn.read_response())


def lane_ids(client: redis.Redis) -> set[int]:
    """CLIENT IDs of every connection the process's lanes of ``client`` hold."""
    lanes = Lanes.of(client)
    taken = [lanes.take() for _ in range(len(lanes._idle))]
    try:
        ids = set()
        for conn in taken:
            conn.send_command("CLIENT", "ID")
            ids.add(int(conn.read_response()))
        return ids
    finally:
        for conn in taken:
            lanes.give(conn)


def test_a_lone_thread_calls_over_the_same_connection(client: redis.Redis, key: str) -> None:
    echo = Script(client, ECHO)
    assert echo(keys=[key], args=["a"]) == ["a", 1]
    mine = connection_id(client)
    assert echo(keys=[key], args=["b"]) == ["b", 2]
    assert connection_id(client) == mine
    assert client.connection_pool.connection_kwargs["decode_responses"] is True


def test_hundreds_of_threads_share_a_few_connections(redis_url: str, key: str) -> None:
    """150 threads calling scripts at once through one client: every reply right, no
    MaxConnectionsError, and the server sees at most ``connections`` of them (each thread
    pinned one of its own before: redis-py's pool refused the 101st)."""
    client = connect(redis_url, connections=4)
    try:
        echo = Script(client, ECHO)
        start = threading.Barrier(150)
        replies: list[Any] = []
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                start.wait(30)
                for j in range(5):
                    replies.append(echo(keys=[key], args=[f"{i}.{j}"]))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(150)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        assert sorted(r[1] for r in replies) == list(range(1, 751))  # each call ran once
        assert Lanes.of(client).opened <= 4
        ids = lane_ids(client)
        listed = {int(c["id"]) for c in client.client_list()}
        assert len(ids) <= 4 and ids <= listed
        # redis-py's own pool is bounded too: more threads wait, none raises
        pool = client.connection_pool
        assert isinstance(pool, redis.BlockingConnectionPool)
        assert pool.max_connections == CLIENT_POOL
    finally:
        client.close()


def test_the_plain_commands_of_hundreds_of_threads_wait_for_a_connection(
    client: redis.Redis, key: str
) -> None:
    """redis-py's own path (plain commands, a script's slow path) on the bounded pool: 150
    threads at once wait their turn instead of raising MaxConnectionsError."""
    start = threading.Barrier(150)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            start.wait(30)
            client.incr(key)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(150)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert int(client.get(key) or 0) == 150


def _child(client: redis.Redis, echo: Script, key: str, parent_id: int, out: Any) -> None:
    # the parent's client and script, inherited by fork: its connections too
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
    conn = Lanes.of(client)._idle[-1]  # the one the next call borrows

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


def test_closing_the_client_disconnects_its_script_connections(redis_url: str, key: str) -> None:
    client = connect(redis_url)
    echo = Script(client, ECHO)
    assert echo(keys=[key], args=["x"]) == ["x", 1]
    ids = lane_ids(client)
    assert ids and ids <= {int(c["id"]) for c in client.client_list()}
    watcher = connect(redis_url)
    try:
        client.close()
        wait_until(
            lambda: not ids & {int(c["id"]) for c in watcher.client_list()},
            10,
            "the closed client's connections gone from CLIENT LIST",
        )
    finally:
        watcher.close()
