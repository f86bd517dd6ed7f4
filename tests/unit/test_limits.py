"""A node raises its open files limit to what its slots need (one HTTP connection each)."""

from __future__ import annotations

import resource
import subprocess
import sys
from collections.abc import Iterator

import pytest

from pipeline.worker.limits import ensure_open_files, open_files_needed


@pytest.fixture
def restore_limit() -> Iterator[tuple[int, int]]:
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield before
    resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_the_soft_limit_is_raised_to_what_the_slots_need(restore_limit: tuple[int, int]) -> None:
    _, hard = restore_limit
    need = open_files_needed(1024)
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.fail(f"this machine's hard open files limit {hard} is below {need}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    assert ensure_open_files(1024) is None
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == need


def test_a_hard_limit_too_low_is_named(restore_limit: tuple[int, int]) -> None:
    soft, hard = restore_limit
    low = min(soft, 600) if hard == resource.RLIM_INFINITY else min(soft, hard, 600)
    # lowering the hard limit cannot be undone without privileges: do it in a child
    code = (
        "import resource; from pipeline.worker.limits import ensure_open_files;"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({low}, {low}));"
        "print(ensure_open_files(4096))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert f"is {low}, below the {open_files_needed(4096)}" in out.stdout
    assert "4096 slots (-c)" in out.stdout


def test_lease_renewals_go_in_chunks() -> None:
    """A node with thousands running renews their leases a few hundred per script call."""
    from pipeline.worker.process import RENEW_CHUNK, chunks

    parts = chunks(list(range(2 * RENEW_CHUNK + 1)))
    assert [len(p) for p in parts] == [RENEW_CHUNK, RENEW_CHUNK, 1]
    assert [x for p in parts for x in p] == list(range(2 * RENEW_CHUNK + 1))
    assert chunks([]) == []
