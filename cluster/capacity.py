"""Capacity planning across replicas: the host tier's process-wide budget (DESIGN section 5).

``--experimental-kv-offload-host-memory-gb G`` is one budget for the whole deployment: it is
divided equally among the ``data_parallel_size`` replicas, and each replica turns its share into
whole host blocks (so the total may come out slightly under G). The ratio option is per replica
already and passes through unchanged; total host memory then grows with the replica count.
"""

import math

from replicas.config import KVOffloadConfig
from replicas.model import ModelArgs

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_block_bytes(args: ModelArgs, block_size: int, dtype: str) -> int:
    """Bytes of one KV block across every layer (K and V)."""
    per_layer = 2 * block_size * args.num_kv_heads * args.head_dim * _DTYPE_BYTES[dtype]
    return args.num_layers * per_layer


def plan_replica_offload(
    offload: KVOffloadConfig, data_parallel_size: int, block_bytes: int
) -> KVOffloadConfig:
    """The host-tier config of one replica: its equal share of a byte budget.

    Raises ``ValueError`` when the share cannot hold one block.
    """
    if not offload.is_active or not offload.host_memory_bytes:
        return offload
    share = offload.host_memory_bytes // data_parallel_size
    if share < block_bytes:
        minimum_gib = block_bytes * data_parallel_size / 2**30
        raise ValueError(
            f"--experimental-kv-offload-host-memory-gb gives each of the {data_parallel_size} "
            f"replicas {share} bytes, less than one KV block ({block_bytes} bytes); raise it to "
            f"at least {minimum_gib:.6f} GiB"
        )
    return offload.model_copy(update={"host_memory_bytes": share})


def host_bytes_total(
    offload: KVOffloadConfig, data_parallel_size: int, num_npu_blocks: int, block_bytes: int
) -> int:
    """Host KV bytes the whole deployment will allocate."""
    if not offload.is_active:
        return 0
    if offload.host_memory_ratio > 0:
        per_replica = math.floor(offload.host_memory_ratio * num_npu_blocks) * block_bytes
    else:
        share = offload.host_memory_bytes // data_parallel_size
        per_replica = share // block_bytes * block_bytes
    return per_replica * data_parallel_size


__all__ = ["host_bytes_total", "kv_block_bytes", "plan_replica_offload"]
