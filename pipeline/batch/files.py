"""OpenAI's ``File`` objects: bytes in a :class:`FileStore`, the record in Redis (expiring with
the file). Another store plugs in through :class:`FileStore` (docs/batches.md). Each store has
an identity (``store_id``) that its files' records and its batches carry: a service acts only
on its own store's (docs/batches.md, "Several services on one Redis")."""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from ..store import Store
from ..store.keys import slot_keys
from .config import BatchSettings
from .model import FileElsewhere, UnknownFile

log = logging.getLogger("pipeline.batch")

FILE_ID = re.compile(r"^file-[A-Za-z0-9_.\-]{1,200}$")
STORE_ID_FILE = ".store-id"  # a local store's identity, made once, shared by its users
STALE_TMP_S = 3600.0  # a temporary file untouched this long was left by a process that died
# a file's record outlives the file by this much, so that the sweep of its own store (which
# may run in another service) still reads where its bytes are; reads see it gone at expiry
RECORD_GRACE_S = 86400.0


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


class FileStore(Protocol):
    """Where a file's bytes live. ``store_id``: the same for every process that sees the same
    bytes (a directory shared over NFS, a bucket and prefix), another for another store."""

    @property
    def store_id(self) -> str: ...

    def writer(self, file_id: str) -> Any:  # a context manager yielding a binary writer
        ...

    def open(self, file_id: str) -> IO[bytes]: ...

    def size(self, file_id: str) -> int: ...

    def delete(self, file_id: str) -> None: ...

    def exists(self, file_id: str) -> bool: ...


class LocalFileStore:
    """Files in one directory, written to a temporary name then renamed (never seen partial).
    The directory is 0700 and every file 0600, whatever the umask: prompts and outputs are
    readable by this user only. Its identity is a random id kept in the directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            os.chmod(self.root, 0o700)  # mkdir's mode is cut by the umask; an older one's 0755
        except PermissionError:
            log.warning("cannot make %s private (0700): it is not this user's", self.root)
        self._store_id = self._identity()
        # a temporary file another process sharing the directory writes is touched as it
        # grows: only one left untouched for long is a dead writer's
        cutoff = time.time() - STALE_TMP_S
        for stale in self.root.glob(".tmp-*"):
            try:
                if stale.stat().st_mtime < cutoff:
                    stale.unlink(missing_ok=True)
            except FileNotFoundError:
                pass

    @property
    def store_id(self) -> str:
        return self._store_id

    def _identity(self) -> str:
        """The directory's store id: read, or made by the first process to get there (written
        whole, then linked into place: another process reads either none or all of it)."""
        path = self.root / STORE_ID_FILE
        if not path.exists():
            tmp = self._create(f".tmp-id-{secrets.token_hex(4)}")
            try:
                with os.fdopen(tmp[0], "w") as fh:
                    fh.write(f"local-{secrets.token_hex(8)}\n")
                os.link(tmp[1], path)
            except FileExistsError:
                pass  # another process made it first: its id is the one
            finally:
                tmp[1].unlink(missing_ok=True)
        return path.read_text().strip()

    def _create(self, name: str) -> tuple[int, Path]:
        """A new file of this store, 0600 whatever the umask: its descriptor and path."""
        path = self.root / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.fchmod(fd, 0o600)
        return fd, path

    def path(self, file_id: str) -> Path:
        if not FILE_ID.match(file_id):
            raise UnknownFile(file_id)
        return self.root / file_id

    @contextmanager
    def writer(self, file_id: str) -> Iterator[IO[bytes]]:
        final = self.path(file_id)
        fd, tmp = self._create(f".tmp-{file_id}-{secrets.token_hex(4)}")
        try:
            with os.fdopen(fd, "wb") as fh:
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
    store: str = ""  # the store_id of the store holding its bytes ("": from before stores)

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

    @property
    def store_id(self) -> str:
        return self.blobs.store_id

    def now(self) -> float:
        """The Redis server's clock (Unix s)."""
        sec, usec = self.client.time()
        return float(sec) + float(usec) / 1e6

    def here(self, info: FileInfo) -> bool:
        """Whether the file's bytes are in this store (a file from before stores: assumed)."""
        return info.store in ("", self.store_id)

    def open(self, info: FileInfo) -> IO[bytes]:
        """The file's bytes; FileElsewhere when another store holds them."""
        if not self.here(info):
            raise FileElsewhere(info.id, info.store, self.store_id)
        return self.blobs.open(info.id)

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
        size = self.blobs.size(file_id)
        info = FileInfo(file_id, size, now, now + ttl, filename, purpose, owner, self.store_id)
        with self.client.pipeline(transaction=True) as p:
            # the times as repr(float): redis-py's encoding of a float
            p.hset(self.keys.file(file_id), mapping=asdict(info))  # type: ignore[arg-type]
            p.expire(self.keys.file(file_id), int(ttl + RECORD_GRACE_S) + 1)
            p.zadd(self.keys.files(), {file_id: now})
            p.zadd(self.keys.files_expiry(), {file_id: info.expires_at})
            p.execute()
        return info

    def get(self, file_id: str, owner: str | None = None, now: float | None = None) -> FileInfo:
        """The file's record (UnknownFile when there is none, it is another owner's, or it
        expired by the server's clock: ``now``, read when not given)."""
        info = self._record(file_id)
        if info is None or (owner is not None and info.owner != owner):
            raise UnknownFile(file_id)
        if info.expires_at <= (self.now() if now is None else now):
            raise UnknownFile(file_id)
        return info

    def _record(self, file_id: str) -> FileInfo | None:
        rec: dict[str, str] = self.client.hgetall(self.keys.file(file_id))  # type: ignore[assignment]
        if not rec:
            return None
        return FileInfo(
            rec["id"],
            int(rec["bytes"]),
            float(rec["created_at"]),
            float(rec["expires_at"]),
            rec.get("filename", ""),
            rec.get("purpose", "batch"),
            rec.get("owner", ""),
            rec.get("store", ""),
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
        now = self.now()
        for fid in ids:
            try:
                info = self.get(fid, owner, now)
            except UnknownFile:
                continue
            if purpose and info.purpose != purpose:
                continue
            out.append(info)
            if len(out) > limit:
                return out[:limit], True
        return out, False

    def delete(self, file_id: str, owner: str | None = None) -> None:
        """Delete a file (UnknownFile; FileElsewhere when another store holds its bytes: its
        record is kept, so that a service on that store can still delete them)."""
        info = self.get(file_id, owner)
        if not self.here(info):
            raise FileElsewhere(file_id, info.store, self.store_id)
        self._forget(file_id)

    def sweep(self) -> int:
        """Remove this store's expired files (and the index entries of records gone past
        their grace, wherever their bytes were); returns how many. Another store's files are
        left to a service on that store."""
        expired: list[str] = self.client.zrangebyscore(  # type: ignore[assignment]
            self.keys.files_expiry(), "-inf", self.now()
        )
        n = 0
        for fid in expired:
            info = self._record(fid)
            if info is None or self.here(info):
                self._forget(fid)
                n += 1
        return n
