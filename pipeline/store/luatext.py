"""The text of the Lua scripts (``pipeline/store/lua/*.lua``) as the server runs them: a
script with the definitions of ``sched.lua`` and ``lib.lua`` it uses prepended
(:func:`source`; a gate's script stands alone), and the key tails it uses
(``TAIL_<NAME>``, from :data:`~.keys.TAILS`: no script spells a key name)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from .keys import TAILS

SCRIPT_NAMES = (
    "submit",
    "dispatch",
    "start",
    "finish",
    "requeue",
    "cancel",
    "cancel_asked",
    "reap",
    "renew",
    "node_beat",
    "ingest",
    "sched_index",
    "sched_recheck",
    "note",
    "explain",
    "wait",
    "epoch",
)


@cache
def lua_source(name: str) -> str:
    """Text of ``lua/<name>.lua`` as it is in the file."""
    return (resources.files("pipeline.store") / "lua" / f"{name}.lua").read_text()


_DEFINES = re.compile(r"^local\s+(?:function\s+([A-Za-z_]\w*)|([A-Za-z_][\w\s,]*?)\s*=)")
_NAME = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class _Chunk:
    """One top-level definition of sched.lua / lib.lua: its text (with the comment above it),
    the names it defines, and the identifiers its code uses."""

    text: str
    defines: frozenset[str]
    uses: frozenset[str]


def _uses(code: str) -> frozenset[str]:
    """The identifiers in ``code``, comment-only lines left out (a trailing comment or a string
    may add a name that is not really used: that only keeps a definition in, never out)."""
    lines = (line for line in code.splitlines() if not line.lstrip().startswith("--"))
    return frozenset(_NAME.findall("\n".join(lines)))


@cache
def _tails() -> tuple[_Chunk, ...]:
    """One definition per key tail: ``local TAIL_PENDING = ':pending'``, ..."""
    names = {n: f"TAIL_{n.upper()}" for n in TAILS}
    return tuple(
        _Chunk(f"local {names[n]} = '{t}'\n", frozenset({names[n]}), frozenset())
        for n, t in TAILS.items()
    )


@cache
def _library() -> tuple[_Chunk, ...]:
    """sched.lua then lib.lua cut into their top-level definitions, in order: each starts at a
    line ``local ...`` at column 0 (the comment lines just above it go with it) and runs to the
    next one. The files' header comments are left out."""
    chunks = list(_tails())
    for text in (lua_source("sched"), lua_source("lib")):
        lines = text.splitlines()
        begins: list[tuple[int, re.Match[str]]] = []
        for i, line in enumerate(lines):
            if m := _DEFINES.match(line):
                begin = i
                while begin > 0 and lines[begin - 1].startswith("--"):
                    begin -= 1
                begins.append((begin, m))
        ends = [b for b, _ in begins[1:]] + [len(lines)]
        for (begin, m), end in zip(begins, ends, strict=True):
            body = "\n".join(lines[begin:end]).rstrip()
            defines = frozenset(x.strip() for x in (m.group(1) or m.group(2)).split(","))
            chunks.append(_Chunk(body + "\n", defines, _uses(body)))
    return tuple(chunks)


@cache
def source(name: str, library: bool = True) -> str:
    """The full text of script ``name`` as registered on the server: the key tails and (with
    ``library``) the definitions of sched.lua and lib.lua it uses, directly or through another
    one (in the files' order), then the script. Only those: the server builds every
    definition (a closure or a table each) on every call of the script, so a script carrying
    all of them costs the server more on every call (``bench/redis_replay.py``)."""
    script = lua_source(name)
    chunks = _library() if library else _tails()
    need = set(_uses(script))
    for chunk in reversed(chunks):  # a definition only uses earlier ones
        if chunk.defines & need:
            need |= chunk.uses
    kept = [c.text for c in chunks if c.defines & need]
    return "".join(kept) + "\n" + script
