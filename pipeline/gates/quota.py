"""``redis-quota``: a limit per value of a request attribute (e.g. per user), in Redis.

Params: ``address`` (optional Redis URL, ``host:port`` or a ``sentinel://`` list with
``master_name``; default: the pipeline's client),
``attribute`` (``userid``; read from ``ctx.metadata``, ``metadata.userid`` also accepted),
``mode`` (``rate-limit`` default, ``concurrency`` or ``tokens``), ``limit`` (int > 0,
required: requests, or tokens in tokens mode), ``window`` (``1m``; seconds or
``"30s"``/``"500ms"``/``"1h"``; rate-limit and tokens only, required in tokens mode), ``prefix``
(``quota:``), ``gating_mode`` (``blocking`` default, or ``classifying``), and in tokens mode
only ``default_max_tokens`` (int >= 0, 256: the completion budget of a body without
``max_tokens``, see :mod:`.tokens`).

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
- **tokens**: at most ``limit`` tokens per sliding ``window`` per key. Admission charges the
  request's estimate (:func:`.tokens.estimate_tokens`: prompt characters / 4 + its
  ``max_tokens``) in a log per (quota key, window) (``Keys.gate_tokens``;
  ``lua/gate_tokens_acquire.lua``); when the attempt ends it settles the charge
  (:meth:`settle`, ``lua/gate_tokens_settle.lua``) to the response's ``usage`` (prompt +
  completion) after a 2xx, to 0 when nothing was served (no request sent, or a non-2xx answer),
  and to the estimate when the request went out and no answer came (a time-out: the server
  may have generated it). A charge counts from its admission until a whole ``window`` after
  its settlement (it is re-stamped then): every token the server received before the answer
  lies within the windows it is counted in, however late the request reached the server
  after its admission. (An attempt that ends without settling — a killed worker — keeps its
  estimate for a window from its admission; so does one in flight longer than the window.)
  Over the budget → Refuse with ``retry_after`` = the time until enough of the
  window's charges expire (server clock), or at most ``SETTLE_POLL_S`` when charges still
  in flight could settle lower and make room sooner. An estimate above ``limit`` can never fit:
  Drop (``GATE_DROPPED``, saying so). Nothing is held: release, renew and reap are no-ops.
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
import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import redis

from ..store.sched import QuotaSpec
from ..store.scripts import ScriptCall
from .base import (
    CONTINUE,
    AcquireContext,
    Decision,
    Gate,
    GateEnv,
    PreparedAcquire,
    PreparedRelease,
    Verdict,
)
from .leases import LeaseScripts, LeaseSet, holder_entry, register
from .params import Params
from .redis_budget import connect, redis_url
from .tokens import DEFAULT_MAX_TOKENS, estimate_tokens

log = logging.getLogger(__name__)

RESERVED = {"classification": "reserved"}
OVERFLOW = {"classification": "overflow"}
MODES = ("rate-limit", "concurrency", "tokens")
# tokens mode: a refusal while charges in flight could settle lower asks again after at most
# this long (s), instead of waiting for the window to expire
SETTLE_POLL_S = 1.0


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
        self.mode = p.get_choice("mode", MODES, "rate-limit")
        self.limit = p.get_int("limit", lo=1)
        if self.mode == "tokens" and not p.has("window"):
            raise p.error("window", "is required in tokens mode (tokens per window)")
        self.window_s = p.get_duration("window", 60.0)
        if self.mode != "concurrency" and self.window_s <= 0:
            raise p.error("window", f"must be a positive duration in {self.mode} mode")
        if self.mode == "tokens":
            self.default_max_tokens = p.get_int("default_max_tokens", DEFAULT_MAX_TOKENS, lo=0)
        elif p.has("default_max_tokens"):
            raise p.error("default_max_tokens", "applies to tokens mode only")
        else:
            self.default_max_tokens = DEFAULT_MAX_TOKENS
        self.prefix = p.get_str("prefix", "quota:")
        self.gating_mode = p.get_choice("gating_mode", ("blocking", "classifying"), "blocking")
        # blocking concurrency: one interchangeable slot per key, handed over on the key's bell
        keyed = self.mode == "concurrency" and self.gating_mode == "blocking"
        setattr(self, "per_key", keyed)  # noqa: B010 - instance override
        setattr(self, "hands_over", keyed)  # noqa: B010 - instance override
        setattr(self, "settles", self.mode == "tokens")  # noqa: B010 - instance override
        self.client: redis.Redis | None = None
        self._own_client = False
        if env is not None:
            self.client = connect(self.url) if self.url else env.client
            self._own_client = self.url is not None
            self._leases = LeaseScripts(self.client)
            self._rate = register(self.client, "gate_rate_acquire")
            self._release = register(self.client, "gate_quota_release")
            self._tokens = register(self.client, "gate_tokens_acquire")
            self._settle = register(self.client, "gate_tokens_settle")

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

    def tokens_keys(self, value: str) -> tuple[str, str]:
        """The charge log and charges of one value's token budget (tokens mode)."""
        namespace = self.prefix.rstrip(":") or "quota"
        return self._env().keys.gate_tokens(namespace, f"{self.attribute}:{value}", self.window_s)

    # -- admission -----------------------------------------------------------------------
    def quota_specs(self) -> list[QuotaSpec]:
        if not self.per_key:
            return []
        return [QuotaSpec(self.quota_key(""), self.attribute, self.limit, local=self.url is None)]

    def wake_keys(self, ctx: AcquireContext) -> list[str]:
        value = ctx.metadata.get(self.attribute)
        return [self.quota_key(value)] if value and self.per_key else []

    def handover_capacity(self) -> int | None:
        return self.limit if self.per_key else None

    def handover_keyed(self) -> bool:
        return self.per_key

    def handover_bell(self, queue: str, wake: Sequence[str]) -> str | None:
        """The holder's key: its slot goes to an attempt parked for the same key."""
        return wake[0] if self.per_key and len(wake) == 1 else None

    def transfer(self, giver: str, ctx: AcquireContext) -> bool:
        if not self.per_key:
            return super().transfer(giver, ctx)  # rate-limit, classifying: nothing to hand
        call = self._transfer_call(giver, ctx)
        return call is not None and bool(int(call.script(keys=call.keys, args=call.args)))

    def prepare_transfer(self, giver: str, ctx: AcquireContext) -> PreparedRelease | None:
        """:meth:`transfer` as one call, when the quota's keys are in the pipeline's Redis."""
        if not self.per_key or self.env is None or self._own_client:
            return None
        call = self._transfer_call(giver, ctx)
        return None if call is None else PreparedRelease.one(call, lambda r: bool(int(r)))

    def _transfer_call(self, giver: str, ctx: AcquireContext) -> ScriptCall | None:
        """The hand-over of ``giver``'s slot of ``ctx``'s key (None: the request has no
        value of the attribute, so no key)."""
        value = ctx.metadata.get(self.attribute)
        if not value:
            return None
        key = self.holders_key(value)
        info = {"key": key, "worker": ctx.worker, "handed_over_by": giver}
        return self._slots(key).transfer_call(giver, ctx.holder, ctx.lease_s, self.limit, info)

    def estimate(self, ctx: AcquireContext) -> int:
        """Tokens charged at admission (tokens mode; see :mod:`.tokens`)."""
        return estimate_tokens(ctx.payload, self.default_max_tokens)

    def acquire(self, ctx: AcquireContext) -> Decision:
        value = ctx.metadata.get(self.attribute)
        if not value:
            return CONTINUE
        if self.mode == "tokens":
            return self._acquire_tokens(ctx, value)
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
        return _exhausted(self.quota_key(value) if self.mode == "concurrency" else None)

    def parked_decision(self, bell: str) -> Decision | None:
        """The key's quota exhausted (``bell``: the key, :meth:`handover_bell`)."""
        return _exhausted(bell) if self.per_key and self.env is not None else None

    def _hinted(self, tenant: Mapping[str, str] | None) -> str | None:
        """The attribute's value in a dispatcher's ``tenant`` hint, when this quota can act
        on it before the start (per-key, its keys in the pipeline's Redis)."""
        if not self.per_key or self.env is None or self._own_client or not tenant:
            return None
        return tenant.get(self.attribute) or None

    def start_bell(self, queue: str, tenant: Mapping[str, str]) -> str | None:
        value = self._hinted(tenant)
        return None if value is None else self.quota_key(value)

    def prepare_acquire(
        self,
        holder: str,
        worker: str,
        lease_s: float,
        tenant: Mapping[str, str] | None = None,
        behind: str | None = None,
    ) -> PreparedAcquire | None:
        """The key's slot, when the dispatcher named the tenant (``tenant``)."""
        value = self._hinted(tenant)
        if value is None or behind is not None:
            return None
        key = self.holders_key(value)
        call = self._slots(key).acquire_call(
            holder, lease_s, self.limit, {"key": key, "worker": worker}
        )
        refused = _exhausted(self.quota_key(value))

        def decide(reply: Any) -> Decision:
            return Decision(Verdict.CONTINUE, labels=dict(RESERVED)) if int(reply) else refused

        return PreparedAcquire.one(call, decide, lambda reply: int(reply) == 1)

    def _acquire_tokens(self, ctx: AcquireContext, value: str) -> Decision:
        estimate = self.estimate(ctx)
        if estimate > self.limit:  # it can never fit
            if self.gating_mode == "classifying":
                return Decision(Verdict.CONTINUE, labels=dict(OVERFLOW))
            return self._too_big(estimate)
        args = [repr(self.window_s), self.limit, ctx.holder, estimate]
        reply = self._tokens(keys=list(self.tokens_keys(value)), args=args)
        code, delay_ms, open_ = (int(x) for x in reply)
        if code in (1, 2):
            return Decision(Verdict.CONTINUE, labels=dict(RESERVED))
        if self.gating_mode == "classifying":
            return Decision(Verdict.CONTINUE, labels=dict(OVERFLOW))
        if code == 3:
            return self._too_big(estimate)
        delay = delay_ms / 1000.0
        if open_:  # charges in flight may settle lower and make room sooner: ask again then
            delay = min(delay, SETTLE_POLL_S)
        return Decision(
            Verdict.REFUSE, reason="quota_exhausted", labels=dict(OVERFLOW), retry_after=delay
        )

    def _too_big(self, estimate: int) -> Decision:
        return Decision(
            Verdict.DROP,
            reason="dropped",
            labels=dict(OVERFLOW),
            message=(
                f"token estimate {estimate} exceeds the whole budget of {self.limit} tokens "
                f"per {self.window_s:g} s of gate {self.name!r}: it can never be admitted"
            ),
        )

    def settle(self, ctx: AcquireContext, tokens: int | None) -> None:
        """Settle ``ctx``'s charge (tokens mode): to ``tokens`` (0 refunds it), or to its
        estimate (None); a charge that stays counts for a window from now."""
        value = ctx.metadata.get(self.attribute)
        if self.mode != "tokens" or self.client is None or not value:
            return
        amount = "" if tokens is None else max(0, tokens)
        args = [ctx.holder, amount, repr(self.window_s)]
        old = int(self._settle(keys=list(self.tokens_keys(value)), args=args))
        if old >= 0:
            log.debug("gate %s: %s charge %d settled to %s", self.name, ctx.holder, old, amount)

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

    def prepare_release(self, holder: str) -> PreparedRelease | None:
        """:meth:`release` as one call, when the quota's keys are in the pipeline's Redis."""
        if self.mode != "concurrency" or self.client is None or self._own_client:
            return None
        call = ScriptCall(self._release, [self._index_key()], [holder])
        return PreparedRelease.one(call, lambda reply: bool(int(reply)))

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
            **({"default_max_tokens": self.default_max_tokens} if self.mode == "tokens" else {}),
        }

    def close(self) -> None:
        if self._own_client and self.client is not None:
            self.client.close()


def _exhausted(wake: str | None) -> Decision:
    """A blocking quota's refusal; ``wake``: the key's bell it parks on (concurrency mode)."""
    return Decision(
        Verdict.REFUSE,
        reason="quota_exhausted",
        labels=dict(OVERFLOW),
        wake_on_release=wake is not None,
        wake_key=wake,
    )


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
