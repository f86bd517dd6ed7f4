"""Where a request is and why (``Request.explain()``, ``pipeline explain``): read in one atomic
step (``lua/explain.lua``), every time by the Redis server's clock (``server_now``), shaped
into :class:`Explanation`. What it shows: docs/observability.md."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..gates.adaptive import find_view
from ..http.backoff import MAX_ATTEMPTS_EXCEEDED

POISON = "poison"  # the verdict on a request its queue's max_attempts ended


@dataclass(frozen=True)
class LogEntry:
    """One decision-log event: its time (server clock), name and fields (the events:
    docs/observability.md, "Explain"; in words: :func:`describe_entry`)."""

    t: float
    event: str
    fields: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> LogEntry:
        data = json.loads(text)
        t = float(data.pop("t", 0.0))
        event = str(data.pop("e", "?"))
        return cls(t, event, data)

    def to_dict(self) -> dict[str, Any]:
        return {"t": self.t, "event": self.event, **self.fields}


@dataclass(frozen=True)
class Position:
    """A queued request's place: ``ahead`` of it in the pending set, ``higher``: priority →
    requests waiting at it. In a queue indexed by tenant (fair share, per-key quotas) the
    dispatcher picks tenants, so also its tenant's place (the ``tenant*`` fields)."""

    ahead: int | None
    higher: dict[int, int]
    indexed: bool = False
    fair_share: bool = False
    tenant: str | None = None
    tenant_ahead: int | None = None
    tenant_waiting: int | None = None
    held_back_by: str | None = None
    tenants_ahead: int | None = None
    tenants_ready: int | None = None

    @property
    def same_priority_ahead(self) -> int | None:
        """Requests of its own priority before it in the pending set."""
        return None if self.ahead is None else max(0, self.ahead - sum(self.higher.values()))


@dataclass(frozen=True)
class Holder:
    """A live lease on a quota key."""

    request_id: str
    attempt: str
    worker: str | None
    lease_left_s: float


@dataclass(frozen=True)
class QuotaUse:
    """A quota key of the request's tenant: ``in_use`` is the larger of ``dispatched`` (what the
    dispatcher counts) and ``leases`` (None when they are in another Redis)."""

    key: str
    limit: int
    in_use: int
    dispatched: int
    leases: int | None
    holders: list[Holder]
    requests: list[str]
    tenants_held_back: int


