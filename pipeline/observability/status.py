"""The status view: per queue counts, recent completions, the oldest waiting request's age and
the tightest deadline slack, gate in-flight / limit and holders."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from ..client import Pipeline

OLDEST_SCAN = 100_000  # pending members examined (in queue order) for the oldest one

# The oldest of the first ARGV[1] members of a pending set: members are "<seq>|<id>" with a
# zero-padded submission sequence, so the smallest string is the earliest submission.
_OLDEST_LUA = """
local best = false
for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)) do
  if not best or m < best then best = m end
end
return best
"""


def _oldest_pending(p: Pipeline, names: list[str], now: float) -> dict[str, float | None]:
    """Age (s) of each queue's oldest pending request (submission to now), None if empty."""
    client = p.store.client
    k = p.store.keys
    script = client.register_script(_OLDEST_LUA)
    members = [script(keys=[k.pending(name)], args=[OLDEST_SCAN]) for name in names]
    ids = [m.partition("|")[2] if m else None for m in members]
    with client.pipeline(transaction=False) as pipe:
        for rid in ids:
            pipe.hget(k.request(rid or ""), "submitted_at")
        submitted = pipe.execute()
    return {
        name: round(max(0.0, now - float(at)), 3) if rid and at else None
        for name, rid, at in zip(names, ids, submitted, strict=True)
    }


def status_snapshot(p: Pipeline) -> dict[str, Any]:
    """``pipeline.inspect()`` plus, per queue, ``done_last_minute``, ``oldest_pending_age_s``
    (s since the oldest pending request was submitted) and ``min_deadline_slack_s`` (s left
    to the earliest deadline of a waiting request)."""
    info = p.inspect()
    k = p.store.keys
    client = p.store.client
    sec, usec = client.time()  # ages and slack by the server's clock, which set the times
    now = sec + usec / 1e6
    with client.pipeline(transaction=False) as pipe:
        for name in info:
            pipe.zcount(k.recent(name), now - 60, "+inf")
            pipe.zrange(k.expiry(name), 0, 0, withscores=True)
        res = pipe.execute()
    oldest = _oldest_pending(p, list(info), now)
    for i, (name, q) in enumerate(info.items()):
        q["done_last_minute"] = res[2 * i]
        q["oldest_pending_age_s"] = oldest[name]
        soonest = res[2 * i + 1]
        q["min_deadline_slack_s"] = round(soonest[0][1] - now, 3) if soonest else None
    return info


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def render_status(info: dict[str, Any]) -> Table:
    t = Table(title="pipeline status")
    for col in (
        "queue",
        "pool",
        "pending",
        "retry_wait",
        "running",
        "done/min",
        "oldest",
        "slack",
        "gate",
        "in flight / limit",
        "holders",
    ):
        t.add_column(col)
    for name, q in info.items():
        g = q["gate"]
        limit = "-" if g.get("limit") is None else str(g["limit"])
        holders = g.get("holders", [])
        shown = ", ".join(f"{h.get('request_id')}#{h.get('attempt')}" for h in holders[:3])
        if len(holders) > 3:
            shown += f" +{len(holders) - 3}"
        t.add_row(
            name + (" (wedged)" if q.get("wedged_since") else ""),
            q["pool"],
            str(q["pending"]),
            str(q["retry_wait"]),
            str(q["running"]),
            str(q.get("done_last_minute", "")),
            _seconds(q.get("oldest_pending_age_s")),
            _seconds(q.get("min_deadline_slack_s")),
            g["type"],
            f"{g['in_flight']} / {limit}",
            shown,
        )
    return t
