"""From an input file to queued requests: check the whole input first (:func:`scan`), spooling
rows to a temporary file (flat memory), then store them chunk by chunk (:func:`enqueue`),
fenced by line numbers in submit.lua (docs/batches.md, "Nothing is lost on a restart").
"""

from __future__ import annotations

import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import orjson

from ..client import Pipeline
from ..client.prefix import MIN_CHARS, prefix_key
from ..errors import InvalidRequest
from ..store import RequestRow
from .lines import Line, LineError, parse_line
from .records import BatchRecords

FIRST_CHUNK = 32  # rows in the first submit call: the dispatcher starts on the head at once
MAX_CHUNK = 500  # ... doubling up to this many: one call must not stall Redis (bench/batch.py)
MAX_ERRORS = 1000  # errors listed in a failed batch's ``errors`` (then one summary entry)
_HEAD = struct.Struct("<QQQ")  # a spooled chunk: after, upto, length of its items


@dataclass(frozen=True)
class RowContext:
    """What every row of one batch shares."""

    batch_id: str
    queue: str
    priority: int
    deadline: float  # the batch's expires_at (Unix s, server clock)
    created_at: float  # the batch's created_at (server clock): per-line timeouts count from it
    metadata: str  # the requests' metadata JSON (the tenant as the fairness attribute)
    endpoint: str | None  # every line's url must be this one (None: any known url)
    extensions: bool  # pipeline run lines
    error_file: bool  # invalid lines go to the error file, the rest runs


@dataclass
class Scan:
    """A checked input: ``total`` request lines, the last line number, the invalid ones, and
    the valid rows spooled for :func:`enqueue`."""

    total: int = 0
    lines: int = 0
    invalid: list[LineError] = field(default_factory=list)
    duplicates: dict[str, list[int]] = field(default_factory=dict)
    model: str | None = None
    spool: IO[bytes] | None = None
    chunks: int = 0

    def errors(self) -> list[dict[str, Any]]:
        """The batch's ``errors.data``: each invalid line (the first :data:`MAX_ERRORS`)."""
        out = [e.as_error() for e in self.invalid[:MAX_ERRORS]]
        if len(self.invalid) > MAX_ERRORS:
            more = len(self.invalid) - MAX_ERRORS
            out.append({"code": "too_many_errors", "line": None, "param": None,
                        "message": f"and {more} more invalid lines"})  # fmt: skip
        return out

    def chunks_iter(self) -> Iterator[tuple[int, int, bytes]]:
        """The spooled chunks in order: (after line, up to line, submit.lua items)."""
        assert self.spool is not None, "a Scan that only checked"
        self.spool.seek(0)
        for _ in range(self.chunks):
            after, upto, n = _HEAD.unpack(self.spool.read(_HEAD.size))
            yield after, upto, self.spool.read(n)

    def close(self) -> None:
        if self.spool is not None:
            self.spool.close()
            self.spool = None


BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark, which some editors put first


def input_lines(
    source: IO[bytes] | Iterable[bytes], max_line_bytes: int | None = None
) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, the line without its end of line) of an input. With
    ``max_line_bytes``, a longer line of a file is read only one byte past that (and refused
    as too long: :func:`parse_line`), the rest of it skipped unread: memory stays bounded
    whatever the file. A byte order mark opening the input is dropped."""
    readline = getattr(source, "readline", None)
    lines: Iterable[bytes] = source
    if max_line_bytes is not None and readline is not None:
        lines = _bounded(readline, max_line_bytes)
    for number, raw in enumerate(lines, 1):
        if number == 1 and raw.startswith(BOM):
            raw = raw[len(BOM) :]
        yield number, raw.rstrip(b"\r\n")


def _bounded(readline: Callable[[int], bytes], most: int) -> Iterator[bytes]:
    while raw := readline(most + 1):
        if len(raw) > most and not raw.endswith(b"\n"):
            while (rest := readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
        yield raw


class RowBuilder:
    """Rows for submit.lua from valid lines: a line with no fields of its own fills in the
    batch's template row."""

    def __init__(self, pipeline: Pipeline, ctx: RowContext) -> None:
        self.pipeline = pipeline
        self.ctx = ctx
        q = self.queue = pipeline.queue_config(ctx.queue)
        store = pipeline.store_of(q.queue_name)
        result_list, result_list_max, result_list_ttl = store.result_list_args(q)
        self.template = RequestRow(
            id="",
            queue=q.queue_name,
            pool=q.worker_pool_id,
            priority=str(ctx.priority),
            deadline=repr(ctx.deadline),
            timeout="",
            payload="",
            metadata=ctx.metadata,
            headers="{}",
            endpoint="",
            result_list=result_list,
            result_list_max=result_list_max,
            result_list_ttl=result_list_ttl,
            labels=orjson.dumps(q.labels).decode() if q.labels else "{}",
        )

    def _prefix(self, body: str) -> str:
        """The line's prefix key (pipeline/client/prefix.py), if its queue groups."""
        if not self.queue.group_prefixes or len(body) < MIN_CHARS:
            return ""
        try:
            return prefix_key(orjson.loads(body), self.queue)
        except ValueError:
            return ""

    def row(self, line: Line) -> RequestRow | LineError:
        rid = f"{self.ctx.batch_id}-{line.number}"
        if line.extra is None:
            return self.template._replace(
                id=rid, payload=line.body, endpoint=line.url or "", custom_id=line.custom_id,
                prefix=self._prefix(line.body),
            )  # fmt: skip
        # a run line with its own priority, deadline, timeout, metadata, headers or queue:
        # checked by Pipeline.prepare, as ``submit`` checks its arguments
        extra = dict(line.extra)
        own_deadline = extra.pop("deadline", None)
        own_timeout = extra.pop("timeout", None)
        extra.setdefault("queue", self.ctx.queue)
        extra.setdefault("priority", self.ctx.priority)
        try:
            row = self.pipeline.prepare(
                orjson.loads(line.body),
                id=rid,
                endpoint=line.url,
                deadline=own_deadline,
                timeout=own_timeout if own_deadline is None else None,
                **extra,
            )
        except InvalidRequest as exc:
            field = line.body_key if exc.field == "payload" else exc.field  # the line's name
            message = str(exc).replace("payload: ", f"{field}: ", 1)
            return LineError(
                line.number, "invalid_request", f"line {line.number}: {message}", field,
                line.custom_id,
            )  # fmt: skip
        if row.pool != self.template.pool and self.pipeline.settings.redis_cluster:
            return LineError(
                line.number, "invalid_request", f"line {line.number}: queue {row.queue!r} is in "
                f"pool {row.pool!r}; on a Redis Cluster a batch's lines stay in its queue's pool "
                f"({self.template.pool!r}): give that queue's lines a batch of their own",
                "queue", line.custom_id,
            )  # fmt: skip
        deadline = self.ctx.deadline
        if own_deadline is not None:
            deadline = min(deadline, float(own_deadline))
        elif own_timeout is not None:
            deadline = min(deadline, self.ctx.created_at + float(own_timeout))
        metadata = row.metadata
        if self.ctx.metadata != "{}" and metadata == "{}":
            metadata = self.ctx.metadata
        return row._replace(
            deadline=repr(deadline), timeout="", metadata=metadata, custom_id=line.custom_id
        )


