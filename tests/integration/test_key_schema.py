"""One key schema: every key a Lua script touches is built by pipeline/store/keys.py and
reaches the script in KEYS (a whole key, or a family's root the script completes with what it
reads and a ``TAIL_`` constant generated from ``keys.TAILS``). No script spells a key name,
and the number of KEYS each script's header names is what its caller passes."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from importlib import resources
from typing import Any

import pytest

from pipeline.batch.records import BatchRecords
from pipeline.config import Settings
from pipeline.store import RequestRow, Store, connect, sched
from pipeline.store.journal import Journal
from pipeline.store.keys import (
    REF_ACTIVE_PREFIX,
    REF_CANCEL_PREFIX,
    TAILS,
    Keys,
    ref_active_key,
    ref_cancel_key,
)
from pipeline.store.luatext import source
from pipeline.store.scripts import Script

LUA = resources.files("pipeline.store") / "lua"


def lua_files() -> dict[str, str]:
    return {p.name.removesuffix(".lua"): p.read_text() for p in LUA.iterdir()}


@pytest.mark.parametrize("prefix", ["pl:", "t:{p:default}:"])
def test_a_family_root_and_its_variable_part_make_the_whole_key(prefix: str) -> None:
    k = Keys(prefix)
    q, p, qk, i, g, node, tk = "q1", "pool1", "quota:userid:alice", "r-1", "g", "n1", "t1"
    assert k.request_prefix() + i == k.request(i)
    assert k.notify_prefix() + i == k.notify(i)
    assert k.batch_prefix() + i == k.batch(i)
    assert k.batch_prefix() + i + TAILS["invalid"] == k.batch_invalid(i)
    for name in ("pending", "delayed", "expiry", "active", "stats", "recent", "sched", "ready"):
        assert k.queue_prefix() + q + TAILS[name] == getattr(k, name)(q)
    assert k.queue_prefix() + q + TAILS["blocked"] == k.blocked(q)
    assert k.queue_prefix() + q + TAILS["tenant"] + tk == k.tenant_queue(q, tk)
    assert k.gate_prefix() + qk + TAILS["sent"] == k.quota_sent(qk)
    assert k.gate_prefix() + qk + TAILS["blocked"] == k.quota_blocked(qk)
    assert k.gate_prefix() + g + TAILS["holders"] == k.gate_holders(g)
    assert k.gate_node_prefix(g) + node + TAILS["holders"] == k.gate_node_holders(g, node)
    assert k.pool_prefix() + p + TAILS["wake"] == k.wake(p)
    assert REF_ACTIVE_PREFIX + i == ref_active_key(i)
    assert REF_CANCEL_PREFIX + i == ref_cancel_key(i)


def test_key_names_are_unchanged() -> None:
    """The data layout: the names Redis holds today (only who builds them moved)."""
    k = Keys("pl:")
    assert k.request("a") == "pl:req:a"
    assert k.pending("q") == "pl:q:q:pending"
    assert k.tenant_queue("q", "t") == "pl:q:q:t:t"
    assert k.quota_sent("quota:u:x") == "pl:gate:quota:u:x:sent"
    assert k.gate_node_holders("g", "n") == "pl:gate:g@n:holders"
    assert k.wake("p") == "pl:pool:p:wake"
    assert k.batch_invalid("b") == "pl:batch:b:invalid"
    assert ref_cancel_key("a") == "request-cancel:a"


def test_lib_lua_reads_the_families_in_the_order_keys_py_passes_them() -> None:
    lib = lua_files()["lib"]
    count = re.search(r"^local KEY_FAMILIES = (\d+)$", lib, re.M)
    assert count is not None
    k = Keys("pl:")
    assert int(count.group(1)) == len(k.families)
    body = lib[lib.index("local function key_families()") :]
    body = body[: body.index("\nend\n")]
    order = [name for name, _ in sorted(
        ((m.group(1), int(m.group(2))) for m in re.finditer(r"(\w+) = KEYS\[n \+ (\d+)\]", body)),
        key=lambda x: x[1],
    )]  # fmt: skip
    expected = {
        "req": k.request_prefix(),
        "notify": k.notify_prefix(),
        "q": k.queue_prefix(),
        "gate": k.gate_prefix(),
        "pool": k.pool_prefix(),
        "batch": k.batch_prefix(),
        "ref_active": REF_ACTIVE_PREFIX,
        "ref_cancel": REF_CANCEL_PREFIX,
        "seq": k.seq(),
        "freed": k.freed_channel(),
        "batches_active": k.batches_active(),
        "batches_expiry": k.batches_expiry(),
        "batches_bell": k.batches_bell(),
    }
    assert [expected[n] for n in order] == list(k.families)


def fragments() -> set[str]:
    """Every piece of a key name keys.py writes after the prefix."""
    k = Keys("")
    out = {t for t in TAILS.values()} | {REF_ACTIVE_PREFIX, REF_CANCEL_PREFIX}
    out |= {f for f in k.families if f}
    out |= {":info", ":nodes", ":slots", ":merge", ":lease", ":results", "wedged", "file:"}
    return out | {"files:", "config:", "batches"}  # ('files' alone is a batch hash field)


def code(text: str) -> str:
    """``text`` without its comments."""
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())


@pytest.mark.parametrize("name", sorted(lua_files()))
def test_no_script_spells_a_key_name(name: str) -> None:
    text = code(lua_files()[name])
    assert not re.search(r"\bprefix\b", text), "a script takes no key prefix"
    literals = re.findall(r"'([^'\n]*)'|\"([^\"\n]*)\"", text)
    spelled = {a or b for a, b in literals} & fragments()
    spelled |= {s for a, b in literals for s in fragments() if ":" in s and s in (a or b)}
    assert not spelled, f"{name}.lua spells key names {sorted(spelled)}: pass them in KEYS"


def test_every_tail_a_script_uses_is_defined() -> None:
    for name in lua_files():
        if name in ("lib", "sched"):
            continue
        full = source(name)
        for tail in set(re.findall(r"\bTAIL_[A-Z]+\b", full)):
            assert f"local {tail} = " in full, (name, tail)


# -- the KEYS a script's header names, and what its caller passes ---------------------------
def header(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        lines.append(line)
    return "\n".join(lines)


def expected_keys(name: str, families: int) -> tuple[int, int] | None:
    """(fewest, most) KEYS the header of script ``name`` names; None when it takes a list."""
    head = header(lua_files()[name])
    if re.search(r"KEYS\[\d*[a-z]", head) or "per queue" in head:
        return None
    numbered = [int(n) for n in re.findall(r"KEYS\[(\d+)\]", head)]
    most = max(numbered, default=0)
    optional = len(re.findall(r"KEYS\[\d+\] \(optional\)", head))
    extra = families if "key families" in head else 0
    return most - optional + extra, most + extra


@pytest.fixture
def store(redis_url: str) -> Iterator[Store]:
    prefix = f"test:schema:{uuid.uuid4().hex[:8]}:"
    client = connect(redis_url)
    s = Store(Settings(redis_url=redis_url, key_prefix=prefix), client)
    yield s
    for key in client.scan_iter(f"{prefix}*", count=10_000):
        client.delete(key)
    client.close()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every script call from here on: (script name, how many KEYS it was given)."""
    seen: list[tuple[str, int]] = []
    command = Script.command

    def recording(self: Script, keys: Any, args: Any) -> tuple[Any, ...]:
        seen.append((self.name, len(keys)))
        return command(self, keys, args)

    monkeypatch.setattr(Script, "command", recording)
    return seen


