"""Lease-counted slot pools in Redis (``gate_lease_*.lua``), and :class:`SlotGate`, what the slot
gates and the concurrency quota share. Every expiry is judged by the Redis server's clock: a
caller gives a lease as a duration, never as a time of its own clock."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis

from ..store.scripts import ScriptCall, register
from .base import CONTINUE, AcquireContext, Admission, Batched, Calls, Decision, HandsOver

# A lease that expired this long ago (s) is purged by the next acquire (its holder is gone and
# no reaper freed it), and a slot pool's keys expire this long after its latest lease.
GRACE_S = 3600.0
REAP_BATCH = 1000  # most leases one reap call frees per slot pool


def split_holder(holder: str) -> tuple[str, str]:
    """``"<request id>:<token>"`` → (request id, token); the token is after the last colon."""
    request_id, _, token = holder.rpartition(":")
    return (request_id, token) if request_id else (holder, "")


def parse_info(info: str | None) -> dict[str, Any]:
    """A holder's info entry (JSON), or {} when absent or corrupt."""
    try:
        data = json.loads(info) if info else {}
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def holder_entry(holder: str, info: str | None, expiry: float, now: float) -> dict[str, Any]:
    """The public description of one reservation (see :meth:`Gate.holders`)."""
    data = parse_info(info)
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
        # the request whose slot this holder took over (a hand-over, see ``HandsOver``), else None
        "handed_over_by": split_holder(giver)[0] if isinstance(giver, str) else None,
    }


class LeaseScripts:
    """The lease scripts registered once on one client."""

    def __init__(self, client: redis.Redis) -> None:
        self.acquire = register(client, "gate_lease_acquire")
        self.release = register(client, "gate_lease_release")
        self.renew = register(client, "gate_lease_renew")
        self.reap = register(client, "gate_lease_reap")
        self.live = register(client, "gate_lease_live")
        self.prune_nodes = register(client, "gate_nodes_prune")


@dataclass(frozen=True)
class LeaseSet:
    """One slot pool: ``holders_key`` (sorted set) with its ``info_key`` (hash). With a
    ``registry`` (set key, member), taking a slot also lists the member there, in the same
    atomic step (a per-node gate's node list)."""

    scripts: LeaseScripts
    holders_key: str
    info_key: str
    registry: tuple[str, str] | None = None

    @property
    def _keys(self) -> list[str]:
        return [self.holders_key, self.info_key]

    def acquire(
        self, holder: str, lease_s: float, limit: int, info: dict[str, Any], giver: str = ""
    ) -> ScriptCall:
        """Take a slot for ``holder`` — with ``giver``, free the giver's slot first in the same
        atomic step (a hand-over). Reply: 1 = new slot taken, 2 = the holder already held one
        (lease extended), 0 = full. The lease lasts ``lease_s`` from now by the server's clock;
        ``info`` gains ``acquired_at``."""
        args: list[Any] = [holder, repr(float(lease_s)), limit, json.dumps(info), GRACE_S, giver]
        if self.registry is None:
            return ScriptCall(self.scripts.acquire, self._keys, args)
        keys = [*self._keys, self.registry[0]]
        return ScriptCall(self.scripts.acquire, keys, [*args, self.registry[1]])

    def release(self, holder: str) -> ScriptCall:
        """Free ``holder``'s slot. Reply: 1 freed, 0 it held nothing."""
        return ScriptCall(self.scripts.release, self._keys, [holder])

    def renew(self, holders: Sequence[str], lease_s: float) -> int:
        """Extend live holders' leases to ``lease_s`` from now (server clock)."""
        if not holders:
            return 0
        args = [repr(float(lease_s)), GRACE_S, *holders]
        return int(self.scripts.renew(keys=self._keys, args=args))

    def reap(self, only: Iterable[str] | None = None) -> list[str]:
        """Free expired leases: all of them, or only the listed holders (see the script)."""
        args = ["all", REAP_BATCH] if only is None else ["listed", *only]
        return [str(h) for h in self.scripts.reap(keys=self._keys, args=args)]

    def count(self) -> int:
        """Unexpired leases (the ones that count against the limit)."""
        return int(self.scripts.live(keys=self._keys, args=["count"])[1])

    def live(self) -> list[dict[str, Any]]:
        """Descriptions of the unexpired leases, earliest expiry first (ages by the server's
        clock)."""
        reply = cast(list[Any], self.scripts.live(keys=self._keys, args=["list"]))
        now = float(reply[0])
        return [
            holder_entry(str(reply[i]), reply[i + 2] or None, float(reply[i + 1]), now)
            for i in range(1, len(reply), 3)
        ]


class SlotGate(Batched, HandsOver):
    """A slot per holder in a lease-counted pool: the acquire, the start's acquire and the
    hand-over, for the pool :meth:`_pool` picks for a request's metadata."""

    limit: int
    taken: Decision = CONTINUE  # the decision when a slot is taken
    own_redis = False  # the pool is on a Redis of its own: its calls go alone, not batched
    prepares = True  # the start's acquire takes the slot for the dispatcher's tenant

    def _pool(self, metadata: Mapping[str, str]) -> tuple[LeaseSet, dict[str, Any]] | None:
        """The pool a request with ``metadata`` takes its slot in, and the entry's fields
        besides the worker; None: no slot to take (admitted)."""
        raise NotImplementedError

    def _refusal(self, metadata: Mapping[str, str]) -> Decision:
        """The decision when the pool is full."""
        raise NotImplementedError

    def _take(
        self, holder: str, lease_s: float, metadata: Mapping[str, str], worker: str, giver: str = ""
    ) -> ScriptCall | None:
        got = self._pool(metadata)
        if got is None:
            return None
        pool, info = got
        info = {**info, "worker": worker, **({"handed_over_by": giver} if giver else {})}
        return pool.acquire(holder, lease_s, self.limit, info, giver)

    def release(self, holder: str) -> bool:
        calls = None if self.env is None else self.release_calls(holder)
        return False if calls is None else calls.run()

    def _calls(self, call: ScriptCall, then: Callable[[Any], bool]) -> Calls[bool]:
        """One call's step; run by ``then`` when the pool is on a Redis of its own."""
        if self.own_redis:
            return Calls((), lambda _: then(call()))
        return Calls((call,), lambda replies: then(replies[0]))

    def acquire(self, ctx: AcquireContext) -> Decision:
        call = self._take(ctx.holder, ctx.lease_s, ctx.metadata, ctx.worker)
        if call is None:
            return CONTINUE
        return self.taken if int(call()) else self._refusal(ctx.metadata)

    def acquire_calls(
        self,
        holder: str,
        worker: str,
        lease_s: float,
        tenant: Mapping[str, str],
        behind: bool = False,
        priority: int | None = None,
    ) -> Calls[Admission] | None:
        call = self._take(holder, lease_s, tenant, worker) if self.prepares else None
        if call is None:
            return None
        refused = self._refusal(tenant)
        if behind:
            return Calls((), lambda _: (refused, False))
        if self.own_redis:
            return None
        return Calls((call,), lambda r: (self.taken if int(r[0]) else refused, int(r[0]) == 1))

    def transfer_calls(self, giver: str, ctx: AcquireContext, bell: str) -> Calls[bool]:
        call = self._take(ctx.holder, ctx.lease_s, ctx.metadata, ctx.worker, giver)
        if call is None:
            return Calls((), lambda _: False)
        return self._calls(call, lambda r: bool(int(r)))
