"""Regenerate examples/demo.jsonl: a sample batch for `make demo`.

300 requests mixing OpenAI Batch API lines and plain submit lines, priorities 0-9, deadlines,
and faults injected through the simulator's headers: 503s then success, 429s with
Retry-After, a terminal 400, requests whose deadline is too short for their retries, and one
invalid line.
"""

import json
import random

rng = random.Random(7)
lines = []
for i in range(300):
    body = {"model": "sim-model", "prompt": f"Summarise document {i}", "max_tokens": 32}
    headers = {}
    kind = rng.random()
    if kind < 0.10:
        headers = {"x-sim-fail-first": "2", "x-sim-fail-status": "503"}
    elif kind < 0.15:
        headers = {"x-sim-fail-first": "1", "x-sim-fail-status": "429", "x-sim-retry-after": "1"}
    if i % 2 == 0:
        line = {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/completions",
                "body": body, "priority": rng.randint(0, 9)}
        if headers:
            line["headers"] = headers
    else:
        line = {"id": f"doc-{i}", "payload": body, "priority": rng.randint(0, 9),
                "timeout": 600}
        if headers:
            line["headers"] = headers
    lines.append(line)
# a terminal client error: the server answers 400
lines[10]["headers"] = {"x-sim-fail-first": "5", "x-sim-fail-status": "400"}
# deadlines too short for the retries they will need
for i in (21, 23):
    lines[i]["timeout"] = 1.5
    lines[i]["headers"] = {"x-sim-fail-first": "10", "x-sim-fail-status": "503"}
# an invalid line: priority out of range
lines[42]["priority"] = 12
with open("examples/demo.jsonl", "w") as fh:
    for line in lines:
        fh.write(json.dumps(line) + "\n")
