"""Redis work per request without the machine's drift: record the Redis traffic of one
utilisation scenario, then replay it on a fresh private server and count what the server does.

Redis CPU per request moves by ±20 % between runs of the same code on this machine
(BENCHMARKS.md), more than most single changes to the scripts. A replay is deterministic: the
recorded top-level commands (scripts by name, arguments as sent) run again in order, on one
connection, and under valgrind's callgrind the server's instruction count comes out the same
to within 0.3 % every time. It counts instructions, not cache misses or system calls, so it
ranks changes to the scripts; `bench/utilisation.py` still says what a request costs.

    .venv/bin/python bench/redis_replay.py record --only 1node -o /tmp/1node.mon   # ~30 s
    .venv/bin/python bench/redis_replay.py replay /tmp/1node.mon --callgrind       # ~30 s

``replay`` runs the scripts of the checkout it is run from (matched to the recording's by
name), so the same recording replayed from two checkouts compares their scripts on identical
traffic, as long as the scripts take the same arguments. Blocking pops are replayed as
non-blocking ones. A scenario with retries does not replay faithfully (a retry's due time is
the server's clock, which a replay runs ahead of): ``replay`` says so when fewer requests
finish than in the recording. ``--callgrind`` needs valgrind (``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from bench.common import free_port, log, stop_proc, wait_for
from bench.utilisation import SCENARIOS
from pipeline.store.scripts import SCRIPT_NAMES, lua_source, source

ROOT = Path(__file__).resolve().parent.parent
UNESCAPE = {"\\": b"\\", '"': b'"', "n": b"\n", "r": b"\r", "t": b"\t", "a": b"\a", "b": b"\b"}
SKIP = {b"HELLO", b"CLIENT", b"SUBSCRIBE", b"PSUBSCRIBE", b"UNSUBSCRIBE", b"PUNSUBSCRIBE",
        b"MONITOR", b"FLUSHDB", b"FLUSHALL", b"INFO", b"CONFIG", b"SLOWLOG"}  # fmt: skip
NONBLOCKING = {b"BLPOP": b"LPOP", b"BRPOP": b"RPOP", b"BZPOPMIN": b"ZPOPMIN"}
SCRIPT_NAME = re.compile(rb"^-- ([a-z_]+)\.lua", re.M)


def parse(line: str) -> list[bytes] | None:
    """The arguments of one MONITOR line (sdscatrepr's escapes undone); None for a command run
    inside a script, which its script runs again."""
    head, sep, rest = line.partition('] "')
    if not sep or head.endswith(" lua"):
        return None
    args: list[bytes] = []
    cur = bytearray()
    i, s = 0, '"' + rest
    while i < len(s):
        c = s[i]
        if c == '"':  # an argument starts; read to its closing quote
            cur.clear()
            i += 1
            while s[i] != '"':
                if s[i] == "\\":
                    if s[i + 1] == "x":
                        cur.append(int(s[i + 2 : i + 4], 16))
                        i += 4
                    else:
                        cur += UNESCAPE[s[i + 1]]
                        i += 2
                else:
                    cur += s[i].encode("latin-1")
                    i += 1
            args.append(bytes(cur))
        i += 1
    return args or None


# -- record ----------------------------------------------------------------------------------
def record(scenario: str, n: int, out: Path) -> None:
    """Run ``scenario`` of bench/utilisation.py on a private server while MONITOR writes every
    command it runs to ``out``."""
    workdir = Path(tempfile.mkdtemp(prefix="plreplay-"))
    port = free_port()
    server = _server(port, workdir, callgrind=None)
    try:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"MONITOR\r\n")
        done = threading.Event()

        def copy() -> None:
            with sock.makefile("rb") as f, out.open("wb") as w:
                w.write(f"# scenario={scenario} n={n}\n".encode())
                for raw in f:
                    if raw.startswith(b"+") and raw != b"+OK\r\n":
                        w.write(raw[1:].rstrip(b"\r\n") + b"\n")
                    if done.is_set():
                        break

        t = threading.Thread(target=copy, daemon=True)
        t.start()
        url = f"redis://127.0.0.1:{port}/0"
        cmd = [sys.executable, str(ROOT / "bench" / "utilisation.py"), "--only", scenario]
        log(f"recording {scenario} ({n} requests) from {url} into {out}")
        subprocess.run([*cmd, "-n", str(n), "--redis-url", url], check=True)
        done.set()
        redis.Redis(port=port).ping()  # one more line, so the copier sees `done`
        t.join(10)
        sock.close()
    finally:
        stop_proc(server, 10)
        shutil.rmtree(workdir, ignore_errors=True)


# -- a private server --------------------------------------------------------------------------
def _server(port: int, workdir: Path, callgrind: Path | None) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis_replay: no redis-server on PATH")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no", "--dir", str(workdir), "--maxclients", "10000"]  # fmt: skip
    if callgrind is not None:
        args = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={callgrind}", *args]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: _pings(port), 60, 0.1, f"redis-server on {port}")
    return proc


def _pings(port: int) -> bool:
    with contextlib.suppress(redis.RedisError):
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    return False


# -- replay ----------------------------------------------------------------------------------
def own_scripts(commands: list[list[bytes]]) -> dict[str, str]:
    """Swap each recorded script for this checkout's script of the same name (in SCRIPT LOAD
    and in EVALSHA); returns sha1 → name of the scripts that run."""
    names: dict[str, str] = {}
    swap: dict[bytes, tuple[bytes, bytes]] = {}
    for args in commands:
        if args[0].upper() == b"SCRIPT" and len(args) > 2 and args[1].upper() == b"LOAD":
            m = SCRIPT_NAME.search(args[2])
            old = hashlib.sha1(args[2]).hexdigest().encode()
            if m is None or old in swap:
                continue
            name = m.group(1).decode()
            try:
                body = (source(name) if name in SCRIPT_NAMES else lua_source(name)).encode()
            except FileNotFoundError:  # not in this checkout: replayed as recorded
                body = args[2]
            sha = hashlib.sha1(body).hexdigest()
            swap[old] = (sha.encode(), body)
            names[sha] = name
    for args in commands:
        op = args[0].upper()
        if op == b"SCRIPT" and len(args) > 2 and args[1].upper() == b"LOAD":
            args[2] = swap.get(hashlib.sha1(args[2]).hexdigest().encode(), (b"", args[2]))[1]
        elif op == b"EVALSHA" and args[1] in swap:
            args[1] = swap[args[1]][0]
    return names


def replay(path: Path, use_callgrind: bool) -> None:
    lines = path.read_text(encoding="latin-1").splitlines()
    header: dict[str, str] = {}
    if lines and lines[0].startswith("#"):
        for kv in lines[0].lstrip("# ").split():
            key, _, value = kv.partition("=")
            header[key] = value
    commands = [a for a in map(parse, lines[1:]) if a is not None]
    names = own_scripts(commands)
    if use_callgrind and shutil.which("valgrind") is None:
        sys.exit("redis_replay: --callgrind needs valgrind (apt-get install valgrind)")
    workdir = Path(tempfile.mkdtemp(prefix="plreplay-"))
    out = workdir / "callgrind.out" if use_callgrind else None
    port = free_port()
    server = _server(port, workdir, out)
    client = redis.Redis(port=port)
    calls: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    try:
        cpu0 = _cpu(client)
        t0 = time.monotonic()
        for args in commands:
            op = args[0].upper()
            if op in SKIP:
                continue
            if op in NONBLOCKING:
                args = [NONBLOCKING[op], args[1]]
            if op == b"EVALSHA":
                calls[names.get(args[1].decode(), "other")] += 1
            try:
                client.execute_command(*args)
            except redis.ResponseError as e:  # NOSCRIPT as in the recording, or a divergence
                errors[type(e).__name__] += 1
        elapsed = time.monotonic() - t0
        cpu = _cpu(client) - cpu0
        done = sum(1 for _ in client.scan_iter("celery-task-meta-*", count=10_000))
    finally:
        client.close()
        stop_proc(server, 300)  # SIGTERM: the server exits and callgrind writes its counts
    finishes = calls["finish"] or 1
    print(f"replayed {path} ({header.get('scenario', '?')}): {len(commands)} commands "
          f"in {elapsed:.1f} s; script calls per finish: "
          + ", ".join(f"{k} {v / finishes:.2f}" for k, v in calls.most_common()))  # fmt: skip
    print(f"errors: {dict(errors) or 'none'}; Celery results written: {done}")
    if done < calls["finish"] * 0.99:
        print("WARNING: fewer requests finished than in the recording (a retry or a due time "
              "by the server's clock): this replay did not follow the recording")  # fmt: skip
    if out is None:
        print(f"Redis CPU per finish: {1000 * cpu / finishes:.3f} ms (this machine, now)")
    else:
        totals = _callgrind_total(out)
        print(f"instructions per finish: {totals / finishes:,.0f} (callgrind, whole server)")
    shutil.rmtree(workdir, ignore_errors=True)


def _cpu(client: redis.Redis) -> float:
    info: dict[str, Any] = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _callgrind_total(out: Path) -> int:
    for f in sorted(out.parent.glob(out.name + "*")):
        for line in f.read_text(errors="replace").splitlines():
            if line.startswith(("totals:", "summary:")):
                return int(line.split()[1])
    raise SystemExit(f"redis_replay: no totals in {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record a utilisation scenario's Redis traffic")
    r.add_argument("--only", choices=sorted(SCENARIOS), default="1node")
    r.add_argument("-n", type=int, default=2000, help="requests")
    r.add_argument("-o", "--out", type=Path, required=True)
    q = sub.add_parser("replay", help="replay a recording with this checkout's scripts")
    q.add_argument("recording", type=Path)
    q.add_argument("--callgrind", action="store_true", help="count instructions (valgrind)")
    a = p.parse_args()
    if a.cmd == "record":
        record(a.only, a.n, a.out)
    else:
        replay(a.recording, a.callgrind)


if __name__ == "__main__":
    main()
