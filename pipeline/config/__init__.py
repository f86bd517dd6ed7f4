"""Configuration as plain data, read by :func:`load_settings`. Imports nothing of the pipeline
but ``errors`` and ``redact``."""

from .load import bool_env, key_prefix, load_settings, parse_pools, parse_queues
from .merge import MergePolicy, parse_merge_policy
from .overrides import with_overrides
from .redis_url import (
    MASTER_VAR,
    celery_transport_options,
    celery_url,
    check_redis_url,
    is_cluster,
    is_sentinel,
    parse_cluster_url,
    parse_sentinel_url,
)
from .reload import ConfigChange, diff_config, from_snapshot, reload_queue_files, to_snapshot
from .settings import DEFAULT_KEY_PREFIX, PoolConfig, QueueConfig, Settings, redirect_origins

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "MASTER_VAR",
    "ConfigChange",
    "MergePolicy",
    "PoolConfig",
    "QueueConfig",
    "Settings",
    "bool_env",
    "celery_transport_options",
    "celery_url",
    "check_redis_url",
    "diff_config",
    "from_snapshot",
    "is_cluster",
    "is_sentinel",
    "key_prefix",
    "load_settings",
    "parse_cluster_url",
    "parse_merge_policy",
    "parse_pools",
    "parse_queues",
    "parse_sentinel_url",
    "redirect_origins",
    "reload_queue_files",
    "to_snapshot",
    "with_overrides",
]
