"""Lua scripts, loaded from ``pipeline/lua/*.lua`` with ``lib.lua`` prepended."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import redis

from .fastredis import FastScript

SCRIPT_NAMES = ("submit", "dispatch", "start", "finish", "requeue", "cancel", "reap", "renew")


@cache
def source(name: str) -> str:
    """The full text of script ``name`` as registered on the server (lib + script)."""
    lua = resources.files("pipeline") / "lua"
    return (lua / "lib.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


class Scripts:
    """The pipeline's scripts registered on one Redis client (EVALSHA over the calling thread's
    own connection, reloaded on NOSCRIPT: see :mod:`pipeline.fastredis`)."""

    def __init__(self, client: redis.Redis) -> None:
        self._scripts: dict[str, Any] = {n: FastScript(client, source(n)) for n in SCRIPT_NAMES}

    def __getattr__(self, name: str) -> Any:
        try:
            return self._scripts[name]
        except KeyError:
            raise AttributeError(name) from None
