"""Lease-counted slots in Redis, shared by ``local-max-concurrency`` and ``redis-quota``.

A slot pool is a sorted set of holders (``"<request id>:<token>"``) scored by lease expiry
(Unix s) plus an info hash (holder → JSON: worker, acquired_at, ...). Acquire, release, renew
and reap are Lua scripts (``pipeline/store/lua/gate_lease_*.lua``), each atomic. Only unexpired
leases count, a renew never revives an expired lease, and a reap frees expired ones: so a
crashed holder's slot comes back within one lease period plus one reaper pass, and the count
never exceeds the limit (no whole-key TTL that could reset a busy counter).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, cast

import redis

from ..store.scripts import ScriptCall, register

# A lease that expired this long ago (s) is purged by the next acquire (its holder is gone and
# no reaper freed it), and a slot pool's keys expire this long after its latest lease.
GRACE_S = 3600.0
REAP_BATCH = 1000  # most leases one reap call frees per slot pool


def fmt_time(t: float) -> str:
    """A Unix time as ARGV text, with µs precision and no exponent (every lease time and
    "now" a gate compares is rounded to the µs this way, on both sides)."""
    return f"{t:.6f}"


def split_holder(holder: str) -> tuple[str, str]:
    """``"<request id>:<token>"`` → (request id, token); the token is after the last colon."""
    request_id, _, token = holder.rpartition(":")
    return (request_id, token) if request_id else (holder, "")


def holder_entry(holder: str, info: str | None, expiry: float, now: float) -> dict[str, Any]:
    """The public description of one reservation (see :meth:`Gate.holders`)."""
    data: dict[str, Any] = {}
    if info:
        try:
            parsed = json.loads(info)
            if isinstance(parsed, dict):
                data = parsed
        except json.JSONDecodeError:
            pass
    request_id, token = split_holder(holder)
    acquired = data.get("acquired_at")
    age = max(0.0, now - float(acquired)) if isinstance(acquired, int | float) else None
    giver = data.get("handed_over_by")
    return {
        "request_id": request_id,
        "attempt": token,
        "worker": data.get("worker", ""),
        "age_s": age,
        "lease_expires_at": expiry,
        # the request whose slot this holder took over (see Gate.hands_over), else None
        "handed_over_by": split_holder(giver)[0] if isinstance(giver, str) else None,
    }


class LeaseScripts:
    """The lease scripts registered once on one client."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.acquire = register(client, "gate_lease_acquire")
        self.release = register(client, "gate_lease_release")
        self.renew = register(client, "gate_lease_renew")
        self.reap = register(client, "gate_lease_reap")


class LeaseSet:
    """One slot pool: ``holders_key`` (sorted set) with its ``info_key`` (hash)."""

    def __init__(self, scripts: LeaseScripts, holders_key: str, info_key: str) -> None:
        self.scripts = scripts
        self.client = scripts.client
        self.holders_key = holders_key
        self.info_key = info_key

    @property
    def _keys(self) -> list[str]:
        return [self.holders_key, self.info_key]

    def acquire(
        self, holder: str, now: float, lease_until: float, limit: int, info: dict[str, Any]
    ) -> int:
        """1 = new slot taken, 2 = holder already held one (lease extended), 0 = full."""
        call = self.acquire_call(holder, now, lease_until, limit, info)
        return int(call.script(keys=call.keys, args=call.args))

    def acquire_call(
        self, holder: str, now: float, lease_until: float, limit: int, info: dict[str, Any]
    ) -> ScriptCall:
        """:meth:`acquire` as a call to send in a batch (its reply is the same)."""
        args = [holder, fmt_time(now), fmt_time(lease_until), limit, json.dumps(info), GRACE_S]
        return ScriptCall(self.scripts.acquire, self._keys, args)

    def release(self, holder: str) -> bool:
        return bool(self.scripts.release(keys=self._keys, args=[holder]))

    def transfer(
        self,
        giver: str,
        taker: str,
        now: float,
        lease_until: float,
        limit: int,
        info: dict[str, Any],
    ) -> int:
        """Free ``giver``'s slot and take one for ``taker``, atomically: 1 = taken, 2 = the
        taker already held one, 0 = full (the giver held nothing and the pool is full)."""
        args = [taker, fmt_time(now), fmt_time(lease_until), limit, json.dumps(info), GRACE_S]
        return int(self.scripts.acquire(keys=self._keys, args=[*args, giver]))

    def renew(self, holders: Sequence[str], now: float, lease_until: float) -> int:
        if not holders:
            return 0
        args = [fmt_time(now), fmt_time(lease_until), GRACE_S, *holders]
        return int(self.scripts.renew(keys=self._keys, args=args))

    def reap(self, now: float, only: Iterable[str] | None = None) -> list[str]:
        """Free expired leases: all of them, or only the listed holders (see the script)."""
        if only is None:
            args: list[Any] = [fmt_time(now), "all", REAP_BATCH]
        else:
            listed = list(only)
            if not listed:
                return []
            args = [fmt_time(now), "listed", *listed]
        return [str(h) for h in self.scripts.reap(keys=self._keys, args=args)]

    def count(self, now: float) -> int:
        """Unexpired leases (the ones that count against the limit)."""
        return int(self.client.zcount(self.holders_key, f"({fmt_time(now)}", "+inf"))

    def live(self, now: float) -> list[dict[str, Any]]:
        """Descriptions of the unexpired leases, earliest expiry first."""
        rows = cast(
            list[tuple[str, float]],
            self.client.zrangebyscore(
                self.holders_key, f"({fmt_time(now)}", "+inf", withscores=True
            ),
        )
        if not rows:
            return []
        infos = cast(list[str | None], self.client.hmget(self.info_key, [h for h, _ in rows]))
        return [
            holder_entry(h, info, float(s), now) for (h, s), info in zip(rows, infos, strict=True)
        ]
