"""A batch line's large answer (over ``PIPELINE_BODY_INLINE_MAX``, stored once in Redis, in a
key of its own) comes out whole in the batch's output file and from ``GET /v1/requests/{id}``
of ``pipeline serve`` (issue 48, item 9)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
from openai import OpenAI

from pipeline.client import Pipeline
from tests.integration.batch.conftest import ServeProc
from tests.integration.batch.test_openai_sdk import poll

BIG_TOKENS = 200_000  # ~1.2 MB of answer


def test_a_large_answer_comes_out_whole(
    served: Pipeline, start_serve: Callable[..., ServeProc], tmp_path: Path
) -> None:
    srv = start_serve()
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-anything")
    path = tmp_path / "big.jsonl"
    with open(path, "w") as fh:
        for i, tokens in enumerate([8, BIG_TOKENS, 8]):
            body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": tokens}  # fmt: skip
            line = {"custom_id": f"r-{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": body}  # fmt: skip
            fh.write(json.dumps(line) + "\n")
    f = client.files.create(file=open(path, "rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = poll(client, batch.id)
    assert batch.status == "completed" and batch.output_file_id
    lines = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in lines] == ["r-0", "r-1", "r-2"]
    big = lines[1]["response"]["body"]
    assert big["usage"]["completion_tokens"] == BIG_TOKENS
    content = big["choices"][0]["message"]["content"]
    assert len(content) > 1_000_000

    # stored once: the record's result names the body's key
    rid = lines[1]["id"]
    store = served.store_of("default")
    stored = json.loads(store.client.hget(store.keys.request(rid), "result"))
    assert "payload" not in stored and store.client.strlen(stored["payload_ref"]) > 1_000_000

    one = httpx.get(f"{srv.url}/v1/requests/{rid}", timeout=30).json()
    assert json.loads(one["result"]["payload"]) == big
