"""The NPU tier: a cache type's block pool in accelerator memory (CPU memory on a CPU
replica), sized from the device's free memory (``replicas.kv.sizing``); where every request's
KV is computed and read."""

from replicas.kv.block_pool import BlockPool
from replicas.kv.events import Tier
from replicas.kv.records import CacheTypeSpec
from replicas.kv.tiers.base import TierLevel
from replicas.kv.tiers.registry import TierPlugin

PLUGIN = TierPlugin(Tier.NPU.traits)


def level(spec: CacheTypeSpec) -> TierLevel:
    """A cache type's NPU tier: ``spec.num_npu_blocks`` blocks."""
    return TierLevel(Tier.NPU, BlockPool(spec.num_npu_blocks, f"npu[{spec.name}]"))