def scan(
    source: Iterable[tuple[int, bytes]],
    builder: RowBuilder | None,
    *,
    max_body_bytes: int,
    max_lines: int,
    enqueue_after: int = 0,
    renew: Callable[[], object] | None = None,
) -> Scan:
    """Check every line; with a ``builder``, spool the valid rows after line ``enqueue_after``
    (stored before the batch resumed); without one, only check."""
    spool = tempfile.TemporaryFile(prefix="pipeline-batch-") if builder else None  # noqa: SIM115 - Scan.close
    out = Scan(spool=spool)
    try:
        _scan(out, source, builder, max_body_bytes, max_lines, enqueue_after, renew)
    except BaseException:
        out.close()
        raise
    return out


def _scan(
    out: Scan,
    source: Iterable[tuple[int, bytes]],
    builder: RowBuilder | None,
    max_body_bytes: int,
    max_lines: int,
    enqueue_after: int,
    renew: Callable[[], object] | None,
) -> None:
    endpoint = builder.ctx.endpoint if builder else None
    extensions = builder.ctx.extensions if builder else True
    seen: dict[str, int] = {}
    rows: list[RequestRow] = []
    after, size = enqueue_after, FIRST_CHUNK
    for number, raw in source:
        out.lines = number
        if not raw.strip():
            continue
        out.total += 1
        if out.total > max_lines:
            out.invalid.append(LineError(number, "too_many_lines", f"more than {max_lines} lines"))
            break
        checked: Line | LineError | RequestRow = parse_line(
            number, raw, endpoint=endpoint, max_body_bytes=max_body_bytes, extensions=extensions
        )
        if isinstance(checked, Line):
            checked = _unique(checked, seen, out.duplicates)
        if isinstance(checked, Line):
            out.model = out.model or checked.model
            if builder is not None and number > enqueue_after:
                checked = builder.row(checked)
        if isinstance(checked, LineError):
            out.invalid.append(checked)
        elif isinstance(checked, RequestRow):
            rows.append(checked)
            if len(rows) >= size:
                _spool(out, after, number, rows)
                after, rows, size = number, [], min(MAX_CHUNK, size * 2)
                if renew is not None and out.chunks % 20 == 0:
                    renew()
    if builder is not None and out.lines > after:
        _spool(out, after, out.lines, rows)


def _unique(line: Line, seen: dict[str, int], duplicates: dict[str, list[int]]) -> Line | LineError:
    """The line, or an error when its custom_id was used on an earlier line."""
    first = seen.setdefault(line.custom_id, line.number)
    if first == line.number:
        return line
    duplicates.setdefault(line.custom_id, [first]).append(line.number)
    return LineError(
        line.number, "duplicate_custom_id",
        f"line {line.number}: custom_id {line.custom_id!r} already used on line {first}",
        "custom_id", line.custom_id,
    )  # fmt: skip


def _spool(out: Scan, after: int, upto: int, rows: list[RequestRow]) -> None:
    assert out.spool is not None
    items = orjson.dumps(rows, default=list)  # orjson writes no NamedTuple by itself
    out.spool.write(_HEAD.pack(after, upto, len(items)))
    out.spool.write(items)
    out.chunks += 1


def invalid_record(err: LineError) -> bytes:
    """An invalid line as kept for the error file."""
    return orjson.dumps(
        {
            "line": err.number,
            "custom_id": err.custom_id,
            "code": err.code,
            "message": err.message,
            "param": err.param,
        }
    )


def enqueue(
    records: BatchRecords, batch_id: str, result: Scan, renew: Callable[[], object]
) -> None:
    """Store the spooled chunks in order; stop when the batch takes no more lines (cancelled
    or lapsed) or another enqueuer is ahead (fenced: see submit.lua)."""
    for i, (after, upto, items) in enumerate(result.chunks_iter()):
        reply = records.submit_chunk(batch_id, after, upto, items)
        if reply and reply[0] == "fenced" and int(reply[1] or 0) >= upto:
            continue  # this chunk was stored before (a resumed enqueue)
        if reply and reply[0] in ("stopped", "fenced"):
            return
        if i % 20 == 19:
            renew()
