"""What ``pipeline serve`` does besides answering: store new batches' lines, cancel cancelled
ones', assemble finished ones' files, close lapsed batches, remove expired files. Each step
holds the batch's lease, so a restart takes up every batch left half-way (docs/batches.md).
A step that fails is tried again after a backoff, logged one line a try: storing a batch's
lines gives up after :data:`INGEST_TRIES` (the batch fails, saying why)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import redis

from ..batch import Batches, IngestFailed
from ..errors import ReplicationError

log = logging.getLogger("pipeline.serve")

SWEEP_EVERY_S = 60.0
INGEST_TRIES = 3  # tries of a batch's ingest (counted in Redis, by every service alike)
INGEST_BACKOFF_S = 2.0  # before its second try; doubled before each next
STEP_BACKOFF_MAX_S = 60.0  # a failing cancel or finalize is tried again at most this far apart


class Background:
    """The service's background work: a small thread pool and one loop thread (running from
    the start)."""

    def __init__(
        self,
        batches: Batches,
        workers: int = 2,
        poll_s: float = 1.0,
        ingest_tries: int = INGEST_TRIES,
        ingest_backoff_s: float = INGEST_BACKOFF_S,
    ) -> None:
        self.batches = batches
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="batch")
        self.poll_s = poll_s
        self.ingest_tries, self.ingest_backoff_s = ingest_tries, ingest_backoff_s
        self._failed: dict[tuple[str, str], tuple[int, float]] = {}  # step -> (fails, not before)
        self._stores_seen: set[str] = set()  # other file stores named in a log line already
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
        """Run ``kind`` (ingest, cancel, finalize) for a batch unless it is running here or
        failed here and waits out its backoff."""
        step = (kind, batch_id)
        with self._lock:
            if step in self._busy or self._failed.get(step, (0, 0.0))[1] > time.monotonic():
                return
            self._busy.add(step)
        self.pool.submit(self._run, kind, batch_id)

    def _run(self, kind: str, batch_id: str) -> None:
        step = (kind, batch_id)
        try:
            b = self.batches
            if kind == "ingest":
                b.resume(batch_id, tries=self.ingest_tries, backoff_s=self.ingest_backoff_s)
            elif kind == "cancel":
                b.cancel_lines(batch_id)
            elif kind == "finalize":
                b.finalize(batch_id)
            self._failed.pop(step, None)
        except IngestFailed as exc:  # counted, and held off, in Redis (Batches.ingest)
            if exc.final:
                log.error("%s", exc, exc_info=exc.__cause__)  # the one traceback it logs
            else:
                log.warning("%s", exc)
        except (redis.RedisError, ReplicationError) as exc:
            log.warning("batch %s: %s: Redis: %s", batch_id, kind, exc)
            self._hold_off(step)
        except Exception:  # logged (the first time with its traceback); tried again later
            fails, again = self._hold_off(step)
            if fails == 1:
                log.exception("batch %s: %s failed; again in %g s", batch_id, kind, again)
            else:
                log.warning("batch %s: %s failed again (%d times; again in %g s)",
                            batch_id, kind, fails, again)  # fmt: skip
        finally:
            with self._lock:
                self._busy.discard(step)

    def _hold_off(self, step: tuple[str, str]) -> tuple[int, float]:
        """A failed step waits before it runs again here: 1, 2, 4 ... 60 s. Returns (fails
        so far, the wait)."""
        with self._lock:
            fails = self._failed.get(step, (0, 0.0))[0] + 1
            wait = min(STEP_BACKOFF_MAX_S, 2.0 ** (fails - 1))
            if len(self._failed) > 10_000:
                self._failed.clear()
            self._failed[step] = (fails, time.monotonic() + wait)
        return fails, wait

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

    def _ours(self, rec: dict[str, str]) -> bool:
        """Whether the batch is in this service's file store (logged once per other store)."""
        files = self.batches.files
        store = rec.get("store", "")
        if files is None or store in ("", files.store_id):
            return True
        if store not in self._stores_seen:
            self._stores_seen.add(store)
            log.warning(
                "batch %s is in file store %s, not in this service's (%s, PIPELINE_FILES_DIR "
                "%s): left to a service on that store; every pipeline serve on one Redis must "
                "share one PIPELINE_FILES_DIR",
                rec.get("id"), store, files.store_id, self.batches.settings.files_dir,
            )  # fmt: skip
        return False

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
            if not self._ours(rec):  # another store's: a service on it reads and writes it
                if status == "cancelling" and rec.get("cancel_done") != "1":
                    self.submit("cancel", bid)  # (Redis only: any service may)
                continue
            if status in ("validating", "in_progress"):
                stored = int(rec.get("submitted") or 0) >= int(rec.get("lines") or 0)
                stored = stored or rec.get("stopped") == "1"  # it takes no more lines
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
