"""Who an attempt is and what its task hands it: named once, from the task's arguments
(``tasks.inference.attempt_id``), and passed down (``Runtime.begin``, ``Runtime.abandon``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..store import holder as make_holder
from .report import Mirrors


@dataclass(frozen=True, slots=True)
class AttemptId:
    """One attempt of one request: its request id and fencing token, and what the dispatcher
    said of it (None: not said, or not readable; the request's record decides)."""

    request_id: str
    token: str
    queue: str | None = None  # the queue it was dispatched from
    number: int | None = None  # which dispatch of the request this is (for the log)
    tenant: Mapping[str, str] | None = field(default=None, compare=False)  # fairness identity
    priority: int | None = None  # the request's priority (0-9), for the start's acquire
    holder: str = field(init=False)  # its name on a gate: "request_id:token"

    def __post_init__(self) -> None:
        object.__setattr__(self, "holder", make_holder(self.request_id, self.token))


@dataclass(frozen=True, slots=True)
class Hooks:
    """What the task layer gives an attempt at its start: the writer of its task's Celery
    result (written by the attempt's own finish / requeue script; None: not mirrored) and
    Celery's ``send_event`` (a park that ends refused tells Flower)."""

    mirrors: Mirrors | None = None
    send_event: Callable[..., Any] | None = None


NO_HOOKS = Hooks()
