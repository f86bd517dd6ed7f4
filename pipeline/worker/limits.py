"""What a node of many slots needs of its process's limits: an open file per slot (each running
attempt keeps its own HTTP connection to the model server) besides Redis, Celery and the files a
process has open (docs/configuration.md, "Slots, workers and connections")."""

from __future__ import annotations

import resource

FD_MARGIN = 256  # descriptors beyond one per slot: Redis, Celery's broker, logs, the health port


def open_files_needed(slots: int) -> int:
    return slots + FD_MARGIN


def ensure_open_files(slots: int) -> str | None:
    """Raise the soft ``RLIMIT_NOFILE`` to what a node of ``slots`` needs, up to the hard
    limit; a warning naming both figures when the hard limit is lower, else None."""
    need = open_files_needed(slots)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            return f"could not raise the open files limit from {soft} to {target}: {exc}"
    if target < need:
        return (
            f"the open files limit (ulimit -n) is {target}, below the {need} a node with "
            f"{slots} slots (-c) needs: one connection to the model server per running attempt; "
            f"raise the hard limit (LimitNOFILE=, ulimit -Hn, docker --ulimit nofile=) or lower -c"
        )
    return None
