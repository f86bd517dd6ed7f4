"""``pipeline run FILE.jsonl``: submit a batch, follow it with a progress bar, write one
result line per request and print a summary.

Input lines are either OpenAI Batch API lines (``custom_id``, ``method``, ``url``, ``body``)
or objects of :func:`pipeline.submit` keyword arguments with a ``payload``. A line that is not
valid gets an ``INVALID_REQUEST`` result line of its own; the others run.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..errors import InvalidRequest
from .api import Pipeline
from .models import Result


@dataclass
class Line:
    number: int
    custom_id: str | None
    kwargs: dict[str, Any] | None = None
    error: str | None = None  # why the line was rejected


def parse_line(number: int, raw: str | bytes) -> Line:
    """One input line → submit kwargs (or the reason it is invalid)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        return Line(number, None, error=f"line {number}: not UTF-8 ({exc.reason})")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return Line(number, None, error=f"line {number}: not JSON: {exc.msg}")
    except RecursionError:
        return Line(number, None, error=f"line {number}: JSON nested too deeply")
    if not isinstance(obj, dict):
        return Line(number, None, error=f"line {number}: not a JSON object")
    if "body" in obj and "payload" not in obj:  # OpenAI Batch API line
        custom_id = obj.get("custom_id")
        kwargs: dict[str, Any] = {"payload": obj.get("body")}
        if custom_id is not None:
            kwargs["id"] = custom_id
        if isinstance(obj.get("url"), str) and obj["url"]:
            kwargs["endpoint"] = obj["url"]
        for key in ("priority", "deadline", "timeout", "metadata", "headers", "queue"):
            if key in obj:
                kwargs[key] = obj[key]
        return Line(number, custom_id if isinstance(custom_id, str) else None, kwargs)
    kwargs = dict(obj)
    if "payload" not in kwargs:
        return Line(number, None, error=f"line {number}: no 'payload' (or 'body')")
    rid = kwargs.get("id")
    return Line(number, rid if isinstance(rid, str) else None, kwargs)


@dataclass
class Summary:
    total: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    attempts: int = 0
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def add(self, result: Result) -> None:
        if result.ok:
            key = f"ok ({result.status_code})"
        elif result.error_code:
            key = result.error_code
        else:
            key = f"HTTP {result.status_code}"
        self.outcomes[key] += 1
        self.attempts += result.attempts
        if result.latency_s is not None:
            self.latencies.append(result.latency_s)

    def table(self) -> Table:
        t = Table(title="Batch summary", show_header=True)
        t.add_column("outcome")
        t.add_column("requests", justify="right")
        for key, n in sorted(self.outcomes.items()):
            t.add_row(key, str(n))
        t.add_section()
        t.add_row("total", str(self.total))
        t.add_row("HTTP attempts", str(self.attempts))
        if self.latencies:
            lat = sorted(self.latencies)
            t.add_row("latency p50", f"{_pct(lat, 50):.2f} s")
            t.add_row("latency p95", f"{_pct(lat, 95):.2f} s")
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


def _invalid(line: Line) -> dict[str, Any]:
    message = line.error or "invalid"
    return {
        "id": line.custom_id or f"line-{line.number}",
        "payload": json.dumps({"error": message}),
        "error_code": "INVALID_REQUEST",
        "error_message": message,
    }


def run_batch(
    pipeline: Pipeline,
    infile: IO[bytes],
    out: IO[str],
    *,
    console: Console,
    timeout: float | None = None,
    show_progress: bool = True,
) -> Summary:
    """Submit every line of ``infile``, wait for all results, write them to ``out``."""
    start = time.time()
    summary = Summary()
    items: list[tuple[Line, dict[str, Any]]] = []
    for number, text in enumerate(infile, 1):
        if not text.strip():
            continue
        line = parse_line(number, text)
        summary.total += 1
        if line.kwargs is not None:
            payload = line.kwargs.pop("payload")
            try:
                pipeline._row(payload, **line.kwargs)  # validate alone: one bad line is its own
                items.append((line, {"payload": payload, **line.kwargs}))
                continue
            except InvalidRequest as exc:
                line.error = f"line {number}: {exc}"
        out.write(json.dumps(_invalid(line)) + "\n")
        summary.outcomes["INVALID_REQUEST"] += 1
    requests = []
    for i in range(0, len(items), 1000):
        requests.extend(pipeline.submit_many([kw for _, kw in items[i : i + 1000]]))
    custom = {r.id: line.custom_id for r, (line, _) in zip(requests, items, strict=True)}
    end = None if timeout is None else time.monotonic() + timeout
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "ok {task.fields[ok]}  failed {task.fields[failed]}  "
            "retrying {task.fields[retrying]}  in flight {task.fields[running]}"
        ),
        TimeElapsedColumn(),
        console=console,
        disable=not show_progress,
        transient=False,
    )
    invalid = summary.outcomes["INVALID_REQUEST"]  # already answered, counted as failed
    counts: dict[str, Any] = {"ok": 0, "failed": invalid, "retrying": 0, "running": 0}
    last_poll = [0.0]
    with progress:
        task = progress.add_task(
            "requests", total=len(requests) + invalid, completed=invalid, **counts
        )

        def refresh() -> None:
            now = time.monotonic()
            if end is not None and now > end:
                raise TimeoutError(f"batch not finished after {timeout} s")
            if now - last_poll[0] > 0.25:
                info = pipeline.inspect()
                counts["retrying"] = sum(q["retry_wait"] for q in info.values())
                counts["running"] = sum(q["running"] for q in info.values())
                last_poll[0] = now
                progress.update(task, **counts)

        for result in pipeline.iter_results([r.id for r in requests], on_poll=refresh):
            row = result.to_dict()
            if custom.get(result.id) is not None:
                row["custom_id"] = custom[result.id]
            out.write(json.dumps(row) + "\n")
            summary.add(result)
            counts["ok" if result.ok else "failed"] += 1
            progress.update(task, advance=1, ok=counts["ok"], failed=counts["failed"])
        progress.update(task, retrying=0, running=0)
    summary.wall_s = time.time() - start
    return summary
