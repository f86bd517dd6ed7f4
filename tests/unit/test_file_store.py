"""The local file store keeps prompts and outputs private — the directory 0700, every file
0600, whatever the umask and however old the directory — and knows its identity (one id per
directory, the same for every process that opens it)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.batch import LocalFileStore

STORE_ID_FILE = ".store-id"  # pipeline.batch.files.STORE_ID_FILE


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=[0o000, 0o022, 0o077], ids=["umask-000", "umask-022", "umask-077"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


@pytest.mark.parametrize("existing", [False, True], ids=["new-dir", "old-0755-dir"])
def test_the_directory_is_0700_and_every_file_0600(
    tmp_path: Path, umask: int, existing: bool
) -> None:
    root = tmp_path / "files"
    if existing:
        root.mkdir(mode=0o755)
        os.chmod(root, 0o755)
    store = LocalFileStore(root)
    with store.writer("file-a") as fh:
        fh.write(b"{}\n")
    assert mode(root) == 0o700
    assert mode(root / "file-a") == 0o600
    assert mode(root / STORE_ID_FILE) == 0o600
    assert sorted(p.name for p in root.iterdir()) == [STORE_ID_FILE, "file-a"]


def test_one_identity_per_directory(tmp_path: Path) -> None:
    a1, a2 = LocalFileStore(tmp_path / "a"), LocalFileStore(tmp_path / "a")
    b = LocalFileStore(tmp_path / "b")
    assert a1.store_id == a2.store_id != b.store_id
    assert a1.store_id.startswith("local-")


def test_only_a_long_untouched_temporary_file_is_removed_at_start(tmp_path: Path) -> None:
    """Another process sharing the directory may be writing a temporary file right now."""
    LocalFileStore(tmp_path)
    fresh, stale = tmp_path / ".tmp-file-x-1", tmp_path / ".tmp-file-y-2"
    fresh.write_bytes(b"being written")
    stale.write_bytes(b"left by a dead process")
    os.utime(stale, (1_000_000, 1_000_000))
    LocalFileStore(tmp_path)
    assert fresh.exists() and not stale.exists()
