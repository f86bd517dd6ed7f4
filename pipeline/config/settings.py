"""Settings and queue configuration as plain, frozen data (every field is in
docs/configuration.md; durations in seconds). A queue names its API key's variable, never the
key: clients load the config too (checked at worker start, ``pipeline.worker.check_endpoints``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigError
from .merge import MergePolicy
from .redis_url import is_cluster

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
# before every Redis key of the pipeline (PIPELINE_KEY_PREFIX): its one spelling
DEFAULT_KEY_PREFIX = "pl:"
DEFAULT_ENDPOINT = "http://127.0.0.1:8000"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
INGEST_FORMATS = ("llm-d-async",)  # wire formats a queue may ingest besides submit()
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
TLS_FILES = ("tls_ca_file", "tls_cert_file", "tls_key_file")
_SECONDS = (
    "default_timeout_s",
    "request_timeout_s",
    "retry_base_delay_s",
    "retry_max_delay_s",
    "result_ttl_seconds",
)
_COUNTS = ("result_list_max_len", "max_response_bytes", "max_attempts")
_FLAGS = (
    "result_list",
    "fair_share",
    "tls_insecure_skip_verify",
    "follow_redirects",
    "engine_priority",
)


def _positive(value: Any, kind: Any = int | float) -> bool:  # a JSON true is no number
    return not isinstance(value, bool) and isinstance(value, kind) and value > 0


def _check_fields(cls: Any, entry: Any, where: str, kind: str) -> None:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: a {kind} entry must be a JSON object")
    unknown = sorted(set(entry) - {f.name for f in fields(cls)})
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")


@dataclass(frozen=True)
class QueueConfig:
    """One queue: where its requests go, how they are gated and retried. The field names are
    the reference's (llm-d-async) plus ours."""

    queue_name: str
    igw_base_url: str
    id: str = ""
    request_path_url: str = "/v1/completions"
    inference_objective: str | None = None
    worker_pool_id: str = "default"
    gate_type: str = "constant"
    gate_params: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    result_queue_name: str | None = None
    result_list: bool = True  # push every terminal result onto the result list too
    result_list_max_len: int = 100_000
    result_ttl_seconds: float | None = None  # None: the pipeline's result TTL
    default_timeout_s: float = 3600.0
    request_timeout_s: float = 300.0
    retry_base_delay_s: float = 2.0
    retry_max_delay_s: float = 60.0
    # HTTP attempts a request gets at most (retries included; an attempt that raised counts):
    # the one that reaches it ends the request MAX_ATTEMPTS_EXCEEDED (a poison request),
    # unless the server said it is busy (429, Retry-After, a gateway's drop: waited out)
    max_attempts: int = 10
    weight: float = 1.0  # the queue's share of its pool's dispatches
    fair_share: bool = False  # its tenants take turns at each priority
    # send the request's priority in the body as the engine's ``priority`` (vLLM's field,
    # lower first: -priority), for an engine that schedules by it
    engine_priority: bool = False
    api_key_env: str | None = None  # the variable whose value is sent as "Bearer <value>"
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None  # None: the key is inside tls_cert_file
    tls_insecure_skip_verify: bool = False
    follow_redirects: bool = False  # 307/308 only; never https -> http
    # the origins (scheme://host[:port]) a redirect may go to besides igw_base_url's own
    redirect_origins: tuple[str, ...] = ()
    max_response_bytes: int = 16 * 1024 * 1024
    ingest: str | None = None  # "llm-d-async": also serve the reference's producers

    @property
    def queue_id(self) -> str:
        return self.id or self.queue_name

    @classmethod
    def from_dict(cls, entry: Any, where: str) -> QueueConfig:
        """Validate one queue entry; ``where`` names it in error messages."""
        _check_fields(cls, entry, where, "queue")
        name = entry.get("queue_name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"{where}: queue_name must be 1-128 characters of [A-Za-z0-9_.-]")
        where = f"{where} ({name})"
        url = entry.get("igw_base_url")
        if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https"):
            raise ConfigError(f"{where}: igw_base_url must be an http(s) URL")
        for key in ("gate_params", "labels"):
            if key in entry and not isinstance(entry[key], dict):
                raise ConfigError(f"{where}: {key} must be an object")
        pool = entry.get("worker_pool_id", "default")
        if not isinstance(pool, str) or not _NAME.match(pool):
            raise ConfigError(f"{where}: worker_pool_id must be a name")
        _check_values(entry, where)
        _check_credentials(entry, where, urlsplit(url).scheme == "https")
        entry = {**entry, "redirect_origins": _redirect_origins(entry, where)}
        return cls(**entry)


def _check_values(entry: dict[str, Any], where: str) -> None:
    for key in _SECONDS:
        if not _positive(entry.get(key, 1.0)):
            raise ConfigError(f"{where}: {key} must be a positive number of seconds")
    for key in _FLAGS:
        if not isinstance(entry.get(key, False), bool):
            raise ConfigError(f"{where}: {key} must be true or false")
    for key in _COUNTS:
        if not _positive(entry.get(key, 1), int):
            raise ConfigError(f"{where}: {key} must be a positive int")
    weight = entry.get("weight", 1)
    if not _positive(weight) or weight > 1e6:
        raise ConfigError(f"{where}: weight must be a positive number (at most 1e6)")
    if entry.get("ingest") not in (None, "", *INGEST_FORMATS):
        formats = ", ".join(INGEST_FORMATS)
        raise ConfigError(f"{where}: ingest must be one of {formats}, not {entry['ingest']!r}")


def _redirect_origins(entry: dict[str, Any], where: str) -> tuple[str, ...]:
    """``redirect_origins``: a list of ``http(s)://host[:port]`` (no path, user or query),
    given only with ``follow_redirects``."""
    return redirect_origins(
        entry.get("redirect_origins", ()), where, bool(entry.get("follow_redirects", False))
    )


def redirect_origins(value: Any, where: str, follow_redirects: bool) -> tuple[str, ...]:
    """A ``redirect_origins`` setting (a queue's, a metric gate's) checked: a list of
    ``http(s)://host[:port]`` (no path, user or query), given only with ``follow_redirects``;
    ConfigError naming ``where`` otherwise."""
    if not isinstance(value, list | tuple) or not all(isinstance(o, str) for o in value):
        raise ConfigError(f"{where}: redirect_origins must be a list of http(s)://host[:port]")
    for origin in value:
        try:
            parts = urlsplit(origin)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number
        except ValueError:
            parts = urlsplit("")
        if (
            parts.scheme not in ("http", "https")
            or not parts.hostname
            or "@" in parts.netloc
            or parts.path not in ("", "/")
            or parts.query
            or parts.fragment
        ):
            raise ConfigError(
                f"{where}: redirect_origins: {origin!r} is not an origin "
                "(http(s)://host[:port], no path)"
            )
    if value and not follow_redirects:
        raise ConfigError(f"{where}: redirect_origins needs follow_redirects")
    return tuple(value)


def _check_credentials(entry: dict[str, Any], where: str, https: bool) -> None:
    env = entry.get("api_key_env")
    if env is not None and (not isinstance(env, str) or not ENV_NAME.match(env)):
        raise ConfigError(
            f"{where}: api_key_env must name an environment variable ([A-Za-z_][A-Za-z0-9_]*)"
        )
    for key in TLS_FILES:
        value = entry.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"{where}: {key} must be a file path")
    if entry.get("tls_key_file") and not entry.get("tls_cert_file"):
        raise ConfigError(f"{where}: tls_key_file needs tls_cert_file")
    skip = entry.get("tls_insecure_skip_verify", False)
    if not https and (skip or any(entry.get(k) for k in TLS_FILES)):
        raise ConfigError(f"{where}: tls_* fields need an https igw_base_url")


