"""How much memory one replica's NPU KV pool takes: one rule for every device.

``size_npu_pool`` turns the memory a device has left into NPU blocks, tokens and the
``max_model_len`` they allow::

    device memory: HBM on a GPU (free after the weights are loaded), RAM on a CPU (available)
      - activation reserve   one step's peak: max_num_batched_tokens rows through the widest
                             layer, max_num_seqs rows of float32 logits (and, on CUDA, kernel
                             workspaces)
      - CPU only: the node's other replicas' weights (counted as not loaded yet), and the host
                  tier's byte budget of every replica of the node (the same DRAM)
      = left
    pool = npu_kv_memory_fraction x left                   (on a CPU: / the node's replicas,
                                                            / (1 + R) with a host ratio R)
    pool <= the blocks the scheduler can ever fill: max_num_seqs full contexts on a GPU,
            CPU_POOL_CONTEXTS full contexts on a CPU (a context: max_model_len, else the
            model's max_position_embeddings)

``num_npu_blocks`` or ``npu_kv_memory_bytes``, when given, win over the rule. ``max_model_len``
then follows: the model's ``max_position_embeddings`` capped by the pool's tokens (an explicit
value larger than either is a start-up error).

The engine sizes its pool here after loading the weights; a deployment on CPUs sizes every
replica's pool here before any starts (from Ray's memory of a node and the weights' estimate),
so that the replicas of a node get the same pool and declare it to Ray (``replica_memory``).
"""

import math
from typing import NamedTuple

import torch
from torch import nn

from replicas.config import (
    CPU_KV_MEMORY_FRACTION,
    GPU_KV_MEMORY_FRACTION,
    HOST_GB_OPTION,
    EngineConfig,
    planning_dtype,
    torch_dtype,
)
from replicas.kv.capacity import configured_npu_blocks, kv_cache_specs, primary_block_bytes
from replicas.kv.host_memory import read_meminfo
from replicas.model import KVCacheSpec, ModelArgs
from replicas.model.registry import build_model

CPU_POOL_CONTEXTS = 4
"""On a CPU the pool holds at most this many full contexts: a step of attention over one long
context already takes the cores, so more full-length requests at once would only queue, and
cached prefixes beyond the pool have the host tier (the same DRAM)."""
CUDA_WORKSPACE_BYTES = 512 * 2**20
"""Part of the activation reserve on CUDA: cuBLAS workspaces and attention kernels' scratch,
which are allocated at the first forward, after the pool is sized."""
LOGITS_COPIES = 3
"""Float32 logits of one step are held about this many times at once (logits, their softmax or
log-softmax, the sampler's working copy)."""


class DeviceMemory(NamedTuple):
    """What a device has: ``kind`` ``cpu`` or ``cuda``; ``free_bytes`` what is left now (a
    GPU's free memory, a CPU's ``MemAvailable``)."""

    kind: str
    total_bytes: int
    free_bytes: int


class PoolSize(NamedTuple):
    """One replica's NPU pool: blocks of the primary cache type (each sliding type is planned
    from them by ``replicas.kv.capacity``), their tokens, the ``max_model_len`` they allow, the
    bytes of every cache type's pool and a one-line reason."""

    num_blocks: int
    num_tokens: int
    max_model_len: int
    pool_bytes: int
    reason: str


