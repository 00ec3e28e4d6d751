"""ClusterConfig from YAML and flags, capacity planning across replicas, CLI start-up errors."""

import warnings
from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.cli import build_config, build_parser, main
from cluster.config import ClusterConfig
from replicas.config import KVOffloadConfig
from replicas.engine.engine import Engine
from replicas.kv.capacity import deployment_host_bytes, kv_cache_specs, plan_replica_offload
from replicas.kv.events import Tier
from replicas.model import load_model_info

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY_BLOCK = 4 * 2 * 16 * 2 * 64 * 4  # layers x (K,V) x tokens x kv heads x head dim x fp32


def parse(*argv: str) -> ClusterConfig:
    return build_config(build_parser().parse_args(["serve", *argv]))


def deployment(dp: int, offload: dict, model: str = "tiny", **model_fields) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "data_parallel_size": dp,
            "model": {"model": model, **model_fields},
            "scheduler": {"kv_offload_config": {"enabled": True, **offload}},
        }
    )


def host_bytes(config: ClusterConfig) -> int:
    args, _ = load_model_info(config.model.model)
    return deployment_host_bytes(args, config.engine_config(), config.data_parallel_size)


def test_block_bytes_of_the_builtin_model():
    args, _ = load_model_info("tiny")
    assert [s.block_bytes(16) for s in kv_cache_specs(args, "float32").values()] == [TINY_BLOCK]
    assert [s.block_bytes(16) for s in kv_cache_specs(args, "bfloat16").values()] == [
        TINY_BLOCK // 2
    ]


@pytest.mark.parametrize(
    ("dp", "budget_blocks", "expected"), [(1, 10, 10), (2, 10, 5), (3, 10, 3), (4, 10, 2)]
)
def test_byte_budget_is_divided_equally_in_whole_blocks(dp, budget_blocks, expected):
    budget = budget_blocks * TINY_BLOCK + 7
    offload = KVOffloadConfig(enabled=True, host_memory_bytes=budget)
    share = plan_replica_offload(offload, dp, TINY_BLOCK)
    assert share.host_memory_bytes // TINY_BLOCK == expected
    config = deployment(dp, {"host_memory_bytes": budget}, num_npu_blocks=100)
    assert host_bytes(config) == expected * dp * TINY_BLOCK <= budget


def test_ratio_is_per_replica_and_grows_with_dp():
    offload = KVOffloadConfig(enabled=True, host_memory_ratio=1.5)
    assert plan_replica_offload(offload, 4, TINY_BLOCK) == offload
    assert host_bytes(deployment(1, {"host_memory_ratio": 1.5}, num_npu_blocks=101)) == (
        151 * TINY_BLOCK
    )
    assert host_bytes(deployment(4, {"host_memory_ratio": 1.5}, num_npu_blocks=101)) == (
        4 * 151 * TINY_BLOCK
    )


def test_deployment_host_bytes_count_every_cache_type_of_a_hybrid_model():
    # tiny-hybrid: 32768-byte global and 65536-byte sliding blocks; 100 global NPU blocks give
    # 21 sliding ones (tests/unit/test_hybrid_cache.py), so a ratio of 2 gives 200 + 42.
    config = deployment(
        2,
        {"host_memory_ratio": 2.0},
        model="tiny-hybrid",
        num_npu_blocks=100,
        max_model_len=1600,
    )
    config.scheduler.max_num_batched_tokens = 256
    assert host_bytes(config) == 2 * (200 * 32768 + 42 * 65536)
    # The byte budget is split by NPU KV bytes: 5 MiB per replica gives 112 + 23 blocks.
    budget = deployment(
        2,
        {"host_memory_bytes": 10 * 2**20},
        model="tiny-hybrid",
        num_npu_blocks=100,
        max_model_len=1600,
    )
    budget.scheduler.max_num_batched_tokens = 256
    assert host_bytes(budget) == 2 * (112 * 32768 + 23 * 65536)


def test_no_host_tier_means_no_host_bytes():
    config = ClusterConfig(data_parallel_size=2)
    args, _ = load_model_info("tiny")
    assert deployment_host_bytes(args, config.engine_config(), 2) == 0


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
    assert engine.stats().cache_types["full"].of(Tier.HOST).num_blocks == 4


