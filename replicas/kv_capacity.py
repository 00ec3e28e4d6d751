"""How many blocks each cache type of one replica gets, in each tier (DESIGN section 5).

NPU memory is split between cache types by their expected footprint: a request of ``T`` tokens
holds ``ceil(T / B)`` global blocks but only the blocks of its sliding window plus one prefill
chunk in a sliding group. Each sliding pool can always hold one request's window and chunk, so a
request never waits for sliding blocks that cannot exist.

The host tier is sized per cache type either by ratio (``floor(R x NPU blocks)``) or by the
replica's byte share, split in proportion to each type's NPU KV memory, in whole blocks.
"""

import logging
import math
from typing import NamedTuple

from replicas.config import EngineConfig, KVOffloadConfig
from replicas.model import KVCacheSpec

logger = logging.getLogger(__name__)


class CachePlan(NamedTuple):
    num_npu_blocks: dict[str, int]
    num_host_blocks: dict[str, int]  # empty when the host tier is off
    block_bytes: dict[str, int]


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


def plan_host_blocks(
    offload: KVOffloadConfig, num_npu_blocks: dict[str, int], block_bytes: dict[str, int]
) -> dict[str, int]:
    """Host blocks per cache type for one replica; empty when the host tier is off."""
    if not offload.is_active:
        return {}
    if offload.host_memory_ratio > 0:
        plan = {g: math.floor(offload.host_memory_ratio * n) for g, n in num_npu_blocks.items()}
        option = f"--experimental-kv-offload-host-memory-ratio={offload.host_memory_ratio}"
    else:
        npu_bytes = {g: n * block_bytes[g] for g, n in num_npu_blocks.items()}
        total = sum(npu_bytes.values())
        plan = {
            g: offload.host_memory_bytes * npu_bytes[g] // total // block_bytes[g]
            for g in num_npu_blocks
        }
        option = "--experimental-kv-offload-host-memory-gb (host_memory_bytes)"
    empty = [g for g, n in plan.items() if n < 1]
    if empty:
        raise ValueError(
            f"{option} leaves the replica no host block for cache type {empty[0]!r} "
            f"({plan}); it needs at least one per type"
        )
    return plan


def plan_cache(
    specs: dict[str, KVCacheSpec], config: EngineConfig, max_positions: int
) -> CachePlan:
    block_bytes = {g: s.block_bytes(config.block_size) for g, s in specs.items()}
    npu = plan_npu_blocks(specs, config, max_positions)
    host = plan_host_blocks(config.scheduler_config.kv_offload_config, npu, block_bytes)
    logger.info(
        "KV cache split: %s",
        ", ".join(
            f"{g}: {npu[g]} NPU + {host.get(g, 0)} host blocks of {block_bytes[g]} bytes"
            for g in specs
        ),
    )
    return CachePlan(npu, host, block_bytes)
