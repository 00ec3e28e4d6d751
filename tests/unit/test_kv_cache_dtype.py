"""``kv_cache_dtype`` on the real engine: greedy outputs with caching on equal those with caching
off (same KV dtype) on NPU hits, host reloads and disk reloads; the tiers copy the quantized
bytes as they are; capacity follows the bytes per block; the disk fingerprint keys on the KV
dtype."""

import random

import pytest
import torch

from cluster import KVOffloadConfig, PrefixCacheConfig, SchedulerConfig
from replicas.config import EngineConfig
from replicas.engine.engine import Engine
from replicas.kv.capacity import kv_cache_specs, plan_cache
from replicas.kv.events import Tier
from replicas.kv.host_memory import HUGEPAGE_BYTES
from replicas.model import load_model_info
from tests.unit.engine_runs import run

KV_DTYPES = ["int8", "fp8_e4m3", "bfloat16"]
PREFIX_BLOCKS = 12


def prefix_prompts(seed: int, num: int = 2) -> list[list[int]]:
    """``num`` prompts sharing a 192-token prefix (12 blocks), each with its own tail."""
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(16 * PREFIX_BLOCKS)]
    return [[*prefix, 3 + i, 5 * i] for i in range(num)]


def make_engine(kv_cache_dtype: str, model: str = "tiny", **kw) -> Engine:
    scheduler = kw.pop("scheduler_config", SchedulerConfig())
    return Engine(
        EngineConfig(
            model=model,
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            num_npu_blocks=kw.pop("num_npu_blocks", 64),
            scheduler_config=scheduler,
            **kw,
        )
    )


def cold_engine(kv_cache_dtype: str, model: str = "tiny") -> Engine:
    """The reference: the same model and KV dtype with caching off."""
    off = SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False))
    return make_engine(kv_cache_dtype, model, scheduler_config=off)


def offload(**kw) -> SchedulerConfig:
    return SchedulerConfig(kv_offload_config=KVOffloadConfig(enabled=True, **kw))


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_npu_hits_give_the_cold_output(kv_cache_dtype, model):
    cold, warm = cold_engine(kv_cache_dtype, model), make_engine(kv_cache_dtype, model)
    assert warm.runner.kv_caches["full"].dtype == warm.runner.specs["full"].storage_dtype
    first, second = prefix_prompts(1)
    run(warm, first, "first")
    output = run(warm, second, "second")
    assert output.num_cached_tokens_in(Tier.NPU) == 16 * PREFIX_BLOCKS
    assert output.token_ids == run(cold, second).token_ids


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_host_reloads_give_the_cold_output_and_copy_the_bytes(kv_cache_dtype):
    cold = cold_engine(kv_cache_dtype)
    warm = make_engine(
        kv_cache_dtype,
        num_npu_blocks=20,
        scheduler_config=offload(host_memory_ratio=4.0, write_through_threshold="immediate"),
    )
    first, second = prefix_prompts(2)
    run(warm, first, "first")
    rng = random.Random(3)
    for i in range(3):  # unrelated traffic pushes the prefix out of the NPU tier
        run(warm, [rng.randrange(256) for _ in range(200)] + [i], f"other{i}")
    output = run(warm, second, "second")
    assert output.num_cached_tokens_in(Tier.HOST) > 0
    assert output.num_cached_tokens == 16 * PREFIX_BLOCKS
    assert output.token_ids == run(cold, second).token_ids
    # The reloaded blocks hold the bytes the first request wrote (no conversion on the way).
    manager = warm.kv_cache
    host = warm.transfer.host_caches["full"]
    assert host.dtype == warm.runner.kv_caches["full"].dtype
    for block_hash in manager.host.cached_hashes():
        npu_id = manager.npu.lookup(block_hash)
        if npu_id is not None:
            host_id = manager.host.lookup(block_hash)
            assert torch.equal(warm.runner.kv_caches["full"][npu_id], host[host_id])
    assert warm.stats().transfer.bytes_loaded % warm.runner.block_bytes == 0


