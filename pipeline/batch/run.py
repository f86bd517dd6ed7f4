"""``pipeline run FILE.jsonl``: a client of batch objects. The batch id follows from the file's
content, so running it again attaches to the same batch and resumes (docs/batches.md)."""

from __future__ import annotations

import codecs
import hashlib
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..client import Pipeline
from .ingest import Scan, input_lines, scan
from .model import Batch, IngestFailed, UnknownBatch
from .output import LineResult, openai_line, result_line
from .service import Batches, content_batch_id


class RunError(Exception):
    """The run cannot start: one line for the user, exit status 2."""


OUTAGE_S = 60.0  # the run waits this long for a Redis that stopped answering (a restart)
LOST_EXIT = 3  # exit status of a run whose batch went with a Redis that lost its state


class StateLostRun(Exception):
    """The batch went with a Redis that lost its state (restarted without persistence,
    flushed) while the run followed it: one line for the user naming the file of lines to
    re-run, exit status :data:`LOST_EXIT`."""

    def __init__(self, batch_id: str, lines: int, rerun: Path, command: str,
                 noticed_at: float | None) -> None:  # fmt: skip
        when = (
            ""
            if noticed_at is None
            else f", noticed at {time.strftime('%H:%M:%S UTC', time.gmtime(noticed_at))}"
        )
        super().__init__(
            f"the pipeline's Redis lost its state (restarted without persistence, or flushed"
            f"{when}) while batch {batch_id} ran: the outcomes of its {lines} line(s) are gone. "
            f"The lines to re-run are in {rerun}; re-run them with: {command}"
        )
        self.rerun = rerun