def device_memory(device: torch.device) -> DeviceMemory:
    """Total and free memory of ``device`` now: ``torch.cuda.mem_get_info`` (after giving
    torch's cached, unused blocks back, so that a loader's staging copies count as free), or
    the host's ``MemTotal`` and ``MemAvailable``."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory("cuda", int(total), int(free))
    info = read_meminfo()
    total = info.get("MemTotal") or _sysconf_bytes("SC_PHYS_PAGES")
    free = info.get("MemAvailable") or _sysconf_bytes("SC_AVPHYS_PAGES")
    return DeviceMemory("cpu", int(total), int(free))


def _sysconf_bytes(name: str) -> int:
    import os

    try:
        return os.sysconf(name) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def module_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers, each storage once (tied weights share)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def activation_reserve_bytes(
    args: ModelArgs, dtype_bytes: int, config: EngineConfig, device_kind: str
) -> int:
    """Memory one engine step needs beside the weights and the KV pool, at most: the step's
    ``max_num_batched_tokens`` rows through a layer (hidden states, fused q/k/v, the MLP's gate,
    up and product) and the attention scores of one head group over one chunk of keys, and
    ``max_num_seqs`` rows of float32 logits; on CUDA, ``CUDA_WORKSPACE_BYTES`` more."""
    sched = config.scheduler_config
    tokens = sched.max_num_batched_tokens
    width = (
        4 * args.hidden_size
        + (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
        + 3 * args.intermediate_size
    )
    rows = tokens * width * dtype_bytes
    scores = 4 * args.num_heads * tokens * min(tokens, 2048)
    logits = 4 * LOGITS_COPIES * min(sched.max_num_seqs, tokens) * args.vocab_size
    workspace = CUDA_WORKSPACE_BYTES if device_kind == "cuda" else 0
    return rows + scores + logits + workspace


def size_npu_pool(
    memory: DeviceMemory,
    args: ModelArgs,
    specs: dict[str, KVCacheSpec],
    config: EngineConfig,
    *,
    weights_bytes: int,
    weights_loaded: bool = True,
    num_node_replicas: int = 1,
) -> PoolSize:
    """One replica's NPU pool on a device with ``memory`` (see the module docstring), for a
    model of ``args`` with KV cache ``specs`` whose weights take ``weights_bytes`` (already out
    of ``memory.free_bytes`` when ``weights_loaded``) and ``config``'s limits; on a CPU the RAM
    is shared by ``num_node_replicas`` replicas, this one included. Raises ``ValueError``
    naming the option when the pool holds no block or ``max_model_len`` does not fit."""
    block_size = config.block_size
    model_limit = args.max_position_embeddings
    per_block = primary_block_bytes(specs, config, model_limit)
    num_blocks = configured_npu_blocks(specs, config, model_limit)
    if num_blocks is not None:
        option = "num_npu_blocks" if config.num_npu_blocks is not None else "npu_kv_memory_bytes"
        reason = f"{option}={getattr(config, option)} (set)"
    else:
        dtype_bytes = next(iter(specs.values())).dtype.itemsize  # the activations'
        num_blocks, reason = _sized_blocks(
            memory,
            args,
            config,
            per_block,
            dtype_bytes,
            weights_bytes,
            weights_loaded,
            num_node_replicas,
        )
    num_tokens = num_blocks * block_size
    max_model_len = resolve_max_model_len(num_blocks, block_size, model_limit, config.max_model_len)
    return PoolSize(
        num_blocks,
        num_tokens,
        max_model_len,
        math.ceil(num_blocks * per_block),
        f"{reason}: {num_blocks} blocks, {num_tokens} tokens, max_model_len {max_model_len}",
    )


def _sized_blocks(
    memory: DeviceMemory,
    args: ModelArgs,
    config: EngineConfig,
    per_block: float,
    dtype_bytes: int,
    weights_bytes: int,
    weights_loaded: bool,
    num_node_replicas: int,
) -> tuple[int, str]:
    """Primary blocks from ``memory`` by the rule, and the reason (the figures it used)."""
    is_cpu = memory.kind == "cpu"
    fraction = config.npu_kv_memory_fraction or (
        CPU_KV_MEMORY_FRACTION if is_cpu else GPU_KV_MEMORY_FRACTION
    )
    reserve = activation_reserve_bytes(args, dtype_bytes, config, memory.kind)
    left = memory.free_bytes - reserve - (0 if weights_loaded else weights_bytes)
    replicas = num_node_replicas if is_cpu else 1
    offload = config.scheduler_config.kv_offload_config
    host = 0
    if is_cpu:
        left -= (replicas - 1) * weights_bytes
        if offload.is_active and offload.host_memory_bytes is not None:
            host = replicas * offload.host_memory_bytes
            left -= host
            if host > memory.free_bytes:  # the host tier's own error, not an empty pool
                raise MemoryError(
                    f"the host KV tier of {replicas} replica(s) needs {host / 2**30:.2f} GiB of "
                    f"host memory but only {memory.free_bytes / 2**30:.2f} GiB is available; "
                    f"lower {HOST_GB_OPTION}"
                )
    budget = fraction * max(left, 0) / replicas
    if is_cpu and offload.is_active and offload.host_memory_ratio > 0:
        budget /= 1 + offload.host_memory_ratio  # the host pool grows with the NPU pool
    contexts = CPU_POOL_CONTEXTS if is_cpu else config.scheduler_config.max_num_seqs
    context = config.max_model_len or args.max_position_embeddings
    cap_blocks = math.ceil(contexts * context / config.block_size)
    num_blocks = min(int(budget // per_block), cap_blocks)
    gib = 2**30
    reason = (
        f"{memory.kind} memory {memory.total_bytes / gib:.1f} GiB, {memory.free_bytes / gib:.1f} "
        f"GiB free; weights {weights_bytes / gib:.2f} GiB"
        + ("" if weights_loaded else " (to load)")
        + f", activation reserve {reserve / gib:.2f} GiB"
        + (f", host tier {host / gib:.2f} GiB" if host else "")
        + (f", {replicas} replicas on the node" if replicas > 1 else "")
        + f"; npu_kv_memory_fraction {fraction:g} gives {budget / gib:.2f} GiB"
        + (
            f", capped at {contexts} contexts of {context} tokens"
            if num_blocks == cap_blocks
            else ""
        )
    )
    if num_blocks < 1:
        raise ValueError(
            f"the NPU KV pool sized from memory holds no block ({reason}); set "
            "npu_kv_memory_bytes or num_npu_blocks, raise npu_kv_memory_fraction, or free memory"
        )
    return num_blocks, reason


def resolve_max_model_len(
    num_blocks: int, block_size: int, model_limit: int, requested: int | None
) -> int:
    """The longest request: ``requested`` if given (``ValueError`` naming the option when the
    pool or the model's positions cannot hold it), else the model's ``max_position_embeddings``
    capped by the pool's tokens."""
    pool_tokens = num_blocks * block_size
    if requested is None:
        return min(model_limit, pool_tokens)
    if requested > pool_tokens:
        raise ValueError(
            f"max_model_len={requested} exceeds the NPU KV pool ({num_blocks} blocks of "
            f"{block_size} tokens = {pool_tokens} tokens); raise num_npu_blocks or lower "
            "max_model_len"
        )
    if requested > model_limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings ({model_limit})"
        )
    return requested


