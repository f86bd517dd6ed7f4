"""Lua scripts (``pipeline/store/lua/*.lua``): registering them, and calling several in one
round trip.

The request-state scripts are functions of one Redis Functions library (:mod:`.functions`),
with their text as :func:`~.luatext.source` builds it (``sched.lua`` and ``lib.lua``
prepended) for ``EVALSHA`` where the library cannot be used; the gate scripts stand alone
(:func:`~.luatext.lua_source`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from .fastredis import FastScript, Replication, call_batch, library_on, needs_recovery
from .functions import function_name, library
from .luatext import SCRIPT_NAMES, lua_source, source


def register(client: redis.Redis, name: str) -> FastScript:
    """A stand-alone script (a gate's) registered on ``client`` (EVALSHA over the calling
    thread's own connection, reloaded on NOSCRIPT)."""
    return FastScript(client, lua_source(name))


@dataclass(frozen=True)
class ScriptCall:
    """One Lua script call, to be sent with others in one round trip (:func:`run_batch`): a
    registered script (:func:`register`, :class:`Scripts`) and its keys and args."""

    script: FastScript
    keys: list[str]
    args: list[Any]


def run_batch(client: redis.Redis, calls: Sequence[ScriptCall]) -> list[Any]:
    """Script calls in one round trip, run in order (each atomic, not all together): their
    replies, or in a failed call's place the error it raised. A call whose script the server
    does not have (NOSCRIPT or a missing function: it restarted, or SCRIPT / FUNCTION FLUSH)
    did not run and is run again on its own, which loads the script or the library. Over the
    calling thread's own connection; through a redis-py pipeline (and its retries, with
    EVALSHA) when that connection failed."""
    replies = call_batch(client, [(call.script, call.keys, call.args) for call in calls])
    if replies is None:
        with client.pipeline(transaction=False) as pipe:
            for call in calls:
                pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
            replies = pipe.execute(raise_on_error=False)
    for i, (reply, call) in enumerate(zip(replies, calls, strict=True)):
        if needs_recovery(reply):  # the call loads what the server lacked
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
    """The pipeline's scripts registered on one Redis client: functions of one library
    (:mod:`.functions`; FCALL, with EVALSHA where the server has no Functions or
    ``functions`` is False) over the calling thread's own connection, reloaded when the server
    lost them (see :mod:`.fastredis`); with ``replicas``,
    those whose writes must survive a failover wait for that many replicas (see
    :func:`replication`)."""

    def __init__(
        self,
        client: redis.Redis,
        replicas: int = 0,
        timeout_ms: int = 1000,
        functions: bool = True,
    ) -> None:
        lib = library_on(client, *library()) if functions else None
        self._scripts: dict[str, Any] = {
            n: FastScript(
                client,
                source(n),
                name=n,
                replication=replication(n, replicas, timeout_ms),
                function=function_name(n),
                library=lib,
            )
            for n in SCRIPT_NAMES
        }

    def __getattr__(self, name: str) -> Any:
        try:
            return self._scripts[name]
        except KeyError:
            raise AttributeError(name) from None
