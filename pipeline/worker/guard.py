"""The lease guard: a process that cannot renew its leases stops acting before they can lapse.

A holder's leases last ``lease_s`` from the last renewal Redis took (by the server's clock).
Cut off from Redis (a partition, a stopped process), the node cannot know when the reaper of
another node frees them and hands their slots on, so it counts on its own monotonic clock from
the *send* time of the last renewal of its attempt that succeeded (or of its start) and stops
before ``budget()``: the lease less a margin for the two clocks' rates and one check
period. Past it, the runtime aborts its attempts' calls (they end as retries, released when
Redis answers, else by the reaper) and no attempt sends until a renewal succeeds again. The
discipline of every lease-based system (Chubby's session, etcd's lease keep-alive); issue 48,
docs/gates.md "What at once means".
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("pipeline.worker")

RATE_MARGIN = 0.1  # the node's clock may run this much slower than Redis's over one lease
CHECKS_PER_LEASE = 20  # the guard looks this often per lease (its period is in the margin)
MIN_PERIOD_S = 0.02


class LeaseGuard:
    """When this process last proved its leases alive, and whether it is in a lapse episode
    (renewals failing past the budget). Thread-safe; its clock is ``time.monotonic``."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self._renewed = time.monotonic()  # the last renewal Redis took (for the log line)
        self.lapsed_at: float | None = None  # the current episode's start (None: none)
        self.episodes = 0  # lapse episodes so far (for tests and status)

    def period(self) -> float:
        """How often the guard looks (a slack inside the budget)."""
        return max(MIN_PERIOD_S, self.lease_s / CHECKS_PER_LEASE)

    def budget(self) -> float:
        """How long after its lease's last proof an attempt may still act."""
        return self.lease_s * (1.0 - RATE_MARGIN) - self.period()

    def late(self, proof: float, now: float | None = None) -> bool:
        """Whether an attempt whose leases were last proven at ``proof`` (monotonic: the send
        time of its start, or of the last renewal Redis took) is past its budget ``now``: it
        may act no more."""
        now = time.monotonic() if now is None else now
        return now - proof >= self.budget()

    def fresh(self, proof: float) -> bool:
        """Proven within half the budget: its leases are surely alive for a round trip more
        (a hand-over's taker need not wait for the transfer record)."""
        return time.monotonic() - proof < self.budget() / 2

    def renewed(self) -> None:
        """Redis took a renewal of every live lease: an episode ends."""
        with self._lock:
            self._renewed = time.monotonic()
            ended, self.lapsed_at = self.lapsed_at, None
        if ended is not None:
            log.warning(
                "lease renewal succeeded again after %.1f s; attempts may send again",
                time.monotonic() - ended,
            )

    def lapse(self, attempts: int) -> None:
        """``attempts`` of this process are past their budget: the start of an episode logs
        an ERROR, once."""
        with self._lock:
            first = self.lapsed_at is None
            if first:
                self.lapsed_at = time.monotonic()
                self.episodes += 1
        if first:
            log.error(
                "lease renewal overdue: no renewal taken by Redis for %.1f s (lease %.1f s); "
                "aborting %d attempt(s) of this process and sending none until a renewal "
                "succeeds",
                time.monotonic() - self._renewed,
                self.lease_s,
                attempts,
            )
