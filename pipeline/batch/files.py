"""OpenAI's ``File`` objects: bytes in a :class:`FileStore`, the record in Redis (expiring with
the file). Another store plugs in through :class:`FileStore` (docs/batches.md)."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from ..store import Store
from ..store.keys import slot_keys
from .config import BatchSettings
from .model import UnknownFile

FILE_ID = re.compile(r"^file-[A-Za-z0-9_.\-]{1,200}$")


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
    """Files in one directory, written to a temporary name then renamed (never seen partial)."""

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
    expires_at: float
    filename: str
    purpose: str
    owner: str

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
        # a file's record and the two indexes change together (MULTI): on a Redis Cluster in
        # one slot of their own
        self.keys = slot_keys(store.keys.prefix, "files") if store.cluster else store.keys
        self.settings = settings
        self.blobs: FileStore = blobs or LocalFileStore(settings.files_dir)

    def now(self) -> float:
        """The Redis server's clock (Unix s)."""
        sec, usec = self.client.time()
        return float(sec) + float(usec) / 1e6

    def _forget(self, file_id: str) -> None:
        self.blobs.delete(file_id)  # bytes first: a crash leaves the record, swept again
        with self.client.pipeline(transaction=True) as p:
            p.delete(self.keys.file(file_id))
            p.zrem(self.keys.files(), file_id)
            p.zrem(self.keys.files_expiry(), file_id)
            p.execute()

    def add(self, file_id: str, filename: str, purpose: str, owner: str) -> FileInfo:
        now = self.now()
        ttl = self.settings.file_ttl_s
        info = FileInfo(file_id, self.blobs.size(file_id), now, now + ttl, filename, purpose, owner)
        with self.client.pipeline(transaction=True) as p:
            # the times as repr(float): redis-py's encoding of a float
            p.hset(self.keys.file(file_id), mapping=asdict(info))  # type: ignore[arg-type]
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
            float(rec["expires_at"]),
            rec.get("filename", ""),
            rec.get("purpose", "batch"),
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
        for fid in ids:
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
        self._forget(file_id)

    def sweep(self) -> int:
        """Remove expired files; returns how many."""
        expired: list[str] = self.client.zrangebyscore(  # type: ignore[assignment]
            self.keys.files_expiry(), "-inf", self.now()
        )
        for fid in expired:
            self._forget(fid)
        return len(expired)
