"""One HTTP call to an OpenAI-compatible endpoint, classified for the retry policy."""

from __future__ import annotations

import enum
import json
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any
from urllib.parse import urlsplit

import httptools

from . import call as httpcall
from .backoff import parse_retry_after
from .rules import Unsendable
from .usage import Usage, parse_usage, usage_of


class Kind(enum.Enum):
    SUCCESS = "success"  # 1xx-2xx
    RETRY = "retry"  # 429, 5xx, transport failure before a response, timeout
    FATAL = "fatal"  # 3xx not followed, other 4xx, or a request that cannot be built or read


UNSENDABLE = "UNSENDABLE"  # the category of a request the client cannot write (never sent)
# the category (and a result's error code) of a 2xx answer whose body is not JSON: an HTML
# page, a cut-off or garbled body, JSON nested deeper than the parser goes
INVALID_RESPONSE = "INVALID_RESPONSE"
_UNREAD: Any = object()  # an outcome whose body classify did not parse


@dataclass(frozen=True)
class Outcome:
    kind: Kind
    status_code: int | None = None
    body: str = ""
    retry_after: float | None = None  # seconds, from the Retry-After header
    error: str | None = None  # transport error text when there was no response
    category: str = ""  # RATE_LIMIT, SERVER_ERROR, INVALID_REQ, TRANSPORT, TLS, UNSENDABLE, ...
    # the gateway's x-llm-d-request-dropped-reason (its flow control shed the request):
    # rejected-saturated, evicted-queue-pressure, ...
    dropped_reason: str | None = None
    # a 2xx body as classify parsed it (its JSON), so that its usage is not parsed again
    parsed: Any = field(default=_UNREAD, repr=False, compare=False)

    @property
    def responded(self) -> bool:
        return self.status_code is not None

    @property
    def ok_2xx(self) -> bool:
        """A 2xx answer: the only kind whose ``usage`` is read."""
        return self.status_code is not None and 200 <= self.status_code < 300

    @property
    def busy(self) -> bool:
        """The server (or its gateway) said it is busy: a 429, a ``Retry-After``, a drop
        reason. Waited out within the deadline; never what ends a request by ``max_attempts``."""
        return self.status_code == 429 or self.retry_after is not None or bool(self.dropped_reason)

    @property
    def unreadable(self) -> bool:
        """A 2xx answer whose body is not JSON (``INVALID_RESPONSE``)."""
        return self.category == INVALID_RESPONSE

    @cached_property
    def usage(self) -> Usage | None:
        """The ``usage`` of a 2xx answer's body (parsed once), else None."""
        if not self.ok_2xx or self.unreadable:
            return None
        return parse_usage(self.body) if self.parsed is _UNREAD else usage_of(self.parsed)

    @property
    def described(self) -> str:
        """``HTTP 429``, with the gateway's drop reason: ``HTTP 429 (dropped: ...)``; a 2xx
        that is not JSON: ``HTTP 200 (not JSON)``."""
        text = f"HTTP {self.status_code}"
        if self.unreadable:
            return f"{text} (not JSON)"
        return f"{text} (dropped: {self.dropped_reason})" if self.dropped_reason else text


DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
_REASON = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def join_url(base: str, path: str) -> str:
    """``base`` + ``path`` with exactly one slash between them."""
    return base.rstrip("/") + "/" + path.lstrip("/")


