"""The simulator's engine model over real HTTP (``pipeline sim --engine``): usage, streaming,
vLLM's metrics, capacity changes, priorities, hang-ups, and the simulator's other features in
front of the engine. Requests are pinned with ``x-sim-hold`` (a held sequence stays in the
engine at its last token) and the tests assert orderings and counters, never durations."""

from __future__ import annotations

import json
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.cli.main import build_parser
from pipeline.cli.services import wait_until
from pipeline.sim import server as server_module
from pipeline.sim.engine import EngineConfig
from pipeline.sim.server import SimConfig, SimServer

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def engine(**fields: Any) -> EngineConfig:
    """A fast engine: a step is 1 ms whatever the batch (the tests never depend on it)."""
    values: dict[str, Any] = dict(
        step_base_s=0.001, step_per_seq_s=0.0, step_per_prefill_token_s=0.0,
        kv_cache_tokens=4096, max_num_seqs=16, max_num_batched_tokens=4096,
    )  # fmt: skip
    values.update(fields)
    return EngineConfig(**values)


@pytest.fixture
def start() -> Iterator[Callable[..., SimServer]]:
    """Factory: a simulator whose engine has the given fields (``sim`` for SimConfig's)."""
    servers: list[SimServer] = []

    def _start(sim: dict[str, Any] | None = None, **fields: Any) -> SimServer:
        server = SimServer(SimConfig(engine=engine(**fields), **(sim or {}))).start_in_thread()
        servers.append(server)
        return server

    yield _start
    for server in servers:
        server.release_all()
        server.stop()


def post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None, path: str = COMPLETIONS
) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


def body(words: int = 3, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"prompt": " ".join(["w"] * words), "max_tokens": max_tokens, **extra}


def until(sim: SimServer, what: str, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The engine's stats once ``check`` holds for them (polled, bounded)."""

    def ready() -> dict[str, Any] | None:
        state = sim.engine_stats()
        return state if check(state) else None

    return wait_until(ready, 10, what, interval=0.005)  # type: ignore[no-any-return]


def events(resp: httpx.Response) -> Iterator[Any]:
    """The JSON of each server-sent event of a streamed answer, then the string [DONE]."""
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (and ``le`` for buckets), parsed as Prometheus does."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            assert sample.labels.get("model_name") == "sim-model", sample
            le = sample.labels.get("le")
            out[sample.name + (f"[{le}]" if le else "")] = sample.value
    return out


def test_answers_carry_the_engines_usage(start: Callable[..., SimServer]) -> None:
    sim = start(sim={"template_message_tokens": 3, "template_prompt_tokens": 1})
    text = post(sim.url, body(words=5, max_tokens=7)).json()
    assert text["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    assert (
        text["choices"][0]["finish_reason"] == "length"
        and len(text["choices"][0]["text"].split()) == 7
    )
    messages = [{"role": "user", "content": "one two"}, {"role": "user", "content": "three"}]
    chat = post(sim.url, {"messages": messages, "max_tokens": 2}, path=CHAT).json()
    assert chat["usage"] == {"prompt_tokens": 3 + 2 * 3 + 1, "completion_tokens": 2,
                             "total_tokens": 12}  # fmt: skip
    stats = sim.stats()
    assert stats["engine"]["finished"] == 2 and stats["completion_tokens"] == 9
    assert metrics(sim.url)["vllm:generation_tokens_total"] == 9
    drawn = start(sim={"completion_min_ratio": 0.5, "seed": 3})
    lengths = [post(drawn.url, body(max_tokens=40)).json()["usage"]["completion_tokens"]
               for _ in range(8)]  # fmt: skip
    assert all(20 <= n <= 40 for n in lengths) and len(set(lengths)) > 1
    assert drawn.stats()["engine"]["finished"] == 8


def test_a_stream_sends_its_first_token_at_the_end_of_prefill(
    start: Callable[..., SimServer],
) -> None:
    """The first event comes once the prompt is prefilled, while the sequence is still in
    the engine (here held at its last token); the rest, the usage and [DONE] when it ends."""
    sim = start()
    plain = post(sim.url, {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 9},
                 path=CHAT).json()  # fmt: skip
    request = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 9,
               "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", sim.url + CHAT, json=request, headers={"x-sim-hold": "s"},
                      timeout=30) as resp:  # fmt: skip
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        chunks = events(resp)
        first = next(chunks)
        state = sim.engine_stats()
        assert (state["running"], state["finished"]) == (1, 1)  # still in the engine
        seen = metrics(sim.url)
        assert seen["vllm:time_to_first_token_seconds_count"] == 2
        assert seen["vllm:e2e_request_latency_seconds_count"] == 1  # the plain one only
        sim.release("s")
        rest = list(chunks)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert first["choices"][0]["finish_reason"] is None
    last, usage, done = rest
    assert done == "[DONE]" and last["id"] == first["id"] == usage["id"]
    assert last["choices"][0]["finish_reason"] == "length"
    content = first["choices"][0]["delta"]["content"] + last["choices"][0]["delta"]["content"]
    assert content == plain["choices"][0]["message"]["content"]
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    stats = sim.stats()
    assert stats["by_status"] == {"200": 2} and stats["completion_tokens"] == 18


