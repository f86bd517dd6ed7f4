"""The token rules, one test per rule: the estimate a token budget charges at admission
(``pipeline.gates.tokens``), what a learned correction keeps (``Learned``, the
reference the Lua is held to in tests/integration/gates/test_tokens.py), what the response's
usage says was served (``pipeline.http.usage``), and what an attempt settles a charge to
(``pipeline.worker.attempt.served_tokens``). Pure functions: no Redis."""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from pipeline.gates.tokens import (
    CLIP_SPREADS,
    CLIP_TOKENS,
    DEFAULT_MAX_TOKENS,
    LEARN_WEIGHT,
    MESSAGE_OVERHEAD,
    OVERHEAD_MAX,
    SLOPE_MAX,
    Learned,
    estimate_parts,
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


@given(body=st.fixed_dictionaries({"prompt": text, "max_tokens": counts}))
def test_the_estimate_is_its_prompt_part_plus_its_completion_part(body: dict[str, Any]) -> None:
    prompt, completion = estimate_parts(body, D)
    assert (prompt, completion) == (math.ceil(len(body["prompt"]) / 4), body["max_tokens"])
    assert estimate_tokens(body, D) == prompt + completion
    assert estimate_parts("not json", D) == (0, D)


# -- the learned correction (estimate_correction: usage) -------------------------------------
sizes = st.integers(min_value=1, max_value=5_000)
answers = st.lists(st.tuples(sizes, sizes), max_size=80)  # (real prompt tokens, estimate)


def taught(pairs: list[tuple[int, int]], start: Learned | None = None) -> Learned:
    learned = start or Learned()
    for real, estimate in pairs:
        learned = learned.learn(real, estimate)
    return learned


def test_before_any_answer_the_plain_estimate_is_charged() -> None:
    assert Learned().charge(57) == 57 and Learned().charge(0) == 0


@given(pairs=answers, prompt=st.integers(min_value=0, max_value=100_000))
def test_the_charge_is_never_below_the_plain_estimate(
    pairs: list[tuple[int, int]], prompt: int
) -> None:
    """Never below it: an over-estimate only holds admissions back while the request is in
    flight (its settlement charges the usage), an under-estimate lets the window run over."""
    learned = taught(pairs)
    assert learned.charge(prompt) >= prompt
    assert 0.0 <= learned.slope <= SLOPE_MAX and 0 <= learned.n <= LEARN_WEIGHT
    assert learned.charge(0) == 0


@given(pairs=answers)
def test_an_answer_without_both_counts_teaches_nothing(pairs: list[tuple[int, int]]) -> None:
    """Only total_tokens (read as 0 prompt tokens), or a prompt estimated at 0 (an empty list
    of token ids, a body that cannot be read): nothing changes."""
    learned = taught(pairs)
    blanks = [(0, e) for _, e in pairs] + [(r, 0) for r, _ in pairs]
    assert taught(blanks, learned) == learned


@given(
    slope=st.floats(min_value=0.25, max_value=4.0),
    overhead=st.integers(min_value=0, max_value=200),
    xs=st.lists(st.integers(min_value=1, max_value=2_000), min_size=8, max_size=LEARN_WEIGHT,
                unique=True),
    prompt=st.integers(min_value=1, max_value=2_000),
)  # fmt: skip
def test_a_templates_overhead_and_a_tokenizers_scale_are_learned(
    slope: float, overhead: int, xs: list[int], prompt: int
) -> None:
    """Answers that follow real = slope × estimate + overhead (a template adds a constant,
    a tokenizer scales): a prompt of any size in their range is then charged what the server
    will count, within two tokens (real counts are whole tokens) and what the shrink toward
    slope 1 moves the line there, plus the spread; never less than its plain estimate."""
    pairs = [(max(1, round(slope * x + overhead)), x) for x in xs]
    learned = taught(pairs)
    assume(min(xs) <= prompt <= max(xs) and min(r for r, _ in pairs) > 1)
    real = slope * prompt + overhead
    mx, var = statistics.fmean(xs), statistics.pvariance(xs)
    drift = abs(slope - 1) * (mx * mx / 1000) / (var + mx * mx / 1000) * abs(prompt - mx)
    charged = learned.charge(prompt)
    assert charged >= prompt
    assert (
        max(prompt, real - 2 - drift) <= charged <= max(prompt, real) + 2 + drift + learned.spread
    )


@given(
    overhead=st.integers(min_value=0, max_value=100),
    scatter=st.integers(min_value=1, max_value=20),
    prompt=st.integers(min_value=10, max_value=400),
)
def test_answers_scattered_around_the_line_are_charged_their_spread_above_it(
    overhead: int, scatter: int, prompt: int
) -> None:
    """The line's errors are 0 on average, and those of the requests in flight add up: the
    charge is the line plus one standard deviation of the answers around it, so that most
    requests are charged at least what the server counts."""
    xs = [10 + 13 * i % 390 for i in range(LEARN_WEIGHT)]
    pairs = [(x + overhead + (scatter if i % 2 else -scatter), x) for i, x in enumerate(xs)]
    learned = taught([(max(1, r), x) for r, x in pairs])
    assert learned.spread == pytest.approx(scatter, rel=0.1, abs=0.5)
    assert learned.charge(prompt) == pytest.approx(prompt + overhead + scatter, abs=2)
    covered = sum(learned.charge(x) >= r for r, x in pairs if r > 0)
    assert covered >= len(pairs) // 2


@given(size=sizes, ratio=st.floats(min_value=0.1, max_value=SLOPE_MAX), count=sizes)
def test_prompts_of_one_size_are_charged_what_they_were_counted(
    size: int, ratio: float, count: int
) -> None:
    """No spread to fit a line to: slope 1 and the difference as the overhead (the estimate
    taken as right about the text, the server adding a constant)."""
    real = max(1, round(ratio * size))
    learned = taught([(real, size)] * (1 + count % 40))
    assert learned.slope == 1.0 and learned.spread == 0.0
    assert learned.charge(size) == max(size, real)


@given(pairs=st.lists(st.tuples(sizes, sizes), min_size=1, max_size=LEARN_WEIGHT))
def test_the_first_answers_weigh_the_same_and_the_first_sets_the_means(
    pairs: list[tuple[int, int]],
) -> None:
    learned = taught(pairs)
    assert learned.n == len(pairs)
    ys = [min(r, SLOPE_MAX * e + OVERHEAD_MAX) for r, e in pairs]
    assert learned.mx == pytest.approx(sum(e for _, e in pairs) / len(pairs))
    assert learned.my == pytest.approx(sum(ys) / len(pairs))
    first = taught(pairs[:1])
    assert (first.mx, first.my) == (pairs[0][1], ys[0])
    assert first.charge(pairs[0][1]) == max(pairs[0][1], math.ceil(ys[0] - 1e-6))


@given(
    history=st.lists(st.tuples(sizes, sizes), min_size=LEARN_WEIGHT, max_size=3 * LEARN_WEIGHT),
    real=st.integers(min_value=1, max_value=10**9),
    estimate=sizes,
)
def test_one_answer_moves_a_learned_line_little_however_wrong(
    history: list[tuple[int, int]], real: int, estimate: int
) -> None:
    """Robust to an outlier: once LEARN_WEIGHT answers are in, one answer's real count is
    brought within CLIP_SPREADS spreads + CLIP_TOKENS of the line learned so far, and it
    moves the means by 1 / LEARN_WEIGHT of its distance: the line at its size by at most
    about (CLIP_SPREADS × spread + CLIP_TOKENS) / LEARN_WEIGHT, the spread by a bounded
    factor."""
    before = taught(history)
    after = before.learn(real, estimate)
    line = before.slope * estimate + before.overhead
    reach = CLIP_SPREADS * before.spread + CLIP_TOKENS
    y = min(max(min(real, SLOPE_MAX * estimate + OVERHEAD_MAX), line - reach), line + reach)
    assert after.my - before.my == pytest.approx((y - before.my) / LEARN_WEIGHT)
    assert after.mx - before.mx == pytest.approx((estimate - before.mx) / LEARN_WEIGHT)
    assert after.spread <= 1.2 * before.spread + 2


@given(start=answers, ratio=st.floats(min_value=1.0, max_value=4.0))
def test_a_changed_template_is_followed_whatever_came_before(
    start: list[tuple[int, int]], ratio: float
) -> None:
    """After any history, 24 × LEARN_WEIGHT answers of a new kind: charged within 2 % of
    them, plus the spread (a few tokens: an old answer far off the line keeps some weight in
    it longest; after 16 × it can still add a few)."""
    xs = [10 + 37 * i % 500 for i in range(24 * LEARN_WEIGHT)]
    learned = taught([(round(ratio * x) + 20, x) for x in xs], taught(start))
    assert learned.spread <= 3
    for x in (50, 250, 450):
        expected = ratio * x + 20
        assert expected - 2 <= learned.charge(x) <= expected * 1.02 + learned.spread + 2


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
