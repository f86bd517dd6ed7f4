"""``redis-quota``: a limit per value of a request attribute (a tenant), one class per ``mode``
(rate-limit, concurrency, tokens). Params and keys: docs/gates.md; token budgets:
docs/scheduling.md."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, cast

from ..store.keys import Keys, gate_tokens_roots
from ..store.sched import QuotaSpec, TokenSpec
from ..store.scripts import ScriptCall, node_client
from .base import CONTINUE, AcquireContext, Calls, Decision, Gate, GateEnv, Settles, Verdict
from .leases import LeaseScripts, LeaseSet, SlotGate, holder_entry, parse_info, register
from .params import Params
from .redis_budget import OnRedis
from .tokens import (
    CLIP_SPREADS,
    CLIP_TOKENS,
    DEFAULT_MAX_TOKENS,
    LEARN_TTL_S,
    LEARN_WEIGHT,
    OVERHEAD_MAX,
    SLOPE_MAX,
    Learned,
    estimate_parts,
)

log = logging.getLogger(__name__)

RESERVED = Decision(Verdict.CONTINUE, labels={"classification": "reserved"})
OVERFLOW = Decision(Verdict.CONTINUE, labels={"classification": "overflow"})
# tokens mode: a refusal while charges in flight could settle lower asks again after at most
# this long (s), instead of waiting for the window to expire
SETTLE_POLL_S = 1.0
# tokens mode, estimate_correction: "none" charges the plain estimate; "usage" corrects its
# prompt part by what the answers' usage taught (pipeline/gates/tokens.py Learned)
CORRECTIONS = ("none", "usage")


def redis_quota(name: str, params: dict[str, Any], env: GateEnv | None) -> Gate:
    modes = {"rate-limit": RateQuota, "concurrency": ConcurrencyQuota, "tokens": TokenQuota}
    mode = Params(Quota.type_name, name, params).get_choice("mode", tuple(modes), "rate-limit")
    return modes[mode](name, params, env)


class Quota(OnRedis):
    """What the modes share: params, the client, the key of an attribute value."""

    type_name = "redis-quota"
    mode: ClassVar[str] = ""

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        p = Params(self.type_name, name, params)
        self.attribute = p.get_str("attribute", "userid").removeprefix("metadata.")
        if not self.attribute:
            raise p.error("attribute", "must name a metadata attribute")
        self.limit = p.get_int("limit", lo=1)
        if self.mode == "tokens" and not p.has("window"):
            raise p.error("window", "is required in tokens mode (tokens per window)")
        self.window_s = p.get_duration("window", 60.0)
        if self.mode != "concurrency" and self.window_s <= 0:
            raise p.error("window", f"must be a positive duration in {self.mode} mode")
        if self.mode == "tokens":
            self.default_max_tokens = p.get_int("default_max_tokens", DEFAULT_MAX_TOKENS, lo=0)
            self.correction = p.get_choice("estimate_correction", CORRECTIONS, "none")
        else:
            for key in ("default_max_tokens", "estimate_correction"):
                if p.has(key):
                    raise p.error(key, "applies to tokens mode only")
        self.prefix = p.get_str("prefix", "quota:")
        self.gating_mode = p.get_choice("gating_mode", ("blocking", "classifying"), "blocking")

    def quota_key(self, value: str) -> str:
        """The reference's key for one attribute value: ``<prefix><attribute>:<value>``."""
        return f"{self.prefix}{self.attribute}:{value}"

    def _keys(self) -> Keys:
        if self.env is None or self.client is None:
            raise RuntimeError(f"gate {self.name!r} is not bound to Redis (env is None)")
        return self.env.keys

    def _over(self, wake: str | None = None, retry_after: float | None = None) -> Decision:
        """Over the limit: refuse (blocking; ``wake``: the key's bell; ask again after
        ``retry_after``), else Continue overflow."""
        if self.gating_mode == "classifying":
            return OVERFLOW
        return Decision(
            Verdict.REFUSE,
            reason="quota_exhausted",
            labels=dict(OVERFLOW.labels),
            wake_on_release=wake is not None,
            wake_key=wake,
            retry_after=retry_after,
        )

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "mode": self.mode,
            "gating_mode": self.gating_mode,
            "quota_limit": self.limit,
            "attribute": self.attribute,
            "window_s": self.window_s,
        }


class RateQuota(Quota):
    mode = "rate-limit"

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        if self.client is not None:
            self._rate = register(self.client, "gate_rate_acquire")

    def rate_key(self, value: str) -> str:
        namespace = self.prefix.rstrip(":") or "quota"
        return self._keys().gate_rate(namespace, f"{self.attribute}:{value}", self.window_s)

    def acquire(self, ctx: AcquireContext) -> Decision:
        value = ctx.metadata.get(self.attribute)
        if not value:
            return CONTINUE
        args = [repr(self.window_s), self.limit, ctx.holder]
        return RESERVED if int(self._rate(keys=[self.rate_key(value)], args=args)) else self._over()