@dataclass(frozen=True)
class PoolConfig:
    """A worker pool (the reference's pool-config entry): a group of worker slots with its own
    Celery queue. ``workers`` caps the slots the dispatcher fills across all nodes (None: the
    slots its live nodes offer, each its ``-c``); the gate, if any, is acquired together with
    the queue's gate just before the HTTP call."""

    id: str
    workers: int | None = None
    gate_type: str | None = None
    gate_params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, entry: Any, where: str) -> PoolConfig:
        _check_fields(cls, entry, where, "pool")
        pid = entry.get("id")
        if not isinstance(pid, str) or not _NAME.match(pid):
            raise ConfigError(f"{where}: id must be 1-128 characters of [A-Za-z0-9_.-]")
        workers = entry.get("workers")
        if workers is not None and not _positive(workers, int):
            raise ConfigError(f"{where} ({pid}): workers must be a positive int")
        params = entry.get("gate_params", {})
        if not isinstance(params, dict):
            raise ConfigError(f"{where} ({pid}): gate_params must be an object")
        return cls(pid, workers, entry.get("gate_type"), params)

    def cap(self, offered: int) -> int:
        """Attempts of the pool the dispatcher keeps running at once, across all nodes, when
        its live nodes offer ``offered`` slots: all of them, or ``workers`` if fewer."""
        return offered if self.workers is None else min(offered, self.workers)


