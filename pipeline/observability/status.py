"""``pipeline status``: per queue counts, recent completions, the oldest waiting request's age
and the tightest deadline slack, gate in-flight / limit and holders; and the Redis server's
memory, eviction policy and persistence (docs/observability.md, "Status")."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import redis
from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.table import Table
from rich.text import Text

from ..client import Pipeline
from ..gates.adaptive import find_view
from ..store import ServerFacts, ShardLoad, primaries, server_facts, shard_load
from ..store.scripts import node_client, register
from ..store.server import SAFE_POLICY

OLDEST_SCAN = 100_000  # pending members examined (in queue order) for the oldest one


def status_snapshot(p: Pipeline) -> dict[str, Any]:
    """``pipeline.inspect()`` plus, per queue, ``done_last_minute``, ``oldest_pending_age_s``
    (submission to now of the oldest pending request) and ``min_deadline_slack_s`` (s left to
    the earliest deadline of a waiting request)."""
    info = p.inspect()
    keys = {name: p.store.for_pool(q["pool"]).keys for name, q in info.items()}
    client = p.store.client
    sec, usec = client.time()  # ages and slack by the server's clock, which set the times
    now = sec + usec / 1e6
    oldest = register(client, "pending_oldest")  # lua/pending_oldest.lua
    members = [oldest(keys=[keys[name].pending(name)], args=[OLDEST_SCAN]) for name in info]
    ids = [m.partition("|")[2] if m else None for m in members]
    with client.pipeline(transaction=False) as pipe:
        for name, rid in zip(info, ids, strict=True):
            k = keys[name]
            pipe.zcount(k.recent(name), now - 60, "+inf")
            pipe.zrange(k.expiry(name), 0, 0, withscores=True)
            pipe.hget(k.request(rid or ""), "submitted_at")
        res = pipe.execute()
    for i, q in enumerate(info.values()):
        q["done_last_minute"], soonest, at = res[3 * i : 3 * i + 3]
        q["oldest_pending_age_s"] = round(max(0.0, now - float(at)), 3) if ids[i] and at else None
        q["min_deadline_slack_s"] = round(soonest[0][1] - now, 3) if soonest else None
    slots = pool_slots(p, sorted({q["pool"] for q in info.values()}), now)
    for q in info.values():
        q["slots"] = slots[q["pool"]]
    return info


def pool_slots(p: Pipeline, pools: list[str], now: float) -> dict[str, dict[str, Any]]:
    """Per pool: its live ``nodes``, the slots they ``offered`` (each its ``-c``), the pool's
    ``workers`` (None: not set), the attempts the dispatcher keeps running at most (``cap``)
    and whether ``workers`` holds that below what is offered (``capped``)."""
    out: dict[str, dict[str, Any]] = {}
    for pool in pools:
        keys = p.store.for_pool(pool).keys
        client = p.store.for_pool(pool).client
        with client.pipeline(transaction=False) as pipe:
            pipe.zrangebyscore(keys.pool_nodes(pool), now, "+inf")
            pipe.hgetall(keys.pool_slots(pool))
            live, offered_by = pipe.execute()
        offered = sum(int(offered_by.get(n, 0) or 0) for n in live)
        cfg = p.settings.pool_configs.get(pool)
        cap = cfg.cap(offered) if cfg else offered
        out[pool] = {
            "nodes": len(live),
            "offered": offered,
            "workers": cfg.workers if cfg else None,
            "cap": cap,
            "capped": cap < offered,
        }
    return out


def pools_table(info: dict[str, Any]) -> Table:
    """Per pool: live nodes, the slots they offer, ``workers`` and the attempts running at
    most; a pool whose ``workers`` is below the slots offered is flagged."""
    t = Table(title="pools", box=box.SIMPLE_HEAD, padding=(0, 1))
    t.add_column("pool", overflow="fold", ratio=1, min_width=8)
    for col in ("nodes", "slots offered", "workers", "running at most"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("note", overflow="fold", ratio=1)
    seen: dict[str, dict[str, Any]] = {}
    for q in info.values():
        if "slots" in q:
            seen.setdefault(q["pool"], q["slots"])
    for pool, s in sorted(seen.items()):
        workers = "-" if s["workers"] is None else str(s["workers"])
        note = Text("")
        if s["capped"]:
            note = Text(
                f"capped by workers: {s['offered'] - s['cap']} slots offered stay idle "
                "(raise workers in PIPELINE_POOLS)",
                style="bold yellow",
            )
        t.add_row(pool, str(s["nodes"]), str(s["offered"]), workers, str(s["cap"]), note)
    return t


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


WIDE_MIN = 150  # columns from which one table holds everything; below: two narrower tables
MAX_HOLDERS = 3  # holders listed per gate (then "+N")


def _holders(gate: dict[str, Any], sep: str) -> str:
    holders = gate.get("holders", [])
    shown = [f"{h.get('request_id')}#{h.get('attempt')}" for h in holders[:MAX_HOLDERS]]
    if len(holders) > MAX_HOLDERS:
        shown.append(f"+{len(holders) - MAX_HOLDERS}")
    return sep.join(shown)


def _in_flight(gate: dict[str, Any]) -> str:
    limit = "-" if gate.get("limit") is None else str(gate["limit"])
    return f"{gate['in_flight']} / {limit}"


def _gate(gate: dict[str, Any]) -> Text:
    """The gate's type; an adaptive gate's the signal its limit follows and why it last moved."""
    text = Text(str(gate["type"]), overflow="fold")
    view = find_view(gate)
    if view is not None:
        text.append(f"\n{view.get('signal')}: {view.get('reason')}", style="dim")
    return text


def _name(name: str, q: dict[str, Any]) -> Text:
    text = Text(name, overflow="fold")
    if q.get("wedged_since"):
        text.append(" (wedged)", style="bold red")
    return text


def _counts(q: dict[str, Any]) -> list[str]:
    return [
        str(q["pending"]),
        str(q["retry_wait"]),
        str(q["running"]),
        str(q.get("done_last_minute", "")),
        _seconds(q.get("oldest_pending_age_s")),
        _seconds(q.get("min_deadline_slack_s")),
    ]


def wide_table(info: dict[str, Any]) -> Table:
    t = Table(title="pipeline status")
    t.add_column("queue", overflow="fold")
    t.add_column("pool", overflow="fold")
    for col in ("pending", "retry_wait", "running", "done/min", "oldest", "slack"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("gate", overflow="fold")
    t.add_column("in flight / limit", justify="right", no_wrap=True)
    t.add_column("holders", overflow="fold")
    for name, q in info.items():
        g = q["gate"]
        t.add_row(
            _name(name, q), q["pool"], *_counts(q), _gate(g), _in_flight(g), _holders(g, ", ")
        )
    return t


def queues_table(info: dict[str, Any]) -> Table:
    t = Table(title="pipeline status: queues", box=box.SIMPLE_HEAD, padding=(0, 1))
    t.add_column("queue", overflow="fold", ratio=1, min_width=8)
    for col in ("pending", "retry", "running", "done/min", "oldest", "slack"):
        t.add_column(col, justify="right", no_wrap=True)
    for name, q in info.items():
        t.add_row(_name(name, q), *_counts(q))
    return t


def gates_table(info: dict[str, Any]) -> Table:
    t = Table(title="gates", box=box.SIMPLE_HEAD, padding=(0, 1))
    t.add_column("queue / pool", overflow="fold", ratio=1, min_width=8)
    t.add_column("gate", overflow="fold", ratio=1, min_width=12)
    t.add_column("in flight", justify="right", no_wrap=True)
    t.add_column("holders", overflow="fold", ratio=1, min_width=12)
    for name, q in info.items():
        g = q["gate"]
        cell = _name(name, q)
        cell.append(f"\n{q['pool']}", style="dim")
        t.add_row(cell, _gate(g), _in_flight(g), _holders(g, "\n"))
    return t


class StatusView:
    """``pipeline status`` as a rich renderable that fits the terminal: one table from
    :data:`WIDE_MIN` columns on, else the counts and the gates as two tables that fit 80
    columns (queue names and holders wrap; no header is cut)."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if options.max_width >= WIDE_MIN:
            yield wide_table(self.info)
        else:
            yield queues_table(self.info)
            yield gates_table(self.info)
        yield pools_table(self.info)


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover - the loop always returns


