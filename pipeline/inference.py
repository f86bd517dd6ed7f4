"""One HTTP call to an OpenAI-compatible endpoint, classified for the retry policy."""

from __future__ import annotations

import enum
import os
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from .backoff import parse_retry_after


class Kind(enum.Enum):
    SUCCESS = "success"  # < 400
    RETRY = "retry"  # 429, 5xx, transport failure before a response, timeout
    FATAL = "fatal"  # other 4xx (with a response), or a request that cannot be built


@dataclass(frozen=True)
class Outcome:
    kind: Kind
    status_code: int | None = None
    body: str = ""
    retry_after: float | None = None  # seconds, from the Retry-After header
    error: str | None = None  # transport error text when there was no response
    category: str = ""  # RATE_LIMIT, SERVER_ERROR, INVALID_REQ, TRANSPORT, TIMEOUT, ...

    @property
    def responded(self) -> bool:
        return self.status_code is not None


def join_url(base: str, path: str) -> str:
    """``base`` + ``path`` with exactly one slash between them."""
    return base.rstrip("/") + "/" + path.lstrip("/")


_clients: dict[int, httpx.Client] = {}
_clients_lock = threading.Lock()


def http_client() -> httpx.Client:
    """The process's shared HTTP client (one per process: safe under prefork and threads)."""
    pid = os.getpid()
    with _clients_lock:
        client = _clients.get(pid)
        if client is None:
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
            client = httpx.Client(limits=limits, follow_redirects=True, trust_env=False)
            _clients.clear()
            _clients[pid] = client
        return client


def classify(status: int, body: str, retry_after: str | None) -> Outcome:
    if status < 400:
        return Outcome(Kind.SUCCESS, status, body)
    ra = parse_retry_after(retry_after)
    if status == 429:
        return Outcome(Kind.RETRY, status, body, ra, category="RATE_LIMIT")
    if status >= 500:
        return Outcome(Kind.RETRY, status, body, ra, category="SERVER_ERROR")
    category = "AUTH_ERROR" if status in (401, 403) else "INVALID_REQ"
    return Outcome(Kind.FATAL, status, body, category=category)


def send(url: str, body: str, headers: dict[str, str], timeout_s: float) -> Outcome:
    """POST ``body`` to ``url``; never raises. ``timeout_s`` bounds the whole call."""
    if urlsplit(url).scheme not in ("http", "https"):
        return Outcome(Kind.FATAL, error=f"unsupported URL {url!r}", category="INVALID_REQ")
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
    try:
        resp = http_client().post(url, content=body.encode(), headers=headers, timeout=timeout)
    except httpx.TimeoutException as exc:
        return Outcome(
            Kind.RETRY,
            error=f"timed out after {timeout_s:.1f} s ({type(exc).__name__})",
            category="TIMEOUT",
        )
    except httpx.TransportError as exc:
        return Outcome(Kind.RETRY, error=f"{type(exc).__name__}: {exc}", category="TRANSPORT")
    except httpx.HTTPError as exc:  # malformed URL and the like
        return Outcome(Kind.FATAL, error=f"{type(exc).__name__}: {exc}", category="INVALID_REQ")
    return classify(resp.status_code, resp.text, resp.headers.get("retry-after"))
