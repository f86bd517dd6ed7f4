"""bench/redis_replay.py reads a real server's MONITOR lines back into the arguments sent (the
replay's instruction counts are only as good as that), and leaves out what scripts ran."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

import redis

from bench.redis_replay import parse

from .conftest import REDIS_URL


@contextmanager
def monitor(client: redis.Redis) -> Iterator[BinaryIO]:
    kw = client.connection_pool.connection_kwargs
    with socket.create_connection((kw["host"], kw["port"])) as sock:
        sock.sendall(b"MONITOR\r\n")
        lines = sock.makefile("rb")
        assert lines.readline() == b"+OK\r\n"
        yield lines


def next_line(lines: BinaryIO, source: str) -> str:
    """The next line from ``source`` (a client's address, or "lua" for a command a script ran;
    the server's other clients run commands too)."""
    while True:
        line = lines.readline().decode("latin-1").removeprefix("+").rstrip("\r\n")
        if f" {source}] " in line:
            return line


def test_a_monitor_line_parses_back_to_the_arguments_sent() -> None:
    client = redis.Redis.from_url(REDIS_URL, single_connection_client=True)
    me = client.client_info()["addr"]  # connected, its handshake done before the MONITOR
    key = "replay-test:k"
    sent = [b"SET", key.encode(), b'q"uote\\back\nline\ttab\x00nul\xffhigh \xc3\xa9 "' + b" " * 3]
    with monitor(client) as lines:
        client.execute_command(*sent)
        assert parse(next_line(lines, me)) == sent
    client.delete(key)


def test_commands_a_script_runs_are_left_to_the_script() -> None:
    client = redis.Redis.from_url(REDIS_URL, single_connection_client=True)
    me = client.client_info()["addr"]  # connected, its handshake done before the MONITOR
    key = "replay-test:s"
    with monitor(client) as lines:
        client.eval("return redis.call('SET', KEYS[1], ARGV[1])", 1, key, "v")
        assert parse(next_line(lines, me)) == [b"EVAL", b"return redis.call('SET', KEYS[1], "
                                           b"ARGV[1])", b"1", key.encode(), b"v"]  # fmt: skip
        assert parse(next_line(lines, "lua")) is None
    client.delete(key)
