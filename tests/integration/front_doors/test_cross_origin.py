"""A web page cannot drive or read the default ``pipeline serve`` (no keys, loopback) through
its visitor's browser. Headless Chromium visits an attacker's page while a batch runs (its
lines held at the simulator), and afterwards the batch still runs, nothing was created and
nothing was read:

- a page of another origin (another local port) sends a ``text/plain`` form and no-cors
  ``fetch`` POSTs: cancel with abort, create a batch, upload a file;
- a page at a DNS-rebound name (``evil.test`` mapped to a loopback address on the service's
  own port: same origin as far as the browser knows) reads the batches and a file's content.
"""

from __future__ import annotations

import http.server
import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from pipeline.batch import Batches
from pipeline.cli.services import free_port
from pipeline.client import Pipeline
from pipeline.sim import SimServer
from tests.conftest import held
from tests.integration.batch.conftest import ServeProc
from tests.integration.test_flower import browse

LINES = 12


class Site:
    """An attacker's HTTP server: ``pages`` by path; any other GET is relayed to ``relay`` with
    the browser's headers (its Host among them), as a DNS-rebound name reaches the service."""

    def __init__(self, host: str, port: int, pages: dict[str, str], relay: str = "") -> None:
        self.url = f"http://{host}:{port}"
        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                page = pages.get(self.path)
                if page is not None:
                    self.answer(200, {"content-type": "text/html"}, page.encode())
                elif relay:
                    got = httpx.get(relay + self.path, headers=dict(self.headers.items()))
                    site.relayed.append((self.path, got.status_code))
                    self.answer(got.status_code, {"content-type": "text/plain"}, got.content)
                else:
                    self.answer(404, {}, b"")

            def answer(self, status: int, headers: dict[str, str], body: bytes) -> None:
                self.send_response(status)
                for k, v in {**headers, "content-length": str(len(body))}.items():
                    self.send_header(k, v)
                self.send_header("connection", "close")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.relayed: list[tuple[str, int]] = []
        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @contextmanager
    def running(self) -> Iterator[Site]:
        self.thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()


def attack_page(serve: str, batch_id: str, file_id: str) -> str:
    """Every write a page of another origin can send without CORS's consent: a text/plain
    form (into a frame, so the page stays), and no-cors fetches with a text/plain body or a
    multipart form. The page notes each step and ends with ``attack-done``."""
    cancel = f"{serve}/v1/batches/{batch_id}/cancel"
    create = json.dumps(
        {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    )
    return f"""<!doctype html><html><body><pre id="log"></pre>
<iframe name="sink" id="sink"></iframe>
<form id="f" method="POST" target="sink" enctype="text/plain" action="{cancel}">
<input name='{{"running":"abort","x":"' value='"}}'></form>
<script>
const log = t => document.getElementById("log").textContent += t + "\\n";
async function send(what, url, init) {{
  try {{ await fetch(url, {{method: "POST", mode: "no-cors", ...init}}); log(what + " sent"); }}
  catch (e) {{ log(what + " failed: " + e); }}
}}
(async () => {{
  await send("cancel", {json.dumps(cancel)},
             {{headers: {{"Content-Type": "text/plain"}}, body: '{{"running":"abort"}}'}});
  await send("create", {json.dumps(serve + "/v1/batches")},
             {{headers: {{"Content-Type": "text/plain"}}, body: {json.dumps(create)}}});
  const form = new FormData();
  form.append("purpose", "batch");
  form.append("file", new Blob(['{{"custom_id":"evil"}}\\n']), "evil.jsonl");
  await send("upload", {json.dumps(serve + "/v1/files")}, {{body: form}});
  await new Promise(done => {{
    document.getElementById("sink").onload = done;
    document.getElementById("f").submit();
  }});
  log("form sent");
  log("attack-done");
}})();
</script></body></html>"""


def rebind_page(file_id: str) -> str:
    """Same-origin reads at the rebound name: what each answered goes into the page."""
    paths = ["/v1/batches", "/v1/files", f"/v1/files/{file_id}/content", "/ui/batches", "/"]
    return f"""<!doctype html><html><body><pre id="log"></pre><script>
const log = t => document.getElementById("log").textContent += t + "\\n";
(async () => {{
  for (const path of {json.dumps(paths)}) {{
    try {{ const r = await fetch(path); log(path + " " + r.status + " " + await r.text()); }}
    catch (e) {{ log(path + " failed: " + e); }}
  }}
  log("rebind-done");
}})();
</script></body></html>"""


@pytest.fixture
def running(
    served: Pipeline, env: dict[str, str], sim: SimServer, tmp_path: Path
) -> Iterator[tuple[ServeProc, OpenAI, str, str]]:
    """A service, a batch that runs (its lines held at the simulator until the test has
    looked; then released, and the batch must complete) and an uploaded file."""
    srv = ServeProc({**env, "PIPELINE_FILES_DIR": str(tmp_path / "files")}, tmp_path / "serve.log")
    name = f"xorigin-{uuid.uuid4().hex[:8]}"
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "sim-model", "messages": [{"role": "user", "content": f"secret {i}"}]},
         "headers": held(name)}
        for i in range(LINES)
    ]  # fmt: skip
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    batches = Batches(served)
    try:
        client = OpenAI(base_url=f"{srv.start().url}/v1", api_key="sk-anything", max_retries=0)
        with open(path, "rb") as fh:
            f = client.files.create(file=fh, purpose="batch")
        batch = batches.submit_batch(lines)
        sim.wait_held(name, 1)
        try:
            yield srv, client, batch.id, f.id
        finally:
            sim.release(name)
            done = batches.wait(batch.id, timeout=60)
            assert done.status == "completed" and done.request_counts.completed == LINES, done
    finally:
        srv.stop()