def _is_stream(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == "text/event-stream"


def answered(status: int, body: str, content_type: str | None = None) -> Outcome:
    """A 1xx-2xx answer: a success when its body is JSON (parsed here, once: its usage is read
    from it), a stream (``text/event-stream``) or a 204's; else ``INVALID_RESPONSE``, retried
    as a 5xx is (a proxy's HTML page, a cut-off body: the server did not deliver the answer),
    within the deadline and the queue's ``max_attempts``. JSON nested deeper than the parser
    goes is not JSON here: its ``RecursionError`` is this outcome, never an escape."""
    if status == 204 or _is_stream(content_type):
        return Outcome(Kind.SUCCESS, status, body)
    try:
        return Outcome(Kind.SUCCESS, status, body, parsed=json.loads(body))
    except RecursionError:
        why = "JSON nested deeper than the parser goes"
    except ValueError as exc:  # the message names a position, never the body's text
        why = str(exc)
    typed = f", content-type {content_type[:64]}" if content_type else ""
    error = f"HTTP {status} answer is not JSON ({why}{typed})"
    return Outcome(Kind.RETRY, status, body, error=error, category=INVALID_RESPONSE)


def classify(
    status: int,
    body: str,
    retry_after: str | None,
    dropped: str | None = None,
    content_type: str | None = None,
) -> Outcome:
    if status < 300:
        return answered(status, body, content_type)
    if status < 400:  # a redirect not followed (the queue's follow_redirects is off)
        return Outcome(Kind.FATAL, status, body, category="REDIRECT")
    ra = parse_retry_after(retry_after)
    # the gateway's drop reason as sent (e.g. ``rejected-saturated``), or ``other`` when it is
    # not a short token (it becomes a metric label and goes into results)
    reason = dropped.strip() if dropped else None
    if reason is not None and not _REASON.match(reason):
        reason = "other"
    if status == 429:
        return Outcome(Kind.RETRY, status, body, ra, category="RATE_LIMIT", dropped_reason=reason)
    if status >= 500:
        return Outcome(Kind.RETRY, status, body, ra, category="SERVER_ERROR", dropped_reason=reason)
    category = "AUTH_ERROR" if status in (401, 403) else "INVALID_REQ"
    return Outcome(Kind.FATAL, status, body, category=category, dropped_reason=reason)


def tls_error(url: str, exc: ssl.SSLError) -> str:
    """A TLS failure in words: what failed, against which server."""
    parts = urlsplit(url)
    where = f"{parts.hostname}:{parts.port or 443}"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate verify failed for {where}: {exc.verify_message}"
    return f"TLS error with {where}: {exc.reason or exc}"


def send(
    url: str,
    body: str,
    headers: dict[str, str],
    timeout_s: float,
    tls: httpcall.TLS | None = None,
    follow_redirects: bool = False,
    max_response_bytes: int = httpcall.MAX_RESPONSE_BYTES,
    redirect_origins: Sequence[str] = (),
) -> Outcome:
    """POST ``body`` to ``url``; never raises. ``timeout_s`` bounds the whole call. A TLS
    failure (an unknown CA, a rejected client certificate) is a transport error: retried
    within the deadline like a refused connection, with category ``TLS``. A request the
    client cannot write (:class:`~pipeline.http.rules.Unsendable`: ``UNSENDABLE``, never
    sent), a redirect that is refused and a body over ``max_response_bytes`` end the request
    (``REDIRECT``, ``TOO_LARGE``): the same call would meet them again."""
    try:
        resp = httpcall.request(
            "POST",
            url,
            body.encode(),
            headers,
            timeout_s,
            tls,
            follow_redirects=follow_redirects,
            redirect_origins=redirect_origins,
            max_response_bytes=max_response_bytes,
        )
    except Unsendable as exc:
        return Outcome(Kind.FATAL, error=str(exc), category=UNSENDABLE)
    except httpcall.RedirectRefused as exc:
        return Outcome(Kind.FATAL, error=str(exc), category="REDIRECT")
    except httpcall.ResponseTooLarge as exc:
        return Outcome(Kind.FATAL, error=str(exc), category="TOO_LARGE")
    except httpcall.CallAborted as exc:  # a cancel closed the connection: never retried
        return Outcome(Kind.FATAL, error=str(exc), category="ABORTED")
    except httpcall.CallTimeout:
        return Outcome(Kind.RETRY, error=f"timed out after {timeout_s:.1f} s", category="TIMEOUT")
    except ssl.SSLError as exc:  # before ValueError: a verify error is both
        return Outcome(Kind.RETRY, error=tls_error(url, exc), category="TLS")
    except ValueError as exc:  # a URL that cannot be sent to, TLS files that cannot be loaded
        return Outcome(Kind.FATAL, error=str(exc), category="INVALID_REQ")
    except (OSError, httptools.HttpParserError) as exc:
        return Outcome(Kind.RETRY, error=f"{type(exc).__name__}: {exc}", category="TRANSPORT")
    h = resp.headers
    return classify(
        resp.status,
        resp.text,
        h.get("retry-after"),
        h.get(DROPPED_REASON_HEADER),
        h.get("content-type"),
    )
