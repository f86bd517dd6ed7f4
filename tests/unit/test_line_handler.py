"""The node's log handler (``LineHandler``): every line whole, in one write, from many threads
at once, with no lock; what it replaces and what it leaves alone."""

from __future__ import annotations

import io
import logging
import threading
from pathlib import Path

from pipeline.observability.logs import LineHandler, use_line_handlers


def test_many_threads_write_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "node.log"
    with open(path, "w") as stream:
        plain = logging.StreamHandler(stream)
        plain.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
        plain.setLevel(logging.INFO)
        logger = logging.getLogger(f"linehandler.{tmp_path.name}")
        logger.propagate = False
        logger.setLevel(logging.DEBUG)
        logger.handlers = [plain]
        use_line_handlers(logger)
        [handler] = logger.handlers
        assert isinstance(handler, LineHandler) and handler.lock is None
        assert handler.level == logging.INFO and handler.formatter is plain.formatter

        def work(n: int) -> None:
            for i in range(300):
                logger.info("thread %d line %d %s", n, i, "x" * (n * 7 % 300))

        threads = [threading.Thread(target=work, args=(n,)) for n in range(48)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        logger.debug("below the level: not written")
    lines = path.read_text().splitlines()
    assert len(lines) == 48 * 300
    seen = set()
    for line in lines:
        level, _, rest = line.partition(" ")
        assert level == "[INFO]", line
        _, n, _, i, pad = rest.split(" ")
        assert pad == "x" * (int(n) * 7 % 300), line
        seen.add((int(n), int(i)))
    assert len(seen) == 48 * 300


def test_handlers_without_a_descriptor_or_of_other_kinds_are_kept() -> None:
    logger = logging.getLogger("linehandler.kept")
    logger.propagate = False
    in_memory = logging.StreamHandler(io.StringIO())  # no file descriptor
    null = logging.NullHandler()
    logger.handlers = [in_memory, null]
    use_line_handlers(logger)
    assert logger.handlers == [in_memory, null]
