"""Configuration as plain data: :class:`Settings`, queues (:class:`QueueConfig`) and worker
pools (:class:`PoolConfig`), read from ``PIPELINE_*`` variables and the queue / pool files by
:func:`load_settings`. Imports nothing of the pipeline but ``errors``."""

from .load import (
    bool_env,
    default_queues,
    load_settings,
    parse_pools,
    parse_queues,
    with_overrides,
)
from .merge import LANES, MergePolicy, parse_merge_policy, read_merge_policy
from .redis_url import (
    MASTER_VAR,
    SentinelURL,
    celery_transport_options,
    is_sentinel,
    parse_sentinel_url,
)
from .reload import (
    ConfigChange,
    diff_config,
    from_snapshot,
    reload_queue_files,
    to_snapshot,
)
from .settings import DEFAULT_ENDPOINT, DEFAULT_REDIS_URL, PoolConfig, QueueConfig, Settings

__all__ = [
    "ConfigChange",
    "diff_config",
    "from_snapshot",
    "reload_queue_files",
    "to_snapshot",
    "DEFAULT_ENDPOINT",
    "DEFAULT_REDIS_URL",
    "LANES",
    "MASTER_VAR",
    "MergePolicy",
    "PoolConfig",
    "QueueConfig",
    "SentinelURL",
    "Settings",
    "bool_env",
    "celery_transport_options",
    "default_queues",
    "is_sentinel",
    "load_settings",
    "parse_merge_policy",
    "parse_pools",
    "parse_queues",
    "parse_sentinel_url",
    "read_merge_policy",
    "with_overrides",
]
