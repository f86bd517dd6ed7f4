"""The batch page of ``pipeline serve`` at ``/``, rendered by headless Chromium: every batch
with its progress bar, counts, status, age and ETA (filled in by the page's own refresh from
``/ui/batches``). The screenshot is saved as ``artifacts/batches-page.png``."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import httpx
from openai import OpenAI

from pipeline.batch import Batches
from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from tests.integration.batch.conftest import ServeProc
from tests.integration.batch.test_openai_sdk import poll, write_input
from tests.integration.test_flower import ARTIFACTS, browse


def test_the_batch_page_shows_every_batch_with_progress(
    served: Pipeline, start_serve: Callable[..., ServeProc], tmp_path: Path
) -> None:
    srv = start_serve(PIPELINE_BATCH_QUEUE="solo")  # its batches wait: nobody serves "solo"
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="sk-anything")
    path = tmp_path / "in.jsonl"
    write_input(path, 40, "page")
    f = client.files.create(file=open(path, "rb"), purpose="batch")
    waiting = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")  # fmt: skip
    wait_until(
        lambda: client.batches.retrieve(waiting.id).status == "in_progress",
        20,
        'client.batches.retrieve(waiting.id).status == "in_progress"',
    )
    # one that ran (default queue, served) and one cancelled
    b = Batches(served)
    ran = b.submit_batch([json.loads(x) for x in path.read_text().splitlines()[:10]]).wait(30)
    cancelled = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
    wait_until(
        lambda: client.batches.retrieve(cancelled.id).status == "in_progress",
        20,
        'client.batches.retrieve(cancelled.id).status == "in_progress"',
    )
    client.batches.cancel(cancelled.id)
    poll(client, cancelled.id)

    ui = httpx.get(f"{srv.url}/ui/batches").json()
    assert {waiting.id, ran.id, cancelled.id} <= {x["id"] for x in ui["data"]}
    assert ui["now"] > 0

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "batches-page.png"
    shot.unlink(missing_ok=True)
    browse(srv.url + "/", f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 10_000
    dom = browse(srv.url + "/", "--dump-dom")
    for bid, status in ((waiting.id, "in_progress"), (ran.id, "completed"),
                        (cancelled.id, "cancelled")):  # fmt: skip
        m = re.search(rf"<tr id=\"b-{bid}\">(.*?)</tr>", dom)
        assert m, f"{bid} not on the page"
        row = m.group(1)
        assert f">{status}<" in row
        assert 'class="bar"' in row
    ran_row = re.search(rf"<tr id=\"b-{ran.id}\">(.*?)</tr>", dom)
    assert ran_row and ">100 %<" in ran_row.group(1) and ">done<" in ran_row.group(1)
    waiting_row = re.search(rf"<tr id=\"b-{waiting.id}\">(.*?)</tr>", dom)
    assert waiting_row and ">0 %<" in waiting_row.group(1) and ">40<" in waiting_row.group(1)
    assert "batch(es), updated" in dom
    client.batches.cancel(waiting.id)
    poll(client, waiting.id)
