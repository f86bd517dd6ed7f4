"""Several ``pipeline serve`` on one Redis with different ``PIPELINE_FILES_DIR``: each batch
and file records the file store that holds its bytes, and a service acts only on its own
store's — it never reads another's input as "deleted", never writes a batch's output into its
own directory where nobody finds it, never deletes or sweeps another store's files. A file of
another store is a 503 naming the fix, not a 404. The store is private: 0700 and 0600."""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest
from openai import OpenAI

from pipeline.batch import BatchSettings, Files, LocalFileStore
from pipeline.batch.model import UnknownFile
from pipeline.cli.services import wait_until
from pipeline.sim import SimServer
from tests.integration.batch.conftest import ServeProc
from tests.observability import isolated

URL = "/v1/chat/completions"


def chat(cid: str) -> bytes:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": cid}]}
    return orjson.dumps({"custom_id": cid, "method": "POST", "url": URL, "body": body})


def status_of(client: OpenAI, batch_id: str) -> str:
    return str(client.batches.retrieve(batch_id).status)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_two_services_with_their_own_stores_act_only_on_their_own_batches(
    env: dict[str, str],
    sim: SimServer,
    start_serve: Callable[..., ServeProc],
    tmp_path: Path,
) -> None:
    """Service A holds the input; B (another directory) is up alone when the batch is created
    and when it is cancelled: B neither reads the input (it is not "deleted") nor assembles the
    batch's files. A, restarted, does both; its output is read from A, and B says why not.
    No worker serves the queue: the lines wait, and the cancel ends them."""
    iso = isolated(env, tmp_path, [{"queue_name": "q", "igw_base_url": sim.url}])
    shared = {k: iso.env[k] for k in ("PIPELINE_KEY_PREFIX", "PIPELINE_QUEUES")}
    shared["PIPELINE_BATCH_QUEUE"] = iso.queue("q")
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    a = start_serve(**shared, PIPELINE_FILES_DIR=str(dir_a))
    b = start_serve(**shared, PIPELINE_FILES_DIR=str(dir_b))
    via_a = OpenAI(base_url=f"{a.url}/v1", api_key="sk-x", max_retries=0)
    via_b = OpenAI(base_url=f"{b.url}/v1", api_key="sk-x", max_retries=0)
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(chat(f"c{i}") for i in range(3)) + b"\n")
    f = via_a.files.create(file=path, purpose="batch")
    # the store is private, whatever the umask
    assert mode(dir_a) == 0o700 and mode(dir_a / f.id) == 0o600

    # created through B while A is down: B leaves it to A's store, A stores its lines
    a.kill()
    batch = via_b.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h")
    a.start()
    wait_until(lambda: status_of(via_b, batch.id) != "validating", 30, "the batch stored")
    assert status_of(via_b, batch.id) == "in_progress"

    # cancelled through B while A is down: B cancels the lines, A assembles the files
    a.kill()
    via_b.batches.cancel(batch.id)
    wait_until(lambda: status_of(via_b, batch.id) == "finalizing", 30, "the lines cancelled")
    a.start()
    done = wait_until(
        lambda: (x := via_b.batches.retrieve(batch.id)).status == "cancelled" and x, 30, "closed"
    )
    assert done.error_file_id and not done.output_file_id
    assert (dir_a / done.error_file_id).exists() and not (dir_b / done.error_file_id).exists()
    errors = [json.loads(x) for x in via_a.files.content(done.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["c0", "c1", "c2"]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert mode(dir_a / done.error_file_id) == 0o600

    # B cannot serve A's files: it says so (503, the fix in the message), never a 404
    for method, where in [("GET", f"/v1/files/{done.error_file_id}/content"),
                          ("GET", f"/v1/files/{f.id}/content"),
                          ("DELETE", f"/v1/files/{f.id}")]:  # fmt: skip
        r = httpx.request(method, b.url + where)
        assert r.status_code == 503, (where, r.text)
        err = r.json()["error"]
        assert err["code"] == "file_store_mismatch" and "PIPELINE_FILES_DIR" in err["message"]
    assert via_b.files.retrieve(f.id).id == f.id  # the record is shared: it is still there
    assert (dir_a / f.id).exists()
    # B said once which batch it left to another store, and nothing failed
    log_b = b.log.read_text()
    assert log_b.count(f"batch {batch.id} is in file store") == 1, log_b
    assert "Traceback" not in log_b and "Traceback" not in a.log.read_text()


def test_a_store_sweeps_only_its_own_expired_files(
    env: dict[str, str], sim: SimServer, tmp_path: Path
) -> None:
    """Each service's sweep removes expired files; a file of another store is left to that
    store's sweep (removing its record would leave its bytes there for ever)."""
    store = isolated(env, tmp_path, [{"queue_name": "q", "igw_base_url": sim.url}]).pl.store
    settings = BatchSettings(file_ttl_s=0.2)
    a = Files(store, settings, blobs=LocalFileStore(tmp_path / "a"))
    b = Files(store, settings, blobs=LocalFileStore(tmp_path / "b"))
    assert a.store_id != b.store_id
    with a.blobs.writer("file-sweep") as fh:
        fh.write(b"{}\n")
    info = a.add("file-sweep", "a.jsonl", "batch", "")
    wait_until(lambda: a.now() > info.expires_at, 10, "the file expired")
    assert b.sweep() == 0
    assert (tmp_path / "a" / "file-sweep").exists()
    for files in (a, b):  # expired: gone for every reader
        with pytest.raises(UnknownFile):
            files.get("file-sweep")
    assert a.sweep() == 1
    assert not (tmp_path / "a" / "file-sweep").exists()
    assert not store.client.exists(a.keys.file("file-sweep"))
    assert store.client.zscore(a.keys.files_expiry(), "file-sweep") is None
