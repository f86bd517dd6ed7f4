"""Bad input gets a clear, typed error at submit() naming the field."""

from __future__ import annotations

import time
from typing import Any

import pytest

from pipeline.client import Pipeline
from pipeline.errors import InvalidRequest
from tests.conftest import nothing_stored


class NotJSON:
    pass


def nested(depth: int) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for _ in range(depth):
        d = {"x": d}
    return d


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


def test_submit_many_rejects_the_batch_naming_the_item(pl: Pipeline) -> None:
    items = [{"payload": {"p": 1}, "queue": "solo"}, {"payload": {"p": 2}, "priority": 99}]
    with pytest.raises(InvalidRequest) as info:
        pl.submit_many(items)
    assert info.value.field == "priority" and "item 1" in str(info.value)
    assert pl.inspect()["solo"]["pending"] == 0


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
    ]
    assert all(r.state() == "queued" for r in reqs)
    assert all(r.cancel() for r in reqs)
