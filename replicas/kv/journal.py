"""What the parts of a KV cache manager record for its engine, in one place.

Every part that moves a block writes here and nowhere else: the copies it plans (the next
``TransferPlan``), the stored/removed events a router follows, and the cache's counters. The
manager owns the journal and hands it down its tree; no part reads another's state through it.
"""

from replicas.kv.events import KVEventKind, Tier
from replicas.kv.hashing import BlockHash
from replicas.kv.records import CacheStats, PlannedCopies
from replicas.kv.views import EventLog


class Journal:
    """The planned copies, the event log and the counters (``stats``: an engine may replace
    them with fresh ones)."""

    __slots__ = ("events", "plan", "stats")

    def __init__(self) -> None:
        self.plan = PlannedCopies()
        self.events = EventLog()  # off until enabled
        self.stats = CacheStats()

    def stored(self, cache_type: str, tier: Tier, block_hash: BlockHash) -> None:
        self.events.emit(cache_type, KVEventKind.STORED, tier, block_hash)

    def removed(self, cache_type: str, tier: Tier, block_hash: BlockHash) -> None:
        self.events.emit(cache_type, KVEventKind.REMOVED, tier, block_hash)
