"""Redis URLs in Celery's syntax, Sentinel lists included (docs/production.md, "Sentinel"),
as plain data: the master's database and credentials are the first entry's."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from ..errors import ConfigError

SENTINEL_SCHEME = "sentinel"
SENTINEL_PORT = 26379
MASTER_VAR = "PIPELINE_REDIS_SENTINEL_MASTER"


def is_sentinel(url: str) -> bool:
    return url.strip().lower().startswith(SENTINEL_SCHEME + "://")


@dataclass(frozen=True)
class SentinelURL:
    """The sentinels of a Sentinel list URL, and the master's database and credentials."""

    sentinels: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_sentinel_url(url: str, where: str = "PIPELINE_REDIS_URL") -> SentinelURL:
    """Parse a ``sentinel://...;sentinel://...`` list; ConfigError naming ``where`` (the
    setting) when an entry is not a sentinel URL with a host, or its port or db is bad."""
    entries = [e.strip() for e in url.split(";") if e.strip()]
    if not entries:
        raise ConfigError(f"{where}: no sentinel in {url!r}")
    sentinels: list[tuple[str, int]] = []
    for i, entry in enumerate(entries):
        try:
            parts = urlsplit(entry)
            port = parts.port or SENTINEL_PORT
        except ValueError as exc:
            raise ConfigError(f"{where}: sentinel #{i + 1}: bad URL ({exc})") from None
        if parts.scheme.lower() != SENTINEL_SCHEME or not parts.hostname:
            raise ConfigError(
                f"{where}: sentinel #{i + 1} must be sentinel://host[:port][/db] "
                "(entries joined by ';')"
            )
        sentinels.append((parts.hostname, port))
    first = urlsplit(entries[0])
    db_text = first.path.strip("/") or "0"
    if not db_text.isdigit():
        raise ConfigError(f"{where}: the database must be a number, not {db_text!r}")
    return SentinelURL(
        sentinels=tuple(sentinels),
        db=int(db_text),
        username=unquote(first.username) if first.username else None,
        password=unquote(first.password) if first.password is not None else None,
    )


def check_sentinel(url: str, where: str, master: str | None) -> None:
    """A Sentinel URL in ``where`` must parse and have the master's name set."""
    if not is_sentinel(url):
        return
    parse_sentinel_url(url, where)
    if not master:
        raise ConfigError(
            f"{where} names sentinels: set {MASTER_VAR} to the name of the master they "
            "monitor (the name in `sentinel monitor <name> ...`)"
        )


def celery_transport_options(master: str | None) -> dict[str, str]:
    """What Celery's Redis Sentinel broker transport and result backend need beyond the URL:
    ``{"master_name": ...}`` (empty without a master name)."""
    return {"master_name": master} if master else {}


CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS


def is_cluster(url: str) -> bool:
    return url.strip().lower().split("://", 1)[0] in CLUSTER_SCHEMES


@dataclass(frozen=True)
class ClusterURL:
    """The seed nodes of a Redis Cluster URL (``redis+cluster://[user:pw@]h:p,h:p``), and the
    credentials and TLS every node shares."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = None


def parse_cluster_url(url: str, where: str = "PIPELINE_REDIS_URL") -> ClusterURL:
    """Parse a cluster URL; ConfigError naming ``where`` when it has no node, a node has no
    port, or it names a database (a cluster has only database 0)."""
    scheme, _, rest = url.strip().partition("://")
    tls = CLUSTER_SCHEMES.get(scheme.lower())
    if tls is None:
        raise ConfigError(f"{where}: a cluster URL starts redis+cluster:// or rediss+cluster://")
    userinfo, _, hosts = rest.rpartition("@")
    hosts, _, path = hosts.partition("/")
    if path.strip("/") not in ("", "0"):
        raise ConfigError(f"{where}: a Redis Cluster has only database 0, not {path!r}")
    nodes: list[tuple[str, int]] = []
    for i, entry in enumerate(e.strip() for e in hosts.split(",")):
        host, _, port = entry.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{where}: cluster node #{i + 1} must be host:port, not {entry!r}")
        nodes.append((host.strip("[]"), int(port)))
    user, _, password = userinfo.partition(":")
    return ClusterURL(
        tuple(nodes),
        tls,
        unquote(user) if user else None,
        unquote(password) if password else None,
    )
