"""Fixtures shared by the integration tests beyond the suite-wide ones in tests/conftest.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import WorkerProc
from tests.observability import Isolated, start_node


@pytest.fixture
def nodes(
    start_worker: Callable[..., WorkerProc],
) -> Iterator[Callable[..., tuple[WorkerProc, int]]]:
    """Start worker nodes of an isolated pipeline (see ``start_node``); stopped at the end."""
    started: list[WorkerProc] = []

    def start(iso: Isolated, **kw: Any) -> tuple[WorkerProc, int]:
        w, port = start_node(start_worker, iso, **kw)
        started.append(w)
        return w, port

    yield start
    for w in started:
        w.proc.terminate()
    for w in started:
        w.stop()
