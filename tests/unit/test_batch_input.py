"""Reading a batch's input: a line longer than the limit is read only one byte past it (then
refused as too long), whatever its length, and the next line is read whole; a byte order mark
opening the input is dropped."""

from __future__ import annotations

import io

from pipeline.batch.ingest import input_lines


class Counting(io.BytesIO):
    """A file that records the most bytes one read returned."""

    most = 0

    def readline(self, size: int | None = -1, /) -> bytes:
        line = super().readline(size)
        self.most = max(self.most, len(line))
        return line


def test_a_long_line_is_read_one_byte_past_the_limit() -> None:
    src = Counting(b'{"a": 1}\n' + b"x" * (10 << 20) + b"\n" + b'{"c": 3}\r\n' + b"tail")
    got = list(input_lines(src, 1000))
    assert [(n, len(raw)) for n, raw in got] == [(1, 8), (2, 1001), (3, 8), (4, 4)]
    assert got[2][1] == b'{"c": 3}' and got[3][1] == b"tail"
    assert src.most <= 1 << 20  # never the whole 10 MiB line at once


def test_without_a_limit_lines_are_whole_and_a_bom_is_dropped() -> None:
    src = io.BytesIO(b"\xef\xbb\xbf{}\n" + b"y" * 5000 + b"\n")
    assert [len(raw) for _, raw in input_lines(src)] == [2, 5000]
    assert [raw for _, raw in input_lines([b"\xef\xbb\xbf{}", b"\xef\xbb\xbf"])] == [
        b"{}",
        b"\xef\xbb\xbf",
    ]
