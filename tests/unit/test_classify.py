"""A 2xx answer is a success only when its body can be read: JSON (parsed once, its usage
read from it), a stream, or a 204's empty body. Anything else is ``INVALID_RESPONSE``, an
outcome like a 5xx — never an exception out of the classification (issue 48: 4, 8)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.gates.answers import observation_of
from pipeline.http.classify import INVALID_RESPONSE, Kind, classify
from pipeline.http.usage import Usage, parse_usage
from pipeline.sim.server import NESTING

NESTED = "[" * NESTING + "]" * NESTING  # valid JSON that json.loads cannot read
USAGE = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (NESTED, "application/json"),
        ('{"id": "cmpl", "choices": [{"text": "cut', "application/json"),
        ("<html><body><h1>Bad Gateway</h1></body></html>", "text/html"),
        ("", None),
    ],
    ids=["nested", "truncated", "html", "empty"],
)
def test_a_2xx_that_is_not_json_is_invalid_response(body: str, content_type: str | None) -> None:
    out = classify(200, body, None, None, content_type)
    assert out.kind is Kind.RETRY and out.category == INVALID_RESPONSE and out.unreadable
    assert out.status_code == 200 and out.body == body and out.responded
    assert out.usage is None and out.described == "HTTP 200 (not JSON)"
    assert (out.error or "").startswith("HTTP 200 answer is not JSON (")
    assert body[:20] not in (out.error or "")[20:] or not body  # names no body text
    view = observation_of(out, 0.1, False)
    assert view is not None and view.kind == "err"  # not an "ok" for an adaptive gate


def test_a_json_2xx_is_parsed_once_for_its_usage() -> None:
    out = classify(200, USAGE, None)
    assert out.kind is Kind.SUCCESS and not out.unreadable
    assert out.parsed == json.loads(USAGE) and out.usage == Usage(3, 4, 7)


def test_a_stream_and_a_204_are_not_read_as_json() -> None:
    stream = classify(200, "data: {}\n\ndata: [DONE]\n\n", None, None, "text/event-stream")
    assert stream.kind is Kind.SUCCESS and stream.usage is None
    assert classify(204, "", None).kind is Kind.SUCCESS


def test_parse_usage_of_nesting_past_the_parser_is_none() -> None:
    assert parse_usage(NESTED) is None  # RecursionError is not an escape


@given(st.text(max_size=200))
def test_classify_never_raises_on_a_2xx_body(body: str) -> None:
    out = classify(200, body, None, None, "application/json")
    assert out.kind in (Kind.SUCCESS, Kind.RETRY)
    assert (out.kind is Kind.RETRY) == (out.category == INVALID_RESPONSE)


def test_busy_is_what_the_server_says_of_its_load() -> None:
    assert classify(429, "{}", None).busy
    assert classify(503, "{}", "2").busy and classify(500, "{}", None, "rejected-saturated").busy
    assert not classify(503, "{}", None).busy and not classify(200, "<html>", None).busy
