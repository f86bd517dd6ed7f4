"""Every Redis key the pipeline uses, in one place (each structure is described in
docs/internals.md, "Redis keys"). All share one prefix (``PIPELINE_KEY_PREFIX``, default
``pl:``) but those the llm-d-async reference names verbatim (docs/llm-d-async.md): a queue's
configured ``result_queue_name``, an ingesting queue's sorted set and result lists, and the
producer's keys (:func:`ref_active_key`, :func:`ref_cancel_key`, payload keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..config import DEFAULT_KEY_PREFIX, QueueConfig

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
    "wakeups": ":wakeups",
    "sent": ":sent",
    "holders": ":holders",
    "wake": ":wake",
    "invalid": ":invalid",
}


@dataclass(frozen=True)
class Keys:
    """Key builder bound to a prefix. A ``*_prefix`` method is a family's root: the family's
    key is the root, the variable part, and for some a :data:`TAILS` end."""

    prefix: str = DEFAULT_KEY_PREFIX
    # before the reference's own key families in :attr:`families`: "" (verbatim), or on a
    # Redis Cluster the pool's tagged prefix (no reference producer writes there: no ingest)
    ref_prefix: str = ""

    # -- per request ---------------------------------------------------------------------
    def request_prefix(self) -> str:
        return f"{self.prefix}req:"

    def request(self, request_id: str) -> str:
        """Hash: the request record, with its decision log (field ``log``)."""
        return self.request_prefix() + request_id

    def notify_prefix(self) -> str:
        return f"{self.prefix}notify:"

    def notify(self, request_id: str) -> str:
        """List: rung when the request reaches its terminal result (a client waits)."""
        return self.notify_prefix() + request_id

    def body(self, request_id: str, token: str) -> str:
        """String: the body of an answer longer than ``PIPELINE_BODY_INLINE_MAX``, stored once,
        by the attempt (``token``) that got it; its result names it in ``payload_ref`` and the
        record in field ``body``. It expires with the result."""
        return f"{self.prefix}body:{request_id}:{token}"

    # -- per queue -----------------------------------------------------------------------
    def queue_prefix(self) -> str:
        return f"{self.prefix}q:"

    def pending(self, queue: str) -> str:
        """Sorted set: waiting requests; score = ordering key, member = ``seq|id``."""
        return self.queue_prefix() + queue + TAILS["pending"]

    def delayed(self, queue: str) -> str:
        """Sorted set: requests waiting out a retry backoff; score = due time."""
        return self.queue_prefix() + queue + TAILS["delayed"]

    def expiry(self, queue: str) -> str:
        """Sorted set: waiting (pending or delayed) requests; score = deadline."""
        return self.queue_prefix() + queue + TAILS["expiry"]

    def active(self, queue: str) -> str:
        """Sorted set: dispatched or running requests; score = lease expiry."""
        return self.queue_prefix() + queue + TAILS["active"]

    def stats(self, queue: str) -> str:
        """Hash: terminal outcome counters."""
        return self.queue_prefix() + queue + TAILS["stats"]

    def recent(self, queue: str) -> str:
        """Sorted set: ids finished in the last 5 minutes or so; score = finish time."""
        return self.queue_prefix() + queue + TAILS["recent"]

    def default_result_list(self, queue: str) -> str:
        """List: terminal results of a queue without a configured ``result_queue_name``."""
        return f"{self.prefix}q:{queue}:results"

    def result_list(self, queue: QueueConfig) -> str:
        """List: a queue's terminal results (``result_queue_name`` verbatim, when set)."""
        return queue.result_queue_name or self.default_result_list(queue.queue_name)

    # -- per queue, scheduling of an indexed queue (lua/sched.lua, docs/scheduling.md) ---
    def sched(self, queue: str) -> str:
        """Hash: present while the queue is indexed (attr, fair, pool, rr, n, cursor)."""
        return self.queue_prefix() + queue + TAILS["sched"]

    def tenant_queue(self, queue: str, tenant_key: str) -> str:
        """Sorted set: one tenant's waiting requests (as in ``pending``)."""
        return self.queue_prefix() + queue + TAILS["tenant"] + tenant_key

    def ready(self, queue: str) -> str:
        """Sorted set: tenants that may be dispatched (``<head member>\\n<tenant key>``)."""
        return self.queue_prefix() + queue + TAILS["ready"]

    def blocked(self, queue: str) -> str:
        """Hash: tenant key → the quota key it is held back by."""
        return self.queue_prefix() + queue + TAILS["blocked"]

    def wakeups(self, queue: str) -> str:
        """Sorted set: token budgets (their charge logs, named as under :meth:`gate_prefix`)
        holding tenants back; score = when their window has room again (server clock)."""
        return self.queue_prefix() + queue + TAILS["wakeups"]

    # -- per quota key (a redis-quota concurrency gate's key, e.g. ``quota:userid:alice``) --
    def quota_sent(self, quota_key: str) -> str:
        """Sorted set: requests dispatched or running under the key (any queue)."""
        return self.gate_prefix() + quota_key + TAILS["sent"]

    def quota_blocked(self, quota_key: str) -> str:
        """Set: ``<queue>\\n<tenant key>`` of the tenants the key holds back."""
        return self.gate_prefix() + quota_key + TAILS["blocked"]

    # -- per pool (a group of worker slots) ----------------------------------------------
    def pool_prefix(self) -> str:
        return f"{self.prefix}pool:"

    def wake(self, pool: str) -> str:
        """List used as a doorbell: pushed when the pool's dispatcher has work to do."""
        return self.pool_prefix() + pool + TAILS["wake"]

    def pool_nodes(self, pool: str) -> str:
        """Sorted set: worker nodes serving the pool; score = liveness expiry."""
        return f"{self.prefix}pool:{pool}:nodes"

    def pool_slots(self, pool: str) -> str:
        """Hash: worker node name → number of execution slots it offers the pool."""
        return f"{self.prefix}pool:{pool}:slots"

    def pool_nodes_pattern(self) -> str:
        """Glob matching every pool's :meth:`pool_nodes` key."""
        return f"{self.prefix}pool:*:nodes"

    def merge(self, pool: str) -> str:
        """Hash: the pool's merge-policy state, shared by its dispatchers."""
        return f"{self.prefix}pool:{pool}:merge"

    # -- gates ---------------------------------------------------------------------------
    def gate_prefix(self) -> str:
        return f"{self.prefix}gate:"

    def gate_holders(self, gate: str) -> str:
        """Sorted set: holders (``id:token``) of a gate's reservations; score = lease expiry."""
        return self.gate_prefix() + gate + TAILS["holders"]

    def gate_info(self, gate: str) -> str:
        """Hash: holder → JSON description (request, attempt, worker, acquired_at)."""
        return f"{self.prefix}gate:{gate}:info"

    def gate_nodes(self, gate: str) -> str:
        """Set: worker nodes whose slot pool of a per-node gate exists."""
        return f"{self.prefix}gate:{gate}:nodes"

    def gate_node_prefix(self, gate: str) -> str:
        return f"{self.gate_prefix()}{gate}@"

    def gate_node_holders(self, gate: str, node: str) -> str:
        """Sorted set: one node's holders of a per-node gate (see :meth:`gate_holders`)."""
        return self.gate_node_prefix(gate) + node + TAILS["holders"]

    def gate_node_info(self, gate: str, node: str) -> str:
        """Hash: one node's holder descriptions of a per-node gate (see :meth:`gate_info`)."""
        return self.gate_info(f"{gate}@{node}")

    def gate_rate(self, gate: str, attribute_value: str, window_s: float) -> str:
        """Sorted set: admission log of a rate-limit gate, one per (key, window)."""
        return f"{self.prefix}gate:{gate}:rate:{window_s:g}:{attribute_value}"

    def gate_tokens(self, gate: str, attribute_value: str, window_s: float) -> tuple[str, str]:
        """A token budget's window, one per (key, window): its charge log (sorted set) and
        its charges (hash)."""
        base = f"{self.prefix}gate:{gate}:tokens:{window_s:g}"
        return f"{base}:log:{attribute_value}", f"{base}:charges:{attribute_value}"

    def gate_tokens_learned(self, gate: str, queue: str) -> str:
        """Hash: what a token budget learned of one queue's prompt tokens from the answers
        (``estimate_correction: usage``): n, the means mx, my, mxx, mxy, myy, the line a, b
        and the spread s around it."""
        return f"{self.prefix}gate:{gate}:tokens-learned:{queue}"

    def gate_adaptive(self, gate: str) -> str:
        """Hash: an adaptive-concurrency gate's controller, shared by every node: ``limit``
        (what the acquire admits up to), ``state`` (the controller's JSON), ``signal``,
        ``reason``, ``moved_at``, ``windows`` (closed so far), ``seen<p>`` (when a request of
        priority p last asked)."""
        return f"{self.prefix}gate:{gate}:adaptive"

    def gate_adaptive_window(self, gate: str) -> str:
        """Hash: the current window's answers of an adaptive-concurrency gate (``start`` and
        the sums gate_adaptive_observe.lua adds; ``knee.Window`` names them)."""
        return f"{self.prefix}gate:{gate}:adaptive-window"

    def leased_rate_state(self, control_key: str) -> str:
        """Hash: the token bucket of a ``redis-leased-rate`` gate, shared by every node."""
        return f"{self.prefix}gate:leased-rate:{control_key}:state"

    def wedged(self) -> str:
        """Hash: queue → Unix time since which the wedge detector has seen it wedged."""
        return f"{self.prefix}wedged"

    # -- batches and files (pipeline/batch/) -------------------------------------------
    def batch_prefix(self) -> str:
        return f"{self.prefix}batch:"

    def batch(self, batch_id: str) -> str:
        """Hash: a batch (status, counts, timestamps, file ids; see ``batch_*.lua``)."""
        return self.batch_prefix() + batch_id

    def batch_invalid(self, batch_id: str) -> str:
        """List: a batch's invalid lines kept for its error file (JSON); expires with it."""
        return self.batch_prefix() + batch_id + TAILS["invalid"]

    def batch_lease(self, batch_id: str) -> str:
        """String with a TTL: the process validating, enqueuing, cancelling or finalizing."""
        return f"{self.prefix}batch:{batch_id}:lease"

    def batches(self) -> str:
        """Sorted set: every unexpired batch; score = created_at."""
        return f"{self.prefix}batches"

    def batches_expiry(self) -> str:
        """Sorted set: every unexpired batch; score = when its record expires."""
        return f"{self.prefix}batches:expiry"

    def batches_active(self) -> str:
        """Set: batches not yet closed."""
        return f"{self.prefix}batches:active"

    def batches_bell(self) -> str:
        """List used as a doorbell (at most one element): a batch is waiting to finalize."""
        return f"{self.prefix}batches:bell"

    def file(self, file_id: str) -> str:
        """Hash: a file's record (name, bytes, purpose, owner); expires with the file."""
        return f"{self.prefix}file:{file_id}"

    def files(self) -> str:
        """Sorted set: every unexpired file; score = created_at."""
        return f"{self.prefix}files"

    def files_expiry(self) -> str:
        """Sorted set: every file; score = when it expires (its bytes are removed then)."""
        return f"{self.prefix}files:expiry"

    # -- global --------------------------------------------------------------------------
    def config_reload(self) -> str:
        """String counter: the config generation ``pipeline reload`` asked for."""
        return f"{self.prefix}config:reload"

    def config_reloads(self) -> str:
        """Hash: worker node → JSON outcome of its latest reload."""
        return f"{self.prefix}config:reloads"

    def freed_channel(self) -> str:
        """Pub/Sub channel: ``<queue>\\n<quota key>...`` when an attempt released its gate
        reservation (``pipeline.bell``)."""
        return f"{self.prefix}freed"

    def abort_channel(self) -> str:
        """Pub/Sub channel of abort notices (a cancel with running="abort": the node running
        the attempt closes its call); lib.lua ``publish_abort`` names it the same way. Apart
        from the release channel so that a node that never parks hears nothing else."""
        return f"{self.freed_channel()}:abort"

    def epoch(self) -> str:
        """Hash: the store epoch (``id``, ``since``; ``lost_at``, ``lost_by``, ``previous``
        once a loss was noticed), written at first use; gone or changed: Redis lost its state
        (lua/epoch.lua, docs/production.md "A wiped Redis")."""
        return f"{self.prefix}epoch"

    def seq(self) -> str:
        """String counter: submission sequence, the last tie-breaker of the ordering key."""
        return f"{self.prefix}seq"

    def pattern(self) -> str:
        """Glob matching every key under the prefix."""
        return f"{self.prefix}*"

    @cached_property
    def families(self) -> tuple[str, ...]:
        """What a request-state or batch script's KEYS end with (lib.lua ``key_families``,
        same order): the roots of the keys it derives from what it reads, then global keys."""
        return (
            self.request_prefix(),
            self.notify_prefix(),
            self.queue_prefix(),
            self.gate_prefix(),
            self.pool_prefix(),
            self.batch_prefix(),
            self.ref_prefix + REF_ACTIVE_PREFIX,
            self.ref_prefix + REF_CANCEL_PREFIX,
            self.seq(),
            self.freed_channel(),
            self.batches_active(),
            self.batches_expiry(),
            self.batches_bell(),
        )


