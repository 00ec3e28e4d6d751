"""How many blocks each cache type of one replica gets, in each tier (DESIGN section 5).

NPU memory is split between cache types by their expected footprint: a request of ``T`` tokens
holds ``ceil(T / B)`` global blocks but only the blocks of its sliding window plus one prefill
chunk in a sliding group. Each sliding pool can always hold one request's window and chunk, so a
request never waits for sliding blocks that cannot exist.

The host tier is sized per cache type either by ratio (``floor(R x NPU blocks)``) or by the
replica's byte share, split in proportion to each type's NPU KV memory, in whole blocks. A byte
budget is process-wide: each of the ``data_parallel_size`` replicas gets an equal share, which
must hold at least one block of every cache type.

The engine (``plan_cache``), the deployment (``plan_replica_offload``, ``deployment_host_bytes``)
and the simulator (``host_blocks_per_replica``) all size the host tier here.
"""

import logging
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch

from replicas.config import (
    DISK_GB_OPTION,
    HOST_GB_OPTION,
    HOST_RATIO_OPTION,
    EngineConfig,
    KVOffloadConfig,
    check_one_host_capacity,
    planning_dtype,
    torch_dtype,
)
from replicas.model import KVCacheSpec, ModelArgs
from replicas.model.registry import build_model

logger = logging.getLogger(__name__)


class CachePlan(NamedTuple):
    num_npu_blocks: dict[str, int]
    num_host_blocks: dict[str, int]  # empty when the host tier is off
    block_bytes: dict[str, int]
    # Per tier behind host that is on (disk, ...): its blocks per cache type.
    num_backing_blocks: "Mapping[str, dict[str, int]]" = MappingProxyType({})

    @property
    def host_bytes(self) -> int:
        """Bytes of every host pool of the replica (0 when the host tier is off)."""
        return sum(n * self.block_bytes[g] for g, n in self.num_host_blocks.items())


def kv_cache_specs(
    args: ModelArgs, dtype: str, kv_cache_dtype: str = "auto"
) -> dict[str, KVCacheSpec]:
    """The model's KV cache specs without its weights: ``kv_cache_specs`` of the model built on
    the meta device, which allocates no memory. A ``dtype`` of ``auto`` plans with the widest
    candidate (``replicas.config.planning_dtype``); so does a ``kv_cache_dtype`` of ``auto``,
    which follows it. Block bytes are the KV format's, scales included."""
    with torch.device("meta"):
        model = build_model(args)
    return model.kv_cache_specs(torch_dtype(planning_dtype(dtype)), kv_cache_dtype)


def _blocks_per_request(spec: KVCacheSpec, num_tokens: int, chunk: int, block_size: int) -> int:
    full = math.ceil(num_tokens / block_size)
    if spec.sliding_window is None:
        return full
    return min(full, math.ceil((spec.sliding_window - 1 + chunk) / block_size) + 1)


def cache_type_shares(
    specs: dict[str, KVCacheSpec], config: EngineConfig, max_positions: int
) -> dict[str, float]:
    """Each cache type's blocks per block of the primary (first, global) type: the ratio of one
    request's blocks, for a request of ``max_model_len`` (else ``max_positions``) tokens."""
    block_size = config.block_size
    num_tokens = config.max_model_len or max_positions
    chunk = min(config.scheduler_config.max_num_batched_tokens, num_tokens)
    per_request = {
        g: _blocks_per_request(s, num_tokens, chunk, block_size) for g, s in specs.items()
    }
    primary = per_request[next(iter(specs))]
    return {g: per_request[g] / primary for g in specs}


def plan_npu_blocks(
    specs: dict[str, KVCacheSpec],
    config: EngineConfig,
    max_positions: int,
    num_primary: int | None = None,
) -> dict[str, int]:
    """NPU blocks per cache type: the first (global) type gets ``num_primary`` (a pool sized by
    ``replicas.kv.sizing.size_npu_pool``), else what ``num_npu_blocks`` or
    ``npu_kv_memory_bytes`` sets; ``ValueError`` when none is given."""
    block_size = config.block_size
    num_tokens = config.max_model_len or max_positions
    chunk = min(config.scheduler_config.max_num_batched_tokens, num_tokens)
    share = cache_type_shares(specs, config, max_positions)
    if num_primary is None:
        num_primary = configured_npu_blocks(specs, config, max_positions)
    if num_primary is None:
        raise ValueError(
            "npu_kv_memory_bytes is None (sized from device memory): size the pool with "
            "replicas.kv.sizing.size_npu_pool, or set npu_kv_memory_bytes or num_npu_blocks"
        )
    plan = {}
    for group, spec in specs.items():
        blocks = max(1, math.ceil(num_primary * share[group]))
        if spec.sliding_window is not None:
            floor_blocks = _blocks_per_request(spec, num_primary * block_size, chunk, block_size)
            blocks = min(num_primary, max(blocks, floor_blocks))
        plan[group] = blocks
    return plan


