"""The front door of ``pipeline serve``, before any handler runs: which ``Host`` names it
answers (against DNS rebinding), which browser requests it refuses (a page of another origin
cannot act through a visitor's browser), and the security headers of every answer
(docs/batches.md, "What the service trusts")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ConfigError
from .auth import LOOPBACK
from .errors import ApiError, log_refusal

# Sec-Fetch-Site values of a request the service's own page or the user (a typed URL, a
# bookmark) started; "same-site" is another port or subdomain: another origin
OWN_SITE = frozenset({"same-origin", "none"})
# paths answered whatever the Host: a probe by address learns nothing from them
ANY_HOST = frozenset({"/healthz"})
DEFAULT_PORT = {"http": 80, "https": 443}
SECURITY_HEADERS = {
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-resource-policy": "same-origin",
    # JSON and files: nothing to run, nothing to frame (the page sets its own policy)
    "content-security-policy": "default-src 'none'; frame-ancestors 'none'",
}


def split_host(value: str) -> tuple[str, int | None] | None:
    """A ``Host`` header (or an allowed-hosts entry) as (lower-case name, port or None);
    None when it is not a host name, an IPv4 address or a bracketed IPv6 one with an
    optional port."""
    if not value or any(c in value for c in "/?#@ \\") or value.strip() != value:
        return None
    try:
        parts = urlsplit("//" + value)
        name, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not name:
        return None
    return name.rstrip("."), port


@dataclass(frozen=True)
class AllowedHosts:
    """The ``Host`` names served: the loopback names on the service's own port, and the
    entries of ``PIPELINE_ALLOWED_HOSTS`` (``name`` for any port, ``name:port`` for one)."""

    names: frozenset[str] = frozenset()
    with_port: frozenset[tuple[str, int]] = frozenset()

    @classmethod
    def parse(cls, text: str) -> AllowedHosts:
        """``PIPELINE_ALLOWED_HOSTS``: comma-separated entries; a bad one is a ConfigError."""
        names: set[str] = set()
        with_port: set[tuple[str, int]] = set()
        for raw in text.split(","):
            entry = raw.strip()
            if not entry:
                continue
            host = split_host(entry)
            if host is None:
                raise ConfigError(
                    f"PIPELINE_ALLOWED_HOSTS: {entry!r} is not a host name or address with an "
                    "optional :port (e.g. batch.example.com, 10.0.0.5:8080, [::1]:8080)"
                )
            name, port = host
            if port is None:
                names.add(name)
            else:
                with_port.add((name, port))
        return cls(frozenset(names), frozenset(with_port))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AllowedHosts | None:
        text = env.get("PIPELINE_ALLOWED_HOSTS", "")
        return cls.parse(text) if text.strip() else None

    def allows(self, host: str, own_port: int | None, scheme: str = "http") -> bool:
        parsed = split_host(host)
        if parsed is None:
            return False
        name, port = parsed
        port = port if port is not None else DEFAULT_PORT.get(scheme)
        if name in LOOPBACK and own_port is not None and port == own_port:
            return True
        return name in self.names or (name, port or 0) in self.with_port


def _same_host(origin: str, host: str) -> bool:
    """Whether an ``Origin`` header names the host and port a request was sent to."""
    try:
        parts = urlsplit(origin)
        name, port = parts.hostname, parts.port
    except ValueError:
        return False
    target = split_host(host)
    if not name or target is None or parts.scheme not in DEFAULT_PORT:
        return False
    default = DEFAULT_PORT[parts.scheme]
    return (name, port or default) == (target[0], target[1] or default)


def cross_site(method: str, headers: Headers) -> str | None:
    """Why a browser request of another origin is refused, or None. Requests with neither
    ``Sec-Fetch-Site`` nor ``Origin`` (API clients, curl, the SDK) pass. A browser's
    navigation to a page (a link from elsewhere) passes; everything else of another origin —
    any POST or DELETE, a ``fetch``, an ``<img>`` or ``<script>`` — is refused."""
    navigation = method in ("GET", "HEAD") and headers.get("sec-fetch-mode") == "navigate"
    site = headers.get("sec-fetch-site")
    if site is not None:
        if site.lower() in OWN_SITE or navigation:
            return None
        return f"a cross-origin request (Sec-Fetch-Site: {site[:40]})"
    origin = headers.get("origin")
    if origin is None or navigation:
        return None
    if not _same_host(origin, headers.get("host", "")):
        return f"a cross-origin request (Origin: {origin[:100]})"
    return None


class Guard:
    """ASGI middleware: checks ``Host`` (when ``hosts`` is set) and refuses cross-origin
    browser requests before the app sees them (400 and 403 in OpenAI's shape, one log line
    each), and adds :data:`SECURITY_HEADERS` to every answer that does not set its own."""

    def __init__(self, app: ASGIApp, hosts: AllowedHosts | None, port: int | None) -> None:
        self.app, self.hosts, self.port = app, hosts, port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    if name not in headers:
                        headers[name] = value
            await send(message)

        error = self.refusal(scope, Headers(scope=scope))
        if error is None:
            await self.app(scope, receive, send_with_headers)
            return
        log_refusal(scope, error)
        await error.response()(scope, receive, send_with_headers)

    def refusal(self, scope: Scope, headers: Headers) -> ApiError | None:
        method = scope["method"]
        if self.hosts is not None and scope["path"] not in ANY_HOST:
            server = scope.get("server")
            own_port = server[1] if server else self.port
            host = headers.get("host", "")
            if not self.hosts.allows(host, own_port, scope.get("scheme", "http")):
                return ApiError(
                    400,
                    f"this service does not answer for the host {host[:100]!r} (a loopback "
                    "name on its own port, or one of PIPELINE_ALLOWED_HOSTS)",
                    code="invalid_host",
                )
        reason = cross_site(method, headers)
        if reason is not None:
            return ApiError(
                403,
                f"{reason}: this API answers no web page of another origin",
                type="permission_error",
                code="cross_origin_request",
            )
        return None