def test_a_completion_stream_without_usage(start: Callable[..., SimServer]) -> None:
    sim = start()
    plain = post(sim.url, body(max_tokens=3))
    with httpx.stream("POST", sim.url + COMPLETIONS, json=body(max_tokens=3, stream=True)) as r:
        got = list(events(r))
    assert got[-1] == "[DONE]" and len(got) == 3 and "usage" not in got[0]
    assert got[0]["object"] == "text_completion" and got[1]["choices"][0]["finish_reason"]
    assert got[0]["choices"][0]["text"] + got[1]["choices"][0]["text"] == (
        plain.json()["choices"][0]["text"])  # fmt: skip
    with httpx.stream("POST", sim.url + COMPLETIONS, json=body(max_tokens=0, stream=True)) as r:
        none = list(events(r))
    assert [c if c == "[DONE]" else c["choices"][0]["text"] for c in none] == ["", "[DONE]"]


def test_metrics_are_vllms_series(start: Callable[..., SimServer]) -> None:
    """vLLM's names, types and label; KV use moves with the sequences in the cache, the
    older gpu_cache_usage_perc with it."""
    sim = start(kv_cache_tokens=64)  # 4 blocks
    text = httpx.get(sim.url + "/metrics").text
    for name, kind in [
        ("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:gpu_cache_usage_perc", "gauge"),
        ("vllm:num_preemptions_total", "counter"), ("vllm:prompt_tokens_total", "counter"),
        ("vllm:generation_tokens_total", "counter"), ("vllm:request_success_total", "counter"),
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:e2e_request_latency_seconds", "histogram"),
        ("vllm:request_queue_time_seconds", "histogram"),
    ]:  # fmt: skip
        assert f"# TYPE {name} {kind}" in text, name
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(post, sim.url, body(words=31, max_tokens=1), {"x-sim-hold": "m"})
        until(sim, "the held sequence parked", lambda s: s["parked"] == 1)
        seen = metrics(sim.url)
        assert seen["vllm:kv_cache_usage_perc"] == seen["vllm:gpu_cache_usage_perc"] == 0.5
        assert seen["vllm:num_requests_running"] == 1
        sim.release("m")
        assert held.result().status_code == 200
    seen = metrics(sim.url)
    assert seen["vllm:kv_cache_usage_perc"] == 0 and seen["vllm:num_requests_running"] == 0
    assert seen["vllm:e2e_request_latency_seconds_count"] == 1
    assert seen["vllm:e2e_request_latency_seconds_bucket[+Inf]"] == 1
    assert seen["vllm:request_success_total"] == 1 and seen["vllm:prompt_tokens_total"] == 31


def test_requests_wait_in_the_engine_until_their_prompt_fits(
    start: Callable[..., SimServer],
) -> None:
    sim = start(kv_cache_tokens=64)  # 4 blocks; a 31-word prompt takes 2
    with ThreadPoolExecutor(3) as pool:
        held = [pool.submit(post, sim.url, body(31, 1), {"x-sim-hold": "kv"}) for _ in range(2)]
        until(sim, "two parked", lambda s: s["parked"] == 2)
        third = pool.submit(post, sim.url, body(31, 1))
        state = until(sim, "one waiting", lambda s: s["waiting"] == 1)
        assert state["kv_cache_usage"] == 1.0 and state["running"] == 2 and not third.done()
        assert metrics(sim.url)["vllm:num_requests_waiting"] == 1
        sim.release("kv")
        assert [f.result().status_code for f in [*held, third]] == [200] * 3
    assert sim.engine_stats()["max_waiting_observed"] == 1


