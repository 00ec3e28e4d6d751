"""ClusterConfig from YAML and flags, capacity planning across replicas, CLI start-up errors."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.capacity import host_bytes_total, kv_block_bytes, plan_replica_offload
from cluster.cli import build_config, build_parser, main
from cluster.config import ClusterConfig
from replicas.config import KVOffloadConfig
from replicas.engine import Engine
from replicas.model import load_model_info

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY_BLOCK = 4 * 2 * 16 * 2 * 64 * 4  # layers x (K,V) x tokens x kv heads x head dim x fp32


def parse(*argv: str) -> ClusterConfig:
    return build_config(build_parser().parse_args(["serve", *argv]))


def test_block_bytes_of_the_builtin_model():
    args, _ = load_model_info("tiny")
    assert kv_block_bytes(args, 16, "float32") == TINY_BLOCK
    assert kv_block_bytes(args, 16, "bfloat16") == TINY_BLOCK // 2


@pytest.mark.parametrize(
    ("dp", "budget_blocks", "expected"), [(1, 10, 10), (2, 10, 5), (3, 10, 3), (4, 10, 2)]
)
def test_byte_budget_is_divided_equally_in_whole_blocks(dp, budget_blocks, expected):
    offload = KVOffloadConfig(enabled=True, host_memory_bytes=budget_blocks * TINY_BLOCK + 7)
    share = plan_replica_offload(offload, dp, TINY_BLOCK)
    assert share.host_memory_bytes // TINY_BLOCK == expected
    assert host_bytes_total(offload, dp, 100, TINY_BLOCK) == expected * dp * TINY_BLOCK
    assert host_bytes_total(offload, dp, 100, TINY_BLOCK) <= offload.host_memory_bytes


def test_ratio_is_per_replica_and_grows_with_dp():
    offload = KVOffloadConfig(enabled=True, host_memory_ratio=1.5)
    assert plan_replica_offload(offload, 4, TINY_BLOCK) == offload
    assert host_bytes_total(offload, 1, 101, TINY_BLOCK) == 151 * TINY_BLOCK
    assert host_bytes_total(offload, 4, 101, TINY_BLOCK) == 4 * 151 * TINY_BLOCK


def test_budget_below_one_block_per_replica_fails_at_startup():
    offload = KVOffloadConfig(enabled=True, host_memory_bytes=3 * TINY_BLOCK)
    with pytest.raises(ValueError, match="--experimental-kv-offload-host-memory-gb gives each"):
        plan_replica_offload(offload, 4, TINY_BLOCK)


def test_engine_config_carries_the_replica_share():
    config = ClusterConfig.model_validate(
        {
            "data_parallel_size": 2,
            "model": {"num_npu_blocks": 32},
            "scheduler": {
                "kv_offload_config": {"enabled": True, "host_memory_bytes": 9 * TINY_BLOCK}
            },
        }
    )
    engine = Engine(config.engine_config())
    assert engine.stats().num_host_blocks == 4


def test_every_shipped_config_loads():
    names = sorted(p.name for p in CONFIGS.glob("*.yaml"))
    assert {"default.yaml", "locality.yaml", "ratio.yaml", "dp4.yaml"} <= set(names)
    for name in names:
        config = ClusterConfig.from_yaml(CONFIGS / name)
        config.engine_config()
    default = ClusterConfig.from_yaml(CONFIGS / "default.yaml")
    assert default.data_parallel_size == 2 and default.scheduler.kv_offload_config.is_active
    assert ClusterConfig.from_yaml(CONFIGS / "dp4.yaml").data_parallel_size == 4
    assert ClusterConfig.from_yaml(CONFIGS / "locality.yaml").routing.weights == (0.9, 0.1)


def test_flags_override_the_file():
    config = parse(
        "--config",
        str(CONFIGS / "default.yaml"),
        "-dp",
        "3",
        "--port",
        "9001",
        "--data-parallel-scoring-profile",
        "load",
        "--block-size",
        "32",
    )
    assert config.data_parallel_size == 3 and config.server.port == 9001
    assert config.routing.weights == (0.1, 0.9) and config.model.block_size == 32
    assert config.scheduler.kv_offload_config.host_memory_bytes == 2**30  # kept from the file
    ratio = parse(
        "--config",
        str(CONFIGS / "default.yaml"),
        "--experimental-kv-offload-host-memory-ratio",
        "2",
    )
    assert ratio.scheduler.kv_offload_config.host_memory_ratio == 2.0
    assert ratio.scheduler.kv_offload_config.host_memory_bytes is None
    off = parse(
        "--experimental-kv-offload-host-memory-ratio",
        "1",
        "--experimental-kv-offload-write-through-threshold",
        "0",
    )
    assert off.scheduler.kv_offload_config.write_through_threshold is None


def test_prefix_caching_off_routes_by_load():
    config = parse("--no-enable-prefix-caching")
    assert not config.routing.enable_prefix_caching
    assert config.routing.weights == (0.1, 0.9)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            [
                "--data-parallel-routing-policy",
                "round-robin",
                "--data-parallel-scoring-profile",
                "locality",
            ],
            "--data-parallel-scoring-profile",
        ),
        (["-dp", "0"], "data_parallel_size"),
        (["--config", "/nonexistent.yaml"], "--config /nonexistent.yaml"),
        (
            [
                "--experimental-kv-offload-host-memory-gb",
                "1",
                "--experimental-kv-offload-host-memory-ratio",
                "2",
            ],
            "mutually exclusive",
        ),
        (["--data-parallel-prefix-weight", "0.3"], "--data-parallel-scoring-profile custom"),
    ],
)
def test_serve_rejects_bad_combinations_before_starting(argv, needle, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_unknown_yaml_field_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data_parallel_size: 2\nmodel:\n  modle: tiny\n")
    with pytest.raises(ValidationError, match="modle"):
        ClusterConfig.from_yaml(bad)
