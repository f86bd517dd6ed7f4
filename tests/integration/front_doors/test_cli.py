"""Bad input at the CLI door: each case runs the real ``pipeline`` console script with one bad
argument, input file or setting, and gets exit status 2 with one line on stderr naming it —
no traceback, no usage text — and nothing stored or half-written in Redis. (Bad batch *lines*
are tests/integration/front_doors/test_batch_lines.py; a file is refused here only as a whole:
not readable, not UTF-8 text, empty, or not JSONL at all.)"""

from __future__ import annotations

import codecs
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipeline.cli.services import free_port
from pipeline.client import Pipeline
from tests.conftest import nothing_stored

PIPELINE = str(Path(sys.executable).parent / "pipeline")  # the console script, as installed
SECRET = "s3cret-door"  # in bad URLs: it must not be printed
LINE = json.dumps({"custom_id": "a", "body": {"model": "m", "prompt": "hi"},
                   "method": "POST", "url": "/v1/completions"})  # fmt: skip


@dataclass(frozen=True)
class Case:
    name: str
    args: list[str]  # "{dir}" stands for the test's directory of input files
    says: str  # a regular expression the one stderr line matches
    env: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.name


def refused_url(path: str = "/0") -> str:
    return f"redis://:{SECRET}@127.0.0.1:{free_port()}{path}"  # nothing listens there


