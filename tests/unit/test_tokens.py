"""The token rules, one test per rule: the estimate a token budget charges at admission
(``pipeline.gates.tokens``), what the response's usage says was served
(``pipeline.http.usage``), and what an attempt settles a charge to
(``pipeline.worker.attempt.served_tokens``). Pure functions: no Redis."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pipeline.gates.tokens import (
    DEFAULT_MAX_TOKENS,
    MESSAGE_OVERHEAD,
    estimate_tokens,
)
from pipeline.http.classify import Kind, Outcome
from pipeline.http.usage import Usage, counted_path, parse_usage
from pipeline.worker.attempt import served_tokens

D = 100  # default_max_tokens in these tests


# -- the estimate --------------------------------------------------------------------------
def test_prompt_is_characters_over_four_rounded_up_plus_max_tokens() -> None:
    assert estimate_tokens({"prompt": "abcdefghi", "max_tokens": 10}, D) == 3 + 10
    assert estimate_tokens({"prompt": "abcd", "max_tokens": 10}, D) == 1 + 10
    assert estimate_tokens({"prompt": "", "max_tokens": 10}, D) == 10


def test_text_of_a_json_body_is_read_like_the_parsed_body() -> None:
    body = {"prompt": "x" * 41, "max_tokens": 7}
    assert estimate_tokens(json.dumps(body), D) == estimate_tokens(body, D) == 11 + 7


def test_without_max_tokens_the_default_completion_budget() -> None:
    assert estimate_tokens({"prompt": "abcd"}, D) == 1 + D
    assert estimate_tokens({"prompt": "abcd"}, 0) == 1


def test_max_completion_tokens_counts_and_the_larger_of_both_wins() -> None:
    assert estimate_tokens({"max_completion_tokens": 30}, D) == 30
    assert estimate_tokens({"max_completion_tokens": 30, "max_tokens": 50}, D) == 50
    assert estimate_tokens({"max_completion_tokens": 60, "max_tokens": 50}, D) == 60
    assert estimate_tokens({"max_tokens": 0}, D) == 0


def test_a_bad_max_tokens_is_ignored() -> None:
    for bad in (-1, 2.5, "20", True, None, [3]):
        assert estimate_tokens({"max_tokens": bad}, D) == D


def test_n_choices_multiply_the_completion_budget() -> None:
    assert estimate_tokens({"prompt": "abcd", "max_tokens": 10, "n": 3}, D) == 1 + 30
    assert estimate_tokens({"max_tokens": 10, "n": 0}, D) == 10  # not a count of choices
    assert estimate_tokens({"max_tokens": 10, "n": "3"}, D) == 10


def test_a_list_of_prompts_adds_up_and_token_ids_count_one_each() -> None:
    assert estimate_tokens({"prompt": ["abcd", "abcd"], "max_tokens": 0}, D) == 2
    assert estimate_tokens({"prompt": [1, 2, 3, 4, 5], "max_tokens": 0}, D) == 5
    assert estimate_tokens({"prompt": [[1, 2], [3]], "max_tokens": 0}, D) == 3


def test_chat_messages_content_plus_an_overhead_per_message() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "x" * 8},
            {"role": "user", "content": [{"type": "text", "text": "y" * 8}, {"type": "image"}]},
        ],
        "max_tokens": 5,
    }
    assert estimate_tokens(body, D) == math.ceil(16 / 4) + 2 * MESSAGE_OVERHEAD + 5


def test_a_body_that_cannot_be_read_is_charged_the_completion_budget() -> None:
    assert estimate_tokens("not json", D) == D
    assert estimate_tokens("[1, 2]", D) == D
    assert estimate_tokens({"messages": "hello", "prompt": 7}, D) == D


def test_the_documented_default_is_256() -> None:
    assert DEFAULT_MAX_TOKENS == 256


text = st.text(max_size=200)
counts = st.integers(min_value=0, max_value=10_000)


@given(prompt=text, max_tokens=counts, extra=counts)
def test_estimate_grows_with_max_tokens_and_never_undercounts_the_budget(
    prompt: str, max_tokens: int, extra: int
) -> None:
    low = estimate_tokens({"prompt": prompt, "max_tokens": max_tokens}, D)
    high = estimate_tokens({"prompt": prompt, "max_tokens": max_tokens + extra}, D)
    assert high - low == extra
    assert low >= max_tokens
    assert low - max_tokens == math.ceil(len(prompt) / 4)


@given(parts=st.lists(text, max_size=8))
def test_more_messages_never_estimate_less(parts: list[str]) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": p} for p in parts]
    for i in range(len(messages)):
        fewer = estimate_tokens({"messages": messages[:i], "max_tokens": 1}, D)
        more = estimate_tokens({"messages": messages[: i + 1], "max_tokens": 1}, D)
        assert more >= fewer + MESSAGE_OVERHEAD


# -- the usage of a response ---------------------------------------------------------------
def test_usage_prompt_and_completion_and_their_total() -> None:
    body = json.dumps({"usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 99}})
    assert parse_usage(body) == Usage(7, 3, 10)


def test_usage_missing_one_direction_counts_it_zero() -> None:
    assert parse_usage('{"usage": {"prompt_tokens": 7}}') == Usage(7, 0, 7)


def test_usage_with_only_total_tokens() -> None:
    assert parse_usage('{"usage": {"total_tokens": 12}}') == Usage(0, 0, 12)
    assert parse_usage('{"usage": {"total_tokens": "12"}}') is None


def test_usage_negative_counts_clamp_to_zero() -> None:
    assert parse_usage('{"usage": {"prompt_tokens": -4, "completion_tokens": 2}}') == Usage(0, 2, 2)


def test_usage_unreadable() -> None:
    for body in (
        "",
        "not json",
        "[]",
        '{"choices": []}',
        '{"usage": 5}',
        '{"usage": {"prompt_tokens": 1.5, "completion_tokens": 2}}',
        '{"usage": {"prompt_tokens": true}}',
        '{"usage": {"prompt_tokens": "3"}}',
    ):
        assert parse_usage(body) is None, body


def test_counted_paths_are_the_references() -> None:
    assert counted_path("http://h:8000/v1/completions")
    assert counted_path("http://h/gw/v1/chat/completions/")
    assert not counted_path("http://h/v1/embeddings")
    assert not counted_path("http://h/xv1/completions")


# -- what an attempt settles its charge to -------------------------------------------------
USAGE = json.dumps({"usage": {"prompt_tokens": 5, "completion_tokens": 6}})


def test_a_2xx_settles_to_its_usage() -> None:
    assert served_tokens(Outcome(Kind.SUCCESS, 200, USAGE)) == 11
    assert served_tokens(Outcome(Kind.SUCCESS, 201, USAGE)) == 11


def test_a_2xx_without_usage_keeps_the_estimate() -> None:
    assert served_tokens(Outcome(Kind.SUCCESS, 200, "{}")) is None


def test_any_other_answer_refunds() -> None:
    for code, kind in (
        (429, Kind.RETRY),
        (503, Kind.RETRY),
        (400, Kind.FATAL),
        (302, Kind.SUCCESS),
    ):
        assert served_tokens(Outcome(kind, code, USAGE)) == 0


def test_a_request_that_was_never_sent_refunds() -> None:
    assert served_tokens(Outcome(Kind.FATAL, error="bad url", category="INVALID_REQ")) == 0
    assert served_tokens(Outcome(Kind.RETRY, error="handshake", category="TLS")) == 0


def test_no_answer_after_sending_keeps_the_estimate() -> None:
    for category in ("TIMEOUT", "TRANSPORT", "INTERRUPTED"):
        assert served_tokens(Outcome(Kind.RETRY, error="x", category=category)) is None
