"""``pipeline status`` as a person reads it: in an 80-column terminal every header is whole
and every line fits (the counts and the gates are two tables), in a wide one everything is one
table. Rendered from a real snapshot of the session's queues (with holders added to one gate,
as ``inspect()`` reports them) on a fixed-width console."""

from __future__ import annotations

import copy
import io
from typing import Any

from rich.console import Console

from pipeline.client import Pipeline
from pipeline.observability.status import WIDE_MIN, StatusView, status_snapshot

NARROW_HEADERS = ("queue", "pending", "retry", "running", "done/min", "oldest", "slack",
                  "queue / pool", "gate", "in flight", "holders")  # fmt: skip
WIDE_HEADERS = ("queue", "pool", "pending", "retry_wait", "running", "done/min", "oldest",
                "slack", "gate", "in flight / limit", "holders")  # fmt: skip


def snapshot_with_holders(pl: Pipeline) -> dict[str, Any]:
    info = copy.deepcopy(status_snapshot(pl))
    gate = info["lim2"]["gate"]
    gate["holders"] = [
        {"request_id": f"doc-{i}", "attempt": f"tok{i}", "worker": "w@h"} for i in range(5)
    ]
    gate["in_flight"] = 2
    info["lim1"]["wedged_since"] = 1.0
    return info


def render(info: dict[str, Any], width: int) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(StatusView(info))
    return console.export_text().splitlines()


def test_status_fits_80_columns_with_whole_headers(pl: Pipeline) -> None:
    info = snapshot_with_holders(pl)
    lines = render(info, 80)
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    assert "…" not in text  # nothing cut short
    heads = [line.split() for line in lines if line.split()[:1] in (["queue"], ["queue", "/"])]
    assert len(heads) == 2  # the counts and the gates
    joined = " ".join(" ".join(h) for h in heads)
    for header in NARROW_HEADERS:
        assert header in joined, header
    for name, q in info.items():
        row = next(line for line in lines if line.split()[:1] == [name]).replace("(wedged)", "")
        assert row.split()[1:4] == [str(q["pending"]), str(q["retry_wait"]), str(q["running"])]
    assert "(wedged)" in text
    # holders one per line, the rest counted
    assert [line.split()[-1] for line in lines if "#tok" in line] == [
        "doc-0#tok0", "doc-1#tok1", "doc-2#tok2"]  # fmt: skip
    assert any(line.split()[-1:] == ["+2"] for line in lines)
    assert "2 / 2" in text


def test_status_in_a_wide_terminal_is_one_table(pl: Pipeline) -> None:
    info = snapshot_with_holders(pl)
    lines = render(info, max(WIDE_MIN, 200))
    assert max(len(line) for line in lines) <= 200
    (head,) = [line for line in lines if "retry_wait" in line]
    cells = [c.strip() for c in head.strip("┃").split("┃")]
    assert cells == list(WIDE_HEADERS)
    lim2 = next(line for line in lines if "│ lim2 " in line)
    assert "doc-0#tok0, doc-1#tok1, doc-2#tok2, +2" in lim2
    assert "2 / 2" in lim2
