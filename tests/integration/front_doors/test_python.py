"""The Python door: every bad argument of ``submit``, ``submit_many``, ``submit_batch``, the
lookups (``get``, ``state``, ``explain``, ``cancel``, ``wait``) and ``configure`` is a typed
error naming the field (``InvalidRequest.field``, ``ConfigError.field``), and nothing is stored
or half-written in Redis (``nothing_stored``).

What ``submit`` takes is what the attempt's HTTP client can send: its id, headers and endpoint
are checked with the client's own predicates (``pipeline.http.rules``). A record written some
other way that breaks them ends ``INVALID_REQUEST`` at its first attempt
(tests/integration/test_outgoing.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pipeline
from pipeline.batch import Batches
from pipeline.client import Pipeline, api
from pipeline.errors import ConfigError, InvalidRequest, UnknownRequest
from tests.conftest import nothing_stored


class NotJSON:
    pass


def nested(depth: int) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for _ in range(depth):
        d = {"x": d}
    return d


MiB = 1024 * 1024

CASES = [
    ("payload", ["not", "a", "dict"], {}),
    ("payload", "a string", {}),
    ("payload", {"x": NotJSON()}, {}),
    ("payload", {"x": float("nan")}, {}),
    ("payload", {"x": "y" * (1024 * 1024 + 1)}, {}),
    ("payload", nested(100_000), {}),
    ("payload", {"bad": "\ud800"}, {}),
    ("deadline", {}, {"deadline": time.time() - 1}),
    ("deadline", {}, {"deadline": "tomorrow"}),
    ("deadline", {}, {"deadline": time.time() + 60, "timeout": 60}),
    ("deadline", {}, {"deadline": float("inf")}),
    ("timeout", {}, {"timeout": -5}),
    ("timeout", {}, {"timeout": 0}),
    ("priority", {}, {"priority": 10}),
    ("priority", {}, {"priority": -1}),
    ("priority", {}, {"priority": "1"}),
    ("priority", {}, {"priority": True}),
    ("priority", {}, {"priority": 1.5}),
    ("queue", {}, {"queue": "nope"}),
    ("queue", {}, {"queue": None}),
    ("metadata", {}, {"metadata": {"userid": 7}}),
    ("metadata", {}, {"metadata": "userid=7"}),
    ("headers", {}, {"headers": {"bad header": "x"}}),
    ("headers", {}, {"headers": {"x-a": "line\r\nbreak"}}),
    ("id", {}, {"id": ""}),
    ("id", {}, {"id": "x" * 257}),
    ("id", {}, {"id": 12345}),
    ("id", {}, {"id": "bad\nid"}),
    ("endpoint", {}, {"endpoint": "http://evil.example/v1"}),
    ("endpoint", {}, {"endpoint": "v1/completions"}),
    # -- what the HTTP client cannot send (issue 45, item 10) -----------------------------
    # the id goes out as x-request-id: Latin-1, printable, as given
    ("id", {}, {"id": "请求-1"}),  # not Latin-1: every attempt would fail
    ("id", {}, {"id": "emoji-\U0001f600"}),
    ("id", {}, {"id": "c1-\x85-control"}),
    ("id", {}, {"id": "nbsp\xa0inside"}),
    ("id", {}, {"id": "trailing-space "}),
    ("id", {}, {"id": "\ttab-first"}),
    ("id", {}, {"id": "line\u2028separator"}),
    # header names: RFC 9110 tokens
    ("headers", {}, {"headers": {"x:a": "1"}}),
    ("headers", {}, {"headers": {"": "1"}}),
    ("headers", {}, {"headers": {"x(a)": "1"}}),
    ("headers", {}, {"headers": {"x-é": "1"}}),
    ("headers", {}, {"headers": {"x-a\r\n": "1"}}),
    # header values: Latin-1, no CR / LF / NUL / other control
    ("headers", {}, {"headers": {"x-a": "nul\x00byte"}}),
    ("headers", {}, {"headers": {"x-a": "cr\rhere"}}),
    ("headers", {}, {"headers": {"x-a": "lf\nhere"}}),
    ("headers", {}, {"headers": {"x-a": "bell\x07"}}),
    ("headers", {}, {"headers": {"x-a": "中文"}}),
    ("headers", {}, {"headers": {"x-a": 1}}),
    # names whose value the pipeline sets (item 11): refused, not silently replaced
    ("headers", {}, {"headers": {"Host": "evil.example"}}),
    ("headers", {}, {"headers": {"X-Request-Id": "spoof"}}),
    ("headers", {}, {"headers": {"content-length": "5"}}),
    ("headers", {}, {"headers": {"Transfer-Encoding": "chunked"}}),
    ("headers", {}, {"headers": {"Connection": "close"}}),
    ("headers", {}, {"headers": {"X-LLM-D-Inference-Objective": "premium"}}),
    ("headers", {}, {"headers": {"x-llm-d-inference-fairness-id": "someone-else"}}),
    # endpoints as they go out on the request line
    ("endpoint", {}, {"endpoint": "/v1/chat completions"}),
    ("endpoint", {}, {"endpoint": "/v1/completions\r\nX-Injected: 1"}),
    ("endpoint", {}, {"endpoint": "/v1/comp\nletions"}),  # urlsplit would drop the LF
    ("endpoint", {}, {"endpoint": "/v1/comp\tletions"}),
    ("endpoint", {}, {"endpoint": "/v1/../admin"}),
    ("endpoint", {}, {"endpoint": "/v1/%2e%2e/admin"}),
    ("endpoint", {}, {"endpoint": "/v1/./completions"}),
    ("endpoint", {}, {"endpoint": "/v1/completions#fragment"}),  # never sent
    ("endpoint", {}, {"endpoint": "//evil.example/v1/completions"}),
    ("endpoint", {}, {"endpoint": "/v1/complétions"}),
    ("endpoint", {}, {"endpoint": "/v1/" + "a" * 2048}),
    ("endpoint", {}, {"endpoint": 5}),
    # sizes: metadata and headers count in max_payload_bytes; headers at most 16 KiB
    ("metadata", {}, {"metadata": {"userid": "u", "blob": "m" * MiB}}),
    ("headers", {}, {"headers": {"x-big": "h" * (16 * 1024)}}),
    ("headers", {}, {"headers": {f"x-h{i}": "v" * 100 for i in range(200)}}),
    # unknown arguments
    ("prioirty", {}, {"prioirty": 1}),
]


@pytest.mark.parametrize(
    ("field", "payload", "kwargs"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_invalid_submission(pl: Pipeline, field: str, payload: Any, kwargs: dict[str, Any]) -> None:
    with nothing_stored(pl), pytest.raises(InvalidRequest) as info:
        pl.submit(payload, **kwargs)
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)


def sized(pl: Pipeline, over: int) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """A payload, metadata and headers that together take ``max_payload_bytes + over``
    bytes as stored (each alone far below it)."""
    limit = pl.settings.max_payload_bytes
    metadata = {"userid": "alice", "note": "m" * (limit // 4)}
    headers = {"x-team": "h" * 1000}
    stored = len(json.dumps(metadata)) + len(json.dumps(headers))
    filler = limit + over - stored - len('{"p":""}')
    return {"p": "p" * filler}, metadata, headers


def test_payload_metadata_and_headers_count_together(pl: Pipeline) -> None:
    """One byte over ``max_payload_bytes`` together is refused, naming what took it over;
    exactly at the limit is taken."""
    payload, metadata, headers = sized(pl, 1)
    with nothing_stored(pl), pytest.raises(InvalidRequest) as info:
        pl.submit(payload, queue="solo", metadata=metadata, headers=headers)
    assert info.value.field == "headers" and "max_payload_bytes" in str(info.value)
    payload, metadata, headers = sized(pl, 0)
    req = pl.submit(payload, queue="solo", metadata=metadata, headers=headers)
    assert req.state() == "queued" and req.cancel()


def test_valid_edge_values_are_accepted(pl: Pipeline) -> None:
    reqs = [
        pl.submit({}, queue="solo", priority=0, timeout=60, id="x" * 256),
        pl.submit(
            {"u": "ünïcödé ✓"},
            queue="solo",
            priority=9,
            metadata={"userid": "alice"},
            headers={"x-team": "a"},
        ),
        # Latin-1 text in an id and a header value, a tab inside a value, a query string
        pl.submit(
            {},
            queue="solo",
            id="café au lait",
            headers={"X-Note": "naïve\tvalue", "Content-Type": "application/json"},
            endpoint="/v1/completions?api-version=2024-10-21&x=%20",
        ),
        # a tenant that cannot go out as a header: stored, the header is left out
        pl.submit({}, queue="solo", metadata={"userid": "李"}),
    ]
    assert all(r.state() == "queued" for r in reqs)
    assert all(r.cancel() for r in reqs)


# -- submit_many ------------------------------------------------------------------------------
def test_submit_many_rejects_the_batch_naming_the_item(pl: Pipeline) -> None:
    items = [{"payload": {"p": 1}, "queue": "solo"}, {"payload": {"p": 2}, "priority": 99}]
    with nothing_stored(pl), pytest.raises(InvalidRequest) as info:
        pl.submit_many(items)
    assert info.value.field == "priority" and info.value.item == 1
    assert "item 1" in str(info.value)
    assert pl.inspect()["solo"]["pending"] == 0


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"payload": {}, "headers": {"x-a": "中文"}}, "headers"),
        ({"payload": {}, "id": "请求"}, "id"),
        ({"payload": {}, "endpoint": "/v1/../x"}, "endpoint"),
        ({"payload": {}, "headers": {"Host": "evil"}}, "headers"),
        ({"payload": {}, "metadata": {"blob": "m" * MiB}}, "metadata"),
        ({"payload": {}, "colour": "red"}, "colour"),
        ({"no": "payload"}, "payload"),
        ("not a dict", "payload"),
    ],
    ids=[
        "header-value",
        "id",
        "endpoint",
        "reserved",
        "metadata-size",
        "unknown",
        "no-payload",
        "not-a-dict",
    ],  # fmt: skip
)
def test_submit_many_names_the_bad_item_and_stores_none(pl: Pipeline, bad: Any, field: str) -> None:
    good = [{"payload": {"n": i}, "queue": "solo", "timeout": 60} for i in range(3)]
    with nothing_stored(pl), pytest.raises(InvalidRequest) as info:
        pl.submit_many([*good[:2], bad, good[2]])
    assert (info.value.field, info.value.item) == (field, 2)
    assert str(info.value).startswith(f"{field}: item 2: ")


@pytest.mark.parametrize("items", [None, 5, "abc", b"abc", {"payload": {}}])
def test_submit_many_wants_an_iterable_of_items(pl: Pipeline, items: Any) -> None:
    with nothing_stored(pl), pytest.raises(InvalidRequest) as info:
        pl.submit_many(items)
    assert info.value.field == "items"


# -- lookups: get, state, explain, cancel, wait, record -----------------------------------------
BAD_IDS = [("empty", ""), ("none", None), ("int", 12345), ("list", ["a"]), ("long", "x" * 257)]
LOOKUPS = {
    "get": lambda pl, rid: pl.get(rid),
    "state": lambda pl, rid: pl.state(rid),
    "explain": lambda pl, rid: pl.explain(rid),
    "cancel": lambda pl, rid: pl.cancel(rid),
    "wait": lambda pl, rid: pl.wait(rid, 0.1),
    "record": lambda pl, rid: pl.record(rid),
}


@pytest.mark.parametrize("rid", [r for _, r in BAD_IDS], ids=[n for n, _ in BAD_IDS])
@pytest.mark.parametrize("call", LOOKUPS)
def test_a_lookup_with_an_id_no_request_can_have(pl: Pipeline, call: str, rid: Any) -> None:
    with nothing_stored(pl), pytest.raises(InvalidRequest) as info:
        LOOKUPS[call](pl, rid)
    assert info.value.field == "id"


@pytest.mark.parametrize("call", ["get", "state", "explain", "cancel", "wait"])
def test_an_unknown_id_raises_unknown_request(pl: Pipeline, call: str) -> None:
    """Item 16: ``cancel`` of an unknown id raised nothing (False), unlike ``get`` and
    ``explain``."""
    with nothing_stored(pl), pytest.raises(UnknownRequest):
        LOOKUPS[call](pl, "never-submitted-id")


@pytest.fixture
def door(pl: Pipeline) -> Iterator[Pipeline]:
    """The module-level API (``pipeline.cancel`` ...) on ``pl``'s settings; the previous
    default pipeline is put back afterwards."""
    before = api._default
    try:
        yield pipeline.configure(settings=pl.settings)
    finally:
        api._default = before


def test_module_level_cancel_of_an_unknown_id(door: Pipeline) -> None:
    with nothing_stored(door), pytest.raises(UnknownRequest):
        pipeline.cancel("unknown-id")
    with pytest.raises(UnknownRequest):
        pipeline.get("unknown-id")
    with pytest.raises(UnknownRequest):
        pipeline.explain("unknown-id")


def test_cancel_of_a_request_whose_record_expired(pl: Pipeline) -> None:
    """A handle outlives its record (the result TTL): cancelling it then is an unknown id."""
    req = pl.submit({}, queue="solo", timeout=60)
    assert req.cancel()
    pl.store_of("solo").client.delete(pl.store_of("solo").keys.request(req.id))
    with pytest.raises(UnknownRequest):
        req.cancel()


@pytest.mark.parametrize("running", ["kill", "", None, 1, ["abort"], "ABORT"])
def test_cancel_running_must_be_finish_or_abort(pl: Pipeline, running: Any) -> None:
    req = pl.submit({}, queue="solo", timeout=60)
    with nothing_stored(pl), pytest.raises(InvalidRequest) as info:
        pl.cancel(req.id, running=running)
    assert info.value.field == "running"
    with nothing_stored(pl), pytest.raises(InvalidRequest) as info:
        req.cancel(running)
    assert info.value.field == "running"
    assert req.cancel()


@pytest.mark.parametrize("by", [5, "two\nlines", "x" * 257])
def test_cancel_by_must_be_printable_text(pl: Pipeline, by: Any) -> None:
    req = pl.submit({}, queue="solo", timeout=60)
    with nothing_stored(pl), pytest.raises(InvalidRequest) as info:
        pl.cancel(req.id, by=by)
    assert info.value.field == "by"
    assert req.cancel()


# -- configure ------------------------------------------------------------------------------
CONFIGURE = [
    ("nonexistent", {"nonexistent": 1}),
    ("lease_s", {"lease_s": -1}),
    ("lease_s", {"lease_s": "30"}),
    ("lease_s", {"lease_s": float("nan")}),
    ("park_s", {"park_s": -0.5}),
    ("max_payload_bytes", {"max_payload_bytes": 0}),
    ("max_payload_bytes", {"max_payload_bytes": True}),
    ("max_payload_bytes", {"max_payload_bytes": 1.5}),
    ("redis_url", {"redis_url": 5}),
    ("redis_url", {"redis_url": ""}),
    ("key_prefix", {"key_prefix": None}),
    ("direct_publish", {"direct_publish": "yes"}),
    ("fairness_header", {"fairness_header": "bad header"}),
    ("objective_header", {"objective_header": "x-objective\r\n"}),
    ("lookahead", {"lookahead": -2}),
    ("queues", {"queues": "default"}),
    ("queues", {"queues": []}),
    ("queues", {"queues": [{"queue_name": "q"}]}),  # no igw_base_url
    ("queues", {"queues": [{"queue_name": "q", "igw_base_url": "ftp://x"}]}),
    ("queues", {"queues": [{"queue_name": "q", "igw_base_url": "http://x", "colour": 1}]}),
    ("pool_configs", {"pool_configs": [{"id": "p", "workers": 0}]}),
    ("pool_configs", {"pool_configs": [{"id": "other"}]}),  # the queues' pool is not in it
    ("merge_policy", {"merge_policy": {"type": "nope"}}),
    ("merge_policy", {"merge_policy": "tier-priority"}),
    ("settings", {"settings": "not settings"}),
]


@pytest.mark.parametrize(
    ("field", "kwargs"), CONFIGURE, ids=[f"{c[0]}-{i}" for i, c in enumerate(CONFIGURE)]
)
def test_configure_names_a_bad_setting_and_keeps_the_pipeline(
    door: Pipeline, field: str, kwargs: dict[str, Any]
) -> None:
    kwargs = {k: v for k, v in kwargs.items() if k != "settings"}
    settings = "not settings" if field == "settings" else door.settings
    with nothing_stored(door), pytest.raises(ConfigError) as info:
        pipeline.configure(settings, **kwargs)  # type: ignore[arg-type]
    assert info.value.field == field and field in str(info.value)
    assert api._default is door  # the pipeline there was is kept


def test_configure_takes_good_settings(door: Pipeline) -> None:
    queues = [{"queue_name": "q", "igw_base_url": "http://127.0.0.1:9"}]
    p = pipeline.configure(door.settings, queues=queues, lease_s=12, park_s=0)
    assert p.settings.lease_s == 12 and list(p.settings.queues) == ["q"]


# -- submit_batch: its arguments (bad lines are the batch's own errors) ------------------------
@pytest.fixture
def lines() -> list[dict[str, Any]]:
    body = {"model": "m", "prompt": "hi"}
    return [{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}]


BATCH_ARGS = [
    ("lines_or_path", {"lines_or_path": 5}),
    ("lines_or_path", {"lines_or_path": None}),
    ("lines_or_path", {"lines_or_path": b'{"custom_id": "a"}'}),
    ("lines_or_path", {"lines_or_path": {"custom_id": "a"}}),
    ("lines_or_path", {"lines_or_path": "/no/such/file.jsonl"}),
    ("lines_or_path", {"lines_or_path": "DIR"}),
    ("lines_or_path", {"lines_or_path": ["\ud800"]}),  # a line that is not UTF-8
    ("lines_or_path", {"lines_or_path": [{"body": NotJSON()}]}),
    ("completion_window", {"completion_window": "forever"}),
    ("completion_window", {"completion_window": 0}),
    ("completion_window", {"completion_window": True}),
    ("completion_window", {"completion_window": float("nan")}),
    ("metadata", {"metadata": "x"}),
    ("metadata", {"metadata": {"k": 5}}),
    ("metadata", {"metadata": {"invalid_lines": "ignore"}}),
    ("priority", {"priority": 10}),
    ("priority", {"priority": "high"}),
    ("queue", {"queue": "nope"}),
    ("queue", {"queue": None}),
    ("endpoint", {"endpoint": "/v1/nope"}),
    ("endpoint", {"endpoint": ["/v1/completions"]}),
    ("id", {"id": "bad id!"}),
    ("id", {"id": 5}),
    ("id", {"id": "x" * 129}),
]


@pytest.mark.parametrize(
    ("field", "kwargs"), BATCH_ARGS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BATCH_ARGS)]
)
def test_submit_batch_arguments(
    door: Pipeline, tmp_path: Path, lines: list[dict[str, Any]], field: str, kwargs: Any
) -> None:
    kwargs = {"lines_or_path": lines, **kwargs}
    if kwargs["lines_or_path"] == "DIR":
        kwargs["lines_or_path"] = str(tmp_path)
    with nothing_stored(door), pytest.raises(InvalidRequest) as info:
        pipeline.submit_batch(**kwargs)
    assert info.value.field == field


def test_submit_batch_with_good_arguments_is_stored(door: Pipeline, lines: Any) -> None:
    batch = Batches(door).submit_batch(lines, queue="solo", completion_window="1h")
    assert batch.status in ("validating", "in_progress")
    batch.cancel()
