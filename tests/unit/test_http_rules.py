"""The HTTP client's sending rules (``pipeline.http.rules``) are the ones ``submit`` checks: what
``submit`` takes, the client writes unchanged; what the client refuses, ``submit`` refuses.
Checked against the client's own request writer (``call._request``) on generated text."""

from __future__ import annotations

from urllib.parse import urlsplit

from hypothesis import example, given
from hypothesis import strategies as st

from pipeline.http import call as httpcall
from pipeline.http.classify import join_url
from pipeline.http.rules import (
    MAX_HEAD_BYTES,
    Unsendable,
    endpoint_error,
    header_name_error,
    header_value_error,
    request_id_error,
    url_error,
)

# text around the edges: controls, Latin-1, beyond it, separators, URL delimiters
EDGY = st.text(
    st.sampled_from(
        list("aZ09-_.~!$&'()*+,;=:@/?#%[]{}\\\" \t\r\n\x00\x01\x7f\x85\xa0éÿĀ中\u2028\U0001f600")
    ),
    max_size=12,
)


def writes(headers: dict[str, str], target: str = "/x") -> bytes | None:
    """The request the client writes, or None when it refuses it."""
    try:
        return httpcall._request("POST", target, "h:1", b"{}", headers)
    except Unsendable:
        return None


@given(EDGY | st.text(max_size=12))
@example("naïve\ttab")
@example("")
def test_a_header_value_submit_takes_is_one_the_client_writes(value: str) -> None:
    written = writes({"x-a": value})
    assert (written is not None) == (header_value_error(value) is None)
    if written is not None:
        assert f"x-a: {value}\r\n".encode("latin-1") in written


@given(EDGY | st.text(max_size=12))
@example("x:a")
@example("")
def test_a_header_name_submit_takes_is_one_the_client_writes(name: str) -> None:
    assert (writes({name: "1"}) is not None) == (header_name_error(name) is None)


@given(EDGY)
@example("café")
@example("a b")
def test_an_id_submit_takes_goes_out_as_given(rid: str) -> None:
    """A server strips a value's surrounding whitespace: an id must arrive as it was given."""
    if request_id_error(rid) is None:
        written = writes({"x-request-id": rid})
        assert written is not None
        line = next(x for x in written.split(b"\r\n") if x.startswith(b"x-request-id:"))
        assert line.partition(b":")[2].strip(b" \t").decode("latin-1") == rid


@given(EDGY.map(lambda s: "/" + s))
@example("/v1/completions?x=1")
@example("/v1/comp\r\nletions")
@example("/v1/../admin")
def test_an_endpoint_submit_takes_goes_out_as_given(endpoint: str) -> None:
    """On the request line, after the queue's base URL, exactly as given: no character
    ``urlsplit`` drops or splits on, no dot segment a server would resolve."""
    if endpoint_error(endpoint) is not None:
        return
    url = join_url("http://gw:8000/base", endpoint)
    assert url_error(url) is None
    parts = urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    assert target == "/base" + endpoint
    assert writes({}, target) is not None


def test_the_client_refuses_a_head_over_its_limit() -> None:
    fits = writes({"x-big": "h" * (MAX_HEAD_BYTES - 100)})
    assert fits is not None and len(fits.partition(b"\r\n\r\n")[0]) + 4 <= MAX_HEAD_BYTES
    assert writes({"x-big": "h" * MAX_HEAD_BYTES}) is None


def test_framing_and_connection_headers_are_the_clients_own() -> None:
    written = writes({"Content-Length": "999", "Connection": "close", "Upgrade": "h2c"})
    assert written is not None
    head = written.lower()
    assert b"content-length: 2\r\n" in head and b"999" not in head
    assert b"connection" not in head and b"upgrade" not in head
