"""The host tier: a cache type's block pool in host memory (one pinned slab on CUDA,
``replicas.kv.host_memory``), behind the NPU tier; blocks reach it by the write-through and
write-back rules and load back into NPU blocks. Up to ``retained_share`` of it may hold
prompt-cache retained blocks ahead of ordinary ones, ordered by ``retained_priority`` (``decay``
or ``pin``, ``replicas.kv.free_block_queue``)."""

from collections.abc import Callable

from replicas.kv.block_pool import BlockPool
from replicas.kv.events import Tier
from replicas.kv.free_block_queue import DECAY
from replicas.kv.records import CacheTypeSpec
from replicas.kv.tiers.base import TierLevel
from replicas.kv.tiers.registry import TierPlugin

PLUGIN = TierPlugin(Tier.HOST.traits)


def level(
    spec: CacheTypeSpec,
    retained_share: float,
    clock: Callable[[], float],
    retained_priority: str = DECAY,
) -> TierLevel:
    """A cache type's host tier: ``spec.num_host_blocks`` blocks (give some)."""
    pool = BlockPool(
        spec.num_host_blocks,
        f"host[{spec.name}]",
        max_retained=int(retained_share * spec.num_host_blocks),
        clock=clock,
        retained_priority=retained_priority,
    )
    return TierLevel(Tier.HOST, pool)
