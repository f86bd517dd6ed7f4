"""Reloading the queue and pool files into running settings, as plain data (a node applies
it in ``pipeline.worker.reload``); a snapshot is what a node accepted, for its children."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..errors import ConfigError
from .load import parse_pools, parse_queues, read_queue_files
from .settings import Settings


def reload_queue_files(current: Settings, env: Mapping[str, str] | None = None) -> Settings:
    """``current`` with the queue and pool files read again (a process's environment does not
    change); ConfigError naming the file, entry and field."""
    env = os.environ if env is None else env
    if not env.get("PIPELINE_QUEUES"):
        raise ConfigError("PIPELINE_QUEUES is not set: there is no queue file to reload")
    queues, pools = read_queue_files(env)
    return replace(current, queues=queues, pool_configs=pools)


@dataclass(frozen=True)
class ConfigChange:
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()  # queues whose entry differs (any field)
    pools: tuple[str, ...] = ()  # pools added, removed or changed

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed or self.pools)

    def describe(self) -> str:
        parts = [
            f"{label} {', '.join(names)}"
            for label, names in (
                ("added", self.added),
                ("changed", self.changed),
                ("removed", self.removed),
                ("pools changed", self.pools),
            )
            if names
        ]
        return "; ".join(parts) or "no change"

    def as_dict(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in asdict(self).items()}


def diff_config(old: Settings, new: Settings) -> ConfigChange:
    oq, nq = old.queues, new.queues
    op, np_ = old.pool_configs, new.pool_configs
    return ConfigChange(
        added=tuple(sorted(set(nq) - set(oq))),
        removed=tuple(sorted(set(oq) - set(nq))),
        changed=tuple(sorted(n for n in set(oq) & set(nq) if oq[n] != nq[n])),
        pools=tuple(sorted(p for p in set(op) | set(np_) if op.get(p) != np_.get(p))),
    )


def _entry(obj: Any) -> dict[str, Any]:
    """A config dataclass as a file entry (a ``null`` field is left out: it is the default,
    and it may not validate)."""
    return {k: v for k, v in asdict(obj).items() if v is not None}


def to_snapshot(settings: Settings) -> dict[str, Any]:
    return {
        "queues": [_entry(q) for q in settings.queues.values()],
        "pools": [_entry(p) for p in settings.pool_configs.values()],
    }


def from_snapshot(base: Settings, data: Any, source: str) -> Settings:
    """``base`` with the queues and pools of a :func:`to_snapshot` (validated again)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: not a config snapshot")
    queues = parse_queues(data.get("queues"), source)
    pools = parse_pools(data["pools"], source, queues) if data.get("pools") else {}
    return replace(base, queues=queues, pool_configs=pools)