@dataclass(frozen=True)
class Settings:
    """Process-wide settings, read from ``PIPELINE_*`` variables by :func:`load_settings`."""

    redis_url: str = DEFAULT_REDIS_URL
    broker_url: str = DEFAULT_REDIS_URL
    key_prefix: str = DEFAULT_KEY_PREFIX
    queues: dict[str, QueueConfig] = field(default_factory=dict)
    pool_configs: dict[str, PoolConfig] = field(default_factory=dict)
    lease_s: float = 30.0
    dispatch_lease_s: float = 120.0
    reaper_period_s: float = 5.0
    result_ttl_s: float = 7 * 24 * 3600.0
    max_payload_bytes: int = 1024 * 1024
    # an answer body longer than this is stored once, in a key of its own (0: always inline)
    body_inline_max: int = 64 * 1024
    gate_wait_timeout_s: float = 300.0
    fairness_attribute: str = "userid"  # metadata key sent as the fairness identity
    fairness_header: str = "x-llm-d-inference-fairness-id"  # "" disables the stamp
    objective_header: str = "x-llm-d-inference-objective"  # "" disables it
    wedge_after_s: float = 300.0  # no completion this long while full and waiting: wedged
    park_s: float = 10.0  # an attempt refused by a full slot gate parks this long for a release
    lookahead: int = -1  # attempts dispatched past a slot gate's capacity; -1: automatic
    direct_publish: bool = True  # the dispatch script pushes Celery messages (Redis broker)
    broker_acks: bool = False  # keep kombu's acks on a Redis broker (else consumed no_ack)
    redis_sentinel_master: str | None = None  # the master's name when the URLs are sentinel://
    redis_min_replicas: int = 0  # submit and terminal writes wait for this many replicas (WAIT)
    redis_wait_timeout_ms: int = 1000  # ... at most this long
    allow_eviction: bool = False  # start a worker on a Redis whose maxmemory-policy may evict
    # script-call connections a process opens to each Redis server, shared by its threads
    redis_connections: int = 24
    merge_policy: MergePolicy = field(default_factory=MergePolicy)

    def lookahead_for(self, capacity: int) -> int:
        """Attempts the dispatcher sends past a slot gate's ``capacity`` (or a per-key quota's
        limit) to park at the workers: half of it, 1-8 (docs/scheduling.md, "Look-ahead and
        parking")."""
        if self.park_s <= 0:
            return 0
        if self.lookahead >= 0:
            return self.lookahead
        return min(8, max(1, -(-capacity // 2)))

    @cached_property
    def stamped_headers(self) -> frozenset[str]:
        """The header names (lower case) whose value the queue's config decides: the
        inference objective's, the fairness identity's and a tier-priority lane's. A request's
        own headers never set them (``submit`` refuses them, an attempt drops them)."""
        m = self.merge_policy
        names = [self.objective_header, self.fairness_header]
        if m.tiered:
            names += [m.priority_header, m.objective_header]
        return frozenset(n.lower() for n in names if n)

    @property
    def redis_cluster(self) -> bool:
        """Whether the pipeline's state is on a Redis Cluster (each pool in a hash slot)."""
        return is_cluster(self.redis_url)

    def pools(self) -> dict[str, list[QueueConfig]]:
        """Worker pool id → the queues it serves."""
        out: dict[str, list[QueueConfig]] = {}
        for q in self.queues.values():
            out.setdefault(q.worker_pool_id, []).append(q)
        return out