def test_the_cache_overflowing_preempts_and_counts(start: Callable[..., SimServer]) -> None:
    """A sequence that grows past what a held one leaves of the cache is preempted (its KV
    recomputed later), waits, and finishes once the hold is released."""
    sim = start(kv_cache_tokens=64)
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(post, sim.url, body(31, 1), {"x-sim-hold": "p"})  # 2 blocks, parked
        until(sim, "parked", lambda s: s["parked"] == 1)
        grower = pool.submit(post, sim.url, body(15, 40))  # its 33rd token needs a 3rd block
        state = until(sim, "a preemption", lambda s: s["preemptions"] == 1)
        assert state["waiting"] == 1 and not grower.done()
        assert metrics(sim.url)["vllm:num_preemptions_total"] == 1
        sim.release("p")
        assert grower.result().json()["usage"]["completion_tokens"] == 40
        assert held.result().status_code == 200


def test_priority_orders_the_engines_queue(start: Callable[..., SimServer]) -> None:
    sim = start(sim={"record_arrivals": True}, max_num_seqs=1, scheduling_policy="priority")
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(post, sim.url, body(), {"x-sim-hold": "seat", "x-request-id": "h"})
        until(sim, "the seat taken", lambda s: s["parked"] == 1)
        late = pool.submit(post, sim.url, body(priority=5), {"x-request-id": "low"})
        until(sim, "one waiting", lambda s: s["waiting"] == 1)
        urgent = pool.submit(post, sim.url, body(priority=-2), {"x-request-id": "high"})
        until(sim, "two waiting", lambda s: s["waiting"] == 2)
        sim.release("seat")
        assert all(f.result().status_code == 200 for f in (first, late, urgent))
    finished = {rid: done for _, done, rid in httpx.get(sim.url + "/sim/arrivals").json()}
    assert finished["h"] < finished["high"] < finished["low"]


def test_a_priority_needs_the_priority_policy(start: Callable[..., SimServer]) -> None:
    sim = start()
    refused = post(sim.url, body(priority=1))
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "Got priority 1 but Priority scheduling is not enabled.")  # fmt: skip
    assert post(sim.url, body(priority=0)).status_code == 200
    for bad in ({"priority": "1"}, {"priority": True}, {"stream": "yes"},
                {"stream": True, "stream_options": []}, {"stream_options": {"include_usage": 1}},
                {"stream_options": {"include_usage": True}}):  # fmt: skip
        assert post(sim.url, body(**bad)).status_code == 400, bad
    assert sim.engine_stats()["finished"] == 1


def test_a_prompt_longer_than_the_model_allows_is_refused(start: Callable[..., SimServer]) -> None:
    sim = start(max_model_len=20)
    refused = post(sim.url, body(words=15, max_tokens=6))
    assert refused.status_code == 400
    assert "maximum context length is 20 tokens" in refused.json()["error"]["message"]
    assert "(15 in the messages, 6 in the completion)" in refused.json()["error"]["message"]
    assert sim.engine_stats()["finished"] == 0


