"""The simulator's hardware profile takes the KV dtype: its bytes per token size the host and
disk tiers in blocks and the copy times, against hand-counted Llama-3-8B figures."""

import json
from dataclasses import asdict

import pytest

from benchmarks.sim.cost_model import CostModel, HardwareProfile
from benchmarks.sim.simulator import SimConfig, Simulator
from replicas.kv.events import Tier

BLOCK = 16
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B, the h200-llama8b profile's model
BF16_TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
INT8_TOKEN_BYTES = LAYERS * 2 * KV_HEADS * (HEAD_DIM * 1 + 2)  # a float16 scale per row
H200 = HardwareProfile.load("h200-llama8b")


@pytest.mark.parametrize(
    ("kv_cache_dtype", "token_bytes"),
    [
        ("auto", BF16_TOKEN_BYTES),
        ("bfloat16", BF16_TOKEN_BYTES),
        ("float32", 2 * BF16_TOKEN_BYTES),
        ("int8", INT8_TOKEN_BYTES),
        ("fp8_e4m3", INT8_TOKEN_BYTES),
    ],
)
def test_bytes_per_token_follow_the_kv_dtype(kv_cache_dtype: str, token_bytes: int):
    profile = H200.with_kv_cache_dtype(kv_cache_dtype)
    assert profile.kv_cache_bytes_per_token == token_bytes
    assert CostModel(profile, BLOCK, 1.0).block_bytes == BLOCK * token_bytes


def simulator(profile: HardwareProfile, **options: object) -> Simulator:
    config = SimConfig(block_size=BLOCK, tokens_per_hash_id=BLOCK, token_scale=1.0, **options)
    return Simulator(config, CostModel(profile, BLOCK, 1.0), [])


def tier_blocks(sim: Simulator, tier: Tier) -> int:
    """Blocks of ``tier`` on the first replica, as its cache manager reports them."""
    return sim.engines[0].kv_cache.views.usage()["full"].tiers[tier].num_blocks


def test_int8_kv_holds_about_twice_the_host_and_disk_blocks_and_halves_each_copy():
    gib = 4.0
    options = {"data_parallel_size": 2, "num_npu_blocks": 64, "host_memory_gb": gib}
    bf16 = simulator(H200.with_kv_cache_dtype("bfloat16"), **options, disk_memory_gb=2 * gib)
    int8 = simulator(H200.with_kv_cache_dtype("int8"), **options, disk_memory_gb=2 * gib)
    share = int(gib * 2**30) // 2
    assert bf16.num_host_blocks == share // (BLOCK * BF16_TOKEN_BYTES) == 1024
    assert int8.num_host_blocks == share // (BLOCK * INT8_TOKEN_BYTES) == 2016
    assert 1.9 <= int8.num_host_blocks / bf16.num_host_blocks <= 2.0
    bf16_disk, int8_disk = (tier_blocks(sim, Tier.DISK) for sim in (bf16, int8))
    assert tier_blocks(bf16, Tier.HOST) == bf16.num_host_blocks
    assert bf16_disk == 2 * share // (BLOCK * BF16_TOKEN_BYTES) == 2048
    assert int8_disk == 2 * share // (BLOCK * INT8_TOKEN_BYTES) == 4032
    bf16_model, int8_model = bf16.cost_model, int8.cost_model
    latency = H200.transfer_latency_s
    for num_blocks in (1, 64, 1000):
        bf16_copy = bf16_model.load_s(num_blocks) - latency
        int8_copy = int8_model.load_s(num_blocks) - latency
        assert int8_copy / bf16_copy == pytest.approx(INT8_TOKEN_BYTES / BF16_TOKEN_BYTES)
        assert 0.5 <= int8_copy / bf16_copy <= 0.51
        disk_ratio = (int8_model.disk_load_s(num_blocks) - H200.disk_latency_s) / (
            bf16_model.disk_load_s(num_blocks) - H200.disk_latency_s
        )
        assert disk_ratio == pytest.approx(INT8_TOKEN_BYTES / BF16_TOKEN_BYTES)


def test_a_profile_without_its_kv_geometry_simulates_only_its_own_dtype():
    data = asdict(H200)
    del data["dtype"], data["kv_head_dim"]
    bare = HardwareProfile(**data)
    assert bare.kv_cache_bytes_per_token == BF16_TOKEN_BYTES
    with pytest.raises(ValueError, match="needs dtype and kv_head_dim"):
        bare.with_kv_cache_dtype("int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        H200.with_kv_cache_dtype("int4")


def test_profiles_round_trip_with_their_kv_dtype(tmp_path):
    path = tmp_path / "h200-int8.json"
    path.write_text(H200.with_kv_cache_dtype("int8").to_json())
    loaded = HardwareProfile.load(path)
    assert loaded.kv_cache_dtype == "int8"
    assert loaded.kv_cache_bytes_per_token == INT8_TOKEN_BYTES
    assert json.loads(path.read_text())["kv_bytes_per_token"] == BF16_TOKEN_BYTES