def listed(client: OpenAI) -> tuple[list[str], list[str]]:
    """Every batch and file the service lists."""
    return [x.id for x in client.batches.list(limit=100).data], [
        x.id for x in client.files.list().data
    ]


def still_running(client: OpenAI, batch_id: str) -> None:
    b = client.batches.retrieve(batch_id)
    assert b.status == "in_progress" and b.cancelling_at is None, b


def test_a_page_of_another_origin_cannot_cancel_create_or_upload(
    running: tuple[ServeProc, OpenAI, str, str],
) -> None:
    srv, client, batch_id, file_id = running
    page = attack_page(srv.url, batch_id, file_id)
    before = listed(client)
    with Site("127.0.0.1", free_port(), {"/attack.html": page}).running() as site:
        dom = browse(site.url + "/attack.html", "--dump-dom", "--no-proxy-server")
    assert "attack-done" in dom, dom  # every request was sent and answered
    still_running(client, batch_id)
    assert listed(client) == before  # no batch, no file made
    refused = [x for x in srv.log.read_text().splitlines() if "refused POST" in x]
    assert len(refused) == 4, refused  # cancel, create, upload, the form
    assert all(": 403 " in x and "cross-origin" in x for x in refused), refused
    assert "Traceback" not in srv.log.read_text()


def test_a_dns_rebound_page_reads_nothing(running: tuple[ServeProc, OpenAI, str, str]) -> None:
    """The attacker's name resolves to a loopback address; its server relays to the service
    on the same port, as the rebound name would reach it: every answer is a 400."""
    srv, client, batch_id, file_id = running
    port = srv.port
    pages = {"/rebind.html": rebind_page(file_id)}
    before = listed(client)
    with Site("127.0.0.2", port, pages, relay=srv.url).running() as site:
        dom = browse(
            f"http://evil.test:{port}/rebind.html",
            "--dump-dom",
            "--no-proxy-server",
            "--host-resolver-rules=MAP evil.test 127.0.0.2",
        )
    start = '<pre id="log">'
    log = dom[dom.index(start) + len(start) : dom.index("</pre>")]
    assert "rebind-done" in log, dom
    assert batch_id not in log and "secret" not in log, log  # no listing, no file content
    assert [x.split()[1] for x in log.splitlines() if x.startswith("/")] == ["400"] * 5, log
    assert {status for _, status in site.relayed} == {400}, site.relayed  # (and the favicon)
    still_running(client, batch_id)
    assert listed(client) == before
