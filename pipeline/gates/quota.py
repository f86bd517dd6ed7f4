"""``redis-quota``: a limit per value of a request attribute (e.g. per user), in Redis.

Params: ``address`` (optional Redis URL, ``host:port`` or a ``sentinel://`` list with
``master_name``; default: the pipeline's client),
``attribute`` (``userid``; read from ``ctx.metadata``, ``metadata.userid`` also accepted),
``mode`` (``rate-limit`` default, or ``concurrency``), ``limit`` (int > 0, required),
``window`` (``1m``; seconds or ``"30s"``/``"500ms"``/``"1h"``; rate-limit only), ``prefix``
(``quota:``), ``gating_mode`` (``blocking`` default, or ``classifying``).

The quota key is ``<prefix><attribute>:<value>`` as in the reference, so every gate with the
same prefix shares one quota per value (e.g. one per-user limit across queues). Its Redis keys
sit under the pipeline prefix: the concurrency holders are ``Keys.gate_holders(<quota key>)``
and the rate-limit logs ``Keys.gate_rate(<prefix without ':'>, "<attribute>:<value>",
window)``.

- A request without the attribute passes (Continue, no labels, nothing held).
- **concurrency**: one lease per holder in a sorted set per value, scored by lease expiry;
  only unexpired leases count, acquire is one Lua step. A per-gate hash
  (``Keys.gate_info(<gate name>)``) maps each holder to its key so release, renew and reap
  find it; reap frees this gate's expired holders and returns them. Release always refunds.
- **rate-limit**: a sliding-window log per (quota key, window); one entry per admitted holder
  (never refunded: release is a no-op); entries older than the window drop out.
- **blocking**: admitted → Continue ``classification=reserved``; over the limit → Refuse
  (``quota_exhausted``, ``classification=overflow``). **classifying** never refuses: over the
  limit is Continue ``classification=overflow`` and holds nothing.

Redis errors propagate from :meth:`acquire` (the worker turns them into a Refuse with reason
``error``). ``budget()`` is 1.0 and ``capacity()`` None: a quota has no overall capacity.

**Quota-aware dispatch** (concurrency, blocking): :meth:`quota_specs` tells the dispatcher the
key and limit, so the dispatch script counts each key's dispatched and running requests and
holds a tenant at its limit back (``lua/sched.lua``) instead of sending attempts this gate
must refuse. A few attempts past the limit (look-ahead) are sent when the pool has room: their
refusal is ``wake_on_release`` with ``wake_key`` = the quota key, so they park at the worker
and take the key's next released slot (a request of the key leaving the active state publishes
the key on the release bell's channel).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, cast

import redis

from ..store.sched import QuotaSpec
from .base import CONTINUE, AcquireContext, Decision, Gate, GateEnv, Verdict
from .leases import LeaseScripts, LeaseSet, holder_entry, register
from .params import Params
from .redis_budget import connect, redis_url

RESERVED = {"classification": "reserved"}
OVERFLOW = {"classification": "overflow"}


class RedisQuotaGate(Gate):
    type_name = "redis-quota"
    static_budget = True

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        p = Params(self.type_name, name, params)
        self.url = redis_url(p)
        attribute = p.get_str("attribute", "userid")
        self.attribute = attribute.removeprefix("metadata.")
        if not self.attribute:
            raise p.error("attribute", "must name a metadata attribute")
        self.mode = p.get_choice("mode", ("rate-limit", "concurrency"), "rate-limit")
        self.limit = p.get_int("limit", lo=1)
        self.window_s = p.get_duration("window", 60.0)
        if self.mode == "rate-limit" and self.window_s <= 0:
            raise p.error("window", "must be a positive duration in rate-limit mode")
        self.prefix = p.get_str("prefix", "quota:")
        self.gating_mode = p.get_choice("gating_mode", ("blocking", "classifying"), "blocking")
        # blocking concurrency: one interchangeable slot per key, handed over on the key's bell
        keyed = self.mode == "concurrency" and self.gating_mode == "blocking"
        setattr(self, "per_key", keyed)  # noqa: B010 - instance override
        setattr(self, "hands_over", keyed)  # noqa: B010 - instance override
        self.client: redis.Redis | None = None
        self._own_client = False
        if env is not None:
            self.client = connect(self.url) if self.url else env.client
            self._own_client = self.url is not None
            self._leases = LeaseScripts(self.client)
            self._rate = register(self.client, "gate_rate_acquire")
            self._release = register(self.client, "gate_quota_release")

    # -- keys ----------------------------------------------------------------------------
    def quota_key(self, value: str) -> str:
        """The reference's key for one attribute value: ``<prefix><attribute>:<value>``."""
        return f"{self.prefix}{self.attribute}:{value}"

    def _env(self) -> GateEnv:
        if self.env is None or self.client is None:
            raise RuntimeError(f"gate {self.name!r} is not bound to Redis (env is None)")
        return self.env

    def _index_key(self) -> str:
        return self._env().keys.gate_info(self.name)

    def _slots(self, holders_key: str) -> LeaseSet:
        return LeaseSet(self._leases, holders_key, self._index_key())

    def rate_key(self, value: str) -> str:
        namespace = self.prefix.rstrip(":") or "quota"
        return self._env().keys.gate_rate(namespace, f"{self.attribute}:{value}", self.window_s)

    def holders_key(self, value: str) -> str:
        return self._env().keys.gate_holders(self.quota_key(value))

    # -- admission -----------------------------------------------------------------------
    def quota_specs(self) -> list[QuotaSpec]:
        if not self.per_key:
            return []
        return [QuotaSpec(self.quota_key(""), self.attribute, self.limit, local=self.url is None)]

    def wake_keys(self, ctx: AcquireContext) -> list[str]:
        value = ctx.metadata.get(self.attribute)
        return [self.quota_key(value)] if value and self.per_key else []

    def handover_bell(self, queue: str, wake: Sequence[str]) -> str | None:
        """The holder's key: its slot goes to an attempt parked for the same key."""
        return wake[0] if self.per_key and len(wake) == 1 else None

    def transfer(self, giver: str, ctx: AcquireContext) -> bool:
        if not self.per_key:
            return super().transfer(giver, ctx)  # rate-limit, classifying: nothing to hand
        value = ctx.metadata.get(self.attribute)
        if not value:
            return False
        key = self.holders_key(value)
        info = {"key": key, "worker": ctx.worker, "handed_over_by": giver}
        return bool(self._slots(key).transfer(giver, ctx.holder, ctx.lease_s, self.limit, info))

    def acquire(self, ctx: AcquireContext) -> Decision:
        value = ctx.metadata.get(self.attribute)
        if not value:
            return CONTINUE
        if self.mode == "concurrency":
            key = self.holders_key(value)
            info = {"key": key, "worker": ctx.worker}
            admitted = self._slots(key).acquire(ctx.holder, ctx.lease_s, self.limit, info)
        else:
            args = [repr(self.window_s), self.limit, ctx.holder]
            admitted = int(self._rate(keys=[self.rate_key(value)], args=args))
        if admitted:
            return Decision(Verdict.CONTINUE, labels=dict(RESERVED))
        if self.gating_mode == "classifying":
            return Decision(Verdict.CONTINUE, labels=dict(OVERFLOW))
        wake = self.quota_key(value) if self.mode == "concurrency" else None
        return Decision(
            Verdict.REFUSE,
            reason="quota_exhausted",
            labels=dict(OVERFLOW),
            wake_on_release=wake is not None,
            wake_key=wake,
        )

    # -- reservations (concurrency mode; rate-limit admissions are never refunded) ---------
    def _index(self) -> dict[str, list[str]]:
        """This gate's holders grouped by their holders key."""
        assert self.client is not None
        groups: dict[str, list[str]] = defaultdict(list)
        stale: list[str] = []
        for holder, info in self._hgetall().items():
            key = _key_of(info)
            if key is None:
                stale.append(holder)
            else:
                groups[key].append(holder)
        if stale:
            self.client.hdel(self._index_key(), *stale)
        return groups

    def _hgetall(self) -> dict[str, str]:
        assert self.client is not None
        return cast(dict[str, str], self.client.hgetall(self._index_key()))

    def release(self, holder: str) -> bool:
        """One round trip: the index entry names the holder's key (``gate_quota_release``)."""
        if self.mode != "concurrency" or self.client is None:
            return False
        return bool(self._release(keys=[self._index_key()], args=[holder]))

    def renew(self, holders: Iterable[str], lease_s: float) -> None:
        if self.mode != "concurrency" or self.client is None:
            return
        wanted = list(holders)
        if not wanted:
            return
        groups: dict[str, list[str]] = defaultdict(list)
        infos = cast(list[str | None], self.client.hmget(self._index_key(), wanted))
        for holder, info in zip(wanted, infos, strict=True):
            key = _key_of(info)
            if key is not None:
                groups[key].append(holder)
        for key, members in groups.items():
            self._slots(key).renew(members, lease_s)

    def reap(self) -> list[str]:
        if self.mode != "concurrency" or self.client is None:
            return []
        freed: list[str] = []
        for key, members in self._index().items():
            freed += self._slots(key).reap(only=members)
        return freed

    def _live(self) -> tuple[float, list[tuple[str, float, str | None]]]:
        """The server's clock, and (holder, lease expiry, info JSON) of this gate's unexpired
        leases by that clock."""
        if self.mode != "concurrency" or self.client is None:
            return 0.0, []
        infos = self._hgetall()
        groups: dict[str, list[str]] = defaultdict(list)
        for holder, info in infos.items():
            key = _key_of(info)
            if key is not None:
                groups[key].append(holder)
        if not groups:
            return 0.0, []
        with self.client.pipeline(transaction=False) as pipe:
            pipe.time()
            for key, members in groups.items():
                pipe.zmscore(key, members)
            (sec, usec), *scores = pipe.execute()
        out = []
        now = float(f"{sec + usec / 1e6:.6f}")  # at the µs precision the scores are stored
        for (_, members), row in zip(groups.items(), scores, strict=True):
            for holder, score in zip(members, row, strict=True):
                if score is not None and float(score) > now:
                    out.append((holder, float(score), infos.get(holder)))
        return now, out

    def in_flight(self) -> int:
        """This gate's unexpired concurrency leases (0 in rate-limit mode)."""
        return len(self._live()[1])

    def holders(self) -> list[dict[str, Any]]:
        now, live = self._live()
        return [holder_entry(h, info, exp, now) for h, exp, info in live]

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "mode": self.mode,
            "gating_mode": self.gating_mode,
            "quota_limit": self.limit,
            "attribute": self.attribute,
            "window_s": self.window_s,
        }

    def close(self) -> None:
        if self._own_client and self.client is not None:
            self.client.close()


def _key_of(info: str | None) -> str | None:
    """The holders key recorded in a holder's index entry, or None when absent/corrupt."""
    if not info:
        return None
    try:
        data = json.loads(info)
    except json.JSONDecodeError:
        return None
    key = data.get("key") if isinstance(data, dict) else None
    return key if isinstance(key, str) and key else None
