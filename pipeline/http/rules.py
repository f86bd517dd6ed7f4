"""What the attempt's HTTP client (:mod:`pipeline.http.call`) can put on the wire, as
predicates. The client refuses a request that breaks them (:class:`Unsendable`, before it
connects), and ``submit`` checks a request's id, headers and endpoint with these very
functions, so the two cannot drift. Each ``*_error`` returns None for a good value, else what
is wrong, in words, for the caller's own error type.

- A header name is an RFC 9110 token.
- A header value is written as ISO-8859-1 (Latin-1) and may not hold CR, LF, NUL or another
  control character but HTAB: CR and LF would end the header (a split request), and RFC 9110
  forbids the rest, which servers refuse.
- The request id goes out as the value of ``x-request-id``, and must arrive as it was given:
  a header value, printable, without leading or trailing whitespace (a server strips it).
- A request's endpoint is the path (and query) of the request line, after the queue's base
  URL: the characters RFC 3986 allows there (anything else percent-encoded), no ``.`` or
  ``..`` segment (a server resolves them, leaving the base URL's path), no fragment and no
  empty query (``urlsplit`` drops both), not ``//`` (another host, to a URL parser), at most
  :data:`MAX_ENDPOINT_LENGTH` characters.
- The sender writes no URL holding a space, a control character or a non-ASCII character
  (``urlsplit`` silently drops CR, LF and TAB), and no request head over
  :data:`MAX_HEAD_BYTES`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MAX_ID_LENGTH = 256  # characters of a request id
MAX_ENDPOINT_LENGTH = 2048  # characters of a request's endpoint
# the request line and headers the client writes at most (it reads at most as much of a
# response's head); Envoy, in front of an llm-d gateway, takes 60 KiB by default
MAX_HEAD_BYTES = 64 * 1024
# a request's own headers as sent (``name: value`` and CRLF each) at most: what a model server
# behind uvicorn's h11 or Node takes in a whole request head by default
MAX_HEADERS_BYTES = 16 * 1024
REQUEST_ID_HEADER = "x-request-id"
# framing and connection headers: the client writes its own (Content-Length) and drops these
# from the headers it is given; the connection, kept alive, is the client's
CONNECTION_HEADERS = frozenset(
    {
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    }
)
# what the attempt sends of its own, besides the connection headers and the queue's stamps
# (``Settings.stamped_headers``): a request's own headers never replace them
ATTEMPT_HEADERS = frozenset({"host", REQUEST_ID_HEADER})
# a queue's engine_hints: the time left to the deadline (ms), as llm-d's SLO-aware routing
# reads a TTFT objective, and the request's prefix key, for a prefix-aware router to score
SLO_HEADER = "x-slo-ttft-ms"
PREFIX_HEADER = "x-prefix-key"

TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# a character a header value cannot carry (see the module's notes)
BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\u0100-\U0010ffff]")
# a character a URL cannot carry on the request line
BAD_URL = re.compile(r"[\x00-\x20\x7f-\U0010ffff]")
# RFC 3986: a path's characters (pchar and "/"), a query's (and "?"), or percent-encoded
_PCHAR = r"[A-Za-z0-9\-._~!$&'()*+,;=:@/]|%[0-9A-Fa-f]{2}"
ENDPOINT = re.compile(rf"/(?:{_PCHAR})*(?:\?(?:{_PCHAR}|\?)+)?")  # a query not empty
_DOT_SEGMENT = re.compile(r"(?:^|/)(?:\.|%2[eE]){1,2}(?:/|$)")


class Unsendable(ValueError):
    """A request the client cannot write: a header name or value, a URL or a head size that
    breaks the rules above. Raised before connecting; never retried (the same request would
    meet it again). The message names the header, never quotes its value (it may be a key)."""


def header_name_error(name: Any) -> str | None:
    if not isinstance(name, str):
        return "a header name must be a str"
    if not TOKEN.fullmatch(name):
        return f"{name!r} is not an HTTP header name (letters, digits and !#$%&'*+-.^_`|~)"
    return None


def value_error(value: str) -> str | None:
    """What makes ``value`` (a str) unsendable as a header value, else None. Printable ASCII,
    most values, is checked in C (``isascii``, ``isprintable``) without the regex."""
    if value.isascii() and value.isprintable():
        return None
    bad = BAD_VALUE.search(value)
    if bad is None:
        return None
    if ord(bad.group()) > 0xFF:
        return "holds a character outside Latin-1 (ISO-8859-1), which a header cannot carry"
    return "holds CR, LF, NUL or another control character"


def header_value_error(value: Any) -> str | None:
    if not isinstance(value, str):
        return "a header value must be a str"
    return value_error(value)


def headers_error(headers: Mapping[Any, Any]) -> str | None:
    """The first header of ``headers`` the client cannot send, named, else None; or what
    makes them together larger than :data:`MAX_HEADERS_BYTES`."""
    size = 0
    for name, value in headers.items():
        wrong = header_name_error(name)
        if wrong is not None:
            return wrong
        wrong = header_value_error(value)
        if wrong is not None:
            return f"the value of {name!r} {wrong}" if isinstance(value, str) else wrong
        size += len(name) + len(value) + 4
    if size > MAX_HEADERS_BYTES:
        return f"{size} bytes as sent, over {MAX_HEADERS_BYTES}"
    return None


def request_id_error(rid: Any) -> str | None:
    """What keeps ``rid`` from going out unchanged as ``x-request-id``, else None."""
    if not isinstance(rid, str) or not rid or len(rid) > MAX_ID_LENGTH:
        return f"must be a non-empty str of at most {MAX_ID_LENGTH} characters"
    wrong = value_error(rid)
    if wrong is not None:
        return f"goes out as the {REQUEST_ID_HEADER} header, and {wrong}"
    if not rid.isprintable():
        return "must be printable (no control characters)"
    if rid != rid.strip():
        return "must not start or end with whitespace (a server strips it)"
    return None


def endpoint_error(path: Any) -> str | None:
    """What keeps ``path`` from going out as given after the queue's base URL, else None."""
    if not isinstance(path, str) or not path.startswith("/") or path.startswith("//"):
        return "must be a URL path starting with a single '/'"
    if len(path) > MAX_ENDPOINT_LENGTH:
        return f"longer than {MAX_ENDPOINT_LENGTH} characters"
    if not ENDPOINT.fullmatch(path):
        return (
            "must be a URL path (and query) of the characters a request line allows: "
            "no space, control, non-ASCII character or '#' (percent-encode them)"
        )
    if _DOT_SEGMENT.search(path.partition("?")[0]):
        return "must not hold a '.' or '..' segment"
    return None


def url_error(url: str) -> str | None:
    """What keeps ``url`` off the request line (checked by the client on every call: printable
    ASCII without a space, most URLs, in C without the regex)."""
    if url.isascii() and url.isprintable() and " " not in url:
        return None
    if BAD_URL.search(url):
        return "holds a space, a control or a non-ASCII character (percent-encode it)"
    return None