def pool_keys(prefix: str, pool: str) -> Keys:
    """A pool's keys on a Redis Cluster: the prefix and then the pool's hash tag
    (``pl:{p:<pool>}:``), so everything a script of the pool touches is in one slot."""
    return slot_keys(prefix, f"p:{pool}")


def slot_keys(prefix: str, tag: str) -> Keys:
    """Keys that all hash to the slot of ``tag`` (the prefix, then ``{<tag>}:``)."""
    tagged = f"{prefix}{{{tag}}}:"
    return Keys(tagged, ref_prefix=tagged)


def celery_queue(pool: str, prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The Celery queue carrying a worker pool's attempts: ``pipeline.<pool>`` for the default
    key prefix; with another prefix the queue is namespaced too (``pipeline.<ns>.<pool>``), so
    pipelines sharing one broker never take each other's messages."""
    return celery_queue_prefix(prefix) + pool


def celery_queue_prefix(prefix: str = DEFAULT_KEY_PREFIX) -> str:
    if prefix == DEFAULT_KEY_PREFIX:
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


def sharded(channel: str) -> bool:
    """Whether the release bell's ``channel`` is a sharded one (SPUBLISH / SSUBSCRIBE): when it
    carries a pool's hash tag, as on a Redis Cluster (lib.lua ``publish_freed`` agrees)."""
    return "{" in channel


def gate_tokens_roots(gate: str, attribute: str, window_s: float) -> tuple[str, str]:
    """What :meth:`Keys.gate_tokens` names for a value of ``attribute``, after the gate prefix
    and up to the value (the dispatch script completes them: the key family root + these +
    the value)."""
    k = Keys("")
    log, charges = k.gate_tokens(gate, f"{attribute}:", window_s)
    return log.removeprefix(k.gate_prefix()), charges.removeprefix(k.gate_prefix())


def holder(request_id: str, token: str) -> str:
    """A reservation holder: one attempt of one request."""
    return f"{request_id}:{token}"
