"""One worker node (a subprocess, as a user starts it) on a Redis of the test's own, serving one
queue named ``default``: what the chaos tests that kill, wipe or fill that Redis start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.cli.services import wait_until
from pipeline.client import Pipeline
from pipeline.config import load_settings
from tests.conftest import ROOT


@dataclass
class PrivateNode:
    env: dict[str, str]  # the node's environment: a client of the same pipeline uses it too
    log: Path  # the node's log (stdout and stderr)
    proc: subprocess.Popen[bytes]

    def pipeline(self) -> Pipeline:
        """A client of the node's pipeline, once the node has registered in its pool."""
        pl = Pipeline(load_settings(self.env))
        nodes = pl.store.keys.pool_nodes("default")
        wait_until(lambda: pl.store.client.zcard(nodes) > 0, 90, "the worker node")
        return pl


def start_node(
    tmp: Path, redis_url: str, queue: dict[str, Any], *, slots: int, name: str, **env: str
) -> PrivateNode:
    """``pipeline worker -c slots -n name`` on ``redis_url`` with ``queue`` (its name:
    ``default``) and ``env`` (e.g. ``PIPELINE_LEASE_S``) beside the test's own environment
    without its ``PIPELINE_`` and ``CELERY_`` settings."""
    qfile = tmp / "queues.json"
    qfile.write_text(json.dumps([{"queue_name": "default", **queue}]))
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "CELERY_"))}
    full.update(PIPELINE_REDIS_URL=redis_url, PIPELINE_QUEUES=str(qfile), PIPELINE_METRICS_PORT="0")
    full.update(env)
    log = tmp / "worker.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "worker", "-c", str(slots), "-n", name],
            env=full, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
    return PrivateNode(full, log, proc)
