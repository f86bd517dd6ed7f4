"""The Redis layer: key names (:mod:`.keys`), connections (:mod:`.connect`), the Lua scripts
and how they are called (:mod:`.scripts`, :mod:`.luatext`, ``lua/``), and the request state
they keep (:mod:`.state`). Imports only ``config`` and ``errors`` of the pipeline."""

from . import sched
from .connect import connect
from .epoch import LOST_NOTICE, Epoch, EpochSeen, epoch_seen, tell_lost
from .keys import Keys, holder
from .rows import RequestRow
from .sched import MergeArgs, QueueTick, QuotaSpec, TokenSpec
from .scripts import ScriptCall, run_batch
from .server import ServerFacts, ShardLoad, check_redis, primaries, server_facts, shard_load
from .state import DirectPublish, Dispatched, Mirror, Store

__all__ = [
    "LOST_NOTICE",
    "DirectPublish",
    "Dispatched",
    "Epoch",
    "EpochSeen",
    "Keys",
    "MergeArgs",
    "Mirror",
    "QueueTick",
    "QuotaSpec",
    "RequestRow",
    "ScriptCall",
    "ServerFacts",
    "ShardLoad",
    "Store",
    "TokenSpec",
    "check_redis",
    "connect",
    "epoch_seen",
    "holder",
    "run_batch",
    "sched",
    "tell_lost",
    "primaries",
    "server_facts",
    "shard_load",
]
