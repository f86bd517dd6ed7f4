"""The README's examples run as written against the stack its first screen starts: `pipeline
up` (here with ``--embedded-redis``, on free ports: this machine runs other Redis servers and
services), then its shell commands, its Python (the client, then its batches, as one reader's
session) and its Batch API example with the official ``openai`` client. The only edit is the
Batch API's port. Ctrl-C stops the stack with status 0, its Redis last; no gate holds a
reservation before it stops."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.cli.services import free_port, redis_reachable, wait_until
from pipeline.client import Pipeline
from pipeline.config import load_settings
from tests.conftest import NODE_START_S, ROOT, assert_idle

README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.S | re.M)


@dataclass
class Stack:
    proc: subprocess.Popen[bytes]
    out: Path
    env: dict[str, str]  # a reader's shell: PATH with the venv, PIPELINE_REDIS_URL named
    redis_url: str
    port: int


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("up")
    # a reader's environment: none of the session's settings
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "CELERY_"))}
    env["PIPELINE_METRICS_PORT"] = "0"
    port = free_port()
    out = tmp / "up.out"
    argv = [str(BIN / "pipeline"), "up", "--embedded-redis", "--port", str(port), "-c", "8"]
    argv += ["--sim-latency-ms", "20", "--sim-jitter-ms", "0"]
    with open(out, "wb") as fh:
        proc = subprocess.Popen(argv, cwd=tmp, env=env, stdout=fh, stderr=subprocess.STDOUT)

    def ready() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"pipeline up exited {proc.returncode}:\n{out.read_text()}")
        return "ready:" in out.read_text()

    try:
        wait_until(ready, NODE_START_S + 60, "pipeline up", interval=0.2)
        url = re.search(r"redis:\s+(redis://\S+/0)", out.read_text())
        assert url, out.read_text()
        shell = {**env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}"}
        shell["PIPELINE_REDIS_URL"] = url.group(1)
        yield Stack(proc, out, shell, url.group(1), port)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # Ctrl-C
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run(stack: Stack, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        argv, cwd=ROOT, env=stack.env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{argv}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_the_shell_commands_run(stack: Stack) -> None:
    (first,) = [b for b in blocks("bash") if "source .venv/bin/activate" in b]
    commands = [line for line in first.splitlines() if line and not line.startswith("source")]
    assert commands and all(c.startswith("pipeline ") for c in commands)
    outputs = [run(stack, ["bash", "-c", c]).stdout for c in commands]
    assert '"status_code": 200' in outputs[0]  # submit --wait: the result


def test_the_python_examples_run(stack: Stack) -> None:
    """The client's example, then its batches' (which goes on with the same ``pipeline``)."""
    client, batches = [b for b in blocks("python") if "pipeline." in b and "OpenAI" not in b]
    assert "submit_batch(" in batches and "examples/batchinput.jsonl" in batches
    proc = run(stack, [sys.executable, "-c", client + batches])
    assert "done: HTTP 200" in proc.stdout  # print(req.explain().to_text())


def test_the_batch_api_example_runs(stack: Stack) -> None:
    (example,) = [b for b in blocks("python") if "OpenAI(" in b]
    assert "127.0.0.1:8080" in example
    code = example.replace("127.0.0.1:8080", f"127.0.0.1:{stack.port}")
    out = run(stack, [sys.executable, "-c", code]).stdout
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert sorted(line["custom_id"] for line in lines) == [f"request-{i}" for i in range(1, 6)]
    assert all(line["response"]["status_code"] == 200 for line in lines)
    # the sample line the README shows is the file's first
    shown = blocks("json")
    first = (ROOT / "examples" / "batchinput.jsonl").read_text().splitlines()[0]
    assert any(block.strip() == first for block in shown)


def test_ctrl_c_stops_the_stack_with_nothing_held(stack: Stack) -> None:
    p = Pipeline(load_settings(stack.env))
    assert_idle(p)  # every example's request ended; no gate holds a reservation
    p.store.client.close()
    stack.proc.send_signal(signal.SIGINT)
    assert stack.proc.wait(90) == 0, stack.out.read_text()
    assert "stopping" in stack.out.read_text()
    assert not redis_reachable(stack.redis_url, 0.5)  # its embedded Redis went, last
