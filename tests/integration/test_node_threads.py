"""A threads node starts its pool's threads with it, before it offers its slots: Celery's
threads pool would start one per message, each start blocking the consumer's loop until the
new thread gets the GIL, all through a fresh node's first burst (tasks/node.py,
``prestart_threads``)."""

from __future__ import annotations

import os
from collections.abc import Callable

from tests.conftest import WorkerProc

SLOTS = 40  # well above the node's own threads (dispatcher, reloader, health, beat...)


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_a_threads_node_has_its_slots_threads_when_it_offers_them(
    start_worker: Callable[..., WorkerProc],
) -> None:
    w = start_worker(concurrency=SLOTS)  # returns once its dispatcher registered its slots
    try:
        assert threads_of(w.proc.pid) >= SLOTS
    finally:
        w.stop()
