"""Where the Redis server's time goes, per request: one utilisation scenario (default: 1 node,
``local-max-concurrency`` 16, 100 ms; ``--scenario`` picks another from ``bench/utilisation``)
on a private ``redis-server`` that logs every command in its SLOWLOG (threshold 0 µs). Each
entry's duration is attributed to its command, and an ``EVALSHA`` to its script by name (the
sha1 of each script's text). Printed per request: calls and µs of server time by script and
command, and the server's CPU (user + sys, from ``INFO cpu``) — SLOWLOG adds its own cost,
so the CPU figure here is a little above ``bench/utilisation.py``'s.

    .venv/bin/python bench/redis_profile.py                 # ~30 s
    .venv/bin/python bench/redis_profile.py --scenario 503 -n 3000
"""

from __future__ import annotations

import hashlib
import sys
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import base_parser, bench_session, log, table
from bench.utilisation import LIMIT, SCENARIOS, scenario
from pipeline.store.scripts import SCRIPT_NAMES, source

SLOWLOG_MAX = 2_000_000


def script_names() -> dict[str, str]:
    """sha1 → name of every script the pipeline registers (with lib.lua where it has it)."""
    names = {}
    for name in SCRIPT_NAMES:
        names[hashlib.sha1(source(name).encode()).hexdigest()] = name
    for path in (resources.files("pipeline.store") / "lua").iterdir():
        stem = path.name.removesuffix(".lua")
        names.setdefault(hashlib.sha1(source(stem, library=False).encode()).hexdigest(), stem)
    return names


def _name(args: list[str], shas: dict[str, str]) -> str:
    cmd = args[0].lower() if args else "?"
    if cmd in ("evalsha", "eval") and len(args) > 1:
        return "lua:" + shas.get(args[1], args[1][:8])
    return cmd


def attribute(
    entries: list[Any], shas: dict[str, str]
) -> tuple[dict[str, list[float]], dict[str, dict[str, list[float]]]]:
    """Over SLOWLOG entries: top-level name → [calls, µs] (a script's µs include the commands
    it ran), and script name → nested command → [calls, µs]. A command a script runs is logged
    (client ``?:0``) just before the script's own entry, so the nested entries between two
    top-level ones belong to the second."""
    top: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    nested: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    pending: list[tuple[str, float]] = []
    for e in sorted(entries, key=lambda e: e["id"]):
        args = [a.decode() if isinstance(a, bytes) else str(a) for a in e["command"].split()]
        name = _name(args, shas)
        addr = e.get("client_address") or b""
        addr = addr.decode() if isinstance(addr, bytes) else str(addr)
        if addr.startswith("?"):
            pending.append((name, e["duration"]))
            continue
        top[name][0] += 1
        top[name][1] += e["duration"]
        for cmd, us in pending:
            nested[name][cmd][0] += 1
            nested[name][cmd][1] += us
        pending = []
    return top, nested


def main() -> int:
    ap = base_parser(__doc__.split("\n\n")[0] if __doc__ else "")
    ap.add_argument("-n", type=int, default=2000, help="requests")
    ap.add_argument("--scenario", choices=list(SCENARIOS), default="1node")
    args = ap.parse_args()
    spec = SCENARIOS[args.scenario]
    with bench_session(args.redis_url) as (rh, workdir):
        c = rh.client
        c.config_set("slowlog-max-len", SLOWLOG_MAX)
        c.config_set("slowlog-log-slower-than", 0)
        c.slowlog_reset()
        cpu0 = c.info("cpu")
        res = scenario(rh, workdir, n=args.n, **spec)
        cpu1 = c.info("cpu")
        c.config_set("slowlog-log-slower-than", 10_000)
        entries = c.slowlog_get(SLOWLOG_MAX)
    total = args.n + 2 * LIMIT  # the scenario's warm-up requests are served too
    cpu_ms = sum(cpu1[k] - cpu0[k] for k in ("used_cpu_sys", "used_cpu_user")) * 1000 / total
    top, nested = attribute(entries, script_names())
    rows = sorted(top.items(), key=lambda kv: -kv[1][1])
    busy = sum(us for _, (_, us) in rows)
    calls = sum(c for _, (c, _) in rows)
    inner = sum(c for cmds in nested.values() for c, _ in cmds.values())
    log(f"{len(entries):,} commands logged for {total:,} requests")
    print(f"\nRedis per request — {res['label']}, {total:,} requests, ratio {res['ratio']:.3f}")
    print(
        table(
            ["command / script (top level)", "calls per req", "µs per req", "µs per call", "share"],
            [
                [
                    name,
                    f"{c / total:.2f}",
                    f"{us / total:.1f}",
                    f"{us / max(c, 1):.1f}",
                    f"{us / busy:.0%}",
                ]
                for name, (c, us) in rows
                if c / total >= 0.005
            ],
        )
    )
    for name, (c, us) in rows:
        cmds = nested.get(name)
        if not cmds or c / total < 0.005:
            continue
        own = us - sum(u for _, u in cmds.values())
        parts = sorted(cmds.items(), key=lambda kv: -kv[1][1])
        desc = ", ".join(f"{k} {n / c:.2f}x {u / c:.1f}" for k, (n, u) in parts[:12])
        print(f"  {name} per call: {us / c:.1f} µs = Lua {own / c:.1f} + {desc}")
    print(
        f"top-level calls: {calls / total:.1f} per request (+ {inner / total:.1f} inside "
        f"scripts); in top-level commands: {busy / total:.0f} µs per request; Redis CPU "
        f"(user+sys): {cpu_ms:.3f} ms per request, of which {cpu_ms - busy / total / 1000:.3f} "
        "outside commands (network, event loop, pub/sub delivery, SLOWLOG itself)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
