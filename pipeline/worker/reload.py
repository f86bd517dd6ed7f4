"""Hot reload of a worker node's queue and pool files, on ``SIGHUP`` or when ``pipeline reload``
moves the config generation (docs/configuration.md#changing-queues-without-a-restart)."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..config import ConfigChange, Settings, diff_config, reload_queue_files
from ..errors import ConfigError
from ..gates import check_gates
from ..observability import metrics
from .endpoints import check_endpoints
from .process import Runtime

log = logging.getLogger("pipeline.reload")

POLL_S = 1.0  # how often a node reads the config generation that `pipeline reload` moves
OUTCOME_TTL_S = 7 * 24 * 3600  # the outcome hash outlives a node by this much at most


class Reloadable(Protocol):  # the dispatcher
    def apply(self, settings: Settings) -> None: ...


@dataclass(frozen=True)
class ReloadOutcome:
    result: str  # success | error | unchanged
    reason: str = ""
    generation: int = 0
    at: float = 0.0
    change: dict[str, list[str]] = field(default_factory=dict)

    def as_json(self) -> str:
        data = dataclasses.asdict(self)
        return json.dumps({**data, **data.pop("change")})


class Reloader:
    def __init__(self, runtime: Runtime, node: str, targets: Sequence[Reloadable]) -> None:
        self.rt = runtime
        self.node = node
        self.targets = targets
        self.keys = runtime.store.keys
        self.client = runtime.store.client
        self._requested = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen = self._generation()  # a `pipeline reload` older than this node is done

    def start(self) -> Reloader:
        self._thread = threading.Thread(target=self._loop, name="pipeline-reload", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._requested.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def request(self) -> None:
        """Reload soon (safe in a signal handler: it only sets an event)."""
        self._requested.set()

    def _generation(self) -> int | None:
        try:
            raw = self.client.get(self.keys.config_reload())
            return int(raw or 0)
        except Exception as exc:  # noqa: BLE001 - Redis away: SIGHUP still works
            log.warning("cannot read the config generation: %s", exc)
            return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            asked = self._requested.wait(POLL_S)
            self._requested.clear()
            if self._stop.is_set():
                return
            generation = self._generation()
            moved = generation is not None and generation != self._seen
            if moved:
                self._seen = generation
            if asked or moved:
                source = "SIGHUP" if asked and not moved else "pipeline reload"
                self._record(self._reload(self._seen or 0, source))

    def _reload(self, generation: int, source: str) -> ReloadOutcome:
        old = self.rt.settings
        now = time.time()
        try:
            new = reload_queue_files(old)
            change = diff_config(old, new)
            if not change:
                log.info("config reload (%s): no change", source)
                return ReloadOutcome("unchanged", "", generation, now)
            check_gates(new)
            warnings = check_endpoints(new)
            self._refuse_removals(change)
        except ConfigError as exc:
            log.error("config reload (%s) rejected, the old config stays: %s", source, exc)
            metrics.series().config_reloads.labels("error").inc()
            return ReloadOutcome("error", str(exc), generation, now)
        self.rt.apply(new)
        for target in self.targets:
            target.apply(new)
        try:
            self.rt.publish_snapshot()
        except OSError as exc:  # the node runs the new config; its children may not
            log.error("config reload: cannot write the snapshot for the pool's children: %s", exc)
        for warning in warnings:
            log.warning("%s", warning)
        log.info("config reloaded (%s): %s", source, change.describe())
        metrics.config_applied(now, reload=True)
        return ReloadOutcome("success", change.describe(), generation, now, change.as_dict())

    def _refuse_removals(self, change: ConfigChange) -> None:
        """A queue leaves only once nothing of it waits or runs (nothing would serve it)."""
        if not change.removed:
            return
        k = self.keys
        with self.client.pipeline(transaction=False) as p:
            for name in change.removed:
                p.zcard(k.pending(name))
                p.zcard(k.delayed(name))
                p.zcard(k.active(name))
            counts: list[Any] = p.execute()
        for i, name in enumerate(change.removed):
            pending, delayed, active = (int(c) for c in counts[3 * i : 3 * i + 3])
            if pending or delayed or active:
                raise ConfigError(
                    f"queue {name!r} cannot be removed: it still has "
                    f"{pending + delayed + active} request(s) ({pending} pending, "
                    f"{delayed} retry_wait, {active} running); remove it from the clients' "
                    f"queue file, let it drain, then reload"
                )

    def _record(self, outcome: ReloadOutcome) -> None:
        try:
            key = self.keys.config_reloads()
            with self.client.pipeline(transaction=False) as p:
                p.hset(key, self.node, outcome.as_json())
                p.expire(key, OUTCOME_TTL_S)
                p.execute()
        except Exception as exc:  # noqa: BLE001 - the log has it anyway
            log.warning("cannot record the reload outcome: %s", exc)
