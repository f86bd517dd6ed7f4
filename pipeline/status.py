"""The status view: per queue counts, recent completions, gate in-flight and holders."""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table

from .client import Pipeline


def status_snapshot(p: Pipeline) -> dict[str, Any]:
    """``pipeline.inspect()`` plus, per queue, completions in the last minute and the
    oldest waiting request's age and deadline slack (s)."""
    info = p.inspect()
    k = p.settings.keys
    now = time.time()
    client = p.store.client
    with client.pipeline(transaction=False) as pipe:
        for name in info:
            pipe.zcount(k.recent(name), now - 60, "+inf")
            pipe.zrange(k.expiry(name), 0, 0, withscores=True)
        res = pipe.execute()
    for i, (_name, q) in enumerate(info.items()):
        q["done_last_minute"] = res[2 * i]
        soonest = res[2 * i + 1]
        q["min_deadline_slack_s"] = round(soonest[0][1] - now, 3) if soonest else None
    return info


def render_status(info: dict[str, Any]) -> Table:
    t = Table(title="pipeline status")
    for col in (
        "queue",
        "pool",
        "pending",
        "retry_wait",
        "running",
        "done/min",
        "gate",
        "in flight / limit",
        "holders",
    ):
        t.add_column(col)
    for name, q in info.items():
        g = q["gate"]
        limit = "-" if g.get("limit") is None else str(g["limit"])
        holders = ", ".join(
            f"{h.get('request_id')}#{h.get('attempt')}" for h in g.get("holders", [])[:3]
        )
        t.add_row(
            name,
            q["pool"],
            str(q["pending"]),
            str(q["retry_wait"]),
            str(q["running"]),
            str(q.get("done_last_minute", "")),
            g["type"],
            f"{g['in_flight']} / {limit}",
            holders,
        )
    return t
