"""Exceptions raised by the pipeline. Catch :class:`PipelineError` for all of them."""

from __future__ import annotations


class PipelineError(Exception):
    """Root of every error this package raises on purpose."""


class InvalidRequest(PipelineError, ValueError):
    """A submission was rejected; ``field`` names the offending argument."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ConfigError(PipelineError):
    """The queue or pool configuration is invalid (raised at startup, naming the entry)."""


class UnknownRequest(PipelineError, KeyError):
    """No request with that id is known (never submitted, or its result has expired)."""
