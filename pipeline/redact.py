"""What must never reach a log, a status page or a metric label in clear: passwords in URLs.
Imports nothing of the pipeline (every layer may use it)."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***`` (for logs and status output); each entry
    of a ``;``-separated list (Celery's Sentinel syntax) too."""
    if ";" in url:
        return ";".join(redact_url(part) for part in url.split(";"))
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
