"""The request-state scripts as one Redis Functions library (Redis 7+), loaded once.

Called with ``EVALSHA``, a script runs its whole text on every call: the definitions of
sched.lua and lib.lua it uses are built again each time (a closure or a table each, ~40,000
server instructions for ``finish``, ~44,000 for a dispatch tick; as FCALL, a request costs the
server 1.8–3.4 % fewer instructions: BENCHMARKS.md, round 8). In a library they are built
once, when it loads; each script becomes a function of it whose body is the script's own text.
``FCALL`` then runs only that body.

The library and its functions are named after a digest of their text (``pipeline_<digest>``,
``pl<digest>_<script>``): pipelines of different versions on one Redis each call their own.
A server that lost the library (a restart without persistence, ``FUNCTION FLUSH``) answers
"Function not found": the caller loads it (``FUNCTION LOAD REPLACE``) and calls again. A
server without Functions (Redis 6.2) answers "unknown command": the scripts are then called
with ``EVALSHA``, as before, for the life of the client.

The library's own variables live as long as it does: the few that one call sets for its own
use (the server's clock, the decision-log entries waiting for their record, the scheduling
hashes read) are reset at the start of every function (``RESET``), so each call starts as a
script would.
"""

from __future__ import annotations

import hashlib
from functools import cache

from .luatext import SCRIPT_NAMES, library_text, lua_source

# What a call of a script sets for itself in sched.lua / lib.lua (see each definition): reset
# before every function runs. tests/test_functions.py checks that this names every top-level
# variable of those files that a function assigns.
RESET = (
    "now_s, now_text, now_whole = nil, nil, nil\n"
    "log_pending = {}\n"
    "log_t, log_t_text = nil, ''\n"
    "sched_confs = {}\n"
)


@cache
def library() -> tuple[str, str]:
    """(library name, library code): every definition of sched.lua and lib.lua, then each
    request-state script as a function ``pl<digest>_<script>(KEYS, ARGV)``."""
    defs = library_text()
    bodies = {name: lua_source(name) for name in SCRIPT_NAMES}
    digest = hashlib.sha1(
        "\0".join([defs, RESET, *(bodies[n] for n in SCRIPT_NAMES)]).encode()
    ).hexdigest()[:12]
    name = f"pipeline_{digest}"
    parts = [f"#!lua name={name}\n", defs, "\nlocal function reset_call()\n", RESET, "end\n"]
    for script in SCRIPT_NAMES:
        parts.append(
            f"\nredis.register_function('{function_name(script, digest)}', "
            f"function(KEYS, ARGV)\nreset_call()\n{bodies[script]}\nend)\n"
        )
    return name, "".join(parts)


def function_name(script: str, digest: str | None = None) -> str:
    """The name of ``script``'s function in this checkout's library."""
    if digest is None:
        digest = library()[0].removeprefix("pipeline_")
    return f"pl{digest}_{script}"


__all__ = ["RESET", "function_name", "library"]