def assert_keys_as_headers_say(calls: list[tuple[str, int]], store: Store) -> None:
    n = len(store.keys.families)
    for name, passed in calls:
        want = expected_keys(name, n)
        if want is not None:
            assert want[0] <= passed <= want[1], (name, passed, want)


def test_every_call_passes_the_keys_its_script_names(
    store: Store, calls: list[tuple[str, int]]
) -> None:
    row = RequestRow("r1", "q", "default", "5", "", "60", "{}", "{}", "{}", "", "", "0", "0", "{}")
    store.submit([row, row._replace(id="r2")])
    store.renew([("r1", "tok", "q")])
    store.note("r1", "tok", _journal())
    store.start("r1", "tok", "q", "w")
    store.requeue("r1", "tok", delay=0, attempted=False)
    store.finish("r1", "tok", attempted=False, status_code=200, payload="{}")
    store.cancel_asked("r2", "tok")
    store.explain("r2")
    store.cancel("r2")
    store.reap("q")
    sched.setup(store.client, store.scripts, store.keys, "q", "default", "userid", fair=True)
    sched.recheck(store.scripts, store.keys, "q")
    assert {n for n, _ in calls} >= {"submit", "renew", "note", "start", "requeue", "finish"}
    assert {n for n, _ in calls} >= {"cancel", "cancel_asked", "explain", "reap", "sched_index"}
    assert_keys_as_headers_say(calls, store)


def _journal() -> Journal:
    j = Journal()
    j.add("parked")
    return j


def test_every_batch_call_passes_the_keys_its_script_names(
    store: Store, calls: list[tuple[str, int]]
) -> None:
    b = BatchRecords(store)
    b.create("b1", 60.0, 60.0, {"queue": "q"})
    b.start("b1", total=1, invalid=0, lines=1, model=None)
    b.results("b1", 1, 1)
    b.cancel("b1")
    b.cancel_lines("b1", 1, "abort", "test")
    b.lapse("b1")
    b.finalized("b1", None, None)
    b.create("b2", 60.0, 60.0, {"queue": "q"})
    b.ingest_failed("b2", {"code": "ingest_failed", "message": "test"}, 1)
    names = {n for n, _ in calls}
    assert names >= {"batch_create", "batch_start", "batch_results", "batch_cancel"}
    assert names >= {"batch_cancel_lines", "batch_lapse", "batch_finalized", "batch_ingest_failed"}
    assert_keys_as_headers_say(calls, store)


def test_headers_name_their_keys() -> None:
    """Every script's header says what its KEYS are."""
    for name, text in lua_files().items():
        if name not in ("lib", "sched"):
            assert "KEYS" in header(text), f"{name}.lua: its header names no KEYS"
