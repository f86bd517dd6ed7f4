"""Gates inside the pipeline: budget-sized dispatch, no head-of-line blocking across tenants,
the fairness identity header, holders in inspect(), and the wedge detector."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.config import QueueConfig, load_settings, with_overrides
from pipeline.errors import ConfigError
from pipeline.sim import SimServer
from pipeline.worker import Attempt, AttemptId, Runtime
from tests.conftest import held


def uid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def test_dispatch_moves_budget_times_free_capacity(pl: Pipeline) -> None:
    q = pl.settings.queues["crash"]  # no worker serves this pool: the test is the dispatcher
    store = pl.store_of("crash")
    ids = [pl.submit({"i": i}, queue="crash", timeout=60).id for i in range(10)]
    assert store.tick(q, [q], 0.0, -1, 8).moved == []  # a closed gate moves nothing
    first = store.tick(q, [q], 0.5, -1, 8).moved  # floor(0.5 x 8 free)
    assert len(first) == 4
    second = store.tick(q, [q], 0.5, -1, 8).moved  # floor(0.5 x 4 free)
    assert len(second) == 2
    assert len(store.tick(q, [q], 1.0, 3, 8).moved) == 0  # queue capacity 3 < 6 active
    for d in first + second:
        assert store.requeue(d.id, d.token, delay=0, attempted=False)
    for rid in ids:
        assert pl.cancel(rid)


def test_a_tenant_over_quota_does_not_block_others(served: Pipeline, sim: SimServer) -> None:
    """quota1: one request in flight per userid. Tenant A floods the queue first; tenant B's
    requests, submitted after, finish while A's first request still holds A's only slot."""
    a, b = {"userid": uid("a")}, {"userid": uid("b")}
    hold = uid("hold")
    slow = served.submit(
        {"p": 0}, id=uid("a0"), queue="quota1", timeout=60, metadata=a, headers=held(hold)
    ).id
    sim.wait_held(hold)  # tenant A holds its slot
    flood = [
        served.submit({"p": i}, queue="quota1", timeout=60, metadata=a, priority=9).id
        for i in range(5)
    ]
    others = [served.submit({"p": i}, queue="quota1", timeout=60, metadata=b).id for i in range(3)]
    for rid in others:
        assert served.wait(rid, 10).ok
    assert served.state(slow) == "running"  # B finished while A's slot was still taken
    assert sim.release(hold) == 1
    for rid in [slow, *flood]:
        assert served.wait(rid, 30).ok


def test_inspect_lists_holders(served: Pipeline, sim: SimServer) -> None:
    hold = uid("hold")
    rid = served.submit({"p": 0}, id=uid("h"), queue="lim2", timeout=30, headers=held(hold)).id
    sim.wait_held(hold)
    gate = served.inspect()["lim2"]["gate"]
    assert gate["type"] == "local-max-concurrency" and gate["limit"] == 2
    (holder,) = [h for h in gate["holders"] if h["request_id"] == rid]
    assert holder["attempt"] == served.record(rid)["token"]
    assert holder["worker"] and holder["age_s"] >= 0
    assert holder["lease_expires_at"] > time.time()
    sim.release(hold)
    assert served.wait(rid, 10).ok


def test_wedge_detector_flags_a_full_queue_with_no_completions(
    served: Pipeline, sim: SimServer
) -> None:
    """lim1 with PIPELINE_WEDGE_AFTER_S=1: a request holding the only slot while another
    waits is reported, and the report clears once work completes."""
    hold = uid("hold")
    slow = served.submit({"p": 0}, id=uid("w"), queue="lim1", timeout=60, headers=held(hold)).id
    sim.wait_held(hold)  # the only slot is taken until the test releases it
    waiting = served.submit({"p": 1}, id=uid("w"), queue="lim1", timeout=60).id
    since = wait_until(lambda: served.inspect()["lim1"]["wedged_since"], 10, "wedge report")
    assert since <= time.time()
    sim.release(hold)
    assert served.wait(slow, 10).ok and served.wait(waiting, 10).ok
    wait_until(lambda: served.inspect()["lim1"]["wedged_since"] is None, 5, "report cleared")


def test_fairness_identity_header(env: dict[str, str], pl: Pipeline) -> None:
    settings = pl.settings
    rt = Runtime(settings)
    record = {
        "id": "r1",
        "queue": "default",
        "deadline": str(time.time() + 60),
        "payload": "{}",
        "metadata": json.dumps({"userid": "alice"}),
        "headers": json.dumps({"X-LLM-D-Inference-Fairness-Id": "spoofed", "x-team": "t"}),
    }
    headers = Attempt(rt, record, AttemptId(record["id"], "tok"), "w").headers()
    assert headers["x-llm-d-inference-fairness-id"] == "alice"
    assert "X-LLM-D-Inference-Fairness-Id" not in headers  # the caller's variant is replaced
    assert headers["x-request-id"] == "r1" and headers["x-team"] == "t"
    assert headers["Content-Type"] == "application/json"
    q: dict[str, Any] = {
        "queue_name": "default",
        "igw_base_url": "http://x",
        "inference_objective": "obj",
    }
    off = with_overrides(settings, queues=[q], fairness_header="")
    headers = Attempt(Runtime(off), record, AttemptId(record["id"], "tok"), "w").headers()
    assert "x-llm-d-inference-fairness-id" not in headers
    # the objective goes out in the header the reference documents and its lanes use
    assert headers["x-llm-d-inference-objective"] == "obj"
    assert "x-gateway-inference-objective" not in headers
    assert isinstance(off.queues["default"], QueueConfig)
    # PIPELINE_OBJECTIVE_HEADER names another header (the old one, for an older gateway)
    old = load_settings({**env, "PIPELINE_OBJECTIVE_HEADER": "x-gateway-inference-objective"})
    old = with_overrides(old, queues=[q])
    headers = Attempt(Runtime(old), record, AttemptId(record["id"], "tok"), "w").headers()
    assert headers["x-gateway-inference-objective"] == "obj"
    assert "x-llm-d-inference-objective" not in headers
    with pytest.raises(ConfigError, match="PIPELINE_OBJECTIVE_HEADER"):
        load_settings({**env, "PIPELINE_OBJECTIVE_HEADER": "bad header"})


def test_tier_priority_lane_headers(pl: Pipeline) -> None:
    """tier-priority stamps the lane's objective (over the queue's own and the caller's, in any
    letter case) and, when asked, the lane index; random-robin stamps neither."""
    from pipeline.config import parse_merge_policy

    q: dict[str, Any] = {
        "queue_name": "default",
        "igw_base_url": "http://x",
        "inference_objective": "queue-objective",
        "labels": {"tier": "batch"},
    }
    policy = parse_merge_policy(
        {
            "type": "tier-priority",
            "parameters": {
                "priority_header": "x-gateway-priority",
                "lane_objectives": {"overflow-batch": "cheap"},
            },
        },
        "merge.json",
    )
    tiered = with_overrides(pl.settings, queues=[q], merge_policy=policy)
    record = {
        "id": "r1",
        "queue": "default",
        "deadline": str(time.time() + 60),
        "payload": "{}",
        "headers": json.dumps({"X-LLM-D-Inference-Objective": "mine"}),
    }
    headers = Attempt(Runtime(tiered), record, AttemptId(record["id"], "tok"), "w").headers()
    assert headers["x-llm-d-inference-objective"] == "cheap"
    assert "X-LLM-D-Inference-Objective" not in headers
    assert headers["x-gateway-priority"] == "5"  # overflow-batch
    plain = with_overrides(pl.settings, queues=[q])
    headers = Attempt(Runtime(plain), record, AttemptId(record["id"], "tok"), "w").headers()
    assert "x-gateway-priority" not in headers
    # the queue's objective wins over the caller's (issue 45, item 11; llm-d-async let the
    # caller's override it), and goes out once
    assert headers["x-llm-d-inference-objective"] == "queue-objective"
    assert "X-LLM-D-Inference-Objective" not in headers
