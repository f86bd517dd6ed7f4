"""The store epoch: the alarm for a Redis that lost its state (restarted without persistence,
flushed). A random id is written at first use (``lua/epoch.lua``, key :meth:`Keys.epoch`); every
node and client remembers the one it saw and compares at moments it talks to Redis anyway (a
node's heartbeat, a client's lookup of a record that is missing). Gone or changed: what was
accepted before is lost. The script writes a new one at once, so new submissions keep working,
and records when and by whom the loss was first noticed (docs/production.md, "A wiped Redis")."""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .keys import sharded
from .scripts import ScriptCall

if TYPE_CHECKING:
    from .state import Store

# An abort-channel notice (keys.py ``abort_channel``; worker/bell.py hears it): the node that
# found the epoch changed tells every node's attempts to check their leases now; those whose
# records went with the old state are aborted (their holders vanished from the gates).
LOST_NOTICE = "!lost"


@dataclass(frozen=True)
class EpochSeen:
    """What the epoch script found: the current ``id``; ``lost_at`` (Unix s, the server's
    clock) and ``lost_by`` once a loss was noticed in this epoch (None, '' before)."""

    id: str
    lost_at: float | None = None
    lost_by: str = ""


def epoch_seen(reply: Any) -> EpochSeen:
    """The reply of ``epoch.lua`` read."""
    eid, lost_at, lost_by = (x.decode() if isinstance(x, bytes) else str(x) for x in reply)
    return EpochSeen(eid, float(lost_at) if lost_at else None, lost_by)


class Epoch:
    """What one process knows of its store's epoch (``known``: None before it asked)."""

    def __init__(self, store: Store, who: str) -> None:
        self.store = store
        self.who = who[:200]
        self.known: str | None = None
        self.lock = threading.Lock()

    def call(self) -> ScriptCall:
        """The epoch script as a call to send in a batch (with the id this process knows;
        it writes a new epoch when there is none)."""
        return ScriptCall(
            self.store.scripts.epoch,
            [self.store.keys.epoch()],
            [self.known or "", secrets.token_hex(8), self.who],
        )

    def ask(self) -> EpochSeen:
        """Send :meth:`call` now, alone (one round trip)."""
        return epoch_seen(self.call()())

    def learn(self) -> str:
        """The epoch id, asked once (the first time; none after): what this process stores
        under from now on."""
        if self.known is None:
            with self.lock:
                if self.known is None:
                    self.known = self.ask().id
        return self.known

    def changed(self, seen: EpochSeen) -> bool:
        """Whether ``seen`` differs from the epoch this process knew (a loss), and from now
        on knows ``seen`` (the first one seen is no loss)."""
        with self.lock:
            before, self.known = self.known, seen.id
        return before is not None and before != seen.id


def tell_lost(stores: list[Store]) -> None:
    """Publish :data:`LOST_NOTICE` on the abort channel of each of ``stores`` (sharded on a
    Redis Cluster, as lib.lua ``publish_abort``)."""
    for store in stores:
        channel = store.keys.abort_channel()
        command = "SPUBLISH" if sharded(channel) else "PUBLISH"
        store.client.execute_command(command, channel, LOST_NOTICE)