def _rdb(facts: ServerFacts) -> str:
    if facts.rdb_save is None:
        save = "save ? (CONFIG GET refused)"
    elif facts.rdb_save.strip() == "":
        save = 'snapshots off (save "")'
    else:
        save = f"save {facts.rdb_save}"
    if facts.rdb_last_save is None or facts.server_time is None:
        return save
    ago = max(0.0, facts.server_time - facts.rdb_last_save)  # both by the server's clock
    changes = facts.rdb_changes_since_save
    pending = "" if changes is None else f", {changes} changes since"
    return f"{save}; last save {ago:.0f} s ago{pending}"


def render_redis(
    facts: ServerFacts,
    title: str = "redis",
    pools: list[str] | None = None,
    load: ShardLoad | None = None,
) -> Table:
    """Memory, ``maxmemory``, its policy (flagged unless ``noeviction``) and persistence; on a
    Redis Cluster one per primary, with the pools whose slot it holds."""
    t = Table(title=title, show_header=False)
    t.add_column("fact")
    t.add_column("value")
    if pools is not None:
        t.add_row("pools", ", ".join(pools) or "-")
    policy = facts.maxmemory_policy or "?"
    if facts.maxmemory_policy not in (None, SAFE_POLICY):
        policy += " (may evict the pipeline's keys: set noeviction)"
    limit = "no limit" if facts.maxmemory == 0 else _bytes(facts.maxmemory)
    aof = "?" if facts.aof_enabled is None else ("on" if facts.aof_enabled else "off")
    t.add_row("memory used", _bytes(facts.used_memory))
    t.add_row("maxmemory", limit)
    t.add_row("maxmemory-policy", policy)
    t.add_row("AOF", aof)
    t.add_row("RDB", _rdb(facts))
    if load is not None:
        t.add_row("ops/s", "?" if load.ops_per_sec is None else str(load.ops_per_sec))
        script = "?" if load.script_seconds is None else f"{load.script_seconds:.1f} s"
        t.add_row("script time", f"{script} since the server started")
    if facts.problem:
        t.add_row("not read", facts.problem)
    return t


