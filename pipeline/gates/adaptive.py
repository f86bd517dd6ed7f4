"""``adaptive-concurrency``: a ``global-max-concurrency`` slot pool whose limit is not
configured but learned (:mod:`.knee`) and shared by every node through Redis. Reservations are
leased holders like every slot gate's (:class:`.leases.SlotGate`: hand-over, parking,
look-ahead, release on every exit path, reaping); the acquire compares in-flight with the
limit as it is in Redis at that moment. Each answer is added to the current window in the
round trip of its attempt's finish; the window is closed, and the limit moved, by one node at a
time (the dispatchers ask; the close script picks one). docs/gates.md, "adaptive-concurrency"."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import httptools

from ..http.call import CallTimeout, request
from ..redact import redact_url
from ..store.scripts import ScriptCall, register
from . import knee
from .base import (
    AcquireContext,
    Admission,
    Calls,
    Controlled,
    Decision,
    Gate,
    GateEnv,
    Observation,
    Observes,
    Verdict,
    note_problem,
    walk,
)
from .engine_metrics import Reading, parse
from .leases import GRACE_S, LeaseScripts, LeaseSet, SlotGate
from .params import Params

log = logging.getLogger(__name__)

STATE_TTL_S = 7 * 24 * 3600.0  # the state and window outlive their last write this long
LIMIT_CACHE_S = 0.1  # a process reads the limit (for capacity and status) at most this often
DEFAULT_HEADROOM = 0.15
DEFAULT_PRIORITY_MEMORY_S = 10.0
METRICS_TIMEOUT_S = 2.0
STATE_FIELDS = ("limit", "state", "signal", "reason", "moved_at", "windows")


class AdaptiveScripts:
    def __init__(self, env: GateEnv) -> None:
        c = env.client
        self.acquire = register(c, "gate_adaptive_acquire")
        self.observe = register(c, "gate_adaptive_observe")
        self.close = register(c, "gate_adaptive_close")
        self.move = register(c, "gate_adaptive_move")


class AdaptiveConcurrencyGate(SlotGate, Observes, Controlled):
    type_name = "adaptive-concurrency"
    per_node = False
    handover_may_fail = True

    def __init__(self, name: str, params: dict[str, Any], env: GateEnv | None) -> None:
        super().__init__(name, params, env)
        p = Params(self.type_name, name, params)
        lo = p.get_int("min", 1, lo=1)
        hi = p.get_int("max", 1000, lo=1)
        if hi < lo:
            raise p.error("max", f"must be at least min ({lo}), not {hi}")
        initial = p.get_int("initial", min(max(8, lo), hi), lo=1)
        if not lo <= initial <= hi:
            raise p.error("initial", f"must be in [min, max] = [{lo}, {hi}], not {initial}")
        controller = p.get_choice("controller", knee.CONTROLLERS, "knee")
        window_min = p.get_duration("window_min", knee.Config.window_min_s)
        window_max = p.get_duration("window_max", knee.Config.window_max_s)
        if window_max <= 0 or window_max < window_min:
            least = f"{window_min:g} s"
            raise p.error("window_max", f"must be above 0 and at least window_min ({least})")
        self.cfg = knee.Config(
            min=lo,
            max=hi,
            initial=initial,
            controller=controller,
            window_min_s=window_min,
            window_max_s=window_max,
        )
        self.limit = initial  # SlotGate's: the limit before the controller's first move
        url = p.opt_str("metrics_url")
        if url is not None and not url.startswith(("http://", "https://")):
            raise p.error("metrics_url", f"must be an http(s) URL, not {redact_url(url)!r}")
        self.metrics_url = url
        self.metrics_timeout_s = p.get_float(
            "metrics_timeout_s", METRICS_TIMEOUT_S, lo=0.0, lo_open=True, hi=10.0
        )
        self.headroom = p.get_float("priority_headroom", DEFAULT_HEADROOM, lo=0.0, hi=0.5)
        self.priority_memory_s = p.get_duration("priority_memory", DEFAULT_PRIORITY_MEMORY_S)
        self._full = Decision(Verdict.REFUSE, reason="gate_closed", wake_on_release=True)
        self._cache: tuple[float, dict[str, str]] | None = None
        self._cache_lock = threading.Lock()
        self._metrics_problem: str | None = None
        self._slots: LeaseSet | None = None
        self._scripts: AdaptiveScripts | None = None
        if env is not None:
            keys = env.keys
            self._slots = LeaseSet(
                LeaseScripts(env.client), keys.gate_holders(name), keys.gate_info(name)
            )
            self._scripts = AdaptiveScripts(env)
            self._state_key = keys.gate_adaptive(name)
            self._window_key = keys.gate_adaptive_window(name)

    # -- the slot pool -----------------------------------------------------------------------

    @property
    def slots(self) -> LeaseSet:
        if self._slots is None:
            raise RuntimeError(f"gate {self.name!r} is not bound to Redis (env is None)")
        return self._slots

    @property
    def scripts(self) -> AdaptiveScripts:
        if self._scripts is None:
            raise RuntimeError(f"gate {self.name!r} is not bound to Redis (env is None)")
        return self._scripts

    def _pool(self, metadata: Mapping[str, str]) -> tuple[LeaseSet, dict[str, Any]]:
        return self.slots, {}

    def _refusal(self, metadata: Mapping[str, str]) -> Decision:
        return self._full

    def _take_call(
        self, holder: str, lease_s: float, worker: str, priority: int, giver: str = ""
    ) -> ScriptCall:
        info: dict[str, Any] = {"worker": worker}
        if giver:
            info["handed_over_by"] = giver
        keys = [self.slots.holders_key, self.slots.info_key, self._state_key, self._window_key]
        args = [
            holder,
            repr(float(lease_s)),
            self.limit,
            json.dumps(info),
            GRACE_S,
            giver,
            max(0, min(9, int(priority))),
            repr(float(self.headroom)),
            repr(float(self.priority_memory_s)),
            STATE_TTL_S,
        ]
        return ScriptCall(self.scripts.acquire, keys, args)

    def acquire(self, ctx: AcquireContext) -> Decision:
        taken = int(self._take_call(ctx.holder, ctx.lease_s, ctx.worker, ctx.priority)())
        return self.taken if taken else self._full

    def acquire_calls(
        self,
        holder: str,
        worker: str,
        lease_s: float,
        tenant: Mapping[str, str],
        behind: bool = False,
        priority: int | None = None,
    ) -> Calls[Admission] | None:
        if priority is None and self.headroom > 0:
            return None  # its band is not known yet: the attempt asks with its record's
        if behind:
            return Calls((), lambda _: (self._full, False))
        call = self._take_call(holder, lease_s, worker, priority or 0)
        return Calls((call,), lambda r: (self.taken if int(r[0]) else self._full, int(r[0]) == 1))

    def transfer_calls(self, giver: str, ctx: AcquireContext, bell: str) -> Calls[bool]:
        call = self._take_call(ctx.holder, ctx.lease_s, ctx.worker, ctx.priority, giver)
        return Calls((call,), lambda r: bool(int(r[0])))

    def release_calls(self, holder: str) -> Calls[bool]:
        return Calls((self.slots.release(holder),), lambda r: bool(int(r[0])))

    def handover_bells(self, queue: str, metadata: Mapping[str, str]) -> tuple[str, ...]:
        return (queue,)

    def renew(self, holders: Iterable[str], lease_s: float) -> None:
        self.slots.renew(list(holders), lease_s)

    def reap(self) -> list[str]:
        return self.slots.reap()

    def in_flight(self) -> int:
        return self.slots.count()

    def holders(self) -> list[dict[str, Any]]:
        return self.slots.live()

    # -- the limit -------------------------------------------------------------------------

    def _state(self, fresh: bool = False) -> dict[str, str]:
        """The state hash's fields, read at most every ``LIMIT_CACHE_S`` (``fresh``: now)."""
        with self._cache_lock:
            cached = self._cache
            if not fresh and cached is not None and time.monotonic() - cached[0] < LIMIT_CACHE_S:
                return cached[1]
        values = self.env.client.hmget(self._state_key, STATE_FIELDS) if self.env else []
        fields = {
            k: (v.decode() if isinstance(v, bytes) else str(v))
            for k, v in zip(STATE_FIELDS, values, strict=False)
            if v is not None
        }
        with self._cache_lock:
            self._cache = (time.monotonic(), fields)
        return fields

    def current_limit(self) -> int:
        """The limit in force (the initial one until the controller first moved it)."""
        if self.env is None:
            return self.limit
        try:
            return int(self._state().get("limit") or self.limit)
        except (ValueError, TypeError):
            return self.limit

    def capacity(self) -> int:
        try:
            return self.current_limit()
        except Exception as exc:  # noqa: BLE001 - capacity never raises; the initial limit
            log.warning("%s gate %s: cannot read the limit: %s", self.type_name, self.name, exc)
            return self.limit

    def budget(self) -> float:
        """Free share of the limit; 0.0 when Redis cannot be read."""
        try:
            limit = self.current_limit()
            return max(0.0, (limit - self.slots.count()) / limit)
        except Exception as exc:  # noqa: BLE001 - budget() never raises; fail closed
            log.warning("%s gate %s: cannot count holders: %s", self.type_name, self.name, exc)
            return 0.0

    def controller_view(self) -> dict[str, Any]:
        """The limit, the signal it acts on and why it last moved (status, explain, metrics,
        Flower's gate events)."""
        try:
            fields = self._state()
        except Exception:  # noqa: BLE001 - a view; the limit cache is as old as it is
            fields = self._cache[1] if self._cache else {}
        moved = fields.get("moved_at")
        reason = fields.get("reason") or "initial limit"
        return {
            "limit": int(fields.get("limit") or self.limit),
            "signal": fields.get("signal") or knee.SIGNAL_ANSWERS,
            "reason": reason,
            "reason_code": knee.reason_code(reason),
            "moved_at": float(moved) if moved else None,
            "windows": int(fields.get("windows") or 0),
            "controller": self.cfg.controller,
            "min": self.cfg.min,
            "max": self.cfg.max,
            "metrics_url": redact_url(self.metrics_url) if self.metrics_url else None,
            "priority_headroom": self.headroom,
        }

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "adaptive": self.controller_view()}

    # -- observations and the controller ------------------------------------------------------

    def observe_calls(self, holder: str, observation: Observation) -> Sequence[ScriptCall]:
        o = observation
        keys = [self.slots.holders_key, self.slots.info_key, self._window_key]
        args = [
            holder,
            repr(max(0.0, float(o.latency_s))),
            max(0, int(o.tokens)),
            o.kind,
            "" if o.retry_after_s is None else repr(float(o.retry_after_s)),
            "1" if o.retried else "0",
            STATE_TTL_S,
        ]
        return (ScriptCall(self.scripts.observe, keys, args),)

    def control(self) -> bool | None:
        """Close the window if it is due (this node then is its one mover), read the engine's
        metrics when the gate names them, decide, and write the next state."""
        keys = [self._window_key, self._state_key, self.slots.holders_key]
        quick = "1" if knee.quick_windows(self._initial()) else "0"
        args = [self.cfg.window_min_s, self.cfg.window_max_s, knee.MIN_SAMPLES, STATE_TTL_S, quick]
        reply = self.scripts.close(keys=keys, args=args)
        if not reply:
            return None
        now, seq, count, elapsed, raw_state = (_text(x) for x in reply[:5])
        win = window_of(reply[5:], float(elapsed))
        state = self._loaded(raw_state)
        engine = self._engine(int(count)) if self.metrics_url else None
        decided = knee.decide(state, win, self.cfg, float(now), engine)
        new = decided.state
        written = self.scripts.move(
            keys=[self._state_key],
            args=[
                seq,
                STATE_TTL_S,
                "limit",
                new.limit,
                "state",
                json.dumps(new.to_json(), separators=(",", ":")),
                "signal",
                new.signal,
                "reason",
                new.reason,
                "moved_at",
                repr(new.moved_at) if new.moved_at else "",
                "quick",
                "1" if knee.quick_windows(new) else "0",
            ],
        )
        if not int(written):
            return None
        if new.limit != state.limit:
            log.info(
                "%s gate %s: limit %d -> %d: %s (signal: %s)",
                self.type_name,
                self.name,
                state.limit,
                new.limit,
                new.reason,
                new.signal,
            )
        self._state(fresh=True)
        return decided.raised

    def _loaded(self, raw: str) -> knee.State:
        if not raw:
            return self._initial()
        try:
            return knee.State.from_json(json.loads(raw), self.cfg)
        except ValueError:
            return self._initial()

    def _initial(self) -> knee.State:
        return knee.initial_state(self.cfg, engine=self.metrics_url is not None)

    def _engine(self, count: int) -> knee.Engine | None:
        """One reading of the engine's metrics, with the gate's in-flight count before and
        after it (the admissions it cannot show yet); None when it failed (logged once)."""
        assert self.metrics_url is not None
        problem = None
        try:
            reading = self._scrape(self.metrics_url)
            after = self.slots.count()
        except Exception as exc:  # noqa: BLE001 - every failure means: decide from the answers
            problem, reading, after = f"{type(exc).__name__}: {exc}", None, count
        self._metrics_problem = note_problem(
            self, self._metrics_problem, problem, "deciding from the answers alone"
        )
        if reading is None:
            return None
        return knee.Engine(
            waiting=reading.waiting,
            running=reading.running,
            kv_usage=reading.kv_usage,
            preemptions_total=reading.preemptions,
            histograms=reading.histograms,
            in_flight_before=count,
            in_flight_after=after,
        )

    def _scrape(self, url: str) -> Reading:
        headers, parts = {}, urlsplit(url)
        if parts.username is not None:  # user:password@ in the URL is HTTP basic auth
            login = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            headers["Authorization"] = "Basic " + base64.b64encode(login.encode()).decode()
        try:
            resp = request("GET", url, b"", headers, self.metrics_timeout_s)
        except (OSError, ValueError, CallTimeout, httptools.HttpParserError) as exc:
            error = str(exc).replace(url, redact_url(url))
            raise OSError(f"GET {redact_url(url)}: {type(exc).__name__}: {error}") from None
        if resp.status != 200:
            raise OSError(f"GET {redact_url(url)}: HTTP {resp.status}")
        return parse(resp.text)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_INT_FIELDS = {
    "answered",
    "ok",
    "measured",
    "peak",
    "overload",
    "overload_in_flight",
    "ttl",
    "evicted",
    "errors",
    "retried",
    "refused",
}
_FLOAT_FIELDS = {
    "ok_latency_s",
    "latency_s",
    "tokens",
    "tokens_sq",
    "latency_tokens",
    "in_flight_sum",
    "retry_after_s",
}


