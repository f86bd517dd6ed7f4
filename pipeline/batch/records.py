"""Batch state in Redis: each step is one atomic script (``pipeline/store/lua/batch_*.lua``,
plus ``submit.lua``'s batch fence). The counts are kept by ``lib.lua``: every script that
writes a request's terminal result counts it in its batch in the same step."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import orjson

from ..store import Store
from ..store.scripts import Script, replication, source

BATCH_SCRIPTS = (
    "batch_create",
    "batch_start",
    "batch_cancel",
    "batch_cancel_lines",
    "batch_finalized",
    "batch_lapse",
    "batch_results",
    "batch_ingest_failed",
)
CANCEL_CHUNK = 500  # request ids per batch_cancel_lines call
READ_CHUNK = 1000  # request records per round trip when reading results


class BatchRecords:
    """The batch scripts and reads, on one pipeline :class:`Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.client = store.client
        self.keys = store.keys
        rep = store.settings.redis_min_replicas
        timeout = store.settings.redis_wait_timeout_ms
        self._scripts = {
            # cancelling lines writes terminal results: wait for replicas as cancel.lua does
            name: Script(
                self.client,
                source(name),
                name=name,
                replication=replication(
                    "cancel" if name == "batch_cancel_lines" else name, rep, timeout
                ),
            )
            for name in BATCH_SCRIPTS
        }

    def _run(self, name: str, batch_id: str, *args: Any) -> Any:
        """Script ``name`` on the batch's hash and the key families (see its header)."""
        keys = [self.keys.batch(batch_id), *self.keys.families]
        return self._scripts[name](keys=keys, args=[batch_id, *args])

    # -- life cycle -----------------------------------------------------------------------
    def create(
        self, batch_id: str, window_s: float, retention_s: float, fields: dict[str, str]
    ) -> bool:
        """Store a new batch; False when a batch with that id existed."""
        k = self.keys
        created, _at, _expires, _status = self._scripts["batch_create"](
            keys=[k.batch(batch_id), k.batches(), k.batches_expiry(), k.batches_active()],
            args=[batch_id, repr(window_s), repr(retention_s), json.dumps(fields)],
        )
        return int(created) == 1

    def start(
        self, batch_id: str, *, total: int, invalid: int, lines: int, model: str | None
    ) -> str:
        """Validation passed: the batch runs (``in_progress``) with ``total`` requests of
        which ``invalid`` are already failed (they go to the error file)."""
        return str(
            self._run("batch_start", batch_id, "ok", total, invalid, lines, "[]", model or "")
        )

    def fail(self, batch_id: str, errors: list[dict[str, Any]]) -> str:
        """Validation failed: the batch is ``failed`` with ``errors``."""
        return str(self._run("batch_start", batch_id, "failed", 0, 0, 0, json.dumps(errors), ""))

    def ingest_failed(self, batch_id: str, error: dict[str, Any], allowed: int) -> tuple[str, int]:
        """Storing the batch's lines raised: count the try, and at the ``allowed``-th give up
        with ``error`` (see batch_ingest_failed.lua). Returns (status afterwards, tries so
        far; 0 when the batch was not validating or in progress)."""
        status, tries = self._run("batch_ingest_failed", batch_id, json.dumps(error), allowed)
        return str(status), int(tries)

    def push_invalid(self, batch_id: str, records: Sequence[bytes]) -> None:
        """Keep invalid lines (JSON records) for the error file; they expire with the batch."""
        if not records:
            return
        key = self.keys.batch_invalid(batch_id)
        ttl = self.client.ttl(self.keys.batch(batch_id))
        with self.client.pipeline(transaction=False) as p:
            for i in range(0, len(records), 1000):
                p.rpush(key, *records[i : i + 1000])
            p.expire(key, max(1, int(ttl)))
            p.execute()

    def invalid(self, batch_id: str) -> list[dict[str, Any]]:
        raw = self.client.lrange(self.keys.batch_invalid(batch_id), 0, -1)
        return [orjson.loads(r) for r in raw]

    def submit_chunk(self, batch_id: str, after: int, upto: int, items: bytes) -> Any:
        """Store the batch's lines after line ``after`` up to line ``upto`` (``items``: the
        JSON array of submit.lua rows of the valid ones), fenced: submit.lua's reply, one entry
        per item, or ``["stopped", status]`` (the batch takes no more lines) or ``["fenced",
        lines covered so far]`` (another enqueuer is ahead)."""
        return self.store.scripts.submit(
            keys=self.keys.families, args=[items, batch_id, after, upto]
        )

    def cancel(self, batch_id: str, running: str = "finish", by: str = "") -> bool:
        """Cancel the batch (see batch_cancel.lua); True when the caller should now cancel the
        submitted lines (those not started; with ``running`` 'abort' the running ones too)."""
        return self._run("batch_cancel", batch_id, running, by)[2] == "1"

    def cancel_lines(self, batch_id: str, submitted: int, running: str, by: str) -> int:
        """Cancel the requests of lines 1..``submitted`` (batch_cancel_lines.lua); returns how
        many ended."""
        n = 0
        ttl = int(self.store.settings.result_ttl_s)
        script = self._scripts["batch_cancel_lines"]
        for first in range(1, submitted + 1, CANCEL_CHUNK):
            last = min(submitted, first + CANCEL_CHUNK - 1)
            ids = [f"{batch_id}-{i}" for i in range(first, last + 1)]
            n += int(script(keys=self.keys.families, args=[ttl, running, by, batch_id, *ids]))
        self.client.hset(self.keys.batch(batch_id), "cancel_done", "1")
        return n

    def finalized(
        self, batch_id: str, output_file_id: str | None, error_file_id: str | None
    ) -> str:
        return str(
            self._run("batch_finalized", batch_id, output_file_id or "", error_file_id or "")
        )

    def lapse(self, batch_id: str) -> str:
        """Close a batch whose window passed while nobody enqueues it (see batch_lapse.lua)."""
        keys = [self.keys.batch(batch_id), self.keys.batch_lease(batch_id), *self.keys.families]
        return str(self._scripts["batch_lapse"](keys=keys, args=[batch_id]))

    # -- leases (who validates, enqueues, cancels or finalizes a batch) -----------------------
    def take_lease(self, batch_id: str, holder: str, ttl_s: int = 30) -> bool:
        key = self.keys.batch_lease(batch_id)
        return bool(self.client.set(key, holder, nx=True, ex=ttl_s)) or (
            self.client.get(key) == holder and bool(self.client.expire(key, ttl_s))
        )

    def hold_lease(self, batch_id: str, holder: str, seconds: float) -> None:
        """Keep the batch's lease ``seconds`` more (and no longer) if ``holder`` holds it: a
        holder that failed holds the batch off for its backoff (``pipeline serve`` takes up
        only batches nobody holds)."""
        key = self.keys.batch_lease(batch_id)
        if self.client.get(key) == holder:
            self.client.pexpire(key, max(1, int(seconds * 1000)))

    def drop_lease(self, batch_id: str, holder: str) -> None:
        key = self.keys.batch_lease(batch_id)
        if self.client.get(key) == holder:
            self.client.delete(key)

    # -- reading --------------------------------------------------------------------------
    def record(self, batch_id: str) -> dict[str, str]:
        return self.client.hgetall(self.keys.batch(batch_id))  # type: ignore[return-value]

    def records(self, batch_ids: Sequence[str]) -> list[dict[str, str]]:
        with self.client.pipeline(transaction=False) as p:
            for bid in batch_ids:
                p.hgetall(self.keys.batch(bid))
            return [r for r in p.execute() if r]

    def page(self, after: str | None, limit: int) -> tuple[list[str], bool]:
        """Batch ids newest first, after the id ``after`` (a cursor); and whether more follow."""
        index = self.keys.batches()
        start = 0
        if after:
            rank = self.client.zrevrank(index, after)
            if rank is None:
                return [], False
            start = int(rank) + 1  # type: ignore[arg-type]
        ids = self.client.zrevrange(index, start, start + limit)
        return list(ids[:limit]), len(ids) > limit  # type: ignore[arg-type]

    def created(self, batch_id: str) -> float | None:
        """The batch's score in the index (its creation time), None when not in this one."""
        score = self.client.zscore(self.keys.batches(), batch_id)
        return None if score is None else float(score)

    def newest(self, cursor: tuple[float, str] | None, limit: int) -> list[tuple[float, str]]:
        """Up to ``limit`` (created, id) newest first, after ``cursor`` in that order (a batch
        created earlier, or at the same time with a smaller id): a page of several pools' merge."""
        index = self.keys.batches()
        got: list[tuple[str, float]]
        if cursor is None:
            got = self.client.zrevrange(  # type: ignore[assignment]
                index, 0, limit - 1, withscores=True
            )
        else:
            score, after = cursor
            ties = int(self.client.zcount(index, score, score))
            got = self.client.zrevrangebyscore(  # type: ignore[assignment]
                index, score, "-inf", start=0, num=limit + ties, withscores=True
            )
            got = [(b, s) for b, s in got if s < score or b < after]
        return [(float(s), str(b)) for b, s in got[:limit]]

    def active(self) -> list[str]:
        return sorted(self.client.smembers(self.keys.batches_active()))  # type: ignore[arg-type]

    def results(self, batch_id: str, first: int, last: int) -> list[tuple[str | None, str | None]]:
        """(result JSON, custom_id) of lines ``first``..``last`` (None where no record), in one
        call: read at most :data:`READ_CHUNK` lines at a time."""
        flat = self._scripts["batch_results"](
            keys=[self.keys.request_prefix()], args=[batch_id, first, last]
        )
        return list(zip(flat[0::2], flat[1::2], strict=True))