class TokenQuota(Quota, Settles):
    mode = "tokens"

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        if self.client is not None:
            self._tokens = register(self.client, "gate_tokens_acquire", library=True)
            self._settle = register(self.client, "gate_tokens_settle")

    @property
    def namespace(self) -> str:
        return self.prefix.rstrip(":") or "quota"

    def tokens_keys(self, value: str) -> tuple[str, str]:
        """The charge log and charges of one value's token budget."""
        return self._keys().gate_tokens(self.namespace, f"{self.attribute}:{value}", self.window_s)

    def token_specs(self) -> list[TokenSpec]:
        """Blocking, in the pipeline's Redis: the dispatcher holds a tenant back while its
        next request does not fit in the window (it reads and charges the window there)."""
        if self.gating_mode != "blocking" or self.url is not None:
            return []
        log_root, charges_root = gate_tokens_roots(self.namespace, self.attribute, self.window_s)
        return [
            TokenSpec(
                log_root,
                charges_root,
                self.attribute,
                self.limit,
                self.window_s,
                self.default_max_tokens,
            )
        ]

    def learned_key(self, queue: str) -> str:
        """Where what the answers taught of ``queue``'s prompts lives (per gate and queue: a
        pool's gate serves queues of other models)."""
        return self._keys().gate_tokens_learned(self.name, queue)

    def learned(self, queue: str) -> Learned:
        """What the answers taught of ``queue``'s prompt tokens (nothing yet: ``Learned()``,
        the plain estimate)."""
        assert self.client is not None
        fields = ("n", "mx", "my", "mxx", "mxy", "myy", "a", "b", "s")
        got = cast(list[Any], self.client.hmget(self.learned_key(queue), fields))
        if got[0] is None:
            return Learned()
        n, *rest = got
        return Learned(int(n), *(float(v) for v in rest))

    def estimate(self, ctx: AcquireContext, learned: Learned | None = None) -> int:
        """Tokens charged at admission (see :mod:`.tokens`), its prompt part corrected by
        ``learned``."""
        prompt, completion = estimate_parts(ctx.payload, self.default_max_tokens)
        return (learned or Learned()).charge(prompt) + completion

    def acquire(self, ctx: AcquireContext) -> Decision:
        value = ctx.metadata.get(self.attribute)
        if not value:
            return CONTINUE
        prompt, completion = estimate_parts(ctx.payload, self.default_max_tokens)
        estimate = prompt + completion
        if estimate > self.limit:  # it can never fit
            return self._over() if self.gating_mode == "classifying" else self._too_big(estimate)
        keys, args = list(self.tokens_keys(value)), [repr(self.window_s), self.limit, ctx.holder]
        if self.correction == "usage":  # the script corrects the estimate by what was learned
            keys.append(self.learned_key(ctx.queue))
            args += [estimate, prompt]
        else:
            args.append(estimate)
        reply = self._tokens(keys=keys, args=args)
        code, delay_ms, open_ = (int(x) for x in reply[:3])
        if code in (1, 2):
            return RESERVED
        if code == 3 and self.gating_mode != "classifying":
            return self._too_big(estimate)
        delay = delay_ms / 1000.0
        if open_:  # charges in flight may settle lower and make room sooner: ask again then
            delay = min(delay, SETTLE_POLL_S)
        return self._over(retry_after=delay)

    def _too_big(self, estimate: int) -> Decision:
        return Decision(
            Verdict.DROP,
            reason="dropped",
            labels=dict(OVERFLOW.labels),
            message=(
                f"token estimate {estimate} exceeds the whole budget of {self.limit} tokens "
                f"per {self.window_s:g} s of gate {self.name!r}: it can never be admitted"
            ),
        )

    def settle(self, ctx: AcquireContext, tokens: int | None, prompt: int | None = None) -> None:
        """See :meth:`Settles.settle`; a charge that stays counts for a window from now. With
        ``estimate_correction: usage`` the answer's ``prompt`` tokens teach the queue's
        correction in the same script call."""
        value = ctx.metadata.get(self.attribute)
        if self.client is None or not value:
            return
        amount = "" if tokens is None else max(0, tokens)
        keys, args = list(self.tokens_keys(value)), [ctx.holder, amount, repr(self.window_s)]
        if self.correction == "usage" and prompt:
            estimate, _ = estimate_parts(ctx.payload, self.default_max_tokens)
            keys.append(self.learned_key(ctx.queue))
            args += [prompt, estimate, repr(SLOPE_MAX), repr(OVERHEAD_MAX), LEARN_WEIGHT]
            args += [LEARN_TTL_S * 1000, repr(CLIP_SPREADS), repr(CLIP_TOKENS)]
        old = int(self._settle(keys=keys, args=args))
        if old >= 0:
            log.debug("gate %s: %s charge %d settled to %s", self.name, ctx.holder, old, amount)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "default_max_tokens": self.default_max_tokens,
            "estimate_correction": self.correction,
        }


