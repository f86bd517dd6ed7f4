"""Batch and file settings from ``PIPELINE_*`` variables (docs/configuration.md); the
pipeline's own :class:`~pipeline.config.Settings` hold the rest."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import Settings
from ..config.load import float_env
from ..errors import ConfigError

DAY = 86400.0


def _positive(env: Mapping[str, str], name: str, default: float) -> float:
    value = float_env(env, name, default)
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, not {env.get(name)!r}")
    return value


@dataclass(frozen=True)
class BatchSettings:
    """Each field is one variable of docs/configuration.md ("Batches and pipeline serve")."""

    retention_s: float = 7 * DAY
    max_lines: int = 1_000_000
    files_dir: str = ""
    max_file_bytes: int = 200 * 1024 * 1024
    file_ttl_s: float = 30 * DAY
    max_active: int = 100  # open batches per tenant (more: HTTP 429)
    queue: str = "default"
    lease_s: int = 30  # how long a killed process still holds a batch's step

    @classmethod
    def from_env(cls, settings: Settings, env: Mapping[str, str] | None = None) -> BatchSettings:
        env = os.environ if env is None else env
        data_home = env.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
        return cls(
            retention_s=_positive(env, "PIPELINE_BATCH_RETENTION_S", settings.result_ttl_s),
            max_lines=int(_positive(env, "PIPELINE_BATCH_MAX_LINES", 1_000_000)),
            files_dir=env.get("PIPELINE_FILES_DIR")
            or os.path.join(data_home, "celery-llm-pipeline", "files"),
            max_file_bytes=int(_positive(env, "PIPELINE_MAX_FILE_BYTES", 200 * 1024 * 1024)),
            file_ttl_s=_positive(env, "PIPELINE_FILE_TTL_S", 30 * DAY),
            max_active=int(_positive(env, "PIPELINE_BATCH_MAX_ACTIVE", 100)),
            queue=env.get("PIPELINE_BATCH_QUEUE") or "default",
            lease_s=max(1, int(_positive(env, "PIPELINE_BATCH_LEASE_S", 30))),
        )
