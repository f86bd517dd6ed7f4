"""The ``pipeline`` command's argument checks: a bad argument is exit status 2 with one line
on stderr naming it, before anything is started or stored."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (the command, the argument and the fault)
    instead of the usage text and a second line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def usage_error(command: str, message: str) -> NoReturn:
    """Exit 2 with one line, as :meth:`Parser.error` (for checks after parsing)."""
    print(f"pipeline {command}: {message}", file=sys.stderr)
    raise SystemExit(2)


def _number(cast: Callable[[str], float], kind: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind}, not {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be {kind}, not {text!r}")
        return value

    return parse


def _bounded(
    cast: Callable[[str], float], kind: str, ok: Callable[[float], bool]
) -> Callable[[str], float]:
    number = _number(cast, kind)

    def parse(text: str) -> float:
        value = number(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {kind}, not {text!r}")
        return value

    parse.__name__ = kind  # argparse names the type in its own messages
    return parse


finite_float = _bounded(float, "a number", lambda v: True)
positive_int = _bounded(int, "an integer >= 1", lambda v: v >= 1)
positive_float = _bounded(float, "a number > 0", lambda v: v > 0)
non_negative_float = _bounded(float, "a number >= 0", lambda v: v >= 0)
port = _bounded(int, "a TCP port 1-65535", lambda v: 1 <= v <= 65535)


def log_level(text: str) -> str:
    """A logging level name, case-insensitive (returned upper case)."""
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, not {text!r}")
    return text.upper()
