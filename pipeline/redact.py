"""What must never reach a log, a status page, a metric label or an error message in clear:
credentials in URLs. Imports nothing of the pipeline (every layer may use it).

One function, :func:`redact_url`, takes every URL form the pipeline accepts
(docs/configuration.md): ``redis://``, ``rediss://``, ``unix://``, ``sentinel://`` and
Celery's ``;``-separated sentinel list, ``redis+cluster://h:p,h:p``, ``http(s)://``, with
credentials as userinfo (``user:password@``) or as query parameters (``?password=``,
``?username=``, and any other parameter whose name looks like a credential). It never raises:
a URL it cannot take apart for sure is hidden whole after its scheme (``redis://***``).
:func:`redact_text` applies it to every URL inside a free text, such as an exception's
message."""

from __future__ import annotations

import re
from urllib.parse import unquote

MASK = "***"

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://(.*)", re.S)
# a host[:port] of the authority: a name or an address, or a bracketed IPv6 address
_HOST = re.compile(r"(\[[0-9A-Fa-f:.%A-Za-z]*\]|[A-Za-z0-9._~%\-]*)(:[0-9]*)?")
# query parameters whose value is a credential (or half of one: a user name)
_SECRET_PARAM = re.compile(
    r"pass|pwd|user|secret|token|key|auth|cred|sig|session|cookie|bearer", re.IGNORECASE
)
# a URL inside free text: a scheme, then everything up to white space or a quote
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]*")
_TRAILING = ".,;:!?)]}"  # sentence punctuation after a URL


def redact_url(url: str) -> str:
    """``url`` with its userinfo and credential-like query parameters replaced by ``***``
    (each entry of a ``;``-separated list too); the whole URL after its scheme when it cannot
    be taken apart for sure. Never raises."""
    try:
        text = url if isinstance(url, str) else str(url)
        return ";".join(_entry(part) for part in text.split(";"))
    except Exception:  # noqa: BLE001 - never raises: an unknown shape is hidden whole
        return _wholesale(url)


def redact_text(text: str) -> str:
    """``text`` with every URL in it redacted (:func:`redact_url`); punctuation that ends a
    URL's token (``redis://h:1/0.`` ``(redis://...)``) is kept outside it. Never raises."""
    try:
        return _URL_IN_TEXT.sub(_redact_token, text)
    except Exception:  # noqa: BLE001 - never raises
        return MASK


def _redact_token(m: re.Match[str]) -> str:
    token = m.group(0)
    url = token.rstrip(_TRAILING)
    return redact_url(url) + token[len(url) :]


def _entry(part: str) -> str:
    m = _SCHEME.fullmatch(part)
    if m is None:  # no scheme: a host:port, a path, or the tail of a list entry
        if "@" in part:
            return MASK
        head, q, query = part.partition("?")
        if q:
            return f"{head}?{_query(query)}"
        return _query(part) if "=" in part else part
    scheme, rest = m.groups()
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:
        authority = f"{MASK}@{authority.rpartition('@')[2]}"
    # an "@" left, or an authority that is not host[:port][,host:port...]: a password with
    # a character that should have been escaped (/ ? # ;) ends the authority early
    if "@" in tail or not all(
        _HOST.fullmatch(h) for h in authority.removeprefix(MASK + "@").split(",")
    ):
        return f"{scheme}://{MASK}"
    path, q, query = tail.partition("?")
    if not q:
        return f"{scheme}://{authority}{path}"
    query, hashmark, fragment = query.partition("#")
    return f"{scheme}://{authority}{path}?{_query(query)}{hashmark}{fragment}"


def _query(query: str) -> str:
    pairs = []
    for pair in query.split("&"):
        name, eq, _ = pair.partition("=")
        secret = eq and _SECRET_PARAM.search(unquote(name).replace("+", " "))
        pairs.append(f"{name}={MASK}" if secret else pair)
    return "&".join(pairs)


def _wholesale(url: object) -> str:
    try:
        m = _SCHEME.match(url if isinstance(url, str) else "")
        return f"{m.group(1)}://{MASK}" if m else MASK
    except Exception:  # noqa: BLE001 - never raises
        return MASK