def test_a_client_that_hangs_up_frees_its_sequence(start: Callable[..., SimServer]) -> None:
    """Running (here held), waiting or streaming: the sequence leaves the engine with its
    blocks and seat as soon as its client closes the connection."""
    sim = start(max_num_seqs=1)
    request = json.dumps(body(20, 2)).encode()
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(request)}\r\n")  # fmt: skip
    running = socket.create_connection(("127.0.0.1", sim.port))
    running.sendall(f"{head}x-sim-hold: gone\r\nx-request-id: r1\r\n\r\n".encode() + request)
    until(sim, "parked", lambda s: s["parked"] == 1 and s["kv_blocks_used"] == 2)
    waiting = socket.create_connection(("127.0.0.1", sim.port))
    waiting.sendall(f"{head}x-request-id: w1\r\n\r\n".encode() + request)
    until(sim, "waiting", lambda s: s["waiting"] == 1)
    waiting.close()
    until(sim, "the waiting one gone", lambda s: s["waiting"] == 0)
    running.close()
    state = until(sim, "the running one gone", lambda s: s["running"] == 0)
    assert state["kv_blocks_used"] == 0 and state["finished"] == 0 and state["aborted"] == 2
    assert {rid for _, rid, _ in sim.hangups()} == {"r1", "w1"}
    assert sim.stats()["held"] == {}
    stream = body(20, 2, stream=True)
    with httpx.stream("POST", sim.url + COMPLETIONS, json=stream, headers={"x-sim-hold": "s"}) as r:
        lines = r.iter_lines()  # (a generator dropped would close the stream)
        next(lines)  # the first token
        until(sim, "streaming", lambda s: s["parked"] == 1)
    state = until(sim, "the stream gone", lambda s: s["running"] == 0)
    assert state["aborted"] == 3 and sim.stats()["by_status"] == {}
    assert post(sim.url, body()).status_code == 200  # the seat is free


def test_a_capacity_change_at_run_time(start: Callable[..., SimServer]) -> None:
    """POST /sim/engine {"replicas": R}: seats, cache and token budget times R from the next
    step on; a request that found a free seat before waits after."""
    sim = start(max_num_seqs=2, kv_cache_tokens=1024)
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(post, sim.url, body(), {"x-sim-hold": "cap"})
        until(sim, "parked", lambda s: s["parked"] == 1)
        assert post(sim.url, body()).status_code == 200  # the second seat
        resp = httpx.post(sim.url + "/sim/engine", json={"replicas": 0.5})
        assert resp.status_code == 200
        state = resp.json()
        assert (state["replicas"], state["max_num_seqs"], state["kv_blocks_total"]) == (0.5, 1, 32)
        assert state["kv_cache_tokens"] == 512 and state["max_num_batched_tokens"] == 2048
        waits = pool.submit(post, sim.url, body())
        until(sim, "waiting for the one seat", lambda s: s["waiting"] == 1)
        assert sim.set_capacity(1.0)["max_num_seqs"] == 2  # in process: a replica is back
        assert waits.result().status_code == 200
        sim.release("cap")
        assert held.result().status_code == 200
    assert httpx.get(sim.url + "/sim/engine").json()["finished"] == 3
    for bad in ({}, {"replicas": 0}, {"replicas": -1}, {"replicas": "2"}, {"replicas": True}):
        resp = httpx.post(sim.url + "/sim/engine", json=bad)
        assert resp.status_code == 400 and "replicas" in resp.json()["error"]["message"], bad
    assert httpx.post(sim.url + "/sim/engine", content=b"{").status_code == 400
    plain = SimServer().start_in_thread()
    try:
        assert httpx.get(plain.url + "/sim/engine").status_code == 404
        with pytest.raises(LookupError):
            plain.set_capacity(2.0)
    finally:
        plain.stop()


def test_faults_and_a_gateway_cap_answer_before_the_engine(
    start: Callable[..., SimServer],
) -> None:
    """A missing key and scripted faults answer without the engine; a gateway's cap
    (--max-concurrency with --overload 429) turns requests away in front of it."""
    keyed = start(sim={"api_key": "k"})
    assert post(keyed.url, body()).status_code == 401
    assert post(keyed.url, body(), {"Authorization": "Bearer k"}).status_code == 200
    assert keyed.engine_stats()["finished"] == 1
    sim = start(sim={"max_concurrency": 1, "overload": "429"})
    fault = {"x-sim-fail-first": "1", "x-sim-fail-status": "503", "x-request-id": "f"}
    assert post(sim.url, body(), fault).status_code == 503
    assert post(sim.url, body(), fault).status_code == 200  # the second attempt
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(post, sim.url, body(), {"x-sim-hold": "g"})
        until(sim, "parked", lambda s: s["parked"] == 1)
        assert post(sim.url, body()).status_code == 429
        sim.release("g")
        assert held.result().status_code == 200
    assert sim.engine_stats()["finished"] == 2
    assert post(sim.url, body(), {"x-sim-latency-ms": "5"}).status_code == 400
    with pytest.raises(ValueError, match="do not apply with an engine"):
        SimServer(SimConfig(engine=engine(), latency_ms=5))