@dataclass
class Summary:
    total: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    attempts: int = 0
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def add(self, line: LineResult) -> None:
        self.total += 1
        r = line.result
        if r is None:
            key = line.error()[0]
        elif r.ok:
            key = f"ok ({r.status_code})"
        elif r.error_code:
            key = r.error_code
        else:
            key = f"HTTP {r.status_code}"
        self.outcomes[key] += 1
        if r is not None:
            self.attempts += r.attempts
            if r.latency_s is not None:
                self.latencies.append(r.latency_s)

    def table(self) -> Table:
        t = Table(title="Batch summary", show_header=True)
        t.add_column("outcome")
        t.add_column("requests", justify="right")
        for key, n in sorted(self.outcomes.items()):
            t.add_row(key, str(n))
        t.add_section()
        t.add_row("total", str(self.total))
        t.add_row("HTTP attempts", str(self.attempts))
        for p in (50, 95) if self.latencies else ():
            t.add_row(f"latency p{p}", f"{_pct(sorted(self.latencies), p):.2f} s")
        t.add_row("wall time", f"{self.wall_s:.2f} s")
        if self.wall_s > 0:
            t.add_row("throughput", f"{self.total / self.wall_s:.1f} req/s")
        return t

    def as_dict(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {
            "total": self.total,
            "outcomes": dict(self.outcomes),
            "attempts": self.attempts,
            "latency_p50_s": _pct(lat, 50) if lat else None,
            "latency_p95_s": _pct(lat, 95) if lat else None,
            "mean_latency_s": statistics.fmean(lat) if lat else None,
            "wall_s": self.wall_s,
        }


def _pct(sorted_values: list[float], p: float) -> float:
    i = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[i]


# Byte order marks of the encodings a batch file is sometimes saved in by mistake (UTF-32
# first: its little-endian mark begins with UTF-16's)
_BOMS = {
    codecs.BOM_UTF32_LE: "UTF-32",
    codecs.BOM_UTF32_BE: "UTF-32",
    codecs.BOM_UTF16_LE: "UTF-16",
    codecs.BOM_UTF16_BE: "UTF-16",
}
SNIFF_BYTES = 4096


def check_file(path: str, max_body_bytes: int, max_lines: int) -> Scan:
    """Read and check the whole file before anything is started: RunError (one line) when
    it cannot be read, is not UTF-8 text, has no request lines, has no line that is a JSON
    object (not JSONL), or repeats a custom_id (naming the lines). Single bad lines are the
    batch's error lines, not a reason to refuse the file."""
    try:
        with open(path, "rb") as fh:
            _check_encoding(path, fh.read(SNIFF_BYTES))
            fh.seek(0)
            result = scan(input_lines(fh), None, max_body_bytes=max_body_bytes,
                          max_lines=max_lines)  # fmt: skip
    except OSError as exc:
        raise RunError(f"cannot read {path}: {exc.strerror or exc}") from None
    if result.total == 0:
        raise RunError(f"{path}: no request lines")
    not_json = [e for e in result.invalid if e.code == "invalid_json_line"]
    if not_json and len(not_json) == result.total:
        raise RunError(
            f"{path} is not JSONL (one JSON object per line): no line is one; {not_json[0].message}"
        )
    if result.duplicates:
        parts = [
            f"{cid!r} on lines {', '.join(map(str, lines))}"
            for cid, lines in list(result.duplicates.items())[:5]
        ]
        more = len(result.duplicates) - 5
        tail = f" (and {more} more)" if more > 0 else ""
        raise RunError(f"{path}: duplicate custom_id {'; '.join(parts)}{tail}")
    too_many = [e for e in result.invalid if e.code == "too_many_lines"]
    if too_many:
        raise RunError(f"{path}: {too_many[0].message}")
    return result


def _check_encoding(path: str, head: bytes) -> None:
    for bom, name in _BOMS.items():
        if head.startswith(bom):
            raise RunError(
                f"{path} is {name} text: a batch file is UTF-8 JSONL "
                f"(iconv -f {name} -t UTF-8 {path})"
            )
    if b"\0" in head:
        raise RunError(f"{path} is not text (it holds NUL bytes): a batch file is UTF-8 JSONL")


def check_outputs(opts: RunOptions) -> None:
    """The result files can be written where asked, and none is the input file: RunError (one
    line naming the option) before anything is started. The output is written whole at the
    end, so a bad path found then would cost the whole run."""
    outputs = [("-o", Path(opts.output))]
    if opts.out_format == "openai":
        outputs.append(("--error-output", error_path(opts)))
    source = Path(opts.path)
    for option, out in outputs:
        if out.is_dir():
            raise RunError(f"{option} {out}: is a directory")
        parent = out.parent.resolve()
        if not parent.is_dir():
            raise RunError(f"{option} {out}: no directory {parent}")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise RunError(f"{option} {out}: cannot write in {parent}")
        if _same_file(out, source):
            raise RunError(f"{option} {out} is the input file: the results would overwrite it")
    if len(outputs) == 2 and _same_file(outputs[0][1], outputs[1][1]):
        raise RunError(f"--error-output {outputs[1][1]} is the same file as -o")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return a.resolve() == b.resolve()


def error_path(opts: RunOptions) -> Path:
    """--format openai: where the error file goes (default ``<output>.errors<suffix>``)."""
    out = Path(opts.output)
    return Path(opts.error_output or out.with_name(out.stem + ".errors" + (out.suffix or ".jsonl")))


@dataclass
class RunOptions:
    path: str
    output: str
    batch_id: str | None = None
    completion_window: str = "24h"
    queue: str | None = None  # lines without a queue of their own (default: "default")
    out_format: str = "results"  # or "openai"
    error_output: str | None = None  # --format openai: the error file (default <output>.errors)
    timeout: float | None = None
    show_progress: bool = True


class Run:
    """One ``pipeline run``: create or attach, store the lines, follow, write the output."""

    def __init__(self, pipeline: Pipeline, opts: RunOptions, console: Console) -> None:
        self.batches = Batches(pipeline)
        self.pipeline = pipeline
        self.opts = opts
        self.console = console
        self.batch: Batch | None = None

    def start(self) -> Batch:
        """Create the file's batch (or find it) and store its lines (or the rest of them)."""
        path = os.path.abspath(self.opts.path)
        with open(path, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        bid = self.opts.batch_id or content_batch_id(path, digest)
        queues = self.pipeline.settings.queues
        queue = self.opts.queue or ("default" if "default" in queues else next(iter(queues)))
        batch, created = self.batches.create(
            batch_id=bid,
            queue=queue,
            completion_window=self.opts.completion_window,
            metadata={"invalid_lines": "error_file"},
            source={"kind": "path", "path": path, "sha256": digest},
            extensions=True,
        )
        self.pipeline.epoch.learn()  # the store epoch this run stores under
        if not created and batch.source.get("sha256") not in (None, digest):
            raise RunError(f"batch {bid} was created from other content than {self.opts.path}")
        if not created:
            c = batch.request_counts
            self.console.print(
                f"[dim]attached to batch {bid} ({batch.status}: {c.done}/{c.total} done)"
            )
        self.batch = self._store_lines(batch)
        return self.batch

    def _store_lines(self, batch: Batch) -> Batch:
        """Store the batch's lines, or the rest (unless a live holder of its lease does)."""
        if batch.status == "validating" or (
            batch.status == "in_progress" and batch.submitted < batch.lines
        ):
            path = os.path.abspath(self.opts.path)
            try:
                return self.batches.ingest(batch, lambda: open(path, "rb"))
            except IngestFailed as exc:  # the batch is failed, saying why: one line, exit 2
                raise RunError(str(exc)) from exc
        return batch

    def follow(self) -> Batch:
        """Wait for the batch to close, with a progress bar; TimeoutError after --timeout."""
        assert self.batch is not None
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "ok {task.fields[ok]}  failed {task.fields[failed]}  "
                "retrying {task.fields[retrying]}  in flight {task.fields[running]}"
            ),
            TimeElapsedColumn(),
            console=self.console,
            disable=not self.opts.show_progress,
        )
        fields: dict[str, Any] = {"ok": 0, "failed": 0, "retrying": 0, "running": 0}
        last_inspect = [0.0]
        with progress:
            c = self.batch.request_counts
            task = progress.add_task("requests", total=c.total, completed=c.done, **fields)

            def on_poll(b: Batch) -> None:
                b = self._store_lines(b)
                rc = b.request_counts
                fields.update(ok=rc.completed, failed=rc.failed)
                now = time.monotonic()
                if now - last_inspect[0] > 0.5:  # queue-wide numbers: once in a while
                    info = self.pipeline.inspect()
                    fields["retrying"] = sum(q["retry_wait"] for q in info.values())
                    fields["running"] = sum(q["running"] for q in info.values())
                    last_inspect[0] = now
                if b.done:
                    fields.update(retrying=0, running=0)
                progress.update(task, total=rc.total, completed=rc.done, **fields)

            self.batch = self._wait(on_poll)
        return self.batch

    def _wait(self, on_poll: Any) -> Batch:
        """Wait for the batch to close, riding over Redis not answering for up to
        :data:`OUTAGE_S` (a restart); :class:`StateLostRun` when the batch went with a Redis
        that lost its state."""
        assert self.batch is not None
        down: list[float | None] = [None]  # since when Redis has not answered (monotonic)

        def polled(b: Batch) -> None:
            down[0] = None
            on_poll(b)

        while True:
            try:
                return self._wait_once(polled)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                now = time.monotonic()
                if down[0] is None:
                    down[0] = now
                    self.console.print("[yellow]Redis does not answer; waiting for it")
                elif now - down[0] > OUTAGE_S:
                    raise RunError(f"Redis did not answer for {OUTAGE_S:.0f} s: {exc}") from None
                time.sleep(0.5)

    def _wait_once(self, on_poll: Any) -> Batch:
        """One wait for the batch; a batch gone with a Redis that lost its state raises
        :class:`StateLostRun`. Redis failing meanwhile (the check for a lost state included:
        a restart resets the pool's connections) raises its error for :meth:`_wait` to ride."""
        assert self.batch is not None
        try:
            return self.batches.wait(
                self.batch.id, timeout=self.opts.timeout, poll_s=0.25, on_poll=on_poll
            )
        except UnknownBatch:
            lost = self.pipeline.lost([])
            if lost is None:
                raise
            raise self._lost(lost.noticed_at) from None

    def _lost(self, noticed_at: float | None) -> StateLostRun:
        """The run's batch went with the Redis state: write its request lines (every one: no
        outcome survived, and the output is written only at the end) to
        ``<output>.rerun.jsonl`` and say how to re-run them."""
        assert self.batch is not None
        out = Path(self.opts.output)
        rerun = out.with_name(out.stem + ".rerun" + (out.suffix or ".jsonl"))
        n = 0
        with open(self.opts.path, "rb") as src, _atomic(rerun) as dst:
            for line in src:
                if line.strip():
                    dst.write(line if line.endswith(b"\n") else line + b"\n")
                    n += 1
        command = f"pipeline run {rerun} -o {self.opts.output}"
        return StateLostRun(self.batch.id, n, rerun, command, noticed_at)

    def write(self, started: float) -> Summary:
        """Write the output (and with --format openai the error file) whole, then rename."""
        assert self.batch is not None
        summary = Summary()
        final = self.batch.status
        openai = self.opts.out_format == "openai"
        out_path = Path(self.opts.output)
        err_path = error_path(self.opts)
        ids = self.batches._input_custom_ids(self.batch)
        # without --format openai, every line goes to the output (no error file)
        with _atomic(out_path) as out, _atomic(err_path) if openai else nullcontext(out) as err:
            for line in self.batches.lines(self.batch, ids):
                summary.add(line)
                if openai:
                    (out if line.ok else err).write(openai_line(line, final))
                else:
                    out.write(result_line(line))
        summary.wall_s = time.time() - started
        return summary

    def reattach_hint(self) -> str:
        assert self.batch is not None
        return (
            f"batch {self.batch.id} keeps running; re-attach with: "
            f"pipeline run {self.opts.path} -o {self.opts.output}"
            + (f" --batch-id {self.batch.id}" if self.opts.batch_id else "")
        )


@contextmanager
def _atomic(path: Path) -> Iterator[IO[bytes]]:
    """A file written under a temporary name and renamed into place if the block ends without
    an error."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent.resolve()))
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