def primary_block_bytes(
    specs: dict[str, KVCacheSpec], config: EngineConfig, max_positions: int
) -> float:
    """The NPU bytes one block of the primary cache type brings with it: its own and each
    other type's share of blocks (``cache_type_shares``)."""
    share = cache_type_shares(specs, config, max_positions)
    return sum(share[g] * s.block_bytes(config.block_size) for g, s in specs.items())


def configured_npu_blocks(
    specs: dict[str, KVCacheSpec], config: EngineConfig, max_positions: int
) -> int | None:
    """The primary cache type's NPU blocks that ``num_npu_blocks`` or ``npu_kv_memory_bytes``
    sets; None when neither is (the pool is sized from memory: ``replicas.kv.sizing``)."""
    if config.num_npu_blocks is not None:
        return config.num_npu_blocks
    if config.npu_kv_memory_bytes is None:
        return None
    per_block = primary_block_bytes(specs, config, max_positions)
    num_primary = int(config.npu_kv_memory_bytes // per_block)
    if num_primary < 1:
        raise ValueError(
            f"npu_kv_memory_bytes={config.npu_kv_memory_bytes} is smaller than one KV block "
            f"({math.ceil(per_block)} bytes)"
        )
    return num_primary


def replica_host_bytes(host_memory_bytes: int, data_parallel_size: int, block_bytes: int) -> int:
    """One replica's equal share of a process-wide host budget, in bytes (rounded down).

    ``block_bytes`` is one block of every cache type; raises ``ValueError`` when the share is
    smaller.
    """
    return _replica_share(host_memory_bytes, data_parallel_size, block_bytes, HOST_GB_OPTION)


def _replica_share(budget: int, data_parallel_size: int, block_bytes: int, option: str) -> int:
    share = budget // data_parallel_size
    if share < block_bytes:
        raise _share_error(option, share, data_parallel_size, block_bytes)
    return share


def plan_replica_offload(
    offload: KVOffloadConfig, data_parallel_size: int, block_bytes: int
) -> KVOffloadConfig:
    """The host-tier config of one replica: its equal share of a byte budget (a ratio is per
    replica already and passes through), and of the disk budget. Raises ``ValueError`` when a
    share holds no block."""
    if not offload.is_active:
        return offload
    update = {}
    if offload.host_memory_bytes is not None:
        update["host_memory_bytes"] = replica_host_bytes(
            offload.host_memory_bytes, data_parallel_size, block_bytes
        )
    if offload.disk_bytes is not None:
        update["disk_bytes"] = _replica_share(
            offload.disk_bytes, data_parallel_size, block_bytes, DISK_GB_OPTION
        )
    tiers = {}
    for name, options in offload.tiers.items():
        option = f"kv_offload_config.tiers[{name!r}].bytes"
        budget = options.get("bytes")
        share = budget and _replica_share(budget, data_parallel_size, block_bytes, option)
        tiers[name] = {**options, "bytes": share} if share else options
    if tiers:
        update["tiers"] = tiers
    return offload.model_copy(update=update) if update else offload


def host_blocks_per_replica(
    num_npu_blocks: int,
    block_bytes: float,
    data_parallel_size: int,
    *,
    host_memory_gib: float = 0.0,
    host_memory_ratio: float = 0.0,
    gib_option: str = HOST_GB_OPTION,
    ratio_option: str = HOST_RATIO_OPTION,
) -> int:
    """Host blocks of one cache type for one replica: ``floor(ratio x NPU blocks)``, or the
    replica's equal share of a process-wide GiB budget in whole blocks; 0 when neither is
    positive. Raises ``ValueError`` when both are positive or the share holds no block.

    The rules of ``plan_host_blocks`` and ``replica_host_bytes`` for one cache type, in floats:
    the simulator's blocks stand for scaled trace tokens, so their bytes need not be whole.
    """
    check_one_host_capacity(host_memory_gib > 0, host_memory_ratio > 0, gib_option, ratio_option)
    if host_memory_ratio > 0:
        return _ratio_blocks(host_memory_ratio, num_npu_blocks)
    if host_memory_gib <= 0:
        return 0
    share = host_memory_gib * 2**30 / data_parallel_size
    num_blocks = int(share // block_bytes)
    if num_blocks < 1:
        raise _share_error(gib_option, share, data_parallel_size, block_bytes)
    return num_blocks


def _share_error(
    option: str, share: float, data_parallel_size: int, block_bytes: float
) -> ValueError:
    minimum_gib = block_bytes * data_parallel_size / 2**30
    return ValueError(
        f"{option} gives each of the {data_parallel_size} replicas {share:.0f} bytes, less than "
        f"one KV block ({block_bytes:.0f} bytes); raise it to at least {minimum_gib:.6f} GiB"
    )


def _ratio_blocks(ratio: float, num_npu_blocks: int) -> int:
    return math.floor(ratio * num_npu_blocks)


def plan_host_blocks(
    offload: KVOffloadConfig, num_npu_blocks: dict[str, int], block_bytes: dict[str, int]
) -> dict[str, int]:
    """Host blocks per cache type for one replica (``offload`` holds the replica's share of a
    byte budget, see ``plan_replica_offload``); empty when the host tier is off."""
    if not offload.is_active:
        return {}
    if offload.host_memory_ratio > 0:
        plan = {g: _ratio_blocks(offload.host_memory_ratio, n) for g, n in num_npu_blocks.items()}
        option = f"{HOST_RATIO_OPTION}={offload.host_memory_ratio}"
    else:
        plan = _split_bytes(offload.host_memory_bytes, num_npu_blocks, block_bytes)
        option = f"{HOST_GB_OPTION} (host_memory_bytes)"
    _check_every_type(plan, option, "host")
    return plan


def _split_bytes(
    budget: int, num_npu_blocks: dict[str, int], block_bytes: dict[str, int]
) -> dict[str, int]:
    """Whole blocks per cache type of a byte budget split in proportion to NPU KV bytes."""
    npu_bytes = {g: n * block_bytes[g] for g, n in num_npu_blocks.items()}
    total = sum(npu_bytes.values())
    return {g: budget * npu_bytes[g] // total // block_bytes[g] for g in npu_bytes}


def _check_every_type(plan: dict[str, int], option: str, tier: str) -> None:
    empty = [g for g, n in plan.items() if n < 1]
    if empty:
        raise ValueError(
            f"{option} leaves the replica no {tier} block for cache type {empty[0]!r} "
            f"({plan}); it needs at least one per type"
        )


def plan_backing_blocks(
    offload: KVOffloadConfig, num_npu_blocks: dict[str, int], block_bytes: dict[str, int]
) -> dict[str, dict[str, int]]:
    """Blocks per cache type of each tier behind host for one replica: its share of the
    tier's byte budget split as a byte budget of the host tier is (in proportion to NPU KV
    memory); empty without such a tier."""
    plans = {}
    for name, options in offload.backing_options().items():
        if options.bytes is None:  # a tier that is only read: no blocks of its own
            plans[name] = dict.fromkeys(num_npu_blocks, 0)
            continue
        plan = _split_bytes(options.bytes, num_npu_blocks, block_bytes)
        option = (
            f"{DISK_GB_OPTION} (disk_bytes)"
            if name == "disk"
            else f"kv_offload_config.tiers[{name!r}].bytes"
        )
        _check_every_type(plan, option, name)
        plans[name] = plan
    return plans


def plan_cache(
    specs: dict[str, KVCacheSpec],
    config: EngineConfig,
    max_positions: int,
    num_primary: int | None = None,
) -> CachePlan:
    """Every tier's blocks per cache type; the primary type's NPU blocks are ``num_primary``
    (``replicas.kv.sizing.size_npu_pool``), else the configured ones."""
    block_bytes = {g: s.block_bytes(config.block_size) for g, s in specs.items()}
    npu = plan_npu_blocks(specs, config, max_positions, num_primary)
    offload = config.scheduler_config.kv_offload_config
    host = plan_host_blocks(offload, npu, block_bytes)
    backing = plan_backing_blocks(offload, npu, block_bytes)
    logger.info(
        "KV cache split (KV dtype %s): %s",
        next(iter(specs.values())).kv_format.name,
        ", ".join(
            f"{g}: {npu[g]} NPU + {host.get(g, 0)} host"
            + "".join(f" + {plan[g]} {tier}" for tier, plan in backing.items())
            + f" blocks of {block_bytes[g]} bytes"
            for g in specs
        ),
    )
    return CachePlan(npu, host, block_bytes, backing)


def deployment_host_bytes(args: ModelArgs, config: EngineConfig, data_parallel_size: int) -> int:
    """Host KV bytes the whole deployment will allocate: ``data_parallel_size`` replicas of
    ``config`` (one replica's config, holding its share of a byte budget), planned as the
    engine plans them, from the model's config alone (no weights); a pool sized from memory is
    estimated as on this machine's CPU (``replicas.kv.sizing.plan_cpu_pool``)."""
    if not config.scheduler_config.kv_offload_config.is_active:
        return 0
    specs = kv_cache_specs(args, config.dtype, config.kv_cache_dtype)
    num_primary = None
    if configured_npu_blocks(specs, config, args.max_position_embeddings) is None:
        from replicas.kv import sizing  # sizing plans with this module's rules

        weights = sizing.estimate_weights_bytes(args, config.dtype, config.quantization)
        memory = sizing.device_memory(torch.device("cpu")).free_bytes
        pool = sizing.plan_cpu_pool(args, config, memory, data_parallel_size, weights)
        num_primary = pool.num_blocks
    plan = plan_cache(specs, config, args.max_position_embeddings, num_primary)
    return data_parallel_size * plan.host_bytes
