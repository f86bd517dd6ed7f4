"""Batch and file settings, read from ``PIPELINE_*`` variables (the pipeline's own
:class:`~pipeline.config.Settings` hold the rest: Redis, queues, result TTL)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..config import Settings
from ..errors import ConfigError

DAY = 86400.0


def _number(env: Mapping[str, str], name: str, default: float, *, positive: bool = True) -> float:
    raw = env.get(name, "").strip()
    if raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number, not {raw!r}") from None
    if positive and not value > 0:
        raise ConfigError(f"{name} must be > 0, not {raw!r}")
    return value


def default_files_dir(env: Mapping[str, str]) -> str:
    base = env.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "celery-llm-pipeline", "files")


@dataclass(frozen=True)
class BatchSettings:
    """``retention_s``: how long a closed batch (and its invalid-line list) is kept;
    ``max_lines``: most input lines in one batch; ``files_dir``: where files live;
    ``max_file_bytes``: largest upload; ``file_ttl_s``: how long a file is kept;
    ``max_active``: batches one tenant may have open at once (more: HTTP 429); ``queue``: the
    queue of the batches created through ``pipeline serve``; ``lease_s``: how long a process
    that stopped (killed) still holds a batch's validation, enqueue, cancel or finalization
    before another takes it over."""

    retention_s: float = 7 * DAY
    max_lines: int = 1_000_000
    files_dir: str = ""
    max_file_bytes: int = 200 * 1024 * 1024
    file_ttl_s: float = 30 * DAY
    max_active: int = 100
    queue: str = "default"
    lease_s: int = 30

    @classmethod
    def from_env(cls, settings: Settings, env: Mapping[str, str] | None = None) -> BatchSettings:
        env = os.environ if env is None else env
        return cls(
            retention_s=_number(env, "PIPELINE_BATCH_RETENTION_S", settings.result_ttl_s),
            max_lines=int(_number(env, "PIPELINE_BATCH_MAX_LINES", 1_000_000)),
            files_dir=env.get("PIPELINE_FILES_DIR") or default_files_dir(env),
            max_file_bytes=int(_number(env, "PIPELINE_MAX_FILE_BYTES", 200 * 1024 * 1024)),
            file_ttl_s=_number(env, "PIPELINE_FILE_TTL_S", 30 * DAY),
            max_active=int(_number(env, "PIPELINE_BATCH_MAX_ACTIVE", 100)),
            queue=env.get("PIPELINE_BATCH_QUEUE") or "default",
            lease_s=max(1, int(_number(env, "PIPELINE_BATCH_LEASE_S", 30))),
        )

    @property
    def files_path(self) -> Path:
        return Path(self.files_dir)