CASES = [
    # pipeline run: the input file
    Case("run-missing-file", ["run", "{dir}/nope.jsonl"],
         r"cannot read .*nope\.jsonl: No such file"),
    Case("run-directory", ["run", "{dir}/adir"], r"cannot read .*adir: Is a directory"),
    Case("run-empty-file", ["run", "{dir}/empty.jsonl"], r"empty\.jsonl: no request lines"),
    Case("run-blank-lines", ["run", "{dir}/blank.jsonl"], r"blank\.jsonl: no request lines"),
    Case("run-not-jsonl", ["run", "{dir}/table.csv"],
         r"table\.csv is not JSONL .*line 1: not JSON"),
    Case("run-pretty-json", ["run", "{dir}/pretty.json"], r"pretty\.json is not JSONL"),
    Case("run-utf16", ["run", "{dir}/utf16.jsonl"], r"utf16\.jsonl is UTF-16 text"),
    Case("run-binary", ["run", "{dir}/blob.bin"], r"blob\.bin is not text"),
    # pipeline run: where the results go
    Case("run-output-missing-dir", ["run", "{dir}/ok.jsonl", "-o", "{dir}/no/out.jsonl"],
         r"-o .*no/out\.jsonl: no directory"),
    Case("run-output-is-input", ["run", "{dir}/ok.jsonl", "-o", "{dir}/ok.jsonl"],
         r"-o .*ok\.jsonl is the input file"),
    Case("run-output-is-input-by-another-name", ["run", "{dir}/ok.jsonl", "-o", "{dir}/link.jsonl"],
         r"-o .*link\.jsonl is the input file"),
    Case("run-output-directory", ["run", "{dir}/ok.jsonl", "-o", "{dir}/adir"],
         r"-o .*adir: is a directory"),
    Case("run-error-output-is-input",
         ["run", "{dir}/ok.jsonl", "-o", "{dir}/out.jsonl", "--format", "openai",
          "--error-output", "{dir}/ok.jsonl"], r"--error-output .*ok\.jsonl is the input file"),
    Case("run-worker-log-missing-dir", ["run", "{dir}/ok.jsonl", "--worker-log", "{dir}/no/w.log"],
         r"--worker-log .*no directory"),
    # pipeline run: its options
    Case("run-unknown-queue", ["run", "{dir}/ok.jsonl", "--queue", "nope"],
         r"--queue: no queue named 'nope'"),
    Case("run-zero-slots", ["run", "{dir}/ok.jsonl", "-c", "0"], r"-c/--concurrency: .*>= 1"),
    Case("run-negative-timeout", ["run", "{dir}/ok.jsonl", "--timeout", "-5"], r"--timeout"),
    Case("run-bad-window", ["run", "{dir}/ok.jsonl", "--completion-window", "3 weeks"],
         r"--completion-window: must be like '24h'"),
    Case("run-bad-batch-id", ["run", "{dir}/ok.jsonl", "--batch-id", "a/b"], r"--batch-id"),
    Case("run-nan-latency", ["run", "{dir}/ok.jsonl", "--sim-latency-ms", "nan"],
         r"--sim-latency-ms"),
    Case("run-bad-format", ["run", "{dir}/ok.jsonl", "--format", "csv"],
         r"--format: invalid choice"),
    # pipeline run: its settings
    Case("run-queue-file-missing", ["run", "{dir}/ok.jsonl"], r"PIPELINE_QUEUES",
         {"PIPELINE_QUEUES": "/nonexistent/queues.json"}),
    Case("run-named-redis-down", ["run", "{dir}/ok.jsonl"],
         r"no Redis to use at redis://\*\*\*@127\.0\.0\.1:\d+/0 \(PIPELINE_REDIS_URL\): "
         r".*[Cc]onnection refused", {"PIPELINE_REDIS_URL": refused_url()}),
    # pipeline status / explain / cancel: settings and numbers
    Case("status-interval-zero", ["status", "--watch", "--interval", "0"], r"--interval: .*> 0"),
    Case("status-redis-down", ["status"],
         r"no Redis answers at redis://\*\*\*@127\.0\.0\.1:\d+/0 \(PIPELINE_REDIS_URL\): "
         r".*refused: start one \(`pipeline up`", {"PIPELINE_REDIS_URL": refused_url()}),
    Case("submit-redis-down", ["submit", '{"prompt": "hi"}'],
         r"no Redis answers at .*\(PIPELINE_REDIS_URL\): .*refused.*`pipeline up`",
         {"PIPELINE_REDIS_URL": refused_url()}),
    Case("explain-redis-down", ["explain", "x"], r"no Redis answers at .*`pipeline up`",
         {"PIPELINE_REDIS_URL": refused_url()}),
    Case("serve-redis-down", ["serve", "--port", "18090"],
         r"pipeline serve: no Redis answers at .*refused.*`pipeline up`",
         {"PIPELINE_REDIS_URL": refused_url()}),
    Case("up-named-redis-down", ["up", "--port", "18091"],
         r"pipeline up: no Redis to use at redis://\*\*\*@.*\(PIPELINE_REDIS_URL\): .*refused",
         {"PIPELINE_REDIS_URL": refused_url()}),
    Case("status-redis-down-query-password", ["status", "--json"],
         r"redis://127\.0\.0\.1:\d+/0\?password=\*\*\* \(PIPELINE_REDIS_URL\)",
         {"PIPELINE_REDIS_URL": refused_url().replace(f":{SECRET}@", "") + f"?password={SECRET}"}),
    Case("status-not-a-redis-url", ["status"],
         r"PIPELINE_REDIS_URL: 'http://\*\*\*@.*not a Redis URL",
         {"PIPELINE_REDIS_URL": f"http://:{SECRET}@127.0.0.1:6379/0"}),
    Case("status-port-out-of-range", ["status"], r"PIPELINE_REDIS_URL: .*port 1-65535",
         {"PIPELINE_REDIS_URL": f"redis://:{SECRET}@127.0.0.1:99999/0"}),
    Case("status-cluster-url-bad-node", ["status"], r"PIPELINE_REDIS_URL: cluster node #2",
         {"PIPELINE_REDIS_URL": f"redis+cluster://:{SECRET}@127.0.0.1:7000,127.0.0.1"}),
    Case("explain-unknown-id", ["explain", "no-such-request"],
         r"unknown request id 'no-such-request'"),
    Case("explain-nan-lease", ["explain", "x"], r"PIPELINE_LEASE_S must be a number",
         {"PIPELINE_LEASE_S": "nan"}),
    Case("cancel-unknown-id", ["cancel", "no-such-request"],
         r"unknown request id 'no-such-request'"),
    Case("cancel-bad-lookahead", ["cancel", "x"], r"PIPELINE_LOOKAHEAD",
         {"PIPELINE_LOOKAHEAD": "many"}),
    Case("reload-zero-timeout", ["reload", "--timeout", "0"], r"--timeout: .*> 0"),
    # pipeline submit
    Case("submit-not-json", ["submit", "{prompt: hi}"], r"payload: not JSON"),
    Case("submit-priority", ["submit", '{"prompt": "hi"}', "--priority", "11"], r"priority"),
    Case("submit-unknown-queue", ["submit", '{"prompt": "hi"}', "--queue", "nope"], r"queue"),
    Case("submit-nan-timeout", ["submit", '{"prompt": "hi"}', "--timeout", "nan"], r"--timeout"),
    # pipeline serve
    Case("serve-port-too-high", ["serve", "--port", "99999"],
         r"--port: must be a TCP port 1-65535"),
    Case("serve-port-zero", ["serve", "--port", "0"], r"--port: must be a TCP port 1-65535"),
    Case("serve-log-level", ["serve", "--loglevel", "loud"], r"--loglevel"),
    Case("serve-public-without-keys", ["serve", "--host", "0.0.0.0", "--port", "18089"],
         r"refusing to serve on 0\.0\.0\.0 without API keys"),
    # pipeline flower: where it would listen, however it is said
    Case("flower-public-option", ["flower", "--address", "0.0.0.0"],
         r"refusing to expose Flower on 0\.0\.0\.0"),
    Case("flower-public-after-dashes",
         ["flower", "--address", "127.0.0.1", "--", "--address=0.0.0.0"],
         r"refusing to expose Flower on 0\.0\.0\.0"),
    Case("flower-public-pair-after-dashes", ["flower", "--", "--address", "10.1.2.3"],
         r"refusing to expose Flower on 10\.1\.2\.3"),
    Case("flower-public-env", ["flower"], r"refusing to expose Flower on 0\.0\.0\.0",
         {"FLOWER_ADDRESS": "0.0.0.0"}),
    Case("flower-public-config-file", ["flower", "--", "--conf={dir}/myflower.py"],
         r"refusing to expose Flower on 192\.0\.2\.1"),
    Case("flower-port", ["flower", "--port", "70000"], r"--port: must be a TCP port"),
    Case("flower-port-after-dashes", ["flower", "--", "--port=0"], r"--port: must be a TCP port"),
    Case("flower-missing-config", ["flower", "--", "--conf={dir}/none.py"], r"Flower's options"),
    # pipeline worker
    Case("worker-unknown-pool", ["worker", "--pools", "nope"], r"--pools: no worker pool 'nope'"),
    Case("worker-zero-slots", ["worker", "-c", "0"], r"-c/--concurrency"),
    Case("worker-pool-impl", ["worker", "-P", "gevent"], r"-P/--pool-impl: invalid choice"),
    Case("worker-log-level", ["worker", "--loglevel", "LOUD"], r"--loglevel"),
    Case("worker-task-events", ["worker"], r"PIPELINE_TASK_EVENTS must be 1/0",
         {"PIPELINE_TASK_EVENTS": "maybe"}),
    # pipeline sim
    Case("sim-port", ["sim", "--port", "99999"], r"--port: must be a TCP port 0-65535"),
    Case("sim-failure-rate", ["sim", "--failure-rate", "1.5"],
         r"--failure-rate: must be a number 0\.\.1"),
    Case("sim-negative-latency", ["sim", "--latency-ms", "-1"], r"--latency-ms"),
    Case("sim-client-ca-without-cert", ["sim", "--tls-client-ca", "{dir}/ok.jsonl"],
         r"--tls-client-ca needs --tls-cert"),
    Case("sim-missing-cert", ["sim", "--tls-cert", "{dir}/none.pem"], r"--tls-cert: no file"),
    # no such command
    Case("unknown-command", ["frobnicate"], r"invalid choice: 'frobnicate'"),
]  # fmt: skip


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    """The input files the cases name, in ``tmp_path``."""
    (tmp_path / "ok.jsonl").write_text(LINE + "\n")
    os.link(tmp_path / "ok.jsonl", tmp_path / "link.jsonl")  # the same file, another name
    (tmp_path / "adir").mkdir()
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_text("\n  \n\n")
    (tmp_path / "table.csv").write_text("custom_id,prompt\na,hi\nb,there\n")
    (tmp_path / "pretty.json").write_text(json.dumps(json.loads(LINE), indent=2) + "\n")
    (tmp_path / "utf16.jsonl").write_bytes(codecs.BOM_UTF16_LE + (LINE + "\n").encode("utf-16-le"))
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "myflower.py").write_text('address = "192.0.2.1"\n')
    return tmp_path


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 22
    assert {c.args[0] for c in CASES} >= {
        "run", "status", "explain", "cancel", "serve", "flower", "worker", "sim", "submit",
        "reload", "up",
    }  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_bad_input_is_one_line_naming_it(
    case: Case, pl: Pipeline, env: dict[str, str], inputs: Path
) -> None:
    args = [a.replace("{dir}", str(inputs)) for a in case.args]
    run_env = {k: v for k, v in env.items() if not k.startswith("FLOWER_")}
    run_env.update(case.env)
    with nothing_stored(pl):
        proc = subprocess.run(
            [PIPELINE, *args],
            env=run_env,
            cwd=inputs,  # a neutral directory
            capture_output=True,
            text=True,
            timeout=90,
        )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert re.search(case.says, lines[0]), lines[0]
    assert lines[0].startswith("pipeline"), lines[0]
    assert SECRET not in proc.stderr + proc.stdout
