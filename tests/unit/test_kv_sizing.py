"""The NPU pool sized from device memory (replicas.kv.sizing): fake memory figures in, blocks,
tokens and max_model_len out, for CPU and GPU shapes."""

import math
from dataclasses import replace

import pydantic
import pytest

from replicas.config import EngineConfig, KVOffloadConfig, SchedulerConfig
from replicas.kv.capacity import kv_cache_specs
from replicas.kv.sizing import (
    CPU_POOL_CONTEXTS,
    DeviceMemory,
    activation_reserve_bytes,
    estimate_weights_bytes,
    plan_cpu_pool,
    replica_memory,
    size_npu_pool,
)
from replicas.model import ModelArgs
from replicas.model.builtin import BUILTIN_MODEL_ARGS

GB, GIB = 10**9, 2**30


def llama_8b(max_positions: int = 131072) -> ModelArgs:
    """Llama-3-8B's shape (the built-in ``llama3-8b-shape``), its context set."""
    return replace(BUILTIN_MODEL_ARGS["llama3-8b-shape"](), max_position_embeddings=max_positions)


def smollm2_1_7b() -> ModelArgs:
    return ModelArgs(
        vocab_size=49152,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=24,
        num_heads=32,
        num_kv_heads=32,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )


def size(memory, args, config, **kwargs):
    specs = kv_cache_specs(args, config.dtype, config.kv_cache_dtype)
    return size_npu_pool(memory, args, specs, config, **kwargs)