def disk_engine(path, kv_cache_dtype: str) -> Engine:
    return make_engine(
        kv_cache_dtype,
        num_npu_blocks=48,
        scheduler_config=offload(
            host_memory_ratio=2.0,
            write_through_threshold="immediate",
            disk_path=str(path),
            disk_bytes=2**24,
        ),
    )


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_disk_reloads_give_the_cold_output(tmp_path, kv_cache_dtype):
    first, second = prefix_prompts(4)
    writer = disk_engine(tmp_path, kv_cache_dtype)
    run(writer, first)
    writer.close()
    assert writer.backing["disk"]["full"].stats().num_cached >= PREFIX_BLOCKS
    restarted = disk_engine(tmp_path, kv_cache_dtype)
    output = run(restarted, second)
    assert output.num_cached_tokens_in(Tier.HOST) == 16 * PREFIX_BLOCKS  # disk counts as host
    assert restarted.stats().cache.disk_hits == 16 * PREFIX_BLOCKS
    assert output.token_ids == run(cold_engine(kv_cache_dtype), second).token_ids
    restarted.close()


def test_another_kv_dtype_never_reads_the_disk_blocks(tmp_path):
    first, second = prefix_prompts(5)
    writer = disk_engine(tmp_path, "int8")
    run(writer, first)
    writer.close()
    other = disk_engine(tmp_path, "fp8_e4m3")  # the same block shape and bytes per block
    output = run(other, second)
    assert output.num_cached_tokens == 0
    assert other.stats().cache.disk_blocks_loaded == 0
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2
    other.close()
    again = disk_engine(tmp_path, "int8")
    assert run(again, second).num_cached_tokens == 16 * PREFIX_BLOCKS
    again.close()


def test_a_host_budget_holds_more_blocks_by_the_bytes_per_block():
    """int8 rows are head_dim + 2 bytes, bfloat16 rows 2 * head_dim: a GiB budget holds
    2 * head_dim / (head_dim + 2) times the blocks (whole blocks, from the bytes); head_dim 64
    is the least gain of the shipped models."""
    model = "tiny"
    args, _ = load_model_info(model, None)
    budget = 2**30
    blocks = {}
    for kv_cache_dtype in ("bfloat16", "int8", "fp8_e4m3"):
        config = EngineConfig(
            model=model,
            dtype="bfloat16",
            kv_cache_dtype=kv_cache_dtype,
            num_npu_blocks=64,
            scheduler_config=offload(host_memory_bytes=budget),
        )
        specs = kv_cache_specs(args, config.dtype, kv_cache_dtype)
        plan = plan_cache(specs, config, args.max_position_embeddings)
        row_bytes = args.head_dim + 2 if kv_cache_dtype != "bfloat16" else 2 * args.head_dim
        block_bytes = args.num_layers * 2 * 16 * args.num_kv_heads * row_bytes
        assert plan.block_bytes == {"full": block_bytes}
        assert plan.num_host_blocks == {"full": budget // block_bytes}
        blocks[kv_cache_dtype] = plan.num_host_blocks["full"]
    ratio = blocks["int8"] / blocks["bfloat16"]
    assert ratio == pytest.approx(2 * args.head_dim / (args.head_dim + 2), rel=1e-3)
    assert ratio >= 1.9
    assert blocks["fp8_e4m3"] == blocks["int8"]


def test_the_start_up_log_states_the_kv_dtype_and_block_bytes(caplog):
    with caplog.at_level("INFO", logger="replicas.kv.capacity"):
        engine = make_engine("int8", num_npu_blocks=8)
    assert engine.config.kv_cache_dtype == "int8"
    block_bytes = 4 * 2 * 16 * 2 * (64 + 2)  # tiny: 4 layers, 2 KV heads, head_dim 64
    assert engine.runner.block_bytes == block_bytes
    assert f"KV dtype int8): full: 8 NPU + 0 host blocks of {block_bytes} bytes" in caplog.text
    assert make_engine("auto", num_npu_blocks=8).config.kv_cache_dtype == "float32"


def test_a_cpu_kv_cache_past_a_hugepage_lies_on_hugepage_aligned_memory():
    engine = make_engine("auto")  # 64 blocks of 64 KiB of float32
    cache = engine.runner.kv_caches["full"]
    assert cache.nbytes >= HUGEPAGE_BYTES and cache.data_ptr() % HUGEPAGE_BYTES == 0
    assert cache.count_nonzero() == 0
