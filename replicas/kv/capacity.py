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
    num_disk_blocks: "dict[str, int] | None" = None  # None when the disk tier is off

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


def plan_npu_blocks(
    specs: dict[str, KVCacheSpec], config: EngineConfig, max_positions: int
) -> dict[str, int]:
    """NPU blocks per cache type; the first (global) type gets ``num_npu_blocks`` if set."""
    block_size = config.block_size
    num_tokens = config.max_model_len or max_positions
    chunk = min(config.scheduler_config.max_num_batched_tokens, num_tokens)
    per_request = {
        g: _blocks_per_request(s, num_tokens, chunk, block_size) for g, s in specs.items()
    }
    primary = next(iter(specs))
    share = {g: per_request[g] / per_request[primary] for g in specs}
    if config.num_npu_blocks is not None:
        num_primary = config.num_npu_blocks
    else:
        bytes_per_primary_block = sum(
            share[g] * s.block_bytes(block_size) for g, s in specs.items()
        )
        num_primary = int(config.npu_kv_memory_bytes // bytes_per_primary_block)
        if num_primary < 1:
            raise ValueError(
                f"npu_kv_memory_bytes={config.npu_kv_memory_bytes} is smaller than one KV block "
                f"({math.ceil(bytes_per_primary_block)} bytes)"
            )
    plan = {}
    for group, spec in specs.items():
        blocks = max(1, math.ceil(num_primary * share[group]))
        if spec.sliding_window is not None:
            floor_blocks = _blocks_per_request(spec, num_primary * block_size, chunk, block_size)
            blocks = min(num_primary, max(blocks, floor_blocks))
        plan[group] = blocks
    return plan


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


def plan_disk_blocks(
    offload: KVOffloadConfig, num_npu_blocks: dict[str, int], block_bytes: dict[str, int]
) -> dict[str, int]:
    """Disk slots per cache type for one replica: its share of the disk budget split as a byte
    budget of the host tier is (in proportion to NPU KV memory); empty without a disk tier."""
    if not offload.has_disk:
        return {}
    plan = _split_bytes(offload.disk_bytes, num_npu_blocks, block_bytes)
    _check_every_type(plan, f"{DISK_GB_OPTION} (disk_bytes)", "disk")
    return plan


def plan_cache(
    specs: dict[str, KVCacheSpec], config: EngineConfig, max_positions: int
) -> CachePlan:
    block_bytes = {g: s.block_bytes(config.block_size) for g, s in specs.items()}
    npu = plan_npu_blocks(specs, config, max_positions)
    offload = config.scheduler_config.kv_offload_config
    host = plan_host_blocks(offload, npu, block_bytes)
    disk = plan_disk_blocks(offload, npu, block_bytes)
    logger.info(
        "KV cache split (KV dtype %s): %s",
        next(iter(specs.values())).kv_format.name,
        ", ".join(
            f"{g}: {npu[g]} NPU + {host.get(g, 0)} host"
            + (f" + {disk[g]} disk" if disk else "")
            + f" blocks of {block_bytes[g]} bytes"
            for g in specs
        ),
    )
    return CachePlan(npu, host, block_bytes, disk or None)


def deployment_host_bytes(args: ModelArgs, config: EngineConfig, data_parallel_size: int) -> int:
    """Host KV bytes the whole deployment will allocate: ``data_parallel_size`` replicas of
    ``config`` (one replica's config, holding its share of a byte budget), planned as the
    engine plans them, from the model's config alone (no weights)."""
    if not config.scheduler_config.kv_offload_config.is_active:
        return 0
    specs = kv_cache_specs(args, config.dtype, config.kv_cache_dtype)
    plan = plan_cache(specs, config, args.max_position_embeddings)
    return data_parallel_size * plan.host_bytes
