"""Every Redis key the pipeline uses, in one place.

All keys share one prefix (``PIPELINE_KEY_PREFIX``, default ``pl:``) so a deployment can share a
Redis database with other software, and so tests can isolate themselves. The exceptions are
named verbatim, as in the reference, so its producers and consumers keep working: a queue's
*result list* when the queue config names one (``result_queue_name``), and for a queue that
ingests the reference's wire format (``"ingest": "llm-d-async"``) its sorted set (the queue's
name), the result lists its messages name, and the producer's ``request-active:<id>`` /
``request-cancel:<id>`` (:func:`ref_active_key`, :func:`ref_cancel_key`) and payload keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..config import QueueConfig, Settings

#: The fixed ends of the key families whose variable part is not last (a queue's, a quota
#: key's, a pool's, a batch's keys). A Lua script gets them as the constants ``TAIL_<NAME>``
#: (luatext.py), never as literals, and the family's root in KEYS (:attr:`Keys.families`).
TAILS = {
    "pending": ":pending",
    "delayed": ":delayed",
    "expiry": ":expiry",
    "active": ":active",
    "stats": ":stats",
    "recent": ":recent",
    "sched": ":sched",
    "tenant": ":t:",
    "ready": ":ready",
    "blocked": ":blocked",
    "sent": ":sent",
    "holders": ":holders",
    "wake": ":wake",
    "invalid": ":invalid",
}


@dataclass(frozen=True)
class Keys:
    """Key builder bound to a prefix."""

    prefix: str = "pl:"

    @classmethod
    def of(cls, settings: Settings) -> Keys:
        """The keys of ``settings``'s prefix (``PIPELINE_KEY_PREFIX``)."""
        return cls(settings.key_prefix)

    # -- per request ---------------------------------------------------------------------
    def request(self, request_id: str) -> str:
        """Hash: the request record (payload, ordering key, state, attempt token, result), and
        its decision log, what ``pipeline explain`` shows: field ``log``, one compact JSON
        object per line and event, oldest first, ``{"t": <server time, Unix s>, "e": <event>,
        ...}`` (``dispatched``, ``held``, ``admitted``, ``parked``, ``refused``, ``retry``,
        ``requeued``, ``reaped``, ``dropped``, ``done``; see lib.lua ``log_with``), the last 50
        kept. It lives and expires with the record."""
        return self.request_prefix() + request_id

    def request_prefix(self) -> str:
        """The root of :meth:`request` (the id appended)."""
        return f"{self.prefix}req:"

    def notify(self, request_id: str) -> str:
        """List: one element pushed when the request reaches its terminal result."""
        return self.notify_prefix() + request_id

    def notify_prefix(self) -> str:
        return f"{self.prefix}notify:"

    # -- per queue -----------------------------------------------------------------------
    def pending(self, queue: str) -> str:
        """Sorted set: waiting requests; score = ordering key, member = ``seq|id``."""
        return self.queue_prefix() + queue + TAILS["pending"]

    def delayed(self, queue: str) -> str:
        """Sorted set: requests waiting out a retry backoff; score = due time (Unix s)."""
        return self.queue_prefix() + queue + TAILS["delayed"]

    def expiry(self, queue: str) -> str:
        """Sorted set: waiting (pending or delayed) requests; score = deadline (Unix s)."""
        return self.queue_prefix() + queue + TAILS["expiry"]

    def active(self, queue: str) -> str:
        """Sorted set: dispatched or running requests; score = lease expiry (Unix s)."""
        return self.queue_prefix() + queue + TAILS["active"]

    def stats(self, queue: str) -> str:
        """Hash: terminal outcome counters of a queue."""
        return self.queue_prefix() + queue + TAILS["stats"]

    def recent(self, queue: str) -> str:
        """Sorted set: ids finished recently; score = finish time (Unix s); trimmed to 5 min by
        one finish in 16 (readers select by score)."""
        return self.queue_prefix() + queue + TAILS["recent"]

    def queue_prefix(self) -> str:
        """The root of a queue's keys: ``<root><queue name><tail>`` (:data:`TAILS`)."""
        return f"{self.prefix}q:"

    def default_result_list(self, queue: str) -> str:
        """List: terminal results of a queue without a configured ``result_queue_name``."""
        return f"{self.prefix}q:{queue}:results"

    def result_list(self, queue: QueueConfig) -> str:
        """List: a queue's terminal results (``result_queue_name`` verbatim, when set)."""
        return queue.result_queue_name or self.default_result_list(queue.queue_name)

    # -- per queue, scheduling (see lua/sched.lua) ---------------------------------------
    # A queue with ``fair_share`` or a blocking per-key concurrency quota in its gates is
    # *indexed*: besides ``pending`` (which stays the whole waiting set, in dispatch order
    # without tenants), each waiting request is in its tenant's sub-queue, and the dispatch
    # script picks tenants from ``ready``. Where a waiting request stands, cheaply:
    #   - requests of a higher priority: ZCOUNT pending on the scores of the higher bands
    #     (score = (9 - priority) x 1e13 + deadline in ms);
    #   - its place among its tenant's: ZRANK tenant_queue(q, tenant) (same member as pending);
    #   - its tenant's place: ZRANK ready <head member>"\n"<tenant key> (fair share: its turn
    #     in its priority's ring), or HGET blocked <tenant key> (waiting for that quota key);
    #   - the tenants taking turns with it: ZCOUNT ready on its priority's band.
    def sched(self, queue: str) -> str:
        """Hash: present while the queue is indexed. ``attr`` (the tenant attribute, a metadata
        key), ``fair`` ('1': fair share), ``pool``, ``rr`` (last ring ticket handed out),
        ``n`` (entries in the tenant sub-queues; equals ZCARD pending when consistent),
        ``cursor`` (where a re-index of pending continues)."""
        return self.queue_prefix() + queue + TAILS["sched"]

    def tenant_queue(self, queue: str, tenant_key: str) -> str:
        """Sorted set: one tenant's waiting requests (score and member as in ``pending``).
        ``tenant_key`` is the tenant (the attribute's value, '' when absent) when it is at most
        128 printable characters without a newline, else ``sha1:<hex of it>``."""
        return self.queue_prefix() + queue + TAILS["tenant"] + tenant_key

    def ready(self, queue: str) -> str:
        """Sorted set: one entry per tenant that may be dispatched, member
        ``<its head's pending member>\\n<tenant key>``. Score without fair share: the head's
        ordering score (so the lowest entry is the head of pending among ready tenants, ties
        by member = submission order); with fair share: ``(9 - priority) x 2^49 + ticket``
        (a ring per priority: a tenant gets a new, last ticket when it joins, when one of its
        requests is dispatched and when its head's priority changes)."""
        return self.queue_prefix() + queue + TAILS["ready"]

    def blocked(self, queue: str) -> str:
        """Hash: tenant key → the quota key it is held back by (its tenants at a limit, out of
        ``ready`` until the key's requests are down to its wake count: see ``quota_blocked``)."""
        return self.queue_prefix() + queue + TAILS["blocked"]

    # -- per quota key (a redis-quota concurrency gate's key, e.g. ``quota:userid:alice``) --
    def quota_sent(self, quota_key: str) -> str:
        """Sorted set: requests dispatched or running under this quota key (any queue); member
        = request id, score = dispatch time (whole seconds of the server's clock, which a
        small sorted set compares without parsing). What the dispatch script counts against the
        key's limit (plus its look-ahead); an attempt leaves it when it leaves the active
        state (lib.lua terminal / enqueue, via the record's ``qkeys``)."""
        return self.gate_prefix() + quota_key + TAILS["sent"]

    def quota_blocked(self, quota_key: str) -> str:
        """Set: ``<queue>\\n<tenant key>`` of tenants held back by this key; emptied (and the
        tenants made ready again) when a request of the key leaves the active state and leaves
        at most its wake count in ``quota_sent`` (the key's limit plus half its look-ahead,
        rounded down: the record's ``qwake``), so one tick tops the look-ahead up after every
        second or third leave instead of after each."""
        return self.gate_prefix() + quota_key + TAILS["blocked"]

    # -- per pool (a group of worker slots) ----------------------------------------------
    def wake(self, pool: str) -> str:
        """List used as a doorbell: pushed when the pool's dispatcher has work to do."""
        return self.pool_prefix() + pool + TAILS["wake"]

    def pool_prefix(self) -> str:
        """The root of a pool's keys: ``<root><pool><tail>``."""
        return f"{self.prefix}pool:"

    def pool_nodes(self, pool: str) -> str:
        """Sorted set: worker nodes serving the pool; score = liveness expiry (Unix s)."""
        return f"{self.prefix}pool:{pool}:nodes"

    def pool_slots(self, pool: str) -> str:
        """Hash: worker node name → number of execution slots it offers the pool."""
        return f"{self.prefix}pool:{pool}:slots"

    def merge(self, pool: str) -> str:
        """Hash: the pool's merge-policy state, shared by its dispatchers: ``c:<queue>`` (the
        queue's smooth weighted round-robin counter), ``w:<lane>`` (tier-priority: dispatches
        the lane has been passed over while it had something to send)."""
        return f"{self.prefix}pool:{pool}:merge"

    # -- gates ---------------------------------------------------------------------------
    def gate_prefix(self) -> str:
        """The root of a gate's and a quota key's keys: ``<root><gate or key><tail>``."""
        return f"{self.prefix}gate:"

    def gate_holders(self, gate: str) -> str:
        """Sorted set: holders of a gate's reservations; member = ``id:token``, score = lease
        expiry (Unix s)."""
        return self.gate_prefix() + gate + TAILS["holders"]

    def gate_info(self, gate: str) -> str:
        """Hash: holder → JSON description (request, attempt, worker, acquired_at)."""
        return f"{self.prefix}gate:{gate}:info"

    def gate_nodes(self, gate: str) -> str:
        """Set: worker nodes whose slot pool of a per-node gate exists (listed when they take a
        slot, dropped once the pool's keys expired: ``gate_nodes_prune.lua``)."""
        return f"{self.prefix}gate:{gate}:nodes"

    def gate_node_holders(self, gate: str, node: str) -> str:
        """Sorted set: one node's holders of a per-node gate (see :meth:`gate_holders`)."""
        return self.gate_node_prefix(gate) + node + TAILS["holders"]

    def gate_node_prefix(self, gate: str) -> str:
        """:meth:`gate_node_holders` up to the node's name (its tail ``TAILS["holders"]``)."""
        return f"{self.gate_prefix()}{gate}@"

    def gate_node_info(self, gate: str, node: str) -> str:
        """Hash: one node's holder descriptions of a per-node gate (see :meth:`gate_info`)."""
        return self.gate_info(f"{gate}@{node}")

    def gate_rate(self, gate: str, attribute_value: str, window_s: float) -> str:
        """Sorted set: admission log of a rate-limit gate, one per (key, window)."""
        return f"{self.prefix}gate:{gate}:rate:{window_s:g}:{attribute_value}"

    def gate_tokens(self, gate: str, attribute_value: str, window_s: float) -> tuple[str, str]:
        """A token budget's window, one per (key, window) (``redis-quota``, tokens mode):
        a sorted set, the charge log (member = holder ``id:token``, score = admission time,
        Unix s, server clock), and a hash, holder → its charge (``e<n>`` while it is the
        admission's estimate, ``<n>`` once settled by the response's usage). Both hold only
        the last window's charges and expire a second after the window of the latest."""
        base = f"{self.prefix}gate:{gate}:tokens:{window_s:g}"
        return f"{base}:log:{attribute_value}", f"{base}:charges:{attribute_value}"

    def leased_rate_state(self, control_key: str) -> str:
        """Hash: the token bucket (``tokens``, ``last_ms``) of a ``redis-leased-rate`` gate,
        shared by every node; the planner's control hash (``control_key``) is named verbatim
        in the gate's params, outside the prefix."""
        return f"{self.prefix}gate:leased-rate:{control_key}:state"

    def wedged(self) -> str:
        """Hash: queue → Unix time since which the wedge detector has seen it wedged."""
        return f"{self.prefix}wedged"

    # -- batches and files (pipeline/batch/) -------------------------------------------
    def batch(self, batch_id: str) -> str:
        """Hash: a batch (status, counts, timestamps, file ids; see ``batch_*.lua``). Expires
        its retention after it closes (and at the latest its window plus retention)."""
        return self.batch_prefix() + batch_id

    def batch_prefix(self) -> str:
        return f"{self.prefix}batch:"

    def batch_invalid(self, batch_id: str) -> str:
        """List: a batch's invalid lines kept for its error file (JSON); expires with it."""
        return self.batch_prefix() + batch_id + TAILS["invalid"]

    def batch_lease(self, batch_id: str) -> str:
        """String with a TTL: the process validating, enqueuing, cancelling or finalizing a
        batch (another takes over once it lapses)."""
        return f"{self.prefix}batch:{batch_id}:lease"

    def batches(self) -> str:
        """Sorted set: every unexpired batch; score = created_at (Unix s, server clock)."""
        return f"{self.prefix}batches"

    def batches_expiry(self) -> str:
        """Sorted set: every unexpired batch; score = when its record expires. Expired ones
        are pruned from :meth:`batches`, this set and :meth:`batches_active`."""
        return f"{self.prefix}batches:expiry"

    def batches_active(self) -> str:
        """Set: batches not yet closed (validating, in_progress, cancelling, finalizing)."""
        return f"{self.prefix}batches:active"

    def batches_bell(self) -> str:
        """List used as a doorbell (at most one element): a batch is waiting to finalize."""
        return f"{self.prefix}batches:bell"

    def file(self, file_id: str) -> str:
        """Hash: a file's record (name, bytes, purpose, owner); expires with the file."""
        return f"{self.prefix}file:{file_id}"

    def files(self) -> str:
        """Sorted set: every unexpired file; score = created_at (Unix s)."""
        return f"{self.prefix}files"

    def files_expiry(self) -> str:
        """Sorted set: every file; score = when it expires (its bytes are removed then)."""
        return f"{self.prefix}files:expiry"

    def pool_nodes_pattern(self) -> str:
        """Glob matching every pool's :meth:`pool_nodes` key."""
        return f"{self.prefix}pool:*:nodes"

    # -- global --------------------------------------------------------------------------
    def config_reload(self) -> str:
        """String counter: the config generation ``pipeline reload`` asked for; every node
        re-reads its queue and pool files when it moves (see ``pipeline.worker.reload``)."""
        return f"{self.prefix}config:reload"

    def config_reloads(self) -> str:
        """Hash: worker node → JSON outcome of its latest reload (generation, result, reason,
        what changed), for ``pipeline reload`` to report."""
        return f"{self.prefix}config:reloads"

    def freed_channel(self) -> str:
        """Pub/Sub channel: a queue's name is published on it each time an attempt of that
        queue ends or goes back (its gate reservation was released just before), followed by
        the quota keys the attempt counted against, one per line (``<queue>\n<key>...``), so
        attempts parked for a slot or a key wake up (see ``pipeline.bell``)."""
        return f"{self.prefix}freed"

    def seq(self) -> str:
        """String counter: submission sequence, the last tie-breaker of the ordering key."""
        return f"{self.prefix}seq"

    def pattern(self) -> str:
        """Glob matching every key under the prefix."""
        return f"{self.prefix}*"

    @cached_property
    def families(self) -> tuple[str, ...]:
        """What a request-state or batch script's KEYS end with, in lib.lua ``key_families``'s
        order: the roots of the keys it derives from what it reads (a root, then an id, or a
        queue's, pool's, quota key's name and a :data:`TAILS` end), then the global keys."""
        return (
            self.request_prefix(),
            self.notify_prefix(),
            self.queue_prefix(),
            self.gate_prefix(),
            self.pool_prefix(),
            self.batch_prefix(),
            REF_ACTIVE_PREFIX,
            REF_CANCEL_PREFIX,
            self.seq(),
            self.freed_channel(),
            self.batches_active(),
            self.batches_expiry(),
            self.batches_bell(),
        )


def celery_queue(pool: str, prefix: str = "pl:") -> str:
    """The Celery queue carrying a worker pool's attempts: ``pipeline.<pool>`` for the default
    key prefix; with another prefix the queue is namespaced too (``pipeline.<ns>.<pool>``), so
    pipelines sharing one broker never take each other's messages."""
    return celery_queue_prefix(prefix) + pool


def celery_queue_prefix(prefix: str = "pl:") -> str:
    if prefix == "pl:":
        return "pipeline."
    return "pipeline." + "".join(c for c in prefix if c.isalnum() or c in "_-") + "."


# -- the llm-d-async reference's own keys (verbatim, outside the prefix; see store/wire.py) --
REF_CANCEL_PREFIX = "request-cancel:"
REF_ACTIVE_PREFIX = "request-active:"


def ref_cancel_key(request_id: str) -> str:
    """String: the generation token a reference producer cancelled (``CancelRequests``)."""
    return REF_CANCEL_PREFIX + request_id


def ref_active_key(request_id: str) -> str:
    """String: the generation token of a reference producer's live submission of the id."""
    return REF_ACTIVE_PREFIX + request_id


def holder(request_id: str, token: str) -> str:
    """A reservation holder: one attempt of one request."""
    return f"{request_id}:{token}"
