"""What an attempt sends (issue 45, items 10 and 11), seen by the simulator.

- A record written some other way than ``submit`` (another producer, by hand) holding what the
  HTTP client cannot send — an id or header value outside Latin-1, a header that would split
  the request, a head over 64 KiB, an endpoint with a space, CR/LF or a ``..`` segment — ends
  ``INVALID_REQUEST`` at its first attempt, unsent and never retried.
- The server receives exactly one of each header the pipeline sets, with the queue's value: a
  request's own ``Host``, ``x-request-id``, objective, fairness identity (also when the
  request names no tenant) and connection headers never replace or double them.

Records are stored with the store's own submit (``Store.submit``), skipping ``submit``'s
checks, as another producer would write them."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline.client import Pipeline
from pipeline.sim import SimServer
from pipeline.store import RequestRow
from tests.conftest import WorkerProc
from tests.observability import isolated, start_node

NODE_QUEUE = "inproc"  # served by the in-process node
FAIRNESS = "x-llm-d-inference-fairness-id"
OBJECTIVE = "x-llm-d-inference-objective"


def uid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def written(pl: Pipeline, queue: str, rid: str, **fields: Any) -> RequestRow:
    """Store a request as another producer would: a valid row with ``fields`` replaced
    (``headers`` and ``metadata`` given as dicts), without ``submit``'s checks."""
    row = pl.prepare({"model": "m", "prompt": "hi"}, id="placeholder", queue=queue, timeout=30)
    for name in ("headers", "metadata"):
        if name in fields:
            fields[name] = json.dumps(fields[name])
    row = row._replace(id=rid, **fields)
    assert pl.store_of(queue).submit([row]) == [1]
    return row


UNSENDABLE: list[tuple[str, str, dict[str, Any], str]] = [
    ("id-not-latin-1", "请求-{}", {}, "'x-request-id'"),
    ("id-emoji", "emoji-\U0001f600-{}", {}, "'x-request-id'"),
    ("header-name", "hname-{}", {"headers": {"bad name": "1"}}, "header name 'bad name'"),
    ("header-crlf", "hcrlf-{}", {"headers": {"x-a": "1\r\nX-Injected: 1"}}, "'x-a'"),
    ("header-nul", "hnul-{}", {"headers": {"x-a": "a\x00b"}}, "'x-a'"),
    ("header-not-latin-1", "hl1-{}", {"headers": {"x-a": "中文"}}, "'x-a'"),
    ("header-8-mib-head", "hbig-{}", {"headers": {"x-big": "h" * 100_000}}, "request head"),
    ("endpoint-space", "espace-{}", {"endpoint": "/v1/completions x"}, "endpoint"),
    ("endpoint-crlf", "ecrlf-{}", {"endpoint": "/v1/comp\r\nletions"}, "endpoint"),
    ("endpoint-dots", "edots-{}", {"endpoint": "/v1/../v1/completions"}, "endpoint"),
]


@pytest.mark.parametrize(
    ("name", "rid", "fields", "said"), UNSENDABLE, ids=[c[0] for c in UNSENDABLE]
)
def test_a_record_the_client_cannot_send_ends_invalid_unsent(
    in_process: Pipeline, sim: SimServer, name: str, rid: str, fields: dict[str, Any], said: str
) -> None:
    pl = in_process
    row = written(pl, NODE_QUEUE, rid.format(uuid.uuid4().hex[:8]), **fields)
    res = pl.wait(row.id, 15)
    assert res.error_code == "INVALID_REQUEST", res
    message = res.error_message or ""
    assert message.startswith("cannot be sent: ") and said in message, message
    assert "X-Injected" not in message and "中文" not in message  # no value quoted
    assert res.attempts == 0  # nothing went out, nothing is retried
    assert row.id not in sim.stats()["attempts_by_request_id"]


def received(sim: SimServer, name: str) -> list[tuple[str, str]]:
    """The headers of the one call recorded under ``name``."""
    (call,) = sim.received_headers(name)
    return call


def test_a_tenant_the_client_cannot_send_is_left_out(in_process: Pipeline, sim: SimServer) -> None:
    """A tenant outside Latin-1 ended every attempt of its request (INFERENCE_ERROR): the
    fairness header is left out instead, as llm-d-async leaves out one it cannot send."""
    pl = in_process
    name = uid("tenant")
    req = pl.submit(
        {"p": 1},
        queue=NODE_QUEUE,
        timeout=30,
        metadata={"userid": "李"},
        headers={"x-sim-record-headers": name},
    )
    res = req.result(15)
    assert res.ok, res
    assert FAIRNESS not in {k for k, _ in received(sim, name)}


def test_the_queue_values_win_and_each_goes_out_once(
    env: dict[str, str],
    sim: SimServer,
    start_worker: Callable[..., WorkerProc],
    tmp_path: Path,
) -> None:
    """Records carrying their own ``Host``, ``x-request-id`` (in two letter cases), objective,
    fairness identity, ``Content-Type`` and ``Connection``: the server sees one of each, the
    queue's (the caller's ``Content-Type`` is kept: it is a default, not the queue's)."""
    iso = isolated(
        env,
        tmp_path,
        [{"queue_name": "obj", "igw_base_url": sim.url, "inference_objective": "queue-obj"}],
    )
    queue = iso.queue("obj")
    w, _ = start_node(start_worker, iso, concurrency=2)
    try:
        own = {
            "HOST": "evil.example:6379",
            "X-Request-Id": "spoofed",
            "x-request-id": "spoofed-too",
            "X-LLM-D-Inference-Objective": "premium",
            "X-LLM-D-Inference-Fairness-Id": "someone-else",
            "content-type": "application/json; charset=utf-8",
            "Connection": "close",
            "Content-Length": "3",
            "x-team": "a",
        }
        anonymous, alice = uid("anon"), uid("alice")
        rows = [
            written(iso.pl, queue, anonymous, headers={**own, "x-sim-record-headers": anonymous}),
            written(
                iso.pl,
                queue,
                alice,
                headers={**own, "x-sim-record-headers": alice},
                metadata={"userid": "alice"},
            ),
        ]
        for row in rows:
            assert iso.pl.wait(row.id, 20).ok
        for row, tenant in zip(rows, (None, "alice"), strict=True):
            got = received(sim, row.id)
            counts = Counter(k for k, _ in got)
            assert max(counts.values()) == 1, got  # no header twice
            h = dict(got)
            assert h["host"] == sim.url.removeprefix("http://")
            assert h["x-request-id"] == row.id
            assert h[OBJECTIVE] == "queue-obj"
            assert h.get(FAIRNESS) == tenant  # none when the request names no tenant
            assert h["content-type"] == "application/json; charset=utf-8"
            assert "connection" not in h and h["x-team"] == "a"
            assert int(h["content-length"]) == len(row.payload.encode())
    finally:
        w.stop()
