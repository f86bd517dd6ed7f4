"""Files: OpenAI's ``File`` objects. The bytes live in a :class:`FileStore` (a directory on
local disk, ``PIPELINE_FILES_DIR``); the record (name, size, purpose, owner, times) lives in
Redis and expires with the file. A file whose record has expired loses its bytes at the next
:meth:`Files.sweep` (``pipeline serve`` sweeps every minute).

Another store (S3 or any object store) plugs in by implementing :class:`FileStore`'s five
methods: ``writer`` (stream to a temporary object, then publish it under its id), ``open``,
``size``, ``delete`` and ``exists``.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from ..store import Store
from .config import BatchSettings
from .model import UnknownFile

FILE_ID = re.compile(r"^file-[A-Za-z0-9_.\-]{1,200}$")
PURPOSES = ("batch", "batch_output")


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


class FileStore(Protocol):
    """Where a file's bytes live."""

    def writer(self, file_id: str) -> Any:  # a context manager yielding a binary writer
        ...

    def open(self, file_id: str) -> IO[bytes]: ...

    def size(self, file_id: str) -> int: ...

    def delete(self, file_id: str) -> None: ...

    def exists(self, file_id: str) -> bool: ...


class LocalFileStore:
    """Files in one directory, written to a temporary name and renamed into place (a reader
    never sees a partial file; a crash leaves only a ``.tmp-*`` file, removed at start)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):
            stale.unlink(missing_ok=True)

    def path(self, file_id: str) -> Path:
        if not FILE_ID.match(file_id):
            raise UnknownFile(file_id)
        return self.root / file_id

    @contextmanager
    def writer(self, file_id: str) -> Iterator[IO[bytes]]:
        final = self.path(file_id)
        tmp = self.root / f".tmp-{file_id}-{secrets.token_hex(4)}"
        try:
            with open(tmp, "wb") as fh:
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)

    def open(self, file_id: str) -> IO[bytes]:
        try:
            return open(self.path(file_id), "rb")
        except FileNotFoundError:
            raise UnknownFile(file_id) from None

    def size(self, file_id: str) -> int:
        return self.path(file_id).stat().st_size

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)

    def exists(self, file_id: str) -> bool:
        return self.path(file_id).exists()


@dataclass(frozen=True)
class FileInfo:
    id: str
    bytes: int
    created_at: float
    filename: str
    purpose: str
    expires_at: float
    owner: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(self.created_at),
            "expires_at": int(self.expires_at),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


class Files:
    """File records in Redis (``file:<id>``, indexed by ``files`` and ``files:expiry``) over a
    :class:`FileStore`."""

    def __init__(self, store: Store, settings: BatchSettings, blobs: FileStore | None = None):
        self.client = store.client
        self.keys = store.keys
        self.settings = settings
        self.blobs: FileStore = blobs or LocalFileStore(settings.files_dir)

    def _now(self) -> float:
        sec, usec = self.client.time()
        return float(sec) + float(usec) / 1e6

    def add(self, file_id: str, filename: str, purpose: str, owner: str = "") -> FileInfo:
        """Record a file whose bytes are in the store; it expires ``file_ttl_s`` from now."""
        now = self._now()
        ttl = self.settings.file_ttl_s
        info = FileInfo(file_id, self.blobs.size(file_id), now, filename, purpose, now + ttl, owner)
        with self.client.pipeline(transaction=True) as p:
            p.hset(
                self.keys.file(file_id),
                mapping={
                    "id": file_id,
                    "bytes": info.bytes,
                    "created_at": repr(now),
                    "expires_at": repr(info.expires_at),
                    "filename": filename,
                    "purpose": purpose,
                    "owner": owner,
                },
            )
            p.expire(self.keys.file(file_id), int(ttl) + 1)
            p.zadd(self.keys.files(), {file_id: now})
            p.zadd(self.keys.files_expiry(), {file_id: info.expires_at})
            p.execute()
        return info

    def get(self, file_id: str, owner: str | None = None) -> FileInfo:
        rec: dict[str, str] = self.client.hgetall(self.keys.file(file_id))  # type: ignore[assignment]
        if not rec or (owner is not None and rec.get("owner", "") != owner):
            raise UnknownFile(file_id)
        return FileInfo(
            rec["id"],
            int(rec["bytes"]),
            float(rec["created_at"]),
            rec.get("filename", ""),
            rec.get("purpose", "batch"),
            float(rec["expires_at"]),
            rec.get("owner", ""),
        )

    def list(
        self,
        *,
        owner: str | None = None,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 10000,
        order: str = "desc",
    ) -> tuple[list[FileInfo], bool]:
        """Files by creation time (``order``), after the id ``after``; and whether more
        follow. Files of other owners (with API keys on) are left out."""
        ids: list[str] = list(self.client.zrange(self.keys.files(), 0, -1))  # type: ignore[arg-type]
        if order == "desc":
            ids.reverse()
        if after:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        out: list[FileInfo] = []
        for i in range(0, len(ids), 500):
            for fid in ids[i : i + 500]:
                try:
                    info = self.get(fid, owner)
                except UnknownFile:
                    continue
                if purpose and info.purpose != purpose:
                    continue
                out.append(info)
                if len(out) > limit:
                    return out[:limit], True
        return out, False

    def delete(self, file_id: str, owner: str | None = None) -> None:
        self.get(file_id, owner)  # raises UnknownFile
        with self.client.pipeline(transaction=True) as p:
            p.delete(self.keys.file(file_id))
            p.zrem(self.keys.files(), file_id)
            p.zrem(self.keys.files_expiry(), file_id)
            p.execute()
        self.blobs.delete(file_id)

    def sweep(self) -> int:
        """Remove the bytes and index entries of expired files; returns how many."""
        expired: list[str] = self.client.zrangebyscore(  # type: ignore[assignment]
            self.keys.files_expiry(), "-inf", self._now()
        )
        for fid in expired:
            self.blobs.delete(fid)
            with self.client.pipeline(transaction=True) as p:
                p.delete(self.keys.file(fid))
                p.zrem(self.keys.files(), fid)
                p.zrem(self.keys.files_expiry(), fid)
                p.execute()
        return len(expired)