def test_every_shipped_config_loads():
    names = sorted(p.name for p in CONFIGS.glob("*.yaml"))
    assert {"default.yaml", "locality.yaml", "ratio.yaml", "dp4.yaml"} <= set(names)
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the shipped files set nothing that is ignored
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
    assert config.model.quantization == "auto"
    assert parse("--quantization", "int4").model.quantization == "int4"
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
    assert off.scheduler.kv_offload_config.write_through_threshold == 0
    assert parse("--speculative-ngram", "4").scheduler.speculative_ngram == 4
    assert parse().scheduler.speculative_ngram == 0


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
        (["--quantization", "fp8"], "model.quantization"),
        (["--prefix-reservation-share", "1.5"], "reservation_share"),
        (["--speculative-ngram", "-1"], "speculative_ngram"),
        (["--speculative-ngram", "4", "--max-num-batched-tokens", "4"], "--speculative-ngram"),
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


def test_yaml_host_budget_of_zero_is_an_error(tmp_path):
    path = tmp_path / "zero.yaml"
    path.write_text(
        "scheduler:\n  kv_offload_config:\n    enabled: true\n    host_memory_bytes: 0\n"
    )
    with pytest.raises(ValidationError, match=r"host_memory_bytes .* must be positive"):
        ClusterConfig.from_yaml(path)


def test_yaml_write_back_without_host_capacity_warns(tmp_path):
    path = tmp_path / "write_back.yaml"
    path.write_text("scheduler:\n  kv_offload_config:\n    write_back: true\n")
    with pytest.warns(UserWarning, match=r"write_back .* no host capacity"):
        config = ClusterConfig.from_yaml(path)
    assert not config.scheduler.kv_offload_config.is_active


def test_config_and_cli_flags_warn_once(tmp_path, caplog):
    path = tmp_path / "write_back.yaml"
    path.write_text("scheduler:\n  kv_offload_config:\n    write_back: true\n")
    with caplog.at_level("WARNING", logger="cluster.cli"):
        parse("--config", str(path), "--experimental-kv-offload-write-back")
    assert len(caplog.records) == 1 and "no host capacity" in caplog.records[0].message


def test_a_capacity_flag_turns_the_tier_on_over_the_file():
    on = parse(
        "--config", str(CONFIGS / "ratio.yaml"), "--experimental-kv-offload-host-memory-gb", "2"
    )
    offload = on.scheduler.kv_offload_config
    assert offload.is_active and offload.host_memory_bytes == 2 * 2**30
    assert offload.host_memory_ratio == 0.0
    off = parse(
        "--config",
        str(CONFIGS / "default.yaml"),
        "--experimental-kv-offload-host-memory-ratio",
        "0",
    )
    assert not off.scheduler.kv_offload_config.is_active


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_flag_says_what_it_does_in_its_group(command):
    parser = build_parser()
    [subparsers] = [a for a in parser._actions if a.dest == "command"]
    sub = subparsers.choices[command]
    titles = {group.title for group in sub._action_groups}
    expected = {"deployment", "model", "cache", "scheduler", "host tier", "routing", "server"}
    assert expected | {"Ray"} <= titles
    assert command == "serve" or "generation" in titles
    for action in sub._actions:
        if action.dest == "help":
            continue
        text = (action.help or "").strip()
        names = {action.dest, *action.option_strings}
        assert text and text not in names and len(text.split()) >= 3, action.option_strings
        assert "Default:" in text or "default" in text.lower(), action.option_strings
    help_text = sub.format_help()
    assert "Default: 2." in help_text  # the write-through threshold, read from KVOffloadConfig


def test_yaml_ttft_profile_and_reservations(tmp_path):
    path = tmp_path / "ttft.yaml"
    path.write_text(
        "scheduler:\n  prefix_cache_config:\n    reservation_share: 0.2\n"
        "routing:\n  scoring_profile: ttft\n  ttft_costs:\n"
        "    prefill_s_per_token: 0.001\n    forfeit_weight: 6\n"
    )
    config = ClusterConfig.from_yaml(path)
    assert config.routing.ttft_costs.forfeit_weight == 6
    assert not config.routing.needs_ttft_costs
    # Without a cost profile the deployment measures one at start-up.
    assert parse("--data-parallel-scoring-profile", "ttft").routing.needs_ttft_costs
    assert config.engine_config().scheduler_config.prefix_cache_config.reservation_share == 0.2
    assert (
        parse(
            "--config", str(path), "--prefix-reservation-share", "0"
        ).scheduler.prefix_cache_config.reservation_share
        == 0
    )