class ReplicaMemory(NamedTuple):
    """What a deployment knows of one replica's host memory before it starts: the NPU KV bytes
    it pins for it (on a CPU; None where the replica sizes its own pool: on a GPU, or where the
    config sets the pool), and the bytes it declares to Ray (weights, NPU pool and host tier
    on a CPU; the host tier on a GPU)."""

    npu_kv_memory_bytes: int | None
    declared_bytes: int
    reason: str


def estimate_weights_bytes(
    args: ModelArgs, dtype: str, quantization: str, checkpoint_bytes: int = 0
) -> int:
    """The bytes a replica's weights will hold, before they are loaded: every parameter in
    ``dtype`` (``auto``: float32, the widest candidate), the linear layers at 8 or 4.5 bits
    under ``int8`` or ``int4``; under ``auto``, a checkpoint stored in less than that
    (``checkpoint_bytes``: a quantized GGUF file, whose packed codes ``auto`` may keep) counts
    what it stores."""
    with torch.device("meta"):
        model = build_model(args)
    itemsize = torch_dtype(planning_dtype(dtype)).itemsize
    total = sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    if args.tie_word_embeddings:  # the LM head is the embedding, which stays dense
        linear -= args.vocab_size * args.hidden_size
    bits = {"int8": 8.0, "int4": 4.5}.get(quantization)
    if bits is not None:
        return int((total - linear) * itemsize + linear * bits / 8)
    dense = total * itemsize
    if quantization == "auto" and 0 < checkpoint_bytes < dense:
        return checkpoint_bytes
    return dense


def replica_memory(
    args: ModelArgs,
    config: EngineConfig,
    *,
    on_gpu: bool,
    node_memory_bytes: int,
    num_node_replicas: int,
    checkpoint_bytes: int = 0,
) -> ReplicaMemory:
    """One replica's memory as its deployment plans it (``ReplicaMemory``): on a CPU the pool is
    sized by ``size_npu_pool`` from a node's ``node_memory_bytes`` (the memory Ray schedules
    there) shared by ``num_node_replicas`` replicas, with the weights estimated
    (``estimate_weights_bytes``) and not yet loaded; the host tier is ``config``'s share."""
    offload = config.scheduler_config.kv_offload_config
    host = (offload.host_memory_bytes or 0) if offload.is_active else 0
    if on_gpu:
        return ReplicaMemory(None, host, f"host tier {host} bytes (the pool is in HBM)")
    weights = estimate_weights_bytes(args, config.dtype, config.quantization, checkpoint_bytes)
    pool = plan_cpu_pool(args, config, node_memory_bytes, num_node_replicas, weights)
    if offload.is_active and offload.host_memory_ratio > 0:
        host = int(offload.host_memory_ratio * pool.pool_bytes)
    is_set = config.num_npu_blocks is not None or config.npu_kv_memory_bytes is not None
    pinned = None if is_set else pool.pool_bytes
    declared = weights + pool.pool_bytes + host
    return ReplicaMemory(pinned, declared, f"weights {weights} bytes, pool {pool.reason}")


def plan_cpu_pool(
    args: ModelArgs,
    config: EngineConfig,
    memory_bytes: int,
    num_node_replicas: int,
    weights_bytes: int,
) -> PoolSize:
    """The NPU pool of one of ``num_node_replicas`` CPU replicas sharing ``memory_bytes``,
    before any has loaded its ``weights_bytes`` of weights, from the model's config alone."""
    specs = kv_cache_specs(args, config.dtype, config.kv_cache_dtype)
    return size_npu_pool(
        DeviceMemory("cpu", memory_bytes, memory_bytes),
        args,
        specs,
        config,
        weights_bytes=weights_bytes,
        weights_loaded=False,
        num_node_replicas=num_node_replicas,
    )