def test_an_8b_shape_on_a_141_gb_gpu_gets_hundreds_of_thousands_of_tokens():
    args = llama_8b()
    config = EngineConfig(dtype="bfloat16")
    weights = estimate_weights_bytes(args, "bfloat16", "none")
    assert 15 * GB < weights < 17 * GB
    free = 141 * GB - weights - GIB  # after the weights and the CUDA context
    pool = size(DeviceMemory("cuda", 141 * GB, free), args, config, weights_bytes=weights)
    kv_per_token = 32 * 2 * 8 * 128 * 2
    reserve = activation_reserve_bytes(args, 2, config, "cuda")
    expected = int(0.9 * (free - reserve) // (16 * kv_per_token))
    assert pool.num_blocks == expected and pool.num_tokens == 16 * expected
    assert 500_000 < pool.num_tokens < 1_000_000
    assert pool.max_model_len == 131072  # the model's own context: the pool holds it
    assert "cuda memory" in pool.reason and "npu_kv_memory_fraction 0.9" in pool.reason


def test_a_gpu_pool_holds_at_most_max_num_seqs_full_contexts():
    args = llama_8b(max_positions=8192)
    config = EngineConfig(dtype="bfloat16", scheduler_config=SchedulerConfig(max_num_seqs=8))
    pool = size(DeviceMemory("cuda", 141 * GB, 120 * GB), args, config, weights_bytes=16 * GB)
    assert pool.num_tokens == 8 * 8192 and pool.max_model_len == 8192
    assert "capped at 8 contexts of 8192 tokens" in pool.reason


def test_a_1_7b_model_on_24_gib_of_ram_serves_4000_token_prompts():
    args = smollm2_1_7b()
    config = EngineConfig(dtype="float32")
    weights = estimate_weights_bytes(args, "float32", "none")
    free = 21 * GIB - weights  # MemAvailable once the float32 weights are loaded
    pool = size(DeviceMemory("cpu", 24 * GIB, free), args, config, weights_bytes=weights)
    kv_per_token = 24 * 2 * 32 * 64 * 4
    reserve = activation_reserve_bytes(args, 4, config, "cpu")
    assert pool.num_blocks == int(0.5 * (free - reserve) // (16 * kv_per_token))
    assert pool.num_tokens >= 4000 and pool.max_model_len == 8192


def test_two_cpu_replicas_of_a_quantized_1_7b_file_each_serve_4000_tokens():
    """A deployment sizes its CPU replicas before they start, from Ray's memory of the node
    (16 GB of a 24 GiB machine), the weights estimated from the file: a 1 GB Q4_K_M GGUF."""
    args = smollm2_1_7b()
    config = EngineConfig(dtype="auto", quantization="auto")
    weights = estimate_weights_bytes(args, "auto", "auto", checkpoint_bytes=GB)
    assert weights == GB
    pool = plan_cpu_pool(args, config, 16 * GB, 2, weights)
    reserve = activation_reserve_bytes(args, 4, config, "cpu")
    per_block = 16 * 24 * 2 * 32 * 64 * 4  # float32: the widest dtype auto may choose
    assert pool.num_blocks == int(0.5 * (16 * GB - 2 * GB - reserve) / 2 // per_block)
    assert pool.num_tokens >= 4000


def test_a_cpu_pool_shares_the_ram_with_the_host_tier_and_the_other_replicas():
    args = replace(smollm2_1_7b(), max_position_embeddings=2**20)  # no cap: memory decides
    memory = DeviceMemory("cpu", 64 * GIB, 40 * GIB)
    base = EngineConfig(dtype="bfloat16")
    alone = size(memory, args, base, weights_bytes=0, num_node_replicas=1)
    shared = size(memory, args, base, weights_bytes=0, num_node_replicas=2)
    assert shared.num_blocks == pytest.approx(alone.num_blocks / 2, abs=1)
    host = KVOffloadConfig(enabled=True, host_memory_bytes=10 * GIB)
    with_host = base.model_copy(
        update={"scheduler_config": SchedulerConfig(kv_offload_config=host)}
    )
    hosted = size(memory, args, with_host, weights_bytes=0, num_node_replicas=2)
    assert hosted.num_blocks < shared.num_blocks
    assert "host tier 20.00 GiB" in hosted.reason
    ratio = KVOffloadConfig(enabled=True, host_memory_ratio=1.0)
    with_ratio = base.model_copy(
        update={"scheduler_config": SchedulerConfig(kv_offload_config=ratio)}
    )
    halved = size(memory, args, with_ratio, weights_bytes=0)
    assert halved.num_blocks == pytest.approx(alone.num_blocks / 2, abs=1)


def test_the_built_in_tiny_model_on_a_cpu_holds_four_contexts():
    """The cap keeps a small model's pool small: the tiny model's 256 MiB, not gigabytes."""
    args = BUILTIN_MODEL_ARGS["tiny"]()
    pool = size(DeviceMemory("cpu", 24 * GIB, 20 * GIB), args, EngineConfig(), weights_bytes=0)
    assert pool.num_tokens == CPU_POOL_CONTEXTS * 16384 and pool.max_model_len == 16384
    assert pool.pool_bytes == 256 * 2**20
    shorter = size(
        DeviceMemory("cpu", 24 * GIB, 20 * GIB),
        args,
        EngineConfig(max_model_len=1000),
        weights_bytes=0,
    )
    assert shorter.num_blocks == math.ceil(CPU_POOL_CONTEXTS * 1000 / 16)


def test_the_fraction_scales_the_pool():
    args = replace(smollm2_1_7b(), max_position_embeddings=2**20)
    memory = DeviceMemory("cpu", 64 * GIB, 40 * GIB)
    low = size(memory, args, EngineConfig(npu_kv_memory_fraction=0.2), weights_bytes=0)
    high = size(memory, args, EngineConfig(npu_kv_memory_fraction=0.4), weights_bytes=0)
    assert high.num_blocks == pytest.approx(2 * low.num_blocks, abs=1)


def test_explicit_blocks_and_bytes_win():
    args = llama_8b()
    memory = DeviceMemory("cuda", 141 * GB, 120 * GB)
    blocks = size(memory, args, EngineConfig(num_npu_blocks=10), weights_bytes=0)
    assert (blocks.num_blocks, blocks.max_model_len) == (10, 160)
    assert blocks.reason.startswith("num_npu_blocks=10 (set)")
    per_block = 16 * 32 * 2 * 8 * 128 * 4  # float32: dtype auto plans with the widest
    config = EngineConfig(npu_kv_memory_bytes=100 * per_block + 5)
    by_bytes = size(memory, args, config, weights_bytes=0)
    assert by_bytes.num_blocks == 100 and "npu_kv_memory_bytes=" in by_bytes.reason


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5, float("nan")])
def test_a_fraction_outside_zero_to_one_is_rejected_naming_the_option(fraction):
    with pytest.raises(pydantic.ValidationError, match="npu_kv_memory_fraction"):
        EngineConfig(npu_kv_memory_fraction=fraction)


def test_a_device_without_room_for_one_block_is_a_startup_error():
    args = llama_8b()
    memory = DeviceMemory("cuda", 24 * GB, 1 * GB)
    with pytest.raises(ValueError, match=r"holds no block.*npu_kv_memory_bytes or num_npu_blocks"):
        size(memory, args, EngineConfig(dtype="bfloat16"), weights_bytes=16 * GB)


def test_an_explicit_max_model_len_beyond_the_pool_is_a_startup_error():
    args = llama_8b()
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds the NPU KV pool"):
        size(
            DeviceMemory("cuda", 1, 1),
            args,
            EngineConfig(num_npu_blocks=10, max_model_len=4096),
            weights_bytes=0,
        )


def test_replica_memory_declares_what_a_cpu_replica_holds():
    args = BUILTIN_MODEL_ARGS["tiny"]()
    host = KVOffloadConfig(enabled=True, host_memory_bytes=2**20)
    config = EngineConfig(scheduler_config=SchedulerConfig(kv_offload_config=host))
    weights = estimate_weights_bytes(args, "auto", "auto")
    cpu = replica_memory(args, config, on_gpu=False, node_memory_bytes=16 * GB, num_node_replicas=2)
    assert cpu.npu_kv_memory_bytes == 256 * 2**20
    assert cpu.declared_bytes == weights + 256 * 2**20 + 2**20
    assert cpu.declared_bytes < 300 * 2**20  # the shared test Ray instance places it
    gpu = replica_memory(args, config, on_gpu=True, node_memory_bytes=16 * GB, num_node_replicas=2)
    assert (gpu.npu_kv_memory_bytes, gpu.declared_bytes) == (None, 2**20)
    pinned = replica_memory(
        args,
        config.model_copy(update={"num_npu_blocks": 8}),
        on_gpu=False,
        node_memory_bytes=16 * GB,
        num_node_replicas=1,
    )
    assert pinned.npu_kv_memory_bytes is None  # the config sets the pool; nothing to pin
    assert pinned.declared_bytes == weights + 8 * 65536 + 2**20


def test_weights_estimates_follow_dtype_and_quantization():
    args = BUILTIN_MODEL_ARGS["tiny"]()
    float32 = estimate_weights_bytes(args, "float32", "none")
    assert estimate_weights_bytes(args, "bfloat16", "none") == float32 // 2
    assert estimate_weights_bytes(args, "auto", "none") == float32  # auto plans at float32
    int8 = estimate_weights_bytes(args, "float32", "int8")
    int4 = estimate_weights_bytes(args, "float32", "int4")
    embedding = args.vocab_size * args.hidden_size * 4
    assert embedding < int4 < int8 < float32
    # a float checkpoint bigger than the dense estimate does not raise it
    assert estimate_weights_bytes(args, "auto", "auto", checkpoint_bytes=10 * float32) == float32
