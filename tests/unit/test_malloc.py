"""A worker process fixes glibc's mmap threshold (pipeline/worker/malloc.py): a large block
freed goes back to the system at once, however large the blocks freed before it were."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from pipeline.worker.malloc import fix_mmap_threshold
print(fix_mmap_threshold() if sys.argv[1] == "fix" else "-")
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
x = bytearray(16 << 20)  # freed: glibc would raise its threshold to 16 MiB
del x
before = rss()
y = bytearray(8 << 20)  # written through (zeroed)
del y
print(rss() - before)
"""


def probe(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
        env={"PATH": "/usr/bin:/bin", **env},
    ).stdout.split()  # fmt: skip
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc, /proc")
def test_a_freed_large_block_leaves_the_process() -> None:
    fixed, kept_kib = probe("fix")
    assert fixed == "True"
    assert kept_kib < 2048  # of 8 MiB freed
    _, default_kib = probe("default")
    assert default_kib > 6 * 1024  # glibc's own way keeps it: what the fix is for


def test_an_operators_setting_wins() -> None:
    fixed, _ = probe("fix", MALLOC_MMAP_THRESHOLD_="65536")
    assert fixed == "False"
