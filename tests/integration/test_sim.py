"""Tests for the model-server simulator, over real HTTP (httpx and raw sockets)."""

from __future__ import annotations

import asyncio
import json
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from pipeline.cli.services import wait_until
from pipeline.sim import server as server_module
from pipeline.sim.server import SimConfig, SimServer, _Clock

COMPLETIONS = "/v1/completions"
BODY = {"prompt": "hello world", "max_tokens": 4}


@pytest.fixture
def start() -> Iterator[Callable[..., SimServer]]:
    """Factory: start a simulator with the given SimConfig fields; all are stopped afterwards."""
    servers: list[SimServer] = []

    def _start(**fields: Any) -> SimServer:
        server = SimServer(SimConfig(**fields)).start_in_thread()
        servers.append(server)
        return server

    yield _start
    for server in servers:
        server.stop()


def post(
    url: str,
    headers: dict[str, str] | None = None,
    body: dict[str, Any] | None = None,
    timeout: float = 10.0,
) -> httpx.Response:
    """POST a completion request on a fresh connection."""
    return httpx.post(url + COMPLETIONS, json=body or BODY, headers=headers, timeout=timeout)


def gauges(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics").text
    running = re.search(r'^vllm:num_requests_running\{model_name="sim-model"\} (\S+)$', text, re.M)
    waiting = re.search(r'^vllm:num_requests_waiting\{model_name="sim-model"\} (\S+)$', text, re.M)
    assert running and waiting, text
    return float(running.group(1)), float(waiting.group(1))


def read_response(sock: socket.socket, buf: bytearray) -> tuple[int, dict[str, str], bytes]:
    """Read one Content-Length framed HTTP response from ``sock`` (``buf`` keeps leftovers)."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before a full response head"
        buf += chunk
    end = buf.index(b"\r\n\r\n")
    status_line, *lines = buf[:end].decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines)}
    total = end + 4 + int(headers["content-length"])
    while len(buf) < total:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        buf += chunk
    body = bytes(buf[end + 4 : total])
    del buf[:total]
    return int(status_line.split()[1]), headers, body


def raw_request(path: str, body: dict[str, Any] | None = None, extra: str = "") -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    method = "POST" if body is not None else "GET"
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n{extra}\r\n"
    return head.encode() + data


def test_completion_shape_and_determinism(start: Callable[..., SimServer]) -> None:
    sim = start()
    with httpx.Client(base_url=sim.url) as client:
        payload = {"model": "m1", "prompt": "hello world", "max_tokens": 5}
        first = client.post(COMPLETIONS, json=payload)
        again = client.post(COMPLETIONS, json=payload).json()
        other = client.post(COMPLETIONS, json={"prompt": "something else"}).json()
    assert first.status_code == 200
    assert first.headers["content-type"] == "application/json"
    data = first.json()
    assert data["id"].startswith("cmpl-") and data["object"] == "text_completion"
    assert isinstance(data["created"], int) and abs(data["created"] - time.time()) < 60
    assert data["model"] == "m1"
    choice = data["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert len(choice["text"].split()) == 5
    assert data["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    assert again["choices"][0]["text"] == choice["text"] and again["id"] != data["id"]
    assert other["model"] == "sim-model" and other["choices"][0]["text"] != choice["text"]
    assert len(other["choices"][0]["text"].split()) == 16  # default max_tokens


def test_chat_completion_shape(start: Callable[..., SimServer]) -> None:
    sim = start()
    messages = [{"role": "user", "content": "hi there"}]
    resp = httpx.post(sim.url + "/v1/chat/completions", json={"messages": messages})
    assert resp.status_code == 200
    data = resp.json()
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    assert data["model"] == "sim-model"
    message = data["choices"][0]["message"]
    assert message["role"] == "assistant" and len(message["content"].split()) == 16
    assert data["usage"]["completion_tokens"] == 16
    bad = httpx.post(sim.url + "/v1/chat/completions", json={"messages": "nope"})
    assert bad.status_code == 400


def test_a_chat_templates_tokens_count_in_the_prompt(start: Callable[..., SimServer]) -> None:
    """As a real server counts a chat template: tokens per message and per prompt, from the
    config or ``x-sim-template-tokens: M[,P]``; a plain completion has no template."""
    sim = start(template_message_tokens=5, template_prompt_tokens=3)
    two = {"messages": [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": "hi there"}], "max_tokens": 1}  # fmt: skip
    with httpx.Client(base_url=sim.url) as client:

        def prompt_tokens(path: str, body: dict[str, Any], **headers: str) -> Any:
            resp = client.post(path, json=body, headers=headers)
            return resp.json()["usage"]["prompt_tokens"] if resp.status_code == 200 else resp

        assert prompt_tokens("/v1/chat/completions", two) == 4 + 2 * 5 + 3
        assert prompt_tokens("/v1/chat/completions", two, **{"x-sim-template-tokens": "1"}) == 6
        assert prompt_tokens(COMPLETIONS, {"prompt": "hi there", "max_tokens": 1}) == 2
        for bad in ("x", "-1", "1,2,3"):
            resp = prompt_tokens("/v1/chat/completions", two, **{"x-sim-template-tokens": bad})
            assert resp.status_code == 400, bad


def test_models_health_404_405_and_bad_json(start: Callable[..., SimServer]) -> None:
    sim = start()
    with httpx.Client(base_url=sim.url) as client:
        assert client.get("/health").json() == {"status": "ok"}
        models = client.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == "sim-model"
        missing, wrong_method = client.get("/nope"), client.get(COMPLETIONS)
        assert missing.status_code == 404 and wrong_method.status_code == 405
        assert missing.json()["error"]["type"] == "not_found_error"  # OpenAI-shaped
        assert wrong_method.json()["error"]["code"] == 405
        bad = client.post(COMPLETIONS, content=b"{not json", headers={"x-request-id": "b"})
        neg = client.post(COMPLETIONS, json={"max_tokens": -1})
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"
    assert isinstance(bad.json()["error"]["message"], str)
    assert neg.status_code == 400
    stats = sim.stats()
    assert stats["requests"] == 2 and stats["by_status"] == {"400": 2}
    assert stats["attempts_by_request_id"] == {"b": 1}


def test_metrics_format(start: Callable[..., SimServer]) -> None:
    sim = start()
    for _ in range(3):
        post(sim.url)
    resp = httpx.get(sim.url + "/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    lines = resp.text.splitlines()
    for name, kind in [
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:request_success_total", "counter"),
    ]:
        assert any(ln.startswith(f"# HELP {name} ") for ln in lines), name
        assert f"# TYPE {name} {kind}" in lines
    assert 'vllm:request_success_total{model_name="sim-model"} 3' in lines
    assert gauges(sim.url) == (0, 0)


def test_queue_overload_gauges_follow_load(start: Callable[..., SimServer]) -> None:
    sim = start(max_concurrency=2, overload="queue")
    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(post, sim.url, {"x-sim-hold": "q"}) for _ in range(5)]
        sim.wait_held("q", 2)
        wait_until(lambda: gauges(sim.url) == (2, 3), 5, "gauges(sim.url) == (2, 3)")
        assert sim.stats()["waiting"] == 3
        assert sim.release("q") == 2  # the three queued ones pass: "q" is released
        statuses = [f.result().status_code for f in futures]
    assert statuses == [200] * 5
    assert gauges(sim.url) == (0, 0)
    stats = sim.stats()
    assert stats["max_concurrency_observed"] == 2 and stats["in_flight"] == 0
    assert stats["by_status"] == {"200": 5}


def test_queued_request_abandoned_by_client_is_forgotten(start: Callable[..., SimServer]) -> None:
    sim = start(max_concurrency=1, overload="queue")
    with ThreadPoolExecutor(2) as pool:
        holder = pool.submit(post, sim.url, {"x-sim-hold": "h"})
        sim.wait_held("h")
        with pytest.raises(httpx.ReadTimeout):  # queued behind the holder until it gives up
            httpx.post(sim.url + COMPLETIONS, json=BODY, timeout=0.2)
        wait_until(lambda: sim.stats()["waiting"] == 0, 5, 'sim.stats()["waiting"] == 0')
        assert sim.stats()["in_flight"] == 1
        sim.release("h")
        assert holder.result().status_code == 200
    stats = sim.stats()
    assert stats["in_flight"] == 0 and stats["max_concurrency_observed"] == 1
    assert stats["requests"] == 2 and stats["by_status"] == {"200": 1}


@pytest.mark.parametrize(
    ("mode", "retry_after", "header"), [("429", 1.0, "1"), ("503", 2.5, "2.5")]
)
def test_overload_rejects_with_retry_after(
    start: Callable[..., SimServer], mode: str, retry_after: float, header: str
) -> None:
    sim = start(max_concurrency=2, overload=mode, overload_retry_after_s=retry_after)
    with ThreadPoolExecutor(2) as pool:
        holders = [pool.submit(post, sim.url, {"x-sim-hold": "h"}) for _ in range(2)]
        sim.wait_held("h", 2)
        rejected = [post(sim.url) for _ in range(4)]
        assert sim.release("h") == 2
        assert all(h.result().status_code == 200 for h in holders)
    assert [r.status_code for r in rejected] == [int(mode)] * 4
    assert all(r.headers["retry-after"] == header for r in rejected)
    assert rejected[0].json()["error"]["message"]
    assert post(sim.url).status_code == 200  # slots were released
    stats = sim.stats()
    assert stats["max_concurrency_observed"] == 2 and stats["in_flight"] == 0
    assert stats["requests"] == 7 and stats["by_status"] == {"200": 3, mode: 4}


def test_held_requests_stay_in_flight_until_released(start: Callable[..., SimServer]) -> None:
    """``x-sim-hold: NAME`` keeps a request open (in flight, in the gauges) until NAME is
    released; releasing answers them as usual and opens the name for later requests."""
    sim = start()
    unheld = post(sim.url).json()
    with ThreadPoolExecutor(3) as pool:
        a = [pool.submit(post, sim.url, {"x-sim-hold": "a"}) for _ in range(2)]
        b = pool.submit(post, sim.url, {"x-sim-hold": "b"})
        sim.wait_held("a", 2)
        sim.wait_held("b", 1)
        stats = sim.stats()
        assert stats["held"] == {"a": 2, "b": 1} and stats["in_flight"] == 3
        assert gauges(sim.url) == (3, 0)
        assert not any(f.done() for f in [*a, b])
        assert sim.release("a") == 2
        answers = [f.result() for f in a]
        assert [r.status_code for r in answers] == [200, 200]
        assert answers[0].json()["choices"] == unheld["choices"]  # the usual body
        assert post(sim.url, {"x-sim-hold": "a"}, timeout=30).status_code == 200  # "a" is open
        assert sim.stats()["held"] == {"b": 1} and not b.done()
        assert sim.release("nobody") == 0
        # the same over HTTP, for a simulator in another process
        resp = httpx.post(sim.url + "/sim/release", json={"name": "b"})
        assert resp.status_code == 200 and resp.json() == {"released": 1}
        assert b.result().status_code == 200
    for bad in ({}, {"name": ""}, {"name": 3}):
        assert httpx.post(sim.url + "/sim/release", json=bad).status_code == 400
    stats = sim.stats()
    assert stats["held"] == {} and stats["in_flight"] == 0 and stats["by_status"] == {"200": 5}


def test_wait_held_times_out(start: Callable[..., SimServer]) -> None:
    sim = start()
    with pytest.raises(TimeoutError, match="0 of 1 requests held under 'x'"):
        sim.wait_held("x", 1, timeout_s=0.05)


def test_reset_answers_held_requests_and_stop_ends_them(start: Callable[..., SimServer]) -> None:
    """Held requests never outlive the test: ``reset()`` answers them (and closes the names it
    opened), a client that hangs up takes its request out of the hold, ``stop()`` ends it."""
    sim = start()
    with ThreadPoolExecutor(2) as pool:
        two = [pool.submit(post, sim.url, {"x-sim-hold": name}) for name in ("x", "y")]
        sim.wait_held("x")
        sim.wait_held("y")
        assert sim.release_all() == 2
        assert [f.result().status_code for f in two] == [200, 200]
        held = pool.submit(post, sim.url, {"x-sim-hold": "r"})
        sim.wait_held("r")
        sim.reset()
        assert held.result().status_code == 200
        assert sim.stats()["held"] == {}
        with socket.create_connection(("127.0.0.1", sim.port), timeout=5) as sock:
            sock.sendall(raw_request(COMPLETIONS, BODY, "x-sim-hold: r\r\n"))
            sim.wait_held("r")  # held again: reset closed the name
        wait_until(
            lambda: sim.stats()["held"] == {} and sim.stats()["in_flight"] == 0,
            5,
            'sim.stats()["held"] == {} and sim.stats()["in_flight"] == 0',
        )
        again = pool.submit(post, sim.url, {"x-sim-hold": "r"})
        sim.wait_held("r")
        sim.stop()
        with pytest.raises(httpx.RemoteProtocolError):
            again.result()


def test_a_request_is_held_at_most_the_cap(
    start: Callable[..., SimServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "HOLD_CAP_S", 0.05)
    sim = start()
    assert post(sim.url, {"x-sim-hold": "forgotten"}, timeout=30).status_code == 200
    assert sim.stats()["held"] == {}


def test_max_concurrency_observed_is_exact_without_limit(start: Callable[..., SimServer]) -> None:
    sim = start()
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(post, sim.url, {"x-sim-hold": "h"}) for _ in range(6)]
        sim.wait_held("h", 6)
        assert sim.stats()["in_flight"] == 6
        sim.release("h")
        assert all(f.result().status_code == 200 for f in futures)
    stats = sim.stats()
    assert stats["max_concurrency_observed"] == 6 and stats["in_flight"] == 0


def test_latency_config_and_header_override(start: Callable[..., SimServer]) -> None:
    sim = start(latency_ms=60, itl_ms=10)
    began = time.monotonic()
    assert post(sim.url).status_code == 200  # 60 + 4 tokens * 10 ms
    assert time.monotonic() - began >= 0.1
    slow = start(latency_ms=600_000)  # ten minutes: only the override answers within 30 s
    assert post(slow.url, {"x-sim-latency-ms": "0"}, timeout=30).status_code == 200


def test_a_client_that_hangs_up_during_the_latency_frees_its_slot(
    start: Callable[..., SimServer],
) -> None:
    sim = start(latency_ms=60_000)
    with pytest.raises(httpx.ReadTimeout):
        post(sim.url, timeout=0.2)
    wait_until(lambda: sim.stats()["in_flight"] == 0, 5, 'sim.stats()["in_flight"] == 0')
    stats = sim.stats()
    assert stats["requests"] == 1 and stats["by_status"] == {}  # never answered
    assert stats["max_concurrency_observed"] == 1


def test_failure_rate_is_seeded(start: Callable[..., SimServer]) -> None:
    def statuses(seed: int) -> list[int]:
        sim = start(failure_rate=0.3, failure_status=500, seed=seed)
        with httpx.Client(base_url=sim.url) as client:
            return [client.post(COMPLETIONS, json=BODY).status_code for _ in range(60)]

    first, same, other = statuses(7), statuses(7), statuses(8)
    assert first == same and first != other
    assert set(first) == {200, 500} and 5 <= first.count(500) <= 35


def test_header_scripted_faults(start: Callable[..., SimServer]) -> None:
    sim = start()
    headers = {
        "x-request-id": "job-1",
        "x-sim-fail-first": "2",
        "x-sim-fail-status": "429",
        "x-sim-retry-after": "3",
    }
    with httpx.Client(base_url=sim.url) as client:
        responses = [client.post(COMPLETIONS, json=BODY, headers=headers) for _ in range(3)]
        other = client.post(COMPLETIONS, json=BODY, headers={**headers, "x-request-id": "job-2"})
        default = client.post(
            COMPLETIONS, json=BODY, headers={"x-request-id": "job-3", "x-sim-fail-first": "1"}
        )
    assert [r.status_code for r in responses] == [429, 429, 200]
    assert [r.headers.get("retry-after") for r in responses] == ["3", "3", None]
    assert other.status_code == 429  # its own attempt counter
    assert default.status_code == 503 and "retry-after" not in default.headers
    stats = sim.stats()
    assert stats["attempts_by_request_id"] == {"job-1": 3, "job-2": 1, "job-3": 1}
    assert stats["by_status"] == {"200": 1, "429": 3, "503": 1}


def test_faults_scripted_by_endpoint_and_api(start: Callable[..., SimServer]) -> None:
    sim = start()
    spec = {"id": "job-9", "fail_first": 1, "status": 500, "retry_after": 2, "mode": "status"}
    with httpx.Client(base_url=sim.url) as client:
        assert client.post("/sim/faults", json=spec).status_code == 200
        assert client.post("/sim/faults", json={"id": "x", "mode": "explode"}).status_code == 400
        h9 = {"x-request-id": "job-9"}
        first = client.post(COMPLETIONS, json=BODY, headers=h9)
        second = client.post(COMPLETIONS, json=BODY, headers=h9)
        sim.script_fault("job-10", fail_first=2, status=502)
        h10 = {"x-request-id": "job-10"}
        tenth = [client.post(COMPLETIONS, json=BODY, headers=h10).status_code for _ in range(3)]
    assert first.status_code == 500 and first.headers["retry-after"] == "2"
    assert second.status_code == 200
    assert tenth == [502, 502, 200]
    with pytest.raises(ValueError):
        sim.script_fault("job-11", fail_first=1, mode="explode")


def test_stall_holds_slot_until_client_gives_up(start: Callable[..., SimServer]) -> None:
    sim = start()
    headers = {"x-request-id": "s1", "x-sim-fail-first": "1", "x-sim-fail-mode": "stall"}
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", sim.port), timeout=5) as sock:
        sock.sendall(raw_request(COMPLETIONS, BODY, extra))
        wait_until(lambda: sim.stats()["stalled"] == 1, 5, 'sim.stats()["stalled"] == 1')
        assert sim.stats()["in_flight"] == 1  # held until the client hangs up
    wait_until(lambda: sim.stats()["in_flight"] == 0, 5, 'sim.stats()["in_flight"] == 0')
    assert post(sim.url, headers).status_code == 200
    stats = sim.stats()
    assert stats["stalled"] == 1 and stats["attempts_by_request_id"] == {"s1": 2}
    assert stats["by_status"] == {"200": 1}


def test_drop_closes_connection_without_response(start: Callable[..., SimServer]) -> None:
    sim = start()
    sim.script_fault("d1", fail_first=1, mode="drop")
    with pytest.raises(httpx.RemoteProtocolError):
        post(sim.url, {"x-request-id": "d1"})
    assert post(sim.url, {"x-request-id": "d1"}).status_code == 200
    stats = sim.stats()
    assert stats["dropped"] == 1 and stats["in_flight"] == 0
    assert stats["attempts_by_request_id"] == {"d1": 2}


def test_keep_alive_reuses_one_connection(start: Callable[..., SimServer]) -> None:
    sim = start()
    with httpx.Client(base_url=sim.url) as client:
        for _ in range(200):
            assert client.post(COMPLETIONS, json=BODY).status_code == 200
    stats = sim.stats()
    assert stats["connections"] == 1 and stats["requests"] == 200


def test_connection_close_is_honoured(start: Callable[..., SimServer]) -> None:
    sim = start()
    for request in (
        raw_request("/health", extra="Connection: close\r\n"),
        b"GET /health HTTP/1.0\r\n\r\n",
    ):
        with socket.create_connection(("127.0.0.1", sim.port), timeout=5) as sock:
            sock.sendall(request + raw_request("/health"))  # the second must be ignored
            buf = bytearray()
            status, headers, _ = read_response(sock, buf)
            assert status == 200 and headers["connection"] == "close"
            while chunk := sock.recv(65536):
                buf += chunk
            assert buf == b""


def test_pipelined_requests_answered_in_order(start: Callable[..., SimServer]) -> None:
    """Pipelined requests are taken one at a time (uvicorn's way): each is answered, in order,
    after the one before it, so a held request holds back the ones behind it."""
    sim = start()
    expected = {
        p: post(sim.url, body={"prompt": p, "max_tokens": 3}).json() for p in ("slow", "fast")
    }
    slow = raw_request(COMPLETIONS, {"prompt": "slow", "max_tokens": 3}, "x-sim-hold: slow\r\n")
    fast = raw_request(COMPLETIONS, {"prompt": "fast", "max_tokens": 3})
    with socket.create_connection(("127.0.0.1", sim.port), timeout=5) as sock:
        sock.sendall(slow + fast + raw_request("/health"))
        sim.wait_held("slow")
        assert sim.stats()["requests"] == 3  # 2 above + "slow": "fast" waits until it is answered
        sim.release("slow")
        buf = bytearray()
        answers = [read_response(sock, buf) for _ in range(3)]
    assert [status for status, _, _ in answers] == [200, 200, 200]
    texts = [json.loads(body)["choices"][0]["text"] for _, _, body in answers[:2]]
    assert texts == [expected["slow"]["choices"][0]["text"], expected["fast"]["choices"][0]["text"]]
    assert json.loads(answers[2][2]) == {"status": "ok"}
    assert sim.stats()["max_concurrency_observed"] == 1


def test_malformed_request_gets_400_and_close(start: Callable[..., SimServer]) -> None:
    sim = start()
    with socket.create_connection(("127.0.0.1", sim.port), timeout=5) as sock:
        sock.sendall(b"NONSENSE\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            answer += chunk
    head = answer.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    assert head.startswith("http/1.1 400 ") and "\r\nconnection: close" in head


def test_reset_clears_stats_and_attempts(start: Callable[..., SimServer]) -> None:
    sim = start()
    headers = {"x-request-id": "r1", "x-sim-fail-first": "1"}
    assert post(sim.url, headers).status_code == 503
    assert post(sim.url, headers).status_code == 200
    assert sim.stats()["requests"] == 2
    sim.reset()
    stats = sim.stats()
    assert stats["requests"] == 0 and stats["by_status"] == {}
    assert stats["attempts_by_request_id"] == {} and stats["max_concurrency_observed"] == 0
    assert post(sim.url, headers).status_code == 503  # attempt counting restarted
    assert httpx.post(sim.url + "/sim/reset").json() == {"ok": True}
    assert httpx.get(sim.url + "/sim/stats").json()["requests"] == 0


def test_arrivals_are_recorded(start: Callable[..., SimServer]) -> None:
    sim = start(record_arrivals=True, latency_ms=50)
    before = time.monotonic()
    for i in range(3):
        assert post(sim.url, {"x-request-id": f"a{i}"}).status_code == 200
    after = time.monotonic()
    arrivals = httpx.get(sim.url + "/sim/arrivals").json()
    assert [rid for _, _, rid in arrivals] == ["a0", "a1", "a2"]
    for arrived, finished, _ in arrivals:
        assert before <= arrived and finished - arrived >= 0.05 and finished <= after


def test_latency_runs_from_arrival_and_is_never_short(start: Callable[..., SimServer]) -> None:
    """Each answer is due ``latency`` after its request arrived (after its admission when it
    waited for a slot): never early, answered in due order whatever the send order."""
    sim = start(record_arrivals=True)
    latencies = {"slow": 220, "fast": 20, "mid": 120}
    with ThreadPoolExecutor(3) as pool:
        for rid, ms in latencies.items():
            pool.submit(post, sim.url, {"x-request-id": rid, "x-sim-latency-ms": str(ms)})
    arrivals = httpx.get(sim.url + "/sim/arrivals").json()  # in the order answered
    due = sorted(arrivals, key=lambda a: a[0] + latencies[a[2]] / 1000)
    assert [rid for _, _, rid in arrivals] == [rid for _, _, rid in due]
    for arrived, finished, rid in arrivals:
        assert finished - arrived >= latencies[rid] / 1000

    queued = start(record_arrivals=True, latency_ms=40, max_concurrency=1, overload="queue")
    with ThreadPoolExecutor(2) as pool:
        assert all(r.status_code == 200 for r in pool.map(lambda _: post(queued.url), range(2)))
    (_, first_done, _), (_, second_done, _) = httpx.get(queued.url + "/sim/arrivals").json()
    assert second_done - first_done >= 0.04  # its latency started when it got the slot


def test_clock_fires_in_due_order_and_stops() -> None:
    loop = asyncio.new_event_loop()
    fired: list[str] = []
    clock = _Clock(loop)
    try:
        now = time.monotonic()
        clock.call_at(now + 0.03, lambda: fired.append("c"))
        clock.call_at(now + 0.01, lambda: fired.append("a"))
        clock.call_at(now + 0.025, lambda: fired.append("b"))
        clock.call_at(now + 0.035, loop.stop)
        loop.run_forever()
        assert fired == ["a", "b", "c"]
        assert time.monotonic() - now >= 0.035
    finally:
        clock.close()
        clock.thread.join(5)
        loop.close()
    assert not clock.thread.is_alive()


def test_cli_serves_until_sigterm() -> None:
    code = (
        "import argparse, sys\n"
        "from pipeline import sim\n"
        "parser = argparse.ArgumentParser()\n"
        "sim.add_arguments(parser)\n"
        "sys.exit(sim.run_from_args(parser.parse_args(sys.argv[1:])))\n"
    )
    args = [sys.executable, "-c", code, "--port", "0", "--max-concurrency", "1", "--overload"]
    with subprocess.Popen([*args, "503"], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 10)
            assert ready, "no listening line"
            line = proc.stdout.readline()
            match = re.fullmatch(r"simulator listening on (http://127\.0\.0\.1:\d+)\n", line)
            assert match, line
            url = match.group(1)
            assert httpx.get(url + "/health").json() == {"status": "ok"}
            with ThreadPoolExecutor(1) as pool:  # hold and release over HTTP, across processes
                held = pool.submit(post, url, {"x-sim-hold": "cli"})
                wait_until(
                    lambda: httpx.get(url + "/sim/stats").json()["held"] == {"cli": 1},
                    5,
                    'httpx.get(url + "/sim/stats").json()["held"] == {"cli": 1}',
                )
                assert post(url).status_code == 503  # the held request has the only slot
                assert httpx.post(url + "/sim/release", json={"name": "cli"}).json() == {
                    "released": 1
                }
                assert held.result().status_code == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


def test_drop_reason_header_like_an_llm_d_gateway(start: Callable[..., SimServer]) -> None:
    """Scripted faults and overload rejections can carry the gateway's
    ``x-llm-d-request-dropped-reason``; the attempt's classifier reads it."""
    from pipeline.http.classify import send

    sim = start(max_concurrency=1, overload_dropped_reason="rejected-saturated")
    faulted = {"x-request-id": "d1", "x-sim-fail-first": "1", "x-sim-fail-status": "503",
               "x-sim-dropped-reason": "evicted-queue-pressure"}  # fmt: skip
    with httpx.Client(base_url=sim.url) as client:
        first = client.post(COMPLETIONS, json=BODY, headers=faulted)
        assert first.headers["x-llm-d-request-dropped-reason"] == "evicted-queue-pressure"
        assert client.post("/sim/faults", json={"id": "d2", "dropped_reason": "evicted"}).is_success
        bad = {"id": "d3", "dropped_reason": "a\r\nx-evil: 1"}
        assert client.post("/sim/faults", json=bad).status_code == 400
    url, body = sim.url + COMPLETIONS, json.dumps(BODY)
    out = send(url, body, {"x-request-id": "d2", "Content-Type": "application/json"}, 5)
    assert (out.status_code, out.dropped_reason) == (503, "evicted")
    assert out.described == "HTTP 503 (dropped: evicted)"
    assert send(url, body, {"x-request-id": "d2"}, 5).dropped_reason is None  # second: 200
    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(post, sim.url, {"x-sim-hold": "h"})
        sim.wait_held("h")
        shed = send(url, body, {}, 5)
        sim.release("h")
        assert holder.result().status_code == 200
    assert (shed.status_code, shed.dropped_reason) == (429, "rejected-saturated")
    assert shed.category == "RATE_LIMIT"
