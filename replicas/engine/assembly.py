"""The parts of an ``Engine`` built from its config at start-up: the loaded model, the NPU
pool's size, the backing tiers' stores and the KV cache manager. Each is a function of what
came before it; ``Engine.__init__`` calls them in order."""

import logging
from typing import TYPE_CHECKING

import torch

from replicas.config import EngineConfig
from replicas.kv.capacity import CachePlan
from replicas.kv.manager import KVCacheManager
from replicas.kv.records import CacheTypeSpec
from replicas.kv.reservations import ReservationPolicy
from replicas.kv.sizing import PoolSize, device_memory, module_bytes, size_npu_pool
from replicas.kv.tiers import TierContext, plugin
from replicas.model import KVCacheSpec, LoadedModel, load_model

if TYPE_CHECKING:
    from replicas.kv.tiers import BackingStore

logger = logging.getLogger(__name__)


def load(config: EngineConfig, device: torch.device) -> LoadedModel:
    """The model ``config`` names, on ``device``, with ``auto`` resolved
    (``replicas.model.loader``); compiled layer by layer where ``torch_compile`` asks."""
    loaded = load_model(
        config.model,
        device,
        config.dtype,
        seed=config.seed,
        revision=config.revision,
        quantization=config.quantization,
        kv_cache_dtype=config.kv_cache_dtype,
        decoder_stack="eager" if config.torch_compile else config.decoder_stack,
        int4_kernel=config.int4_kernel,
    )
    if config.torch_compile and loaded.model.compiled is None:
        loaded.model.compile_layers()
    return loaded


def npu_pool(
    device: torch.device, loaded: LoadedModel, specs: dict[str, KVCacheSpec], config: EngineConfig
) -> PoolSize:
    """The NPU pool from the memory the device has left now that the weights are loaded
    (``replicas.kv.sizing``), logged in one line with how it was sized."""
    pool = size_npu_pool(
        device_memory(device),
        loaded.args,
        specs,
        config,
        weights_bytes=module_bytes(loaded.model),
    )
    logger.info("engine: NPU KV pool from %s", pool.reason)
    return pool


def kv_cache_manager(
    config: EngineConfig,
    specs: dict[str, KVCacheSpec],
    plan: CachePlan,
    backing: "dict[str, dict[str, BackingStore]]",
) -> KVCacheManager:
    """The replica's KV cache: one cache type per KV spec, sized by ``plan``, with the
    configured prefix-cache and host-tier policies."""
    sched = config.scheduler_config
    offload = sched.kv_offload_config
    return KVCacheManager(
        block_size=config.block_size,
        cache_types=[
            CacheTypeSpec(
                g, plan.num_npu_blocks[g], plan.num_host_blocks.get(g, 0), spec.sliding_window
            )
            for g, spec in specs.items()
        ],
        enable_prefix_caching=sched.prefix_cache_config.enabled,
        reservations=ReservationPolicy(sched.prefix_cache_config.reservation_share),
        write_through_threshold=offload.write_through_threshold,
        write_back=offload.write_back,
        retention=offload.retention,
        curve_sample_rate=offload.miss_ratio_curve_sample_rate,
        backing=backing,
        retained_share=offload.retained_share,
        retained_priority=offload.retained_priority,
        reuse_partial_blocks=True,
        interactive_lifetime_s=sched.prefix_cache_config.interactive_lifetime_s,
    )


def model_fingerprint(config: EngineConfig, loaded: LoadedModel) -> str:
    """A digest of what decides a KV block's bytes (``replicas.kv.disk.model_fingerprint``):
    blocks of equal fingerprints may be shared, on disk or between replicas."""
    from replicas.kv.disk import model_fingerprint as fingerprint

    architecture = f"{type(loaded.model).__name__}|{loaded.args!r}|{loaded.quantization}"
    # The KV dtype (format) is the layout of the blocks' bytes: another one, another fingerprint.
    return fingerprint(loaded.model, architecture, config.kv_cache_dtype, config.block_size)


def open_backing(
    config: EngineConfig,
    fingerprint: str,
    kv_caches: dict[str, torch.Tensor],
    num_backing_blocks: dict[str, dict[str, int]],
) -> "dict[str, dict[str, BackingStore]]":
    """One store per cache type of each tier behind host that is on, opened by the tier's
    plugin (``replicas.kv.tiers``) and keyed by this model's ``fingerprint``."""
    offload = config.scheduler_config.kv_offload_config
    options = offload.backing_options()
    stores = {}
    for tier, num_blocks in num_backing_blocks.items():
        context = TierContext(
            fingerprint,
            {c: tuple(kv_caches[c].shape[1:]) for c in num_blocks},
            {c: kv_caches[c].dtype for c in num_blocks},
            num_blocks,
            offload.retained_share,
            offload.retained_priority,
        )
        stores[tier] = plugin(tier).open(context, options[tier])
    return stores
