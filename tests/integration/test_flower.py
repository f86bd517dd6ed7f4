"""Flower shows the truth about requests and gates: a real Flower (``pipeline flower``) against
a real worker node, checked through Flower's REST API and its tasks page in headless Chromium
(Debian's ``chromium``; ``.ci/system-deps``, which ``make test`` and ``.ci/run`` call, installs
it when missing). The page's screenshot is saved under ``artifacts/``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from pipeline.cli.services import wait_until
from pipeline.sim import SimServer
from tests.conftest import ROOT, WorkerProc, assert_idle, held, quota
from tests.observability import Isolated, free_port, isolated, start_node, total

ARTIFACTS = ROOT / "artifacts"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,900",
    "--virtual-time-budget=5000",
]


class Flower:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def get(self, path: str, **params: Any) -> Any:
        r = httpx.get(self.url + path, params=params, timeout=10)
        assert r.status_code == 200, f"{path}: {r.status_code} {r.text[:500]}"
        return r.json() if "json" in r.headers.get("content-type", "") else r.text

    def task(self, rid: str) -> dict[str, Any] | None:
        r = httpx.get(f"{self.url}/api/task/info/{rid}", timeout=10)
        return r.json() if r.status_code == 200 else None


@pytest.fixture
def iso(env: dict[str, str], sim: SimServer, tmp_path: Path) -> Iterator[Isolated]:
    wait_quota = {"gate_type": "wait-on-refuse", "gate_params": {"gate": quota(1)}}
    i = isolated(
        env,
        tmp_path,
        [
            {"queue_name": "f", "igw_base_url": sim.url},
            {"queue_name": "quota", "igw_base_url": sim.url, **quota(1)},
            {"queue_name": "park", "igw_base_url": sim.url, **wait_quota},
        ],
    )
    yield i
    assert_idle(i.pl)


@pytest.fixture
def flower(iso: Isolated, tmp_path: Path) -> Iterator[Flower]:
    """``pipeline flower`` on loopback, open (no basic auth), REST API enabled."""
    port = free_port()
    log = tmp_path / "flower.log"
    fh = open(log, "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "flower", "--port", str(port)],
        env={**iso.env, "FLOWER_UNAUTHENTICATED_API": "true"},
        cwd=ROOT,
        stdout=fh,
        stderr=subprocess.STDOUT,
    )
    f = Flower(proc, f"http://127.0.0.1:{port}", log)

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"flower exited: {log.read_text()[-3000:]}")
        try:
            return httpx.get(f.url + "/healthcheck", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, 30, "flower", interval=0.1)
    yield f
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "chromium is required (apt-get install -y chromium; .ci/system-deps installs it)"
    return exe


def browse(url: str, *args: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run(
            [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def page_showing(url: str, needles: list[str], timeout: float = 90.0) -> str:
    """The page's DOM once it contains every one of ``needles``: Flower's tasks table fills
    in from a request the page makes after loading, and a browser on a busy machine can dump
    the DOM before that answer arrived; load the page again until it shows them. The last
    DOM is kept in ``artifacts/`` when they never show."""
    last = [""]

    def shown() -> str | None:
        last[0] = dom = browse(url, "--dump-dom")
        return dom if all(n in dom for n in needles) else None

    try:
        return wait_until(shown, timeout, f"{needles} on {url}", interval=0.5)  # type: ignore[no-any-return]
    except (AssertionError, TimeoutError):
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "flower-page-last.html").write_text(last[0])
        raise


def final(flower: Flower, rid: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        t = flower.task(rid)
        return t if t and t["state"] in ("SUCCESS", "FAILURE") else None

    return wait_until(done, 20, f"final state of {rid} in flower", interval=0.1)  # type: ignore[no-any-return]


def task_events_on(flower: Flower, pl: Any, queue: str) -> None:
    """Workers send task events only once a monitor asks (Celery's default): Flower asks
    every 5 s, so a node started after Flower shows its tasks within seconds. Probe until a
    request's task reaches Flower."""

    def seen() -> bool:
        probe = pl.submit({"prompt": "probe"}, queue=queue)
        assert pl.wait(probe.id, 10).ok
        try:
            wait_until(
                lambda: (flower.task(probe.id) or {}).get("state") == "SUCCESS",
                1.0,
                f"{probe.id} a success in flower",
            )
        except TimeoutError:
            return False  # a new probe: the events may have been asked for after this one
        return True

    wait_until(seen, 30, "task events from the new node in flower", interval=0.1)


def test_flower_shows_requests_retries_and_gate_decisions(
    iso: Isolated,
    flower: Flower,
    start_worker: Callable[..., WorkerProc],
    sim: SimServer,
) -> None:
    # a look-ahead attempt over its quota parks 0.2 s, then is refused and goes back (room
    # for the look-ahead attempts: a tenant at its quota gets them only from free slots)
    w, _ = start_node(start_worker, iso, concurrency=8, extra_env={"PIPELINE_PARK_S": "0.2"})
    try:
        pl, f = iso.pl, iso.queue("f")
        task_events_on(flower, pl, f)
        ok = pl.submit({"prompt": "ok"}, queue=f, priority=7)
        retried = pl.submit(
            {"prompt": "retry"}, queue=f, headers={"x-sim-fail-first": "2"}, priority=3
        )
        bad = pl.submit(
            {"prompt": "bad"},
            queue=f,
            headers={"x-sim-fail-first": "1", "x-sim-fail-status": "400"},
        )
        # users u1's and u2's one slot each (a concurrency-1 quota; the two queues share the
        # keys) are held at the simulator until the test has seen the gate's decisions: u1's
        # next request (sent past the limit) parks 0.2 s for u1's key and is refused on the
        # quota queue, u2's is parked (a Wait) on the wait-on-refuse queue
        user = {"metadata": {"userid": "u1"}}
        holder = pl.submit(
            {"prompt": "q1"}, queue=iso.queue("quota"), headers=held(iso.tag), **user
        )
        sim.wait_held(iso.tag)
        refused = pl.submit({"prompt": "q2"}, queue=iso.queue("quota"), **user)
        other = {"metadata": {"userid": "u2"}}
        holder2 = pl.submit(
            {"prompt": "p1"}, queue=iso.queue("park"), headers=held(iso.tag + "2"), **other
        )
        sim.wait_held(iso.tag + "2")
        parked = pl.submit({"prompt": "p2"}, queue=iso.queue("park"), **other)

        # while its user's slot is held, the parked request's task shows the gate's event
        def parked_state() -> bool:
            t = flower.task(parked.id)
            return bool(t and t["state"] == "GATE-WAITING")

        wait_until(parked_state, 20, "GATE-WAITING in flower", interval=0.05)
        wait_until(lambda: int(pl.record(refused.id).get("dispatches", 0)) >= 2, 20, "a refusal")
        assert sim.release(iso.tag) == 1 and sim.release(iso.tag + "2") == 1

        for req in (ok, retried, refused, holder, holder2, parked):
            t = final(flower, req.id)
            assert t["state"] == "SUCCESS", t
            assert t["name"] == "pipeline.infer"
            assert req.id in t["args"] and t["worker"] == w.name
            assert "'status_code': 200" in t["result"]
        t = flower.task(ok.id)
        assert t is not None
        assert f"'queue': '{f}'" in t["kwargs"] and "'priority': 7" in t["kwargs"]
        assert "'attempt': 1" in t["kwargs"] and t["retried"] is None
        # the retried request went through RETRY with the reason, its last attempt is #3
        t = flower.task(retried.id)
        assert t is not None and t["retried"] is not None
        assert "HTTP 503" in t["exception"] and "'attempt': 3" in t["kwargs"]
        t = final(flower, bad.id)
        assert t["state"] == "FAILURE" and "HTTP 400" in t["exception"]
        # a request cancelled with running="abort" mid-call: its task shows REVOKED
        aborted = pl.submit({"prompt": "abort"}, queue=f, headers=held(iso.tag + "3"))
        sim.wait_held(iso.tag + "3")
        assert pl.cancel(aborted.id, running="abort")
        wait_until(
            lambda: (flower.task(aborted.id) or {}).get("state") == "REVOKED",
            20,
            "REVOKED in flower",
            interval=0.1,
        )
        t = flower.task(refused.id)
        assert t is not None and "gate refused (quota_exhausted)" in t["exception"]
        # every gate event reached flower: counted per worker and type in flower's /metrics
        text = flower.get("/metrics")
        from prometheus_client.parser import text_string_to_metric_families

        samples = [
            (s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        ]
        ev = "flower_events_total"
        assert total(samples, ev, worker=w.name, type="task-gate-refused") >= 1
        assert total(samples, ev, worker=w.name, type="task-gate-waiting") >= 1
        assert total(samples, ev, worker=w.name, type="task-retried") >= 3

        # the tasks page, rendered by a real browser, lists them with their final states. It
        # shows 15 tasks, the latest first, of every worker on the broker (those of other test
        # sessions on this Redis too, once Flower turned their events on): ask for this node's
        tasks_page = f"{flower.url}/tasks?worker={quote(w.name)}"
        dom = page_showing(tasks_page, [r.id for r in (ok, retried, bad, refused, parked)])
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "flower-tasks.png"
        shot.unlink(missing_ok=True)
        browse(tasks_page, f"--screenshot={shot}")
        assert shot.exists() and shot.stat().st_size > 10_000
        assert "pipeline.infer" in dom and "SUCCESS" in dom and "FAILURE" in dom
        # args and kwargs columns: request id, queue, priority and attempt number
        assert f"'queue': '{f}', 'priority': 3, 'attempt': 3" in dom.replace("&#39;", "'")
        assert "HTTP 400" in dom
        # and a task's own page shows the retry's reason
        page_showing(f"{flower.url}/task/{refused.id}", ["gate refused (quota_exhausted)"])
    finally:
        w.stop()


def test_flower_refuses_to_listen_beyond_loopback_without_auth(iso: Isolated) -> None:
    env = {k: v for k, v in iso.env.items() if k != "FLOWER_BASIC_AUTH"}
    out = subprocess.run(
        [sys.executable, "-m", "pipeline", "flower", "--address", "0.0.0.0", "--port", "1"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "FLOWER_BASIC_AUTH" in out.stderr
    compose = (ROOT / "docker-compose.yml").read_text()
    assert "FLOWER_BASIC_AUTH: ${FLOWER_BASIC_AUTH:?" in compose
    assert os.path.exists(ROOT / "docker-compose.yml")
