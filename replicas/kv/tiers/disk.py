"""The disk tier: blocks in files on a local disk behind the host tier, kept across restarts
and read by every replica of the node (``replicas.kv.disk``). Configured by
``kv_offload_config.disk_path`` and ``disk_bytes``; a resize hands blocks over through it."""

from pydantic import Field

from replicas.kv.events import Tier
from replicas.kv.tiers.base import BackingStore
from replicas.kv.tiers.registry import BackingOptions, TierContext, TierPlugin


class DiskOptions(BackingOptions):
    path: str = Field(min_length=1, description="The directory of the node's disk tier.")


def open_stores(context: TierContext, options: DiskOptions) -> dict[str, BackingStore]:
    """One disk store per cache type under ``options.path``, keyed by the model's fingerprint
    (a store that cannot open its files is off, with a warning)."""
    from replicas.kv.disk import DiskStore

    return {
        cache_type: DiskStore(
            options.path,
            context.fingerprint,
            cache_type,
            context.block_shapes[cache_type],
            context.dtypes[cache_type],
            num_slots,
            max_retained=int(context.retained_share * num_slots),
            retained_priority=context.retained_priority,
        )
        for cache_type, num_slots in context.num_blocks.items()
    }


PLUGIN = TierPlugin(Tier.DISK.traits, DiskOptions, open_stores)
