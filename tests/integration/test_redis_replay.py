"""bench/redis_replay.py reads a real server's MONITOR lines back into the arguments sent (the
replay's instruction counts are only as good as that), leaves out what scripts ran, and with
``--pace`` sends each command no sooner than its recorded time."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from bench.redis_replay import _run, count, paced, parse, read_recording
from tests.conftest import REDIS_URL


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


def test_count_puts_each_command_a_script_ran_under_that_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = redis.Redis.from_url(REDIS_URL, single_connection_client=True)
    me = client.client_info()["addr"]
    key = "replay-test:count"
    body = (
        "-- finish.lua: a stand-in\n"
        "redis.call('SET', KEYS[1], 'a')\nreturn redis.call('GET', KEYS[1])"
    )
    with monitor(client) as lines:
        sha = client.script_load(body)
        client.evalsha(sha, 1, key)
        kept = [
            next_line(lines, me),
            next_line(lines, me),
            next_line(lines, "lua"),
            next_line(lines, "lua"),
        ]
    client.delete(key)
    recording = tmp_path / "r.mon"
    recording.write_text("# scenario=test n=1\n" + "\n".join(kept) + "\n", encoding="latin-1")
    count(recording, top=5)
    out = capsys.readouterr().out
    assert "2.0 commands inside scripts per finish" in out
    assert "finish                   2.00  (1.00 calls)" in out
    assert "SET count" in out and "GET count" in out


@given(
    st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=50),
    st.floats(0.01, 100),
)
def test_a_paced_replay_keeps_the_recorded_gaps_divided_by_its_speed(
    gaps: list[float], speed: float
) -> None:
    stamps = [1.8e9]
    for g in gaps:
        stamps.append(stamps[-1] + g)
    due = paced(stamps, speed)
    assert due[0] == 0.0
    for i in range(1, len(stamps)):
        assert due[i] >= due[i - 1]
        assert due[i] == pytest.approx((stamps[i] - stamps[0]) / speed, abs=1e-6)


def test_a_paced_replay_sends_no_command_before_its_time(tmp_path: Path) -> None:
    key = "replay-test:paced"
    t = 1796436617.0
    lines = [
        f'{t:.6f} [0 127.0.0.1:1] "DEL" "{key}"',
        f'{t + 0.2:.6f} [0 127.0.0.1:1] "RPUSH" "{key}" "a"',
        f'{t + 0.2:.6f} [0 lua] "GET" "{key}"',  # run by a script: not replayed
        f'{t + 0.4:.6f} [0 127.0.0.1:1] "RPUSH" "{key}" "b"',
    ]
    recording = tmp_path / "r.mon"
    recording.write_text("# scenario=test n=1\n" + "\n".join(lines) + "\n", encoding="latin-1")
    header, commands, stamps = read_recording(recording)
    assert header == {"scenario": "test", "n": "1"}
    assert [c[0] for c in commands] == [b"DEL", b"RPUSH", b"RPUSH"]
    due = paced(stamps, 2.0)
    assert due == pytest.approx([0.0, 0.1, 0.2])
    client = redis.Redis.from_url(REDIS_URL)
    got = _run(redis.Redis.from_url(REDIS_URL), commands, {}, False, due)
    assert got.elapsed >= due[-1]  # each command slept until its time
    assert client.lrange(key, 0, -1) == [b"a", b"b"]
    client.delete(key)


@pytest.mark.parametrize("speed", ["0", "-1", "fast", "nan"])
def test_a_pace_that_is_not_above_0_is_refused_naming_the_option(speed: str) -> None:
    bench = Path(__file__).resolve().parents[2] / "bench" / "redis_replay.py"
    run = subprocess.run(
        [sys.executable, str(bench), "replay", "any.mon", "--pace", speed],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "--pace" in run.stderr and "above 0" in run.stderr