def store_state(p: Pipeline) -> dict[str, Any]:
    """The store epoch (docs/production.md, "A wiped Redis"): ``id`` and ``since``, and once a
    loss of the Redis state was noticed ``lost_at``, ``lost_by`` and ``previous`` (times:
    Unix s, the server's clock; ``now`` to compare them with). Read only: ``pipeline status``
    writes nothing."""
    client = p.store.client
    with node_client(client, p.store.keys.epoch()).pipeline(transaction=False) as pipe:
        pipe.hgetall(p.store.keys.epoch())
        pipe.time()
        epoch, (sec, usec) = pipe.execute()
    out: dict[str, Any] = {"now": sec + usec / 1e6, **epoch}
    for name in ("since", "lost_at"):
        if name in out:
            out[name] = float(out[name])
    return out


def render_state(state: dict[str, Any]) -> Text | None:
    """A line when the Redis state was lost (or the epoch is missing), else None."""
    if "lost_at" in state:
        at = datetime.fromtimestamp(state["lost_at"], UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        ago = max(0.0, state["now"] - state["lost_at"])
        return Text(
            f"Redis lost its state: noticed at {at} ({_seconds(ago)} ago) by "
            f"{state.get('lost_by') or '?'}; every request accepted before then is gone "
            "(turn on persistence: docs/production.md)",
            style="bold red",
        )
    if "id" not in state:
        return Text("no store epoch yet (no node or client has used this Redis)", style="dim")
    return None


def render(p: Pipeline) -> RenderableType:
    table = StatusView(status_snapshot(p))
    # on a Redis Cluster, each primary (shard), the pools whose slot it holds and its load
    shards = primaries(p.store.client)
    parts: list[RenderableType] = []
    for name, node in shards:
        try:
            facts, load = server_facts(node), shard_load(node)
        except redis.RedisError:
            continue
        title = "redis" if len(shards) == 1 else f"redis {name}"
        pools = on_node(p, node) if len(shards) > 1 else None
        parts.append(render_redis(facts, title, pools, load))
    lost = render_state(store_state(p))
    return Group(*([lost] if lost is not None else []), *parts, table)


def on_node(p: Pipeline, node: redis.Redis) -> list[str]:
    """The pools whose slot ``node`` (a primary of a Redis Cluster) serves."""
    client = p.store.client
    return [
        pool for pool in sorted(p.settings.pools())
        if node_client(client, p.store.for_pool(pool).keys.wake(pool)) is node
    ]  # fmt: skip
