"""Lua scripts (``pipeline/store/lua/*.lua``): loading and registering them, and calling
several in one round trip.

The request-state scripts are registered with ``sched.lua`` and ``lib.lua`` prepended
(:func:`source`); the gate scripts stand alone (:func:`lua_source`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import redis

from .fastredis import FastScript, Replication, call_batch

SCRIPT_NAMES = (
    "submit",
    "dispatch",
    "start",
    "finish",
    "requeue",
    "cancel",
    "cancel_asked",
    "reap",
    "renew",
    "node_beat",
    "ingest",
    "sched_index",
    "sched_recheck",
    "note",
    "explain",
    "wait",
)


@cache
def lua_source(name: str) -> str:
    """Text of ``lua/<name>.lua`` as it is in the file."""
    return (resources.files("pipeline.store") / "lua" / f"{name}.lua").read_text()


_DEFINES = re.compile(r"^local\s+(?:function\s+([A-Za-z_]\w*)|([A-Za-z_][\w\s,]*?)\s*=)")
_NAME = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class _Chunk:
    """One top-level definition of sched.lua / lib.lua: its text (with the comment above it),
    the names it defines, and the identifiers its code uses."""

    text: str
    defines: frozenset[str]
    uses: frozenset[str]


def _uses(code: str) -> frozenset[str]:
    """The identifiers in ``code``, comment-only lines left out (a trailing comment or a string
    may add a name that is not really used: that only keeps a definition in, never out)."""
    lines = (line for line in code.splitlines() if not line.lstrip().startswith("--"))
    return frozenset(_NAME.findall("\n".join(lines)))


@cache
def _library() -> tuple[_Chunk, ...]:
    """sched.lua then lib.lua cut into their top-level definitions, in order: each starts at a
    line ``local ...`` at column 0 (the comment lines just above it go with it) and runs to the
    next one. The files' header comments are left out."""
    chunks: list[_Chunk] = []
    for text in (lua_source("sched"), lua_source("lib")):
        lines = text.splitlines()
        starts = [i for i, line in enumerate(lines) if _DEFINES.match(line)]
        for n, i in enumerate(starts):
            begin = i
            while (
                begin > 0
                and lines[begin - 1].startswith("--")
                and (n == 0 or begin - 1 > starts[n - 1])
            ):
                begin -= 1
            end = starts[n + 1] if n + 1 < len(starts) else len(lines)
            while end > i + 1 and lines[end - 1].startswith("--"):
                end -= 1  # the next definition's comment
            m = _DEFINES.match(lines[i])
            assert m is not None
            names = m.group(1) or m.group(2)
            defines = frozenset(x.strip() for x in names.split(","))
            body = "\n".join(lines[begin:end]).rstrip()
            chunks.append(_Chunk(body + "\n", defines, _uses("\n".join(lines[i:end]))))
    return tuple(chunks)


@cache
def source(name: str) -> str:
    """The full text of script ``name`` as registered on the server: the definitions of
    sched.lua and lib.lua it uses, directly or through another one (in the files' order), then
    the script. Only those: the server builds every definition of the prefix (a closure or a
    table each) on every call of the script, ~24 µs of Redis CPU per call for all of them on a
    cold cache (BENCHMARKS.md, "Less Redis per request")."""
    script = lua_source(name)
    chunks = _library()
    need = set(_uses(script))
    for chunk in reversed(chunks):  # a definition only uses earlier ones
        if chunk.defines & need:
            need |= chunk.uses
    kept = [c.text for c in chunks if c.defines & need]
    return "".join(kept) + "\n" + script


def register(client: redis.Redis, name: str) -> FastScript:
    """A stand-alone script (a gate's) registered on ``client`` (EVALSHA over the calling
    thread's own connection, reloaded on NOSCRIPT)."""
    return FastScript(client, lua_source(name))


@dataclass(frozen=True)
class ScriptCall:
    """One Lua script call, to be sent with others in one round trip (:func:`run_batch`): a
    script (anything with a ``sha`` that is callable like redis-py's ``Script``) and its keys
    and args."""

    script: Any
    keys: list[str]
    args: list[Any]


def run_batch(client: redis.Redis, calls: Sequence[ScriptCall]) -> list[Any]:
    """Script calls in one round trip, run in order (each atomic, not all together): their
    replies, or in a failed call's place the error it raised. A call whose script the server
    does not have (NOSCRIPT: it restarted, or SCRIPT FLUSH) did not run and is run again on its
    own, which loads the script. Over the calling thread's own connection; through a redis-py
    pipeline (and its retries) when that connection failed."""
    replies = call_batch(client, [(call.script, call.keys, call.args) for call in calls])
    if replies is None:
        with client.pipeline(transaction=False) as pipe:
            for call in calls:
                pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
            replies = pipe.execute(raise_on_error=False)
    for i, (reply, call) in enumerate(zip(replies, calls, strict=True)):
        if isinstance(reply, redis.exceptions.NoScriptError):
            try:
                replies[i] = call.script(keys=call.keys, args=call.args)
            except redis.RedisError as exc:
                replies[i] = exc
    return replies


def _tick_wrote_results(reply: Any) -> bool:
    """Whether a dispatch tick wrote terminal results (requests expired while waiting, or
    malformed entries reported): ``{moved, expired per queue, next_event, rejected per
    queue}``."""
    return any(int(n) > 0 for n in reply[1]) or any(len(r) > 0 for r in reply[3])


def replication(name: str, replicas: int, timeout_ms: int) -> Replication | None:
    """How script ``name`` waits for ``replicas`` replicas (``PIPELINE_REDIS_MIN_REPLICAS``):
    ``submit`` raises when they do not confirm in time (the caller must know an acknowledged
    request may be lost); the scripts that write terminal results — ``finish`` (an attempt),
    ``cancel``, and a dispatch tick that expired or rejected requests — wait and log a
    warning (the result stands on the master, and the worker cannot do better). Requeues,
    starts and dispatches are not waited for: lost in a failover, the request's lease lapses
    and it runs again, fenced by its token."""
    if replicas <= 0:
        return None
    if name == "submit":
        return Replication(replicas, timeout_ms, strict=True)
    if name in ("finish", "cancel"):
        return Replication(replicas, timeout_ms)
    if name == "dispatch":
        return Replication(replicas, timeout_ms, when=_tick_wrote_results)
    return None


class Scripts:
    """The pipeline's scripts registered on one Redis client (EVALSHA over the calling thread's
    own connection, reloaded on NOSCRIPT: see :mod:`pipeline.fastredis`); with ``replicas``,
    those whose writes must survive a failover wait for that many replicas (see
    :func:`replication`)."""

    def __init__(self, client: redis.Redis, replicas: int = 0, timeout_ms: int = 1000) -> None:
        self._scripts: dict[str, Any] = {
            n: FastScript(
                client, source(n), name=n, replication=replication(n, replicas, timeout_ms)
            )
            for n in SCRIPT_NAMES
        }

    def __getattr__(self, name: str) -> Any:
        try:
            return self._scripts[name]
        except KeyError:
            raise AttributeError(name) from None