def test_a_held_sequence_is_let_go_at_the_cap(
    start: Callable[..., SimServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "HOLD_CAP_S", 0.05)
    sim = start()
    assert post(sim.url, body(), {"x-sim-hold": "forgotten"}).status_code == 200
    state = sim.engine_stats()
    assert (state["finished"], state["parked"]) == (1, 0) and sim.stats()["held"] == {}


def test_reset_answers_held_sequences_and_restarts_the_counters(
    start: Callable[..., SimServer],
) -> None:
    sim = start()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(post, sim.url, body(), {"x-sim-hold": "r"})
        until(sim, "parked", lambda s: s["parked"] == 1)
        sim.reset()
        assert held.result().status_code == 200
    state = sim.engine_stats()
    assert (state["finished"], state["running"], state["steps"]) == (0, 0, 0)
    assert metrics(sim.url)["vllm:e2e_request_latency_seconds_count"] == 0


def test_the_cli_serves_an_engine_preset() -> None:
    args = [sys.executable, "-m", "pipeline", "sim", "--port", "0", "--engine", "kv-bound",
            "--time-scale", "0.001", "--kv-cache-tokens", "8192", "--scheduling-policy",
            "priority"]  # fmt: skip
    with subprocess.Popen(args, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            assert select.select([proc.stdout], [], [], 10)[0], "no listening line"
            url = proc.stdout.readline().rsplit(" ", 1)[1].strip()
            assert post(url, body(priority=3)).json()["usage"]["completion_tokens"] == 4
            state = httpx.get(url + "/sim/engine").json()
            assert (state["preset"], state["time_scale"], state["kv_cache_tokens"]) == (
                "kv-bound", 0.001, 8192)  # fmt: skip
            assert (state["scheduling_policy"], state["max_num_seqs"]) == ("priority", 256)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--kv-cache-tokens", "100"], "--kv-cache-tokens needs --engine"),
        (["--time-scale", "0.5"], "--time-scale needs --engine"),
        (["--engine", "h100", "--latency-ms", "5"], "--latency-ms does not apply with --engine"),
        (["--engine", "h100", "--time-scale", "0"], "--time-scale: must be a number above 0"),
        (["--engine", "h100", "--max-num-seqs", "x"], "--max-num-seqs: must be a whole number"),
        (["--engine", "a100"], "--engine: invalid choice"),
        (["--engine", "h100", "--kv-cache-tokens", "8"], "kv_cache_tokens must hold"),
    ],
)
def test_the_cli_names_a_bad_engine_option(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        args = build_parser().parse_args(["sim", "--port", "0", *argv])
        args.func(args)  # exits before it serves
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_the_prefix_cache_reports_cached_tokens(start: Callable[..., SimServer]) -> None:
    """With --enable-prefix-caching: a prompt sharing 2 full blocks with an earlier one
    reports them in usage.prompt_tokens_details (streamed too), and vLLM's prefix-cache
    counters count the tokens looked up and found."""
    sim = start(enable_prefix_caching=True)
    shared = " ".join(f"s{i}" for i in range(32))
    first = post(sim.url, {"prompt": shared + " a b c", "max_tokens": 2}).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    again = post(sim.url, {"prompt": shared + " d e", "max_tokens": 2}).json()
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    streamed = {"prompt": shared + " f", "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", sim.url + COMPLETIONS, json=streamed) as r:
        usage = [c for c in events(r) if c != "[DONE]" and c.get("usage")][-1]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 32}
    seen = metrics(sim.url)
    assert seen["vllm:prefix_cache_queries_total"] == 35 + 34 + 33
    assert seen["vllm:prefix_cache_hits_total"] == 64
    assert sim.engine_stats()["prefix_cache_hits"] == 64
    plain = start()
    assert "prompt_tokens_details" not in post(plain.url, body()).json()["usage"]
    assert "vllm:prefix_cache_hits_total" not in metrics(plain.url)
