"""Redis URLs in Celery's syntax, Sentinel lists included (docs/production.md, "Sentinel"),
as plain data: the master's database and credentials are the first entry's."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from ..errors import ConfigError
from ..redact import redact_url

SENTINEL_SCHEME = "sentinel"
SENTINEL_PORT = 26379
MASTER_VAR = "PIPELINE_REDIS_SENTINEL_MASTER"
CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS
REDIS_SCHEMES = ("redis", "rediss", "unix", SENTINEL_SCHEME, *CLUSTER_SCHEMES)
BAD_AUTHORITY = (
    "not host[:port] with a numeric port 1-65535 (a password's / ? # @ ; and % must be "
    "percent-encoded)"
)


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
        raise ConfigError(f"{where}: no sentinel in {redact_url(url)!r}")
    sentinels: list[tuple[str, int]] = []
    for i, entry in enumerate(entries):
        try:
            parts = urlsplit(entry)
            port = parts.port or SENTINEL_PORT
        except ValueError:  # the message would quote the text: a mistyped password's part
            raise ConfigError(f"{where}: sentinel #{i + 1}: {BAD_AUTHORITY}") from None
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
    query = dict(parse_qsl(first.query))  # ?username= and ?password= stand for the userinfo
    return SentinelURL(
        sentinels=tuple(sentinels),
        db=int(db_text),
        username=unquote(first.username) if first.username else query.get("username"),
        password=unquote(first.password) if first.password is not None else query.get("password"),
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


def check_redis_url(url: str, where: str = "PIPELINE_REDIS_URL") -> None:
    """ConfigError naming ``where`` (the setting) unless ``url`` is a Redis URL the pipeline
    can use: ``redis://``, ``rediss://``, ``unix://``, a Sentinel list or a cluster URL, with
    a numeric port and database. The message shows the URL redacted."""
    scheme = url.strip().partition("://")[0].lower() if "://" in url else ""
    if scheme not in REDIS_SCHEMES:
        raise ConfigError(
            f"{where}: {redact_url(url)!r} is not a Redis URL (redis://, rediss://, unix://, "
            "sentinel://... or redis+cluster://...)"
        )
    if scheme == SENTINEL_SCHEME:
        parse_sentinel_url(url, where)
    elif scheme in CLUSTER_SCHEMES:
        parse_cluster_url(url, where)
    elif scheme == "unix":
        if not urlsplit(url).path:
            raise ConfigError(f"{where}: a unix:// URL names the socket's path (unix:///path)")
    else:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise ConfigError(f"{where}: {BAD_AUTHORITY}") from None
        if port == 0:
            raise ConfigError(f"{where}: {BAD_AUTHORITY}")
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ConfigError(f"{where}: the database must be a number, not {db!r}")


def celery_url(url: str) -> str:
    """``url`` as Celery and kombu take it: a ``redis://`` / ``rediss://`` URL's ``?username=``
    and ``?password=`` (which redis-py reads) moved into its userinfo, as kombu's URL parser
    raises on a password given twice (``TypeError: dict() got multiple values``). Every other
    URL, and one with neither parameter, is returned as it is."""
    parts = urlsplit(url.strip())
    if parts.scheme.lower() not in ("redis", "rediss") or not parts.query:
        return url
    query = parse_qsl(parts.query, keep_blank_values=True)
    creds = {k: v for k, v in query if k in ("username", "password")}
    if not creds:
        return url
    rest = [(k, v) for k, v in query if k not in ("username", "password")]
    # a query's values are decoded (parse_qsl), the userinfo's are still percent-encoded
    user = quote(creds["username"], safe="") if "username" in creds else parts.username or ""
    userinfo = user
    if "password" in creds:
        userinfo += ":" + quote(creds["password"], safe="")
    elif parts.password is not None:
        userinfo += ":" + parts.password
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{userinfo}@{host}", query=urlencode(rest)).geturl()


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


CLUSTER_QUERY = ("username", "password")  # the credentials may come as query parameters


def parse_cluster_url(url: str, where: str = "PIPELINE_REDIS_URL") -> ClusterURL:
    """Parse a cluster URL; ConfigError naming ``where`` when it has no node, a node has no
    port, it names a database (a cluster has only database 0), or a query parameter other
    than ``username`` and ``password`` (which, as in redis-py, stand for the userinfo)."""
    scheme, _, rest = url.strip().partition("://")
    tls = CLUSTER_SCHEMES.get(scheme.lower())
    if tls is None:
        raise ConfigError(f"{where}: a cluster URL starts redis+cluster:// or rediss+cluster://")
    rest, _, query = rest.partition("?")
    userinfo, _, hosts = rest.rpartition("@")
    hosts, _, path = hosts.partition("/")
    if path.strip("/") not in ("", "0"):
        raise ConfigError(f"{where}: a Redis Cluster has only database 0, not {path!r}")
    params = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(params) - set(CLUSTER_QUERY))
    if unknown:
        raise ConfigError(
            f"{where}: a cluster URL takes only username= and password= as query parameters, "
            f"not {', '.join(unknown)}"
        )
    nodes: list[tuple[str, int]] = []
    for i, entry in enumerate(e.strip() for e in hosts.split(",")):
        host, _, port = entry.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{where}: cluster node #{i + 1}: {BAD_AUTHORITY}")
        nodes.append((host.strip("[]"), int(port)))
    user, _, password = userinfo.partition(":")
    return ClusterURL(
        tuple(nodes),
        tls,
        unquote(user) if user else params.get("username") or None,
        unquote(password) if password else params.get("password") or None,
    )
