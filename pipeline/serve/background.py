"""What ``pipeline serve`` does besides answering: store new batches' lines, cancel cancelled
ones', assemble finished ones' files, close lapsed batches, remove expired files. Each step
holds the batch's lease, so a restart takes up every batch left half-way (docs/batches.md)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import redis

from ..batch import Batches

log = logging.getLogger("pipeline.serve")

SWEEP_EVERY_S = 60.0


class Background:
    """The service's background work: a small thread pool and one loop thread (running from
    the start)."""

    def __init__(self, batches: Batches, workers: int = 2, poll_s: float = 1.0) -> None:
        self.batches = batches
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="batch")
        self.poll_s = poll_s
        self._busy: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="batch-loop", daemon=True)
        self._since_sweep = SWEEP_EVERY_S
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- work items -------------------------------------------------------------------------
    def submit(self, kind: str, batch_id: str) -> None:
        """Run ``kind`` (ingest, cancel, finalize) for a batch unless it is running here."""
        with self._lock:
            if (kind, batch_id) in self._busy:
                return
            self._busy.add((kind, batch_id))
        self.pool.submit(self._run, kind, batch_id)

    def _run(self, kind: str, batch_id: str) -> None:
        try:
            b = self.batches
            if kind == "ingest":
                batch = b.get(batch_id)
                opener = b.opener(batch)
                if opener is None:
                    log.error("batch %s: its input file is gone; it cannot be read", batch_id)
                    fid = batch.input_file_id
                    message = f"the input file {fid} was deleted before the batch was read"
                    error = dict(code="input_file_missing", line=None, param="input_file_id")
                    b.at(batch_id).fail(batch_id, [{**error, "message": message}])
                else:
                    b.ingest(batch, opener)
            elif kind == "cancel":
                b.cancel_lines(batch_id)
            elif kind == "finalize":
                b.finalize(batch_id)
        except Exception:  # logged; the loop takes it up again
            log.exception("batch %s: %s failed", batch_id, kind)
        finally:
            with self._lock:
                self._busy.discard((kind, batch_id))

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
                self.wait_for_bell()
            except redis.RedisError as exc:
                log.warning("batch loop: Redis: %s", exc)
                self._stop.wait(self.poll_s)
            except Exception:
                log.exception("batch loop")
                self._stop.wait(self.poll_s)

    def wait_for_bell(self) -> None:
        """Until a finished batch rings its pool's doorbell (to finalize it at once, not at the
        poll), or the poll period passes. On a Redis Cluster each pool's bell is in its own
        slot, which one BLPOP cannot wait on: they are looked at once per poll period."""
        bells = [(r.client, r.keys.batches_bell()) for r in self.batches.every_records()]
        if len(bells) == 1:
            client, bell = bells[0]
            client.blpop([bell], timeout=self.poll_s)
        elif not any([client.lpop(bell) for client, bell in bells]):
            self._stop.wait(self.poll_s)

    def tick(self) -> None:
        """One pass over the open batches (and, every minute, expired files)."""
        for rec in self.batches.records_in(self.batches.active()):
            bid, status = rec["id"], rec.get("status")
            records = self.batches.at(bid)
            if status in ("validating", "in_progress"):
                # past its window with nobody storing its lines (any batch: the script checks)
                status = records.lapse(bid)
            if rec.get("files") != "1":
                continue  # created outside the service (pipeline run, Python): not ours
            if status in ("validating", "in_progress"):
                stored = int(rec.get("submitted") or 0) >= int(rec.get("lines") or 0)
                leased = records.client.exists(records.keys.batch_lease(bid))
                if (status == "validating" or not stored) and not leased:
                    self.submit("ingest", bid)
            elif status == "cancelling" and rec.get("cancel_done") != "1":
                self.submit("cancel", bid)
            elif status == "finalizing":
                self.submit("finalize", bid)
        self._since_sweep += self.poll_s
        if self._since_sweep >= SWEEP_EVERY_S and self.batches.files is not None:
            self._since_sweep = 0.0
            n = self.batches.files.sweep()
            if n:
                log.info("removed %d expired file(s)", n)