@dataclass(frozen=True)
class Explanation:
    """Where a request is and why. Times are Unix s by the Redis server's clock; ``gate``'s
    ``holds_slot``: this attempt holds one of its reservations; ``log``: oldest first."""

    id: str
    state: str
    queue: str
    pool: str
    priority: int
    server_now: float
    submitted_at: float | None
    deadline: float | None
    deadline_slack_s: float | None
    attempts: int
    dispatches: int
    tenant: str | None = None
    batch_id: str | None = None
    custom_id: str | None = None
    position: Position | None = None
    retry_due_in_s: float | None = None
    attempt: str | None = None
    worker: str | None = None
    started_at: float | None = None
    lease_left_s: float | None = None
    last_status: int | None = None
    last_error: str | None = None
    finished_at: float | None = None
    result: dict[str, Any] | None = None
    gate: dict[str, Any] | None = None
    quotas: list[QuotaUse] = field(default_factory=list)
    log: list[LogEntry] = field(default_factory=list)
    # the queue's max_attempts (None: the queue is not configured here)
    max_attempts: int | None = None
    # "poison": every attempt its queue allows failed (it ended MAX_ATTEMPTS_EXCEEDED)
    verdict: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (``pipeline explain --json``)."""
        out = asdict(self)
        out["log"] = [e.to_dict() for e in self.log]
        if self.position is not None:
            out["position"]["same_priority_ahead"] = self.position.same_priority_ahead
            out["position"]["higher"] = {str(p): n for p, n in self.position.higher.items()}
        return out

    def to_text(self) -> str:
        """A few aligned lines for people (``pipeline explain``)."""
        return "\n".join(_text_lines(self))


# -- building ----------------------------------------------------------------------------
def _num(value: Any) -> float | None:
    try:
        return None if value in (None, "", False) else float(value)
    except (TypeError, ValueError):
        return None


def _int(value: Any, default: int = 0) -> int:
    n = _num(value)
    return default if n is None else int(n)


def _list(value: Any) -> list[Any]:
    """A Lua array as cjson returns it (an empty one is ``{}``)."""
    return list(value) if isinstance(value, list) else []


def _opt_int(value: Any) -> int | None:
    return None if value is None or value is False else int(value)


def _position(raw: dict[str, Any]) -> Position:
    indexed = "tenant" in raw
    return Position(
        ahead=_opt_int(raw.get("rank")),
        higher={int(p): int(n) for p, n in _list(raw.get("higher"))},
        indexed=indexed,
        fair_share=bool(raw.get("fair")),
        tenant=raw.get("tenant") if indexed else None,
        tenant_ahead=_opt_int(raw.get("tenant_rank")),
        tenant_waiting=_opt_int(raw.get("tenant_waiting")),
        held_back_by=raw.get("held_by") or None,
        tenants_ahead=_opt_int(raw.get("ready_rank")),
        tenants_ready=_opt_int(raw.get("ready")),
    )


def _quota(raw: dict[str, Any], now: float, workers: dict[tuple[str, str], str]) -> QuotaUse:
    flat = _list(raw.get("holders"))
    holders = []
    for member, expiry in zip(flat[::2], flat[1::2], strict=True):
        rid, _, token = str(member).rpartition(":")
        left = round(float(expiry) - now, 3)
        holders.append(Holder(rid, token, workers.get((rid, token)), left))
    leases = _opt_int(raw.get("leases"))
    sent = int(raw.get("sent") or 0)
    return QuotaUse(
        key=str(raw["key"]),
        limit=int(raw["limit"]),
        in_use=max(sent, leases or 0),
        dispatched=sent,
        leases=leases,
        holders=holders,
        requests=[str(r) for r in _list(raw.get("requests"))],
        tenants_held_back=int(raw.get("blocked") or 0),
    )


def build(
    request_id: str,
    raw: dict[str, Any],
    gate: dict[str, Any] | None,
    max_attempts: int | None = None,
) -> Explanation:
    """An :class:`Explanation` from ``Store.explain``'s reply, the queue's
    ``Gate.describe()`` and ``max_attempts`` (None when the queue is not configured here)."""
    now = float(raw["now"])
    r: dict[str, Any] = raw.get("record") or {}
    state = str(r.get("state", ""))
    token = r.get("token") or None
    workers: dict[tuple[str, str], str] = {}
    gate_info = None
    if gate is not None:
        holds = False
        for h in gate.get("holders", []):
            if h.get("worker"):
                workers[(str(h.get("request_id")), str(h.get("attempt")))] = str(h["worker"])
            holds = holds or (h.get("request_id") == request_id and h.get("attempt") == token)
        gate_info = {
            "type": gate.get("type"),
            "in_flight": gate.get("in_flight"),
            "limit": gate.get("limit"),
            "holds_slot": bool(token) and holds,
        }
        view = find_view(gate)
        if view is not None:  # an adaptive gate: its limit, what it acts on, why it moved
            keep = ("limit", "signal", "reason", "moved_at")
            gate_info["adaptive"] = {k: view.get(k) for k in keep}
    deadline = _num(r.get("deadline"))
    active = state in ("dispatched", "running")
    due = _num(raw.get("due"))
    lease = _num(raw.get("lease"))
    result = r.get("result") if isinstance(r.get("result"), dict) else None
    poison = result is not None and result.get("error_code") == MAX_ATTEMPTS_EXCEEDED
    return Explanation(
        id=request_id,
        state=state,
        queue=str(r.get("queue", "")),
        pool=str(r.get("pool", "")),
        priority=_int(r.get("priority")),
        server_now=now,
        submitted_at=_num(r.get("submitted_at")),
        deadline=deadline,
        deadline_slack_s=None if deadline is None else round(deadline - now, 3),
        attempts=_int(r.get("attempts")),
        dispatches=_int(r.get("dispatches")),
        tenant=r.get("tenant"),
        batch_id=r.get("batch"),
        custom_id=r.get("custom_id"),
        position=_position(raw["position"]) if isinstance(raw.get("position"), dict) else None,
        retry_due_in_s=None if due is None else round(due - now, 3),
        attempt=token if active else None,
        worker=r.get("worker") if state == "running" else None,
        started_at=_num(r.get("started_at")) if state == "running" else None,
        lease_left_s=None if lease is None or not active else round(lease - now, 3),
        last_status=_opt_int(r.get("last_status")),
        last_error=r.get("last_error") or None,
        finished_at=_num(r.get("finished_at")),
        result=result,
        gate=gate_info,
        quotas=[_quota(q, now, workers) for q in _list(raw.get("quotas"))],
        log=[LogEntry.parse(e) for e in _list(raw.get("log"))],
        max_attempts=max_attempts,
        verdict=POISON if poison else None,
    )


# -- text --------------------------------------------------------------------------------
LABEL = 10  # width of the label column


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S.%f")[:-3]


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _s(value: float) -> str:
    return f"{value:.1f} s" if abs(value) >= 0.95 else f"{value * 1000:.0f} ms"


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}" + ("es" if word.endswith(("s", "sh", "ch")) else "s")


def _state_line(e: Explanation) -> str:
    where = f"queue {e.queue} (pool {e.pool}), priority {e.priority}"
    if e.state == "queued":
        return f"queued in {where}"
    if e.state == "retry_wait":
        due = "" if e.retry_due_in_s is None else f": back in the queue in {_s(e.retry_due_in_s)}"
        return f"waiting out a retry backoff{due}; {where}"
    if e.state in ("dispatched", "running"):
        lease = "" if e.lease_left_s is None else f", lease {_s(e.lease_left_s)} left"
        if e.state == "dispatched":
            return f"dispatched to its pool, not started yet (attempt {e.attempt}{lease}); {where}"
        since = "" if e.started_at is None else f" for {_s(e.server_now - e.started_at)}"
        return f"running on {e.worker}{since} (attempt {e.attempt}{lease}); {where}"
    if e.state == "done":
        return f"done: {_outcome(e)}; {where}"
    return f"{e.state}; {where}"


def _outcome(e: Explanation) -> str:
    r = e.result or {}
    if r.get("error_code"):
        msg = r.get("error_message") or ""
        return f"{r['error_code']}" + (f" ({msg})" if msg and msg != "cancelled" else "")
    if r.get("status_code") is not None:
        return f"HTTP {r['status_code']}"
    return "?"


def _position_lines(p: Position) -> list[str]:
    out = []
    if p.ahead is None:
        out.append("not in its queue's pending set (being moved: ask again)")
    else:
        parts = [f"{n} at priority {prio}" for prio, n in sorted(p.higher.items(), reverse=True)]
        parts.append(f"{p.same_priority_ahead} at its own")
        order = "priority, deadline, submission" if not p.indexed else "the pending order"
        out.append(f"{p.ahead} before it in the queue ({order}): " + ", ".join(parts))
    if p.indexed:
        who = f"tenant {p.tenant!r}" if p.tenant else "no tenant"
        mine = ""
        if p.tenant_ahead is not None and p.tenant_waiting is not None:
            mine = f": {p.tenant_ahead} of its {p.tenant_waiting} waiting before it"
        out.append(f"{who}{' (fair share)' if p.fair_share else ''}{mine}")
        if p.held_back_by:
            out.append(f"held back: its tenant is at quota key {p.held_back_by}")
        elif p.tenants_ahead is not None:
            n = _plural(p.tenants_ahead, "tenant")
            out.append(f"{n} ahead of its tenant among {p.tenants_ready} ready")
    return out


def _quota_line(q: QuotaUse) -> str:
    leases = "" if q.leases is None else f", {q.leases} leased"
    text = f"{q.key} {q.in_use}/{q.limit} in use ({q.dispatched} dispatched{leases})"
    if q.holders:
        names = [
            f"{h.request_id}#{h.attempt}" + (f" on {h.worker}" if h.worker else "")
            for h in q.holders
        ]
        text += "; holders: " + ", ".join(names)
    elif q.requests:
        text += "; requests: " + ", ".join(q.requests)
    if q.tenants_held_back:
        text += f"; {_plural(q.tenants_held_back, 'tenant')} held back"
    return text


def _dispatched(f: dict[str, Any]) -> str:
    ahead = f" past quota key {f['ahead']} (look-ahead: parks for it)" if "ahead" in f else ""
    return f"#{f.get('n', '?')}{ahead}"


def _admitted(f: dict[str, Any]) -> str:
    text = f"by its gate on {f.get('worker', '?')}"
    if "waited" in f:
        text += f" after {_s(float(f['waited']))} parked"
    if f.get("handed_over"):
        text += " (a finishing holder's slot)"
    return text


def _parked(f: dict[str, Any]) -> str:
    text = f"at {f.get('gate', '?')} ({f.get('reason') or 'full'})"
    if f.get("key"):
        text += f", key {f['key']}"
    if f.get("behind"):
        text += f", behind {f['behind']} parked on its worker"
    return text + (": waits for capacity" if f.get("verdict") == "wait" else "")


def _back(f: dict[str, Any]) -> str:
    """``refused`` / ``requeued``."""
    parts = [
        f"by {f['gate']}" if f.get("gate") else "",
        f"({f['reason']})" if f.get("reason") else "",
    ]
    text = " ".join(p for p in parts if p)
    if f.get("key"):
        text += f", key {f['key']}"
    if "delay" in f:
        text += f"; back in the queue after {_s(float(f['delay']))}"
    return text.strip(" ;,") or "back to the queue"


def _retry(f: dict[str, Any]) -> str:
    text = f"HTTP {f['status']}" if "status" in f else "transport error"
    if "error" in f:  # no answer, or one that is not JSON: HTTP 200 (not JSON)
        text = str(f["error"])
    if f.get("dropped"):
        text += f" (dropped: {f['dropped']})"
    if "attempt" in f:
        text = f"attempt {f['attempt']}: {text}"
    if "delay" in f:
        text += f"; backoff {_s(float(f['delay']))}"
    if f.get("retry_after") is not None:
        text += f" (Retry-After {float(f['retry_after']):g} s)"
    return text


def _reaped(f: dict[str, Any]) -> str:
    on = f" on {f['worker']}" if f.get("worker") else ""
    return f"lease expired while {f.get('state', '?')}{on}; back to the queue"


def _done(f: dict[str, Any]) -> str:
    outcome = str(f.get("outcome", "?"))
    if outcome == "ok" or outcome.startswith("http_"):
        return f"HTTP {f.get('status', outcome.removeprefix('http_'))}"
    return outcome


def _cancelled(f: dict[str, Any]) -> str:
    if "running" not in f:  # the attempt's own entry: it ended before it sent
        return f"{f.get('reason', 'cancelled')} while it waited for a slot; unsent"
    by = f" by {f['by']}" if f.get("by") else ""
    text = f"asked{by} while {f.get('was', '?')}"
    if f.get("was") == "running":
        text += "; its call aborted" if f["running"] == "abort" else "; a sent attempt finishes"
    return text


_EVENTS: dict[str, Any] = {
    "dispatched": _dispatched,
    "held": lambda f: f"its tenant held back at quota key {f.get('key')}",
    "admitted": _admitted,
    "parked": _parked,
    "refused": _back,
    "requeued": _back,
    "retry": _retry,
    "reaped": _reaped,
    "dropped": lambda f: f"by {f.get('gate', 'its gate')}",
    "cancelled": _cancelled,
    "joined": lambda f: (
        f"taken as line {f.get('line')} of batch {f.get('batch')} (the same content)"
    ),
    "poison": lambda f: (
        f"attempt {f.get('attempts', '?')} failed too ({f.get('last', '?')}): max_attempts reached"
    ),
    "done": _done,
}


def describe_entry(entry: LogEntry) -> str:
    """One log event in words (an unknown event: its fields as JSON)."""
    words = _EVENTS.get(entry.event)
    if words is not None:
        return str(words(entry.fields))
    return json.dumps(entry.fields, separators=(",", ":")) if entry.fields else ""


def _gate_row(g: dict[str, Any]) -> str:
    limit = "" if g.get("limit") is None else f"/{g['limit']}"
    holds = "; this attempt holds a slot" if g.get("holds_slot") else ""
    text = f"{g.get('type')} {g.get('in_flight')}{limit} in flight{holds}"
    a = g.get("adaptive")
    if isinstance(a, dict):
        text += f"; adaptive limit {a.get('limit')} ({a.get('signal')}: {a.get('reason')})"
    return text


def _deadline_row(e: Explanation, deadline: float, slack: float) -> str:
    if e.state == "done":
        return _when(deadline)
    if slack >= 0:
        return f"in {_s(slack)} ({_when(deadline)})"
    return f"passed {_s(-slack)} ago ({_when(deadline)}): it ends DEADLINE_EXCEEDED now"


def _attempts_row(e: Explanation) -> str:
    text = _plural(e.attempts, "HTTP attempt")
    if e.max_attempts is not None:
        text += f" (at most {e.max_attempts})"
    text += f", {_plural(e.dispatches, 'dispatch')}"
    if e.state != "done" and e.last_status is not None:
        text += f"; last answer HTTP {e.last_status}"
    elif e.state != "done" and e.last_error:
        text += f"; last error {e.last_error}"
    return text


def _poison_row(e: Explanation) -> str:
    """Why a request is judged poison: its attempts, all failed, and what the last one got."""
    message = str((e.result or {}).get("error_message") or "")
    last = message.partition("; last: ")[2]
    text = f"poison: all {e.attempts} attempts its queue allows (max_attempts) failed"
    return text + (f"; the last: {last}" if last else "")


def _log_rows(e: Explanation) -> list[tuple[str, str]]:
    if not e.log:
        return [("log", "(empty)")]
    width = max(len(x.event) for x in e.log)
    rows = []
    for i, x in enumerate(e.log):
        when = f"{_clock(x.t)} {_s(x.t - e.server_now):>9}"
        rows.append(("log" if i == 0 else "", f"{when}  {x.event:<{width}}  {describe_entry(x)}"))
    return rows


def _text_lines(e: Explanation) -> list[str]:
    who = f"{e.id} (tenant {e.tenant!r})" if e.tenant else e.id
    rows: list[tuple[str, str]] = [("request", who), ("state", _state_line(e))]
    if e.batch_id:
        rows.append(("batch", f"{e.batch_id} line {e.custom_id or '?'}"))
    if e.position is not None:
        rows += [("position", line) for line in _position_lines(e.position)]
    rows += [("quota", _quota_line(q)) for q in e.quotas]
    if e.gate is not None and e.state != "done":
        rows.append(("gate", _gate_row(e.gate)))
    if e.deadline is not None and e.deadline_slack_s is not None:
        rows.append(("deadline", _deadline_row(e, e.deadline, e.deadline_slack_s)))
    if e.submitted_at is not None:
        age = _s(e.server_now - e.submitted_at)
        rows.append(("submitted", f"{_when(e.submitted_at)} ({age} ago)"))
    rows.append(("attempts", _attempts_row(e)))
    if e.verdict == POISON:
        rows.append(("verdict", _poison_row(e)))
    rows += _log_rows(e)
    return [f"{label:<{LABEL}}{text}".rstrip() for label, text in rows]