def window_of(pairs: Sequence[Any], elapsed_s: float) -> knee.Window:
    """A :class:`knee.Window` from the closed window's hash (field, value, ...); a field it
    does not know or cannot read is left at its default."""
    values: dict[str, Any] = {}
    for i in range(0, len(pairs) - 1, 2):
        name, raw = _text(pairs[i]), _text(pairs[i + 1])
        try:
            if name in _INT_FIELDS:
                values[name] = int(float(raw))
            elif name in _FLOAT_FIELDS:
                values[name] = float(raw)
        except ValueError:
            continue
    return knee.Window(elapsed_s=elapsed_s, **values)


def adaptive_views(gate: Gate) -> list[dict[str, Any]]:
    """The controller views of every ``adaptive-concurrency`` gate in ``gate``."""
    return [g.controller_view() for g in walk(gate) if isinstance(g, AdaptiveConcurrencyGate)]


def find_view(described: Any) -> dict[str, Any] | None:
    """The first adaptive gate's view in a ``Gate.describe()`` (a composite's parts and a
    wrapper's gate included), or None."""
    if not isinstance(described, dict):
        return None
    view = described.get("adaptive")
    if isinstance(view, dict):
        return view
    for part in [described.get("gate"), *(described.get("gates") or [])]:
        found = find_view(part)
        if found is not None:
            return found
    return None