class ConcurrencyQuota(Quota, SlotGate):
    """A slot per holder of a key. Blocking: one interchangeable slot of the key, handed over
    on the key's bell, counted by the dispatcher (:meth:`quota_specs`)."""

    mode = "concurrency"
    taken = RESERVED

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        self.blocking = self.gating_mode == "blocking"
        self.prepares = self.blocking  # a classifying quota's slot is not taken at the start
        self.own_redis = self.url is not None  # its calls cannot go with the pipeline's
        if self.client is not None:
            self._leases = LeaseScripts(self.client)
            self._release = register(self.client, "gate_quota_release")

    def _index_key(self) -> str:
        return self._keys().gate_info(self.name)

    def _slots(self, holders_key: str) -> LeaseSet:
        return LeaseSet(self._leases, holders_key, self._index_key())

    def holders_key(self, value: str) -> str:
        return self._keys().gate_holders(self.quota_key(value))

    def _pool(self, metadata: Mapping[str, str]) -> tuple[LeaseSet, dict[str, Any]] | None:
        value = metadata.get(self.attribute)
        if not value:
            return None
        key = self.holders_key(value)
        return self._slots(key), {"key": key}

    def _refusal(self, metadata: Mapping[str, str]) -> Decision:
        return self._over(self.quota_key(metadata[self.attribute]))

    def quota_specs(self) -> list[QuotaSpec]:
        if not self.blocking:
            return []
        return [QuotaSpec(self.quota_key(""), self.attribute, self.limit, local=self.url is None)]

    def handover_bells(self, queue: str, metadata: Mapping[str, str]) -> tuple[str, ...]:
        """The holder's key: its slot goes to an attempt parked for the same key."""
        value = metadata.get(self.attribute) if self.blocking else None
        return (self.quota_key(value),) if value else ()

    def release_calls(self, holder: str) -> Calls[bool]:
        """One round trip: the index entry names the holder's key (``gate_quota_release``)."""
        call = ScriptCall(self._release, [self._index_key()], [holder])
        return self._calls(call, lambda r: bool(int(r)))

    def _infos(self, holders: Iterable[str] | None = None) -> dict[str, str]:
        """Index entries (holder → JSON naming its key) of all this gate's holders, or of the
        listed ones that have one."""
        assert self.client is not None
        if holders is None:
            return cast(dict[str, str], self.client.hgetall(self._index_key()))
        wanted = list(holders)
        got = cast(list[Any], self.client.hmget(self._index_key(), wanted) if wanted else [])
        return {h: info for h, info in zip(wanted, got, strict=True) if info}

    def renew(self, holders: Iterable[str], lease_s: float) -> None:
        if self.client is not None:
            for key, members in _by_key(self._infos(holders)).items():
                self._slots(key).renew(members, lease_s)

    def reap(self) -> list[str]:
        if self.client is None:
            return []
        infos = self._infos()
        stale = [h for h, info in infos.items() if _key_of(info) is None]
        if stale:
            self.client.hdel(self._index_key(), *stale)
        groups = _by_key(infos).items()
        return [h for key, members in groups for h in self._slots(key).reap(only=members)]

    def holders(self) -> list[dict[str, Any]]:
        """This gate's unexpired leases (ages and expiry by the server's clock)."""
        if self.client is None:
            return []
        infos = self._infos()
        groups = _by_key(infos)
        if not groups:
            return []
        # at the keys' server (on a cluster the pool's primary: a cluster pipeline sends no TIME)
        with node_client(self.client, next(iter(groups))).pipeline(transaction=False) as pipe:
            pipe.time()
            for key, members in groups.items():
                pipe.zmscore(key, members)
            (sec, usec), *scores = pipe.execute()
        now = float(f"{sec + usec / 1e6:.6f}")  # at the µs precision the scores are stored
        return [
            holder_entry(holder, infos.get(holder), float(score), now)
            for (_, members), row in zip(groups.items(), scores, strict=True)
            for holder, score in zip(members, row, strict=True)
            if score is not None and float(score) > now
        ]


def _by_key(infos: Mapping[str, str]) -> dict[str, list[str]]:
    """Holders grouped by the holders key their index entry names (none: left out)."""
    groups: dict[str, list[str]] = defaultdict(list)
    for holder, info in infos.items():
        key = _key_of(info)
        if key is not None:
            groups[key].append(holder)
    return groups


def _key_of(info: str | None) -> str | None:
    """The holders key recorded in a holder's index entry, or None when absent/corrupt."""
    key = parse_info(info).get("key")
    return key if isinstance(key, str) and key else None
