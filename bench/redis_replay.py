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
    .venv/bin/python bench/redis_replay.py replay /tmp/1node.mon --by-script       # ~5 s
    .venv/bin/python bench/redis_replay.py replay /tmp/1node.mon --pace 1          # ~17 s
    .venv/bin/python bench/redis_replay.py count /tmp/1node.mon                    # ~2 s

``replay`` runs the scripts of the checkout it is run from (matched to the recording's by
name), so the same recording replayed from two checkouts compares their scripts on identical
traffic, as long as the scripts take the same arguments. Blocking pops are replayed as
non-blocking ones.

A replay sends the commands back to back, so the server never idles, and the same commands
cost it less CPU than in the live run. ``--pace SPEED`` sends each command at its recorded time
instead (divided by SPEED: 1 is the recorded rate, 160 requests/s in the utilisation scenarios),
so the server idles between commands as it did live. Its CPU per finish then comes out near
the live run's, with no workers, simulator or client on the machine.
It still moves with the machine's speed as much as a live run does, so compare trees in
alternating runs.

A scenario with retries does not replay faithfully (a retry's due time is
the server's clock, which a replay runs ahead of): ``replay`` says so when fewer requests
finish than in the recording. ``--callgrind`` needs valgrind (``apt-get install valgrind``);
``REDIS_SERVER=/path/to/redis-server`` runs another build (one with symbols, for
``callgrind_annotate`` of a profile kept with ``--keep``). ``--by-script`` shares the server's
time out by script (from the slow log); without ``--callgrind`` the replay also prints the
server's user and system CPU per finish. ``count`` lists the commands each script ran inside
it, per finished request, from the recording alone: each ``redis.call`` costs the server about
as much as a small command from a client (see ``count``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from pipeline.cli.services import wait_until

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from bench.common import above_zero, free_port, log, stop_proc
from bench.utilisation import SCENARIOS
from pipeline.store.scripts import SCRIPT_NAMES, source

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
    binary = os.environ.get("REDIS_SERVER") or shutil.which("redis-server")
    if binary is None:
        sys.exit("redis_replay: no redis-server on PATH")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no", "--dir", str(workdir), "--maxclients", "10000"]  # fmt: skip
    if callgrind is not None:
        args = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={callgrind}", *args]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: _pings(port), 60, f"redis-server on {port}", interval=0.1)
    return proc


def _pings(port: int) -> bool:
    with contextlib.suppress(redis.RedisError):
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    return False


# -- replay ----------------------------------------------------------------------------------
def own_scripts(commands: list[list[bytes]]) -> dict[str, str]:
    """Swap each recorded script for this checkout's script of the same name (in SCRIPT LOAD
    and in EVALSHA). Returns sha1 → script name."""
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
                body = (
                    source(name) if name in SCRIPT_NAMES else source(name, library=False)
                ).encode()
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


@dataclasses.dataclass
class Outcome:
    """What one replay did: script calls by name, errors by type, Celery results written,
    seconds taken, the server's CPU and (by_script) its time by script or command."""

    calls: collections.Counter[str]
    errors: collections.Counter[str]
    done: int
    elapsed: float
    cpu: CpuTimes
    spent: collections.Counter[str] | None


def replay(
    path: Path,
    use_callgrind: bool,
    by_script: bool = False,
    keep_profile: Path | None = None,
    pace: float | None = None,
) -> None:
    header, commands, stamps = read_recording(path)
    names = own_scripts(commands)
    if use_callgrind and shutil.which("valgrind") is None:
        sys.exit("redis_replay: --callgrind needs valgrind (apt-get install valgrind)")
    workdir = Path(tempfile.mkdtemp(prefix="plreplay-"))
    out = workdir / "callgrind.out" if use_callgrind else None
    port = free_port()
    server = _server(port, workdir, out)
    try:
        due = paced(stamps, pace) if pace else None
        got = _run(redis.Redis(port=port), commands, names, by_script, due)
    finally:
        stop_proc(server, 300)  # SIGTERM: the server exits and callgrind writes its counts
    finishes = got.calls["finish"] or 1
    how = f"at {pace:g}x the recorded pace" if pace else "back to back"
    print(f"replayed {path} ({header.get('scenario', '?')}): {len(commands)} commands "
          f"in {got.elapsed:.1f} s ({how}); script calls per finish: "
          + ", ".join(f"{k} {v / finishes:.2f}" for k, v in got.calls.most_common()))  # fmt: skip
    print(f"errors: {dict(got.errors) or 'none'}; Celery results written: {got.done}")
    if got.done < got.calls["finish"] * 0.99:
        print("WARNING: fewer requests finished than in the recording (a retry or a due time "
              "by the server's clock): this replay did not follow the recording")  # fmt: skip
    if got.spent:
        total = sum(got.spent.values())
        print("server time by script or command (slow log, µs per finish, share):")
        for name, us in got.spent.most_common(12):
            print(f"  {name:<22} {us / finishes:8.1f}  {100 * us / total:5.1f} %")
    if out is None:
        cpu = got.cpu
        print(f"Redis CPU per finish: {1000 * (cpu.user + cpu.sys) / finishes:.3f} ms "
              f"(user {1000 * cpu.user / finishes:.3f}, system {1000 * cpu.sys / finishes:.3f}; "
              "this machine, now)")  # fmt: skip
    else:
        totals = _callgrind_total(out)
        print(f"instructions per finish: {totals / finishes:,.0f} (callgrind, whole server)")
        if keep_profile is not None:
            shutil.copy(out, keep_profile)
    shutil.rmtree(workdir, ignore_errors=True)


def read_recording(
    path: Path,
) -> tuple[dict[str, str], list[list[bytes]], list[float]]:
    """A recording's header (scenario, n), its top-level commands and when each was run (the
    server's clock, Unix s, as MONITOR stamped it)."""
    lines = path.read_text(encoding="latin-1").splitlines()
    header: dict[str, str] = {}
    if lines and lines[0].startswith("#"):
        for kv in lines[0].lstrip("# ").split():
            key, _, value = kv.partition("=")
            header[key] = value
    commands: list[list[bytes]] = []
    stamps: list[float] = []
    for line in lines[1:]:
        if (args := parse(line)) is not None:
            commands.append(args)
            stamps.append(float(line.split(" ", 1)[0]))
    return header, commands, stamps


def paced(stamps: list[float], speed: float) -> list[float]:
    """When to send each command, in seconds from the first: its recorded time since the
    first's, divided by ``speed`` (above 0)."""
    first = stamps[0] if stamps else 0.0
    return [(t - first) / speed for t in stamps]


def _run(
    client: redis.Redis,
    commands: list[list[bytes]],
    names: dict[str, str],
    by_script: bool,
    due: list[float] | None = None,
) -> Outcome:
    """Send ``commands`` on one connection, each at its ``due`` time (s from the start) when
    given, else back to back."""
    calls: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    if by_script:  # every command into the slow log, with its run time
        client.config_set("slowlog-log-slower-than", 0)
        client.config_set("slowlog-max-len", 2 * len(commands))
    try:
        cpu0 = _cpu(client)
        t0 = time.monotonic()
        for i, args in enumerate(commands):
            op = args[0].upper()
            if op in SKIP:
                continue
            if due is not None and (wait := t0 + due[i] - time.monotonic()) > 0:
                time.sleep(wait)
            if op in NONBLOCKING:
                args = [NONBLOCKING[op], args[1]]
            if (script := called_script(args, names)) is not None:
                calls[script] += 1
            try:
                client.execute_command(*args)
            except redis.ResponseError as e:  # NOSCRIPT as in the recording, or a divergence
                errors[type(e).__name__] += 1
        elapsed = time.monotonic() - t0
        cpu = _cpu(client) - cpu0
        done = sum(1 for _ in client.scan_iter("celery-task-meta-*", count=10_000))
        spent = _time_by_script(client, names) if by_script else None
    finally:
        client.close()
    return Outcome(calls, errors, done, elapsed, cpu, spent)


def called_script(args: list[bytes], names: dict[str, str]) -> str | None:
    """The script an EVALSHA runs (``names``: sha1 → script name), "other" when unknown; None
    for any other command."""
    if args[0].upper() != b"EVALSHA" or len(args) < 2:
        return None
    return names.get(args[1].decode(), "other")


# -- count -----------------------------------------------------------------------------------
KEY_ID = re.compile(r"u\d+-[\w-]+|[0-9a-f]{8,}[\w.@-]*")


def count(path: Path, top: int) -> None:
    """The commands each script ran inside it, per finished request, from a recording's
    MONITOR lines (a script's commands follow its call): where a script's time goes, since
    each ``redis.call`` costs the server about as much as a small command from a client."""
    names: dict[str, str] = {}
    script = "none"
    calls: collections.Counter[str] = collections.Counter()
    inside: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in path.read_text(encoding="latin-1").splitlines()[1:]:
        head, sep, rest = line.partition('] "')
        if not sep:
            continue
        if head.endswith(" lua"):
            parts = rest.split('"')
            key = parts[2] if len(parts) > 2 else ""
            key = KEY_ID.sub("<id>", key.split(":", 1)[-1])
            inside[(script, f"{parts[0]} {key[:48]}")] += 1
            continue
        args = parse(line)
        if args is None:
            continue
        op = args[0].upper()
        if op == b"SCRIPT" and len(args) > 2 and (m := SCRIPT_NAME.search(args[2])):
            names[hashlib.sha1(args[2]).hexdigest()] = m.group(1).decode()
        script = called_script(args, names) or "none"
        calls[script] += script != "none"
    finishes = calls["finish"] or 1
    per_script: collections.Counter[str] = collections.Counter()
    for (name, _), n in inside.items():
        per_script[name] += n
    print(f"{path}: {sum(inside.values()) / finishes:.1f} commands inside scripts per finish")
    for name, n in per_script.most_common():
        print(f"  {name:<22} {n / finishes:6.2f}  ({calls[name] / finishes:.2f} calls)")
    print(f"the {top} most frequent, per finish:")
    for (name, cmd), n in inside.most_common(top):
        print(f"  {n / finishes:6.2f}  {name:<22} {cmd}")


def _time_by_script(client: redis.Redis, names: dict[str, str]) -> collections.Counter[str]:
    """Microseconds each script (by name) or plain command from a client ran, from the slow
    log (a script's time includes the commands it ran, which the log also lists)."""
    spent: collections.Counter[str] = collections.Counter()
    for entry in client.slowlog_get(-1):
        if entry.get("client_address") == b"?:0":  # run by a script: in the script's time
            continue
        args = entry["command"].split() or [b"?"]
        spent[called_script(args, names) or args[0].upper().decode()] += int(entry["duration"])
    spent.pop("SLOWLOG", None)
    spent.pop("SCAN", None)
    return spent


def _cpu(client: redis.Redis) -> CpuTimes:
    info: dict[str, Any] = client.info("cpu")
    return CpuTimes(float(info["used_cpu_user"]), float(info["used_cpu_sys"]))


class CpuTimes(NamedTuple):
    """The server's user and system CPU seconds."""

    user: float
    sys: float

    def __sub__(self, other: object) -> CpuTimes:
        assert isinstance(other, CpuTimes)
        return CpuTimes(self.user - other.user, self.sys - other.sys)


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
    q.add_argument("--by-script", action="store_true", help="server time by script (slow log)")
    q.add_argument("--keep", type=Path, help="copy the callgrind profile here")
    q.add_argument(
        "--pace",
        type=above_zero(float),
        metavar="SPEED",
        help="send each command at its recorded time divided by SPEED (1: as recorded)",
    )
    c = sub.add_parser("count", help="commands run inside each script, from a recording")
    c.add_argument("recording", type=Path)
    c.add_argument("--top", type=int, default=30)
    a = p.parse_args()
    if a.cmd == "record":
        record(a.only, a.n, a.out)
    elif a.cmd == "count":
        count(a.recording, a.top)
    else:
        replay(a.recording, a.callgrind, a.by_script, a.keep, a.pace)


if __name__ == "__main__":
    main()
