"""Batches: create one from an input, validate and enqueue it, read, list, cancel and wait for
it, and write its output — for ``pipeline.submit_batch``, ``pipeline serve`` and ``pipeline
run``. Who does what, and how a stopped creator is taken over: docs/batches.md."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from functools import partial
from pathlib import Path
from typing import IO, Any

import orjson
import redis

from ..client import CANCEL_RUNNING, Pipeline, canceller
from ..client.api import check_priority
from ..errors import InvalidRequest, ReplicationError, UnknownRequest
from ..store import Store
from .config import BatchSettings
from .files import Files
from .ingest import RowBuilder, RowContext, Scan, enqueue, input_lines, invalid_record, scan
from .lines import KNOWN_URLS, max_line_bytes
from .model import FINAL, Batch, IngestFailed, UnknownBatch, UnknownFile, window_seconds
from .output import LineResult, openai_line
from .records import READ_CHUNK, BatchRecords

BATCH_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
MAX_METADATA = 16
MAX_REASON = 500  # characters of an unexpected error kept in a failed batch's errors
# errors of the state store's reach, not of the batch: never counted against it (a batch
# waits for Redis or its replicas; a failed batch would be a lie)
TRANSIENT = (redis.ConnectionError, redis.TimeoutError, ReplicationError)
TRANSIENT_HOLD_S = 5.0  # a batch whose ingest met one is held off this long
Opener = Callable[[], IO[bytes] | Generator[bytes, None, None]]  # opens a batch's input


class InputGone(Exception):
    """The input of a batch is not there to read (its uploaded file was deleted)."""


def content_batch_id(path: str | Path, sha256: str | None = None) -> str:
    """The id ``pipeline run`` gives a file's batch: the same content, the same batch
    (``sha256``: the file's digest, hex, when the caller has read it already)."""
    if sha256 is None:
        with open(path, "rb") as fh:
            sha256 = hashlib.file_digest(fh, "sha256").hexdigest()
    return "batch_" + sha256[:32]


def _check_metadata(metadata: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA:
        raise InvalidRequest("metadata", f"must be an object of at most {MAX_METADATA} pairs")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise InvalidRequest("metadata", "keys must be strings of <= 64, values <= 512")
    return dict(metadata)


class Batches:
    """Batches of one :class:`Pipeline` (its Redis, queues and settings)."""

    def __init__(
        self, pipeline: Pipeline, settings: BatchSettings | None = None, files: Files | None = None
    ) -> None:
        self.pipeline = pipeline
        self.settings = settings or BatchSettings.from_env(pipeline.settings)
        self.files = files
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._by_store: dict[int, BatchRecords] = {}  # per pool's store (one if standalone)
        self._homes: dict[str, BatchRecords] = {}  # batch id -> where it was found

    # -- where a batch lives: its queue's pool (its own hash slot on a Redis Cluster) ----------
    def records_of(self, pool: str) -> BatchRecords:
        store = self.pipeline.store.for_pool(pool)
        records = self._by_store.get(id(store))
        if records is None:
            records = self._by_store[id(store)] = BatchRecords(store)
        return records

    def every_records(self) -> list[BatchRecords]:
        """The batch records of every pool: one on a standalone Redis."""
        return list(
            {id(r): r for r in map(self.records_of, self.pipeline.settings.pools())}.values()
        )

    def at(self, batch_id: str) -> BatchRecords:
        """The records of the batch's pool: on a cluster the pool whose slot holds it (found
        by :meth:`Store.holding`, remembered), or the first when none does (unknown there)."""
        home = self._homes.get(batch_id)
        if home is not None:
            return home
        every = self.every_records()
        if len(every) == 1:
            return every[0]
        queues = self.pipeline.settings.queues.values()
        store = self.pipeline.store.holding(lambda k: k.batch(batch_id), queues)
        if store is None:
            return every[0]
        if len(self._homes) > 10_000:
            self._homes.clear()
        home = self._homes[batch_id] = self._by_store[id(store)]
        return home

    # -- creating ---------------------------------------------------------------------------
    def create(
        self,
        *,
        batch_id: str | None = None,
        endpoint: str | None = None,
        completion_window: str | float = "24h",
        metadata: dict[str, str] | None = None,
        priority: int = 0,
        queue: str = "default",
        tenant: str | None = None,
        input_file_id: str | None = None,
        source: dict[str, Any] | None = None,
        files: bool = False,
        extensions: bool = False,
    ) -> tuple[Batch, bool]:
        """Store a new batch (``validating``), or find the one with ``batch_id``; returns it
        and whether it was created. Its lines are stored by :meth:`ingest`."""
        bid = batch_id or "batch_" + secrets.token_hex(12)
        if not isinstance(bid, str) or not BATCH_ID.match(bid):
            raise InvalidRequest("batch_id", "must be 1-128 characters of [A-Za-z0-9_.-]")
        window = window_seconds(completion_window)
        meta = _check_metadata(metadata)
        if endpoint is not None and (not isinstance(endpoint, str) or endpoint not in KNOWN_URLS):
            raise InvalidRequest("endpoint", f"must be one of {', '.join(sorted(KNOWN_URLS))}")
        check_priority(priority)
        self.pipeline.queue_config(queue)
        invalid_lines = meta.get("invalid_lines", "fail")
        if invalid_lines not in ("fail", "error_file"):
            raise InvalidRequest("metadata", "invalid_lines must be 'fail' or 'error_file'")
        req_meta = {self.pipeline.settings.fairness_attribute: tenant} if tenant else {}
        store = self._store_of_input(input_file_id) if files else ""
        window_text = completion_window if isinstance(completion_window, str) else f"{window:g}s"
        fields = {
            "endpoint": endpoint or "",
            "completion_window": window_text,
            "input_file_id": input_file_id or "",
            "metadata": json.dumps(meta) if meta else "",
            "files": "1" if files else "0",
            "store": store,
            "owner": tenant or "",
            "queue": queue,
            "priority": str(priority),
            "source": json.dumps(source or {}),
            "invalid_lines": invalid_lines,
            "extensions": "1" if extensions else "0",
            "req_metadata": json.dumps(req_meta),
            "result_ttl": str(int(self.pipeline.settings.result_ttl_s)),
        }
        pool = self.pipeline.queue_config(queue).worker_pool_id
        created = self.records_of(pool).create(bid, window, self.settings.retention_s, fields)
        return self.get(bid), created

    def _store_of_input(self, input_file_id: str | None) -> str:
        """The file store a batch of ``pipeline serve`` is assembled in: its input file's."""
        if self.files is None:
            return ""
        try:
            return self.files.get(input_file_id or "").store or self.files.store_id
        except UnknownFile:
            return self.files.store_id

    def ours(self, batch: Batch) -> bool:
        """Whether this client's file store is the batch's (``pipeline serve``: only a
        service on the store holding its input reads it and writes its output files)."""
        return self.files is not None and batch.files and batch.store in ("", self.files.store_id)

    def ingest(
        self, batch: Batch, opener: Opener, *, tries: int = 1, backoff_s: float = 2.0
    ) -> Batch:
        """Check the batch's whole input and store its lines: a ``validating`` batch fails or
        starts; an ``in_progress`` one resumes after its last stored line. Under the batch's
        lease (another holder: nothing done). Returns the batch after.

        An unexpected error counts as one of the batch's ``tries`` (counted in its record, by
        every process alike): before the last, the lease is held ``backoff_s`` × 2^(try - 1)
        s (nobody takes the batch up meanwhile); at the last, the batch gives up (``failed``
        with the reason in ``errors``). Either way :class:`IngestFailed` is raised. With
        more than one try, an error of Redis's reach (:data:`TRANSIENT`) is not counted: it is
        raised as it is and holds the batch :data:`TRANSIENT_HOLD_S` s."""
        records = self.at(batch.id)
        if not records.take_lease(batch.id, self.holder, self.settings.lease_s):
            return self.get(batch.id)
        hold = 0.0
        try:
            self._ingest(batch.id, opener)
        except Exception as exc:
            if tries > 1 and isinstance(exc, TRANSIENT):
                hold = TRANSIENT_HOLD_S
                raise
            failed = self._ingest_failed(batch.id, exc, tries, backoff_s)
            hold = failed.retry_in_s
            raise failed from exc
        finally:
            self._release(records, batch.id, hold)
        return self.get(batch.id)

    def _release(self, records: BatchRecords, batch_id: str, hold: float) -> None:
        try:
            if hold > 0:
                records.hold_lease(batch_id, self.holder, hold)
            else:
                records.drop_lease(batch_id, self.holder)
        except redis.RedisError:
            pass  # unreachable: the lease lapses by itself (PIPELINE_BATCH_LEASE_S)

    def _ingest_failed(
        self, batch_id: str, exc: Exception, tries: int, backoff_s: float
    ) -> IngestFailed:
        """Count a failed try of the batch's ingest; the error to raise."""
        if isinstance(exc, InputGone):  # it will not come back: give up at once
            tries = 1
            error = {"code": "input_file_missing", "line": None, "param": "input_file_id",
                     "message": str(exc)}  # fmt: skip
            reason = str(exc)
        else:
            reason = f"{type(exc).__name__}: {exc}"[:MAX_REASON]
            said = "once" if tries == 1 else f"{tries} times"
            error = {"code": "ingest_failed", "line": None, "param": None,
                     "message": f"storing the batch's lines failed {said}: {reason}"}  # fmt: skip
        status, n = self.at(batch_id).ingest_failed(batch_id, error, tries)
        n = n or tries  # 0: it had left validating / in_progress meanwhile (cancelled)
        retry_in = backoff_s * 2 ** (n - 1) if n < tries else 0.0
        return IngestFailed(batch_id, reason, tries=min(n, tries), allowed=tries,
                            retry_in_s=retry_in, status=status)  # fmt: skip

    def resume(self, batch_id: str, *, tries: int = 3, backoff_s: float = 2.0) -> Batch:
        """Store the lines of a batch ``pipeline serve`` assembles (or the rest of them), read
        from its uploaded input: :meth:`ingest` with ``tries``; a batch of another file store
        is left alone (:meth:`ours`), one whose input is gone fails at once."""
        batch = self.get(batch_id)
        if not self.ours(batch):
            return batch
        return self.ingest(batch, partial(self._open_input, batch), tries=tries,
                           backoff_s=backoff_s)  # fmt: skip

    def _open_input(self, batch: Batch) -> IO[bytes]:
        opener = self.opener(batch)
        if opener is None:
            fid = batch.input_file_id
            raise InputGone(f"the input file {fid} was deleted before the batch was read")
        return opener()

    def _ingest(self, batch_id: str, opener: Opener) -> None:
        rec = self.at(batch_id).record(batch_id)
        status = rec.get("status")
        if status not in ("validating", "in_progress") or rec.get("stopped") == "1":
            return  # closed, or it takes no more lines (cancelled, lapsed, given up)
        resume_after = int(rec.get("submitted") or 0) if status == "in_progress" else 0
        if status == "in_progress" and resume_after >= int(rec.get("lines") or 0):
            return  # every line is stored
        ctx = RowContext(
            batch_id=batch_id,
            queue=rec.get("queue", "default"),
            priority=int(rec.get("priority") or 0),
            deadline=float(rec["expires_at"]),
            created_at=float(rec["created_at"]),
            metadata=rec.get("req_metadata") or "{}",
            endpoint=rec.get("endpoint") or None,
            extensions=rec.get("extensions") == "1",
            error_file=rec.get("invalid_lines") == "error_file",
        )
        max_body = self.pipeline.settings.max_payload_bytes
        with closing(opener()) as source:
            result = scan(
                input_lines(source, max_line_bytes(max_body)),
                RowBuilder(self.pipeline, ctx),
                max_body_bytes=max_body,
                max_lines=self.settings.max_lines,
                enqueue_after=resume_after,
                renew=self._renewer(batch_id),
            )
        try:
            if status == "in_progress" or self._start(batch_id, ctx, result):
                enqueue(self.at(batch_id), batch_id, result, self._renewer(batch_id))
        finally:
            result.close()

    def _start(self, batch_id: str, ctx: RowContext, result: Scan) -> bool:
        """Fail or start a validated batch; True when its lines are to be stored."""
        fatal = result.total == 0 or any(e.code == "too_many_lines" for e in result.invalid)
        if fatal or (result.invalid and not ctx.error_file):
            errors = result.errors() or [
                {
                    "code": "empty_file",
                    "line": None,
                    "param": None,
                    "message": "the input has no request lines",
                }  # fmt: skip
            ]
            self.at(batch_id).fail(batch_id, errors)
            return False
        self.at(batch_id).push_invalid(batch_id, [invalid_record(e) for e in result.invalid])
        status = self.at(batch_id).start(
            batch_id,
            total=result.total,
            invalid=len(result.invalid),
            lines=result.lines,
            model=result.model,
        )
        return status == "in_progress"

    def _renewer(self, batch_id: str) -> Callable[[], object]:
        return partial(self.at(batch_id).take_lease, batch_id, self.holder, self.settings.lease_s)

    def submit_batch(
        self,
        lines_or_path: str | Path | Iterable[dict[str, Any] | str | bytes],
        *,
        completion_window: str | float = "24h",
        metadata: dict[str, str] | None = None,
        priority: int = 0,
        queue: str = "default",
        endpoint: str | None = None,
        batch_id: str | None = None,
        tenant: str | None = None,
    ) -> Batch:
        """Create a batch from OpenAI batch lines (a path to a JSONL file, or the lines as
        dicts or JSON text), check them all and store them; returns the batch (``failed``
        with ``errors`` when lines are bad, unless ``metadata["invalid_lines"]`` is
        ``"error_file"``). ``batch_id``: an idempotency key (an existing batch is resumed).

        Every bad line is an error line naming its field; a line given as a dict that is not
        JSON (a set, a non-str key) raises InvalidRequest before anything is stored. An
        unexpected error while the lines are stored fails the batch (its ``errors`` say why)
        and raises :class:`IngestFailed`: no batch is left ``validating``."""
        opener: Opener
        if isinstance(lines_or_path, str | Path):
            path = os.path.abspath(lines_or_path)
            if not os.path.isfile(path):
                raise InvalidRequest("lines_or_path", f"no such file: {lines_or_path}")
            source: dict[str, Any] = {"kind": "path", "path": path}

            def opener() -> IO[bytes]:
                return open(path, "rb")

        elif isinstance(lines_or_path, bytes | dict) or not isinstance(lines_or_path, Iterable):
            raise InvalidRequest(
                "lines_or_path", "must be a JSONL file's path or an iterable of lines"
            )
        else:
            items = [_line_bytes(n, x) for n, x in enumerate(lines_or_path, 1)]
            source = {"kind": "inline"}
            opener = partial(_each, items)

        batch, _ = self.create(
            batch_id=batch_id,
            endpoint=endpoint,
            completion_window=completion_window,
            metadata=metadata,
            priority=priority,
            queue=queue,
            tenant=tenant,
            source=source,
            extensions=True,
        )
        return self.ingest(batch, opener)

    # -- reading ----------------------------------------------------------------------------
    def get(self, batch_id: str, owner: str | None = None) -> Batch:
        rec = self.at(batch_id).record(batch_id)
        if not rec or (owner is not None and rec.get("owner", "") != owner):
            raise UnknownBatch(batch_id)
        return Batch.from_record(rec, self)

    def page(self, after: str | None, limit: int) -> tuple[list[str], bool]:
        """Batch ids newest first after the id ``after``, every pool's merged; and whether
        more follow."""
        every = self.every_records()
        if len(every) == 1:
            return every[0].page(after, limit)
        cursor = None
        if after:
            score = next((s for r in every if (s := r.created(after)) is not None), None)
            if score is None:
                return [], False
            cursor = (score, after)
        # newest first as one sorted set orders them: by score, then by id, both descending
        merged = sorted((e for r in every for e in r.newest(cursor, limit + 1)), reverse=True)
        return [bid for _, bid in merged[:limit]], len(merged) > limit

    def records_in(self, batch_ids: list[str]) -> list[dict[str, str]]:
        """The records of ``batch_ids`` that exist, in that order (one round trip per pool)."""
        every = self.every_records()
        if len(every) == 1:
            return every[0].records(batch_ids)
        found = {rec["id"]: rec for r in every for rec in r.records(batch_ids)}
        return [found[bid] for bid in batch_ids if bid in found]

    def active(self) -> list[str]:
        """The batches not yet closed, every pool's."""
        return sorted(bid for r in self.every_records() for bid in r.active())

    def list(
        self, *, after: str | None = None, limit: int = 20, owner: str | None = None
    ) -> tuple[list[Batch], bool]:
        """Batches newest first after the id ``after``; and whether more follow. With an
        ``owner``, only that tenant's."""
        out: list[Batch] = []
        cursor = after
        while True:
            ids, more = self.page(cursor, max(limit, 100))
            for rec in self.records_in(ids):
                if owner is None or rec.get("owner", "") == owner:
                    out.append(Batch.from_record(rec, self))
                    if len(out) > limit:
                        return out[:limit], True
            if not more or not ids:
                return out, False
            cursor = ids[-1]

    def active_count(self, owner: str) -> int:
        return sum(1 for rec in self.records_in(self.active()) if rec.get("owner", "") == owner)

    # -- cancelling, waiting ------------------------------------------------------------------
    def cancel(
        self,
        batch_id: str,
        owner: str | None = None,
        *,
        lines: bool = True,
        running: str = "finish",
        by: str | None = None,
    ) -> Batch:
        """Cancel (see :meth:`Batch.cancel`); a closed batch is returned unchanged.
        ``lines=False``: only mark it; the caller runs :meth:`cancel_lines` later.
        ``running``, ``by``: as :meth:`Pipeline.cancel` (``by`` defaults to the owner)."""
        if running not in CANCEL_RUNNING:
            raise InvalidRequest("running", f"must be one of {', '.join(CANCEL_RUNNING)}")
        who = canceller(by if by is not None or not owner else f"owner {owner}")
        self.get(batch_id, owner)
        if self.at(batch_id).cancel(batch_id, running, who) and lines:
            self.cancel_lines(batch_id)
        return self.get(batch_id)

    def cancel_lines(self, batch_id: str) -> int:
        """Cancel the not-started lines of a ``cancelling`` batch, under its lease (idempotent:
        again after a canceller died half-way). Returns how many."""
        # an enqueuer holding the lease stops at its next chunk (the batch takes no more lines)
        end = time.monotonic() + self.settings.lease_s
        while not self.at(batch_id).take_lease(batch_id, self.holder, self.settings.lease_s):
            if time.monotonic() > end:
                return 0  # still held: the holder's successor (pipeline serve's loop) does it
            time.sleep(0.05)
        try:
            rec = self.at(batch_id).record(batch_id)
            if rec.get("status") != "cancelling" or rec.get("cancel_done") == "1":
                return 0
            return self.at(batch_id).cancel_lines(
                batch_id,
                int(rec.get("submitted") or 0),
                rec.get("cancel_running") or "finish",
                rec.get("cancelled_by") or "",
            )
        finally:
            self.at(batch_id).drop_lease(batch_id, self.holder)

    def wait(
        self,
        batch_id: str,
        timeout: float | None = None,
        poll_s: float = 0.2,
        on_poll: Callable[[Batch], None] | None = None,
    ) -> Batch:
        """Poll until the batch is closed; raises TimeoutError after ``timeout`` s."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = self.get(batch_id)
            if on_poll is not None:
                on_poll(batch)
            if batch.status in FINAL:
                return batch
            if batch.status in ("validating", "in_progress"):
                # past its window with nobody storing its lines: close it (the script checks
                # the window by the server's clock and the lease; otherwise it does nothing)
                self.at(batch_id).lapse(batch_id)
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"batch {batch_id} not done after {timeout} s")
            time.sleep(poll_s)

    # -- results ----------------------------------------------------------------------------
    def lines(
        self, batch: Batch, custom_ids: Callable[[int], dict[int, str]] | None = None
    ) -> Iterator[LineResult]:
        """Every request line's outcome, in input order. Lines never stored are known only
        from the input: ``custom_ids(after)`` maps their numbers to custom_ids (None: the
        input is gone; they come without one)."""
        invalid = {int(r["line"]): r for r in self.at(batch.id).invalid(batch.id)}
        last = batch.submitted
        cancelled = batch.status in ("cancelled", "cancelling")
        missing = "batch_cancelled" if cancelled else "batch_expired"
        if batch.gave_up and not cancelled:
            missing = "batch_failed"
        rest = custom_ids(last) if custom_ids is not None and batch.lines > last else None
        stored = self._stored(batch.id, last)
        store = self.at(batch.id).store
        for n in range(1, max(batch.lines, last) + 1):
            res, cid = next(stored) if n <= last else (None, None)
            if n in invalid:  # never stored: a record by its id is another request's
                cid = invalid[n].get("custom_id")
                yield LineResult(n, batch.request_id(n), cid, invalid=invalid[n])
            elif res is not None:
                yield LineResult(n, batch.request_id(n), cid, _with_body(store, res))
            elif n > last and (rest is None or n in rest):
                cid = rest[n] if rest is not None else None
                yield LineResult(n, batch.request_id(n), cid, missing=missing)

    def _stored(self, batch_id: str, last: int) -> Iterator[tuple[str | None, str | None]]:
        """(result JSON, custom_id) of lines 1..``last``; the next range is read meanwhile."""
        ranges = [(lo, min(last, lo + READ_CHUNK - 1)) for lo in range(1, last + 1, READ_CHUNK)]
        with ThreadPoolExecutor(1, thread_name_prefix="batch-read") as pool:
            read = self.at(batch_id).results
            ahead = [pool.submit(read, batch_id, *r) for r in ranges[:1]]
            for i in range(len(ranges)):
                chunk = ahead.pop().result()
                if i + 1 < len(ranges):
                    ahead.append(pool.submit(read, batch_id, *ranges[i + 1]))
                yield from chunk

    def finalize(self, batch_id: str) -> Batch:
        """Write a ``finalizing`` batch's output and error files and close it. Idempotent: file
        ids follow from the batch id, files are written whole then renamed."""
        batch = self.get(batch_id)
        if batch.status != "finalizing" or not self.ours(batch):
            return batch  # another store's batch: finalized by a service on that store
        if not self.at(batch_id).take_lease(batch_id, self.holder, self.settings.lease_s):
            return batch
        try:
            self.at(batch_id).finalized(batch_id, *self.write_files(batch))
        finally:
            self.at(batch_id).drop_lease(batch_id, self.holder)
        return self.get(batch_id)

    def write_files(self, batch: Batch) -> tuple[str | None, str | None]:
        """Write the batch's output and error files; returns their ids (None when empty)."""
        assert self.files is not None, "finalize needs a file store"
        blobs = self.files.blobs
        out_id, err_id = f"file-{batch.id}-output", f"file-{batch.id}-errors"
        final = self.at(batch.id).record(batch.id).get("final_status", batch.status)
        with blobs.writer(out_id) as out, blobs.writer(err_id) as err:
            for line in self.lines(batch, self._input_custom_ids(batch)):
                (out if line.ok else err).write(openai_line(line, final))
        ids: list[str | None] = []
        for fid, name in ((out_id, "output"), (err_id, "errors")):
            if blobs.size(fid):  # an empty file is not kept
                self.files.add(fid, f"{batch.id}_{name}.jsonl", "batch_output", batch.owner)
                ids.append(fid)
            else:
                blobs.delete(fid)
                ids.append(None)
        return ids[0], ids[1]

    def _input_custom_ids(self, batch: Batch) -> Callable[[int], dict[int, str]] | None:
        """custom_ids of the input's lines after a line number, read from the input (for
        lines never stored: cancelled or lapsed before they were enqueued)."""
        opener = self.opener(batch)
        if opener is None:
            return None

        limit = max_line_bytes(self.pipeline.settings.max_payload_bytes)

        def read(after: int) -> dict[int, str]:
            out: dict[int, str] = {}
            with closing(opener()) as src:
                for n, raw in input_lines(src, limit):
                    if n <= after or not raw.strip() or len(raw) > limit:
                        continue
                    try:
                        obj = orjson.loads(raw)
                    except orjson.JSONDecodeError:
                        continue
                    if isinstance(obj, dict):
                        cid = obj.get("custom_id", obj.get("id", f"line-{n}"))
                        if isinstance(cid, str):
                            out[n] = cid
            return out

        return read

    def opener(self, batch: Batch) -> Callable[[], IO[bytes]] | None:
        """How to open the batch's input again: its uploaded file, or its path."""
        kind = batch.source.get("kind")
        if kind == "file" and self.files is not None and batch.input_file_id:
            blobs, fid = self.files.blobs, batch.input_file_id
            if not blobs.exists(fid):
                return None
            return lambda: blobs.open(fid)
        if kind == "path" and os.path.isfile(batch.source.get("path", "")):
            path = batch.source["path"]
            return lambda: open(path, "rb")
        return None


def _each(items: list[bytes]) -> Generator[bytes, None, None]:
    yield from items


def _line_bytes(number: int, item: dict[str, Any] | str | bytes) -> bytes:
    """A line given to :meth:`Batches.submit_batch` as the bytes of a JSONL line (a str not
    UTF-8-encodable and a dict that is no JSON: InvalidRequest naming the line)."""
    if isinstance(item, bytes):
        return item
    try:
        if isinstance(item, str):
            return item.encode("utf-8")
        return orjson.dumps(item)
    except (UnicodeEncodeError, TypeError) as exc:  # orjson.JSONEncodeError is a TypeError
        message = f"line {number} cannot be written as a JSON line: {exc}"
        raise InvalidRequest("lines_or_path", message) from None


def _with_body(store: Store, res: str) -> dict[str, Any]:
    """A line's stored result with its body (stored apart when large); a body gone before
    its result (evicted) leaves the line without one rather than stopping the output."""
    data: dict[str, Any] = orjson.loads(res)
    try:
        return store.with_body(data)
    except UnknownRequest:
        return data
