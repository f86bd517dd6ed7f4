"""The official ``openai`` package drives ``pipeline serve`` as it drives OpenAI's Batch API:
the steps of OpenAI's Batch guide, unchanged, against a real service process, a real worker
node and the simulator."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.sim import SimServer
from tests.integration.batch.conftest import ServeProc


def write_input(
    path: Path, n: int, tag: str, fail: dict[int, dict[str, str]] | None = None
) -> None:
    with open(path, "w") as fh:
        for i in range(n):
            body: dict[str, Any] = {
                "model": "sim-model",
                "messages": [{"role": "system", "content": "You are a helpful assistant."},
                             {"role": "user", "content": f"Hello world {tag} {i}"}],
                "max_tokens": 8,
            }  # fmt: skip
            line = {"custom_id": f"request-{i}", "method": "POST",
                    "url": "/v1/chat/completions", "body": body}  # fmt: skip
            fh.write(json.dumps(line) + "\n")


def poll(client: OpenAI, batch_id: str, timeout: float = 60) -> Any:
    def closed() -> Any:
        b = client.batches.retrieve(batch_id)
        return b if b.status in ("completed", "failed", "expired", "cancelled") else None

    return wait_until(closed, timeout, f"batch {batch_id} to close", interval=0.2)


def test_the_openai_batch_guide_runs_unchanged(
    served: Pipeline, start_serve: Callable[..., ServeProc], sim: SimServer, tmp_path: Path
) -> None:
    srv = start_serve()
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-anything")
    path = tmp_path / "batchinput.jsonl"
    write_input(path, 25, "guide")

    # 1. upload the batch input file
    batch_input_file = client.files.create(file=open(path, "rb"), purpose="batch")
    assert batch_input_file.purpose == "batch" and batch_input_file.bytes == path.stat().st_size
    assert batch_input_file.filename == "batchinput.jsonl"
    # 2. create the batch
    batch = client.batches.create(
        input_file_id=batch_input_file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"description": "nightly eval job"},
    )
    assert batch.status in ("validating", "in_progress")
    assert batch.metadata == {"description": "nightly eval job"}
    assert batch.expires_at is not None and batch.expires_at - batch.created_at == 24 * 3600
    # 3. check its status until it is done
    batch = poll(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed) == (25, 25)
    assert batch.request_counts.failed == 0
    assert batch.output_file_id and batch.error_file_id is None
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    # 4. retrieve the results
    file_response = client.files.content(batch.output_file_id)
    lines = [json.loads(x) for x in file_response.text.splitlines()]
    assert [x["custom_id"] for x in lines] == [f"request-{i}" for i in range(25)]
    for x in lines:
        assert x["error"] is None and x["response"]["status_code"] == 200
        assert x["response"]["body"]["object"] == "chat.completion"
        assert x["response"]["request_id"] == x["id"]
    out_file = client.files.retrieve(batch.output_file_id)
    assert out_file.purpose == "batch_output" and out_file.bytes == len(file_response.content)
    # every line reached the simulator exactly once
    attempts = sim.stats()["attempts_by_request_id"]
    assert all(attempts[x["id"]] == 1 for x in lines)
    # a single request of the batch, by id
    one = httpx.get(f"{srv.url}/v1/requests/{lines[0]['id']}").json()
    assert one["state"] == "done" and one["batch_id"] == batch.id
    assert one["custom_id"] == "request-0" and one["result"]["status_code"] == 200
    # 5. list batches; files
    listed = client.batches.list(limit=10)
    assert batch.id in [b.id for b in listed.data]
    assert batch_input_file.id in [f.id for f in client.files.list().data]


def test_cancel_list_pages_and_errors_through_the_sdk(
    pl: Pipeline, start_serve: Callable[..., ServeProc], tmp_path: Path
) -> None:
    """Batches on a queue nobody serves stay in progress: cancel one; page through the list
    with ``after``/``limit``; OpenAI's errors and status codes."""
    srv = start_serve(PIPELINE_BATCH_QUEUE="solo")  # a queue no worker serves
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-anything", max_retries=0)
    path = tmp_path / "in.jsonl"
    write_input(path, 5, "cancel")
    f = client.files.create(file=open(path, "rb"), purpose="batch")
    ids = []
    for _ in range(3):
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
        ids.append(b.id)
    wait_until(
        lambda: client.batches.retrieve(ids[0]).status == "in_progress",
        20,
        'client.batches.retrieve(ids[0]).status == "in_progress"',
    )
    cancelled = client.batches.cancel(ids[0])
    assert cancelled.status == "cancelling" and cancelled.cancelling_at
    done = poll(client, ids[0])
    assert done.status == "cancelled" and done.request_counts.failed == 5
    errs = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert [e["error"]["code"] for e in errs] == ["batch_cancelled"] * 5
    assert done.output_file_id is None
    for bid in ids[1:]:
        client.batches.cancel(bid)
        poll(client, bid)
    page1 = client.batches.list(limit=2)
    assert [b.id for b in page1.data] == ids[::-1][:2] and page1.has_more
    page2 = client.batches.list(limit=2, after=page1.data[-1].id)
    assert page2.data[0].id == ids[0]
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(ids[0])  # closed
    assert ids[0] in [b.id for b in client.batches.list().data]
    # errors: OpenAI's shapes and status codes
    with pytest.raises(openai.NotFoundError) as nf:
        client.batches.retrieve("batch_nope")
    assert nf.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as br:
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                              completion_window="24h")  # fmt: skip
    assert br.value.body["param"] == "input_file_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/nothing", completion_window="24h")
    r = httpx.post(f"{srv.url}/v1/files", files={"file": ("x.jsonl", b"{}")},
                   data={"purpose": "fine-tune"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    client.files.delete(f.id)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_a_file_with_bad_lines_fails_validation_with_each_line(
    pl: Pipeline, start_serve: Callable[..., ServeProc], tmp_path: Path
) -> None:
    srv = start_serve()
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-anything")
    path = tmp_path / "bad.jsonl"
    write_input(path, 3, "bad")
    with open(path, "a") as fh:
        fh.write('{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions",'
                 ' "body": {}}\n')  # fmt: skip
        fh.write('{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}}\n')
        fh.write("not json\n")
    f = client.files.create(file=open(path, "rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")  # fmt: skip
    b = poll(client, b.id)
    assert b.status == "failed" and b.failed_at
    assert b.errors is not None and b.errors.data is not None
    got = {(e.line, e.code) for e in b.errors.data}
    assert got == {(4, "duplicate_custom_id"), (5, "mismatched_endpoint"), (6, "invalid_json_line")}


def test_api_keys_name_the_tenant_and_scope_what_it_sees(
    served: Pipeline, start_serve: Callable[..., ServeProc], tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# key tenant\nsk-alice-0001 alice\nsk-bob-00002 bob\n")
    srv = start_serve(PIPELINE_API_KEYS=str(keys))
    alice = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-alice-0001")
    bob = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-bob-00002", max_retries=0)
    nobody = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-wrong-0003", max_retries=0)
    path = tmp_path / "in.jsonl"
    write_input(path, 3, "keys")
    f = alice.files.create(file=open(path, "rb"), purpose="batch")
    b = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                             completion_window="24h")  # fmt: skip
    b = poll(alice, b.id)
    assert b.status == "completed"
    # the tenant is the requests' fairness attribute
    rid = json.loads(alice.files.content(b.output_file_id).text.splitlines()[0])["id"]
    assert json.loads(served.record(rid)["metadata"]) == {"userid": "alice"}
    # bob sees none of it
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(b.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.content(f.id)
    assert b.id not in [x.id for x in bob.batches.list().data]
    for tail in ("", "/explain"):
        url = f"{srv.url}/v1/requests/{rid}{tail}"
        assert httpx.get(url, headers={"authorization": "Bearer sk-bob-00002"}).status_code == 404
    # the owner gets the request's explanation (pipeline explain --json)
    why = httpx.get(
        f"{srv.url}/v1/requests/{rid}/explain", headers={"authorization": "Bearer sk-alice-0001"}
    )
    assert why.status_code == 200, why.text
    data = why.json()
    assert data["id"] == rid and data["state"] == "done"
    assert [e["event"] for e in data["log"]][-1] == "done"
    with pytest.raises(openai.AuthenticationError) as au:
        nobody.batches.list()
    assert au.value.status_code == 401
    assert httpx.get(f"{srv.url}/v1/batches").status_code == 401
    # keys never reach the log
    assert "sk-alice-0001" not in srv.log.read_text()


def test_uploads_have_a_size_limit(
    pl: Pipeline, start_serve: Callable[..., ServeProc], tmp_path: Path
) -> None:
    srv = start_serve(PIPELINE_MAX_FILE_BYTES="1000")
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-anything", max_retries=0)
    path = tmp_path / "big.jsonl"
    write_input(path, 50, "big")
    with pytest.raises(openai.APIStatusError) as exc:
        client.files.create(file=open(path, "rb"), purpose="batch")
    assert exc.value.status_code == 413
    assert "big.jsonl" not in [f.filename for f in client.files.list().data]
    assert not any(p.name.startswith("file-") for p in (tmp_path / "files").iterdir())


def test_without_keys_it_refuses_a_non_loopback_address(env: dict[str, str]) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run(
        [sys.executable, "-m", "pipeline", "serve", "--host", "0.0.0.0", "--port", "1"],
        env={k: v for k, v in env.items() if k != "PIPELINE_API_KEYS"},
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "PIPELINE_API_KEYS" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_tenant_over_its_open_batches_gets_429(
    pl: Pipeline, start_serve: Callable[..., ServeProc], tmp_path: Path
) -> None:
    """``PIPELINE_BATCH_MAX_ACTIVE`` open batches per tenant (on a queue nobody serves here,
    so they stay open): one more is a 429 ``rate_limit_exceeded``; other tenants are not
    affected, and a closed batch frees its place."""
    keys = tmp_path / "keys"
    keys.write_text("sk-alice-0001 alice\nsk-bob-00002 bob\n")
    srv = start_serve(
        PIPELINE_API_KEYS=str(keys), PIPELINE_BATCH_MAX_ACTIVE="1", PIPELINE_BATCH_QUEUE="solo"
    )
    alice = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-alice-0001", max_retries=0)
    bob = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-bob-00002", max_retries=0)
    path = tmp_path / "in.jsonl"
    write_input(path, 2, "cap")

    def create(client: OpenAI) -> Any:
        f = client.files.create(file=open(path, "rb"), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
        return wait_until(
            lambda: client.batches.retrieve(b.id).status == "in_progress" and b,
            30,
            "the batch running",
        )

    first = create(alice)
    with pytest.raises(openai.RateLimitError) as exc:
        create(alice)
    assert exc.value.status_code == 429
    err = exc.value.body
    assert isinstance(err, dict) and err.get("code") == "rate_limit_exceeded"
    assert "at most 1 open batches per tenant" in str(err.get("message"))
    other = create(bob)  # bob has his own allowance
    assert alice.batches.cancel(first.id).status in ("cancelling", "cancelled")
    wait_until(
        lambda: alice.batches.retrieve(first.id).status == "cancelled",
        30,
        "alice's batch cancelled",
    )
    again = create(alice)  # the closed batch freed her place
    for client, b in ((alice, again), (bob, other)):
        client.batches.cancel(b.id)
        wait_until(
            lambda c=client, i=b.id: c.batches.retrieve(i).status == "cancelled", 30, "cancelled"
        )


def test_cancel_with_running_abort_stops_lines_in_flight(
    pl: Pipeline, start_serve: Callable[..., ServeProc], start_worker: Any, sim: SimServer,
    tmp_path: Path,
) -> None:  # fmt: skip
    """``extra_body={"running": "abort"}``: a line mid-call has its connection closed and
    lines waiting for the gate's one slot end unsent; the batch is cancelled with every line
    counted, nothing retried and no slot held. Without it, OpenAI's semantics (test above)."""
    srv = start_serve(PIPELINE_BATCH_QUEUE="parked")  # local limit 1; no node serves it yet
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-anything", max_retries=0)
    path = tmp_path / "in.jsonl"
    write_input(path, 4, "abort")
    f = client.files.create(file=open(path, "rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")  # fmt: skip
    wait_until(lambda: client.batches.retrieve(b.id).status == "in_progress", 20, "in progress")
    lines = [f"{b.id}-{i}" for i in range(1, 5)]
    for rid in lines:  # every line's first attempt stalls at the simulator
        sim.script_fault(rid, 1, mode="stall")
    with pytest.raises(openai.BadRequestError, match="running"):
        client.batches.cancel(b.id, extra_body={"running": "kill"})
    w = start_worker(pools="parked", concurrency=4)
    try:
        wait_until(
            lambda: sum(sim.stats()["attempts_by_request_id"].get(r, 0) for r in lines) == 1,
            20,
            "one line at the simulator (the others wait for the gate's one slot)",
        )
        at_sim = next(r for r in lines if sim.stats()["attempts_by_request_id"].get(r))
        cancelled = client.batches.cancel(b.id, extra_body={"running": "abort"})
        assert cancelled.status in ("cancelling", "cancelled")
        done = poll(client, b.id)
        assert done.status == "cancelled" and done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (0, 4)
        assert done.error_file_id is not None
        errs = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
        assert [e["error"]["code"] for e in errs] == ["batch_cancelled"] * 4
        wait_until(lambda: any(r == at_sim for _, r, _ in sim.hangups()), 10, "the call closed")
        attempts = sim.stats()["attempts_by_request_id"]
        assert sum(attempts.get(r, 0) for r in lines) == 1  # nothing sent after the cancel
        assert pl.explain(at_sim).log[-2].fields["running"] == "abort"
    finally:
        w.stop()
