"""Every invalid configuration fails at start-up with one sentence naming the option."""

import typing
import warnings

import pytest
from pydantic import ValidationError

from cluster import LLM, KVOffloadConfig, PrefixCacheConfig, SchedulerConfig
from cluster.cli import main
from replicas import config as replica_config
from replicas import dtypes
from replicas.config import ReplicaModelConfig
from replicas.kv.events import Tier
from replicas.kv.retention import policy_names
from replicas.model.kv_format import KV_FORMATS
from replicas.model.native_stack import DECODER_STACKS
from replicas.model.quant import INT4_KERNELS, QUANTIZATIONS


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        (
            {"enabled": True, "host_memory_bytes": 2**20, "host_memory_ratio": 1.0},
            "mutually exclusive",
        ),
        ({"enabled": True, "host_memory_ratio": -1.0}, "host_memory_ratio"),
        ({"enabled": True, "host_memory_bytes": -5}, "host_memory_bytes"),
        ({"enabled": True, "host_memory_bytes": 0}, r"host-memory-gb.*must be positive"),
        ({"host_memory_bytes": 0}, "host_memory_bytes"),
        (
            {"enabled": True, "host_memory_ratio": 1.0, "write_through_threshold": -1},
            "write_through_threshold",
        ),
        ({"enabled": True}, "needs a positive host_memory_bytes or host_memory_ratio"),
    ],
)
def test_offload_config_errors_name_the_option(kwargs, option):
    with pytest.raises(ValidationError, match=option):
        KVOffloadConfig(**kwargs)


def test_capacity_without_enabled_warns_and_stays_off():
    with pytest.warns(UserWarning, match="enabled=True"):
        config = KVOffloadConfig(host_memory_ratio=2.0)
    assert not config.is_active


@pytest.mark.parametrize(
    ("kwargs", "options"),
    [
        ({"write_back": True}, ["--experimental-kv-offload-write-back"]),
        (
            {"write_through_threshold": "immediate"},
            ["--experimental-kv-offload-write-through-threshold"],
        ),
        (
            {"write_back": True, "write_through_threshold": 2, "host_memory_ratio": 0.0},
            ["write_back", "write_through_threshold", "they have no effect"],
        ),
    ],
)
def test_write_options_without_host_capacity_warn(kwargs, options):
    with pytest.warns(UserWarning, match="no host capacity") as caught:
        config = KVOffloadConfig(**kwargs)
    assert not config.is_active
    assert len(caught) == 1 and all(option in str(caught[0].message) for option in options)


@pytest.mark.parametrize("off", [0, None])
def test_a_disabled_write_through_without_capacity_is_silent(off):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert KVOffloadConfig(write_through_threshold=off).write_through_threshold == 0


def test_defaults_are_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = KVOffloadConfig()
    assert not config.is_active and config.write_through_threshold == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KVOffloadConfig(enabled=True, host_memory_ratio=1.0, write_back=True)
        KVOffloadConfig(enabled=True, host_memory_bytes=2**20, write_through_threshold="immediate")


def test_host_tier_needs_prefix_caching():
    with pytest.raises(ValidationError, match="needs prefix caching"):
        SchedulerConfig(
            prefix_cache_config=PrefixCacheConfig(enabled=False),
            kv_offload_config=KVOffloadConfig(enabled=True, host_memory_ratio=1.0),
        )


def test_speculative_ngram_is_off_by_default_and_fits_a_step():
    assert SchedulerConfig().speculative_ngram == 0
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        SchedulerConfig(speculative_ngram=-1)
    with pytest.raises(
        ValidationError, match=r"speculative_ngram \(--speculative-ngram\) must be below"
    ):
        SchedulerConfig(speculative_ngram=8, max_num_batched_tokens=8)
    assert SchedulerConfig(speculative_ngram=7, max_num_batched_tokens=8).speculative_ngram == 7


def test_byte_budget_below_one_block_is_a_startup_error():
    offload = KVOffloadConfig(enabled=True, host_memory_bytes=1000)
    with pytest.raises(ValueError, match=r"host-memory-gb.*less than one KV block"):
        LLM("tiny", scheduler_config=SchedulerConfig(kv_offload_config=offload))


def test_ratio_giving_no_block_is_a_startup_error():
    offload = KVOffloadConfig(enabled=True, host_memory_ratio=0.1)
    with pytest.raises(ValueError, match="host-memory-ratio"):
        LLM("tiny", num_npu_blocks=4, scheduler_config=SchedulerConfig(kv_offload_config=offload))


def test_host_budget_beyond_machine_memory_is_a_startup_error():
    offload = KVOffloadConfig(enabled=True, host_memory_bytes=2**50)
    with pytest.raises(MemoryError, match="GiB of host memory but only"):
        LLM("tiny", scheduler_config=SchedulerConfig(kv_offload_config=offload))


def test_host_capacity_from_ratio_and_bytes():
    ratio = KVOffloadConfig(enabled=True, host_memory_ratio=2.5)
    llm = LLM("tiny", num_npu_blocks=10, scheduler_config=SchedulerConfig(kv_offload_config=ratio))
    assert llm.stats().cache_types["full"].of(Tier.HOST).num_blocks == 25
    block_bytes = llm.engine.runner.block_bytes
    budget = KVOffloadConfig(enabled=True, host_memory_bytes=7 * block_bytes + 5)
    llm = LLM("tiny", num_npu_blocks=10, scheduler_config=SchedulerConfig(kv_offload_config=budget))
    assert llm.stats().cache_types["full"].of(Tier.HOST).num_blocks == 7
    assert llm.engine.transfer.host_bytes == 7 * block_bytes


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (
            [
                "--experimental-kv-offload-host-memory-gb",
                "1",
                "--experimental-kv-offload-host-memory-ratio",
                "1",
            ],
            "mutually exclusive",
        ),
        (["--experimental-kv-offload-host-memory-gb", "0"], "host-memory-gb) must be positive"),
        (["--experimental-kv-offload-host-memory-gb", "-2"], "host-memory-gb) must be positive"),
        (["--experimental-kv-offload-host-memory-ratio", "-1"], "host_memory_ratio"),
        (
            ["--experimental-kv-offload-write-through-threshold", "-1"],
            "--experimental-kv-offload-write-through-threshold",
        ),
        (
            ["--no-enable-prefix-caching", "--experimental-kv-offload-host-memory-ratio", "1"],
            "no-enable-prefix-caching",
        ),
        (["--block-size", "0"], "block_size"),
    ],
)
def test_cli_errors_exit_non_zero_with_one_sentence(argv, option, capsys):
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert option in err and err.startswith("strata: error:") and "\n" not in err


def test_cli_write_options_without_host_capacity_warn(caplog):
    from cluster.cli import build_config, build_parser

    args = build_parser().parse_args(
        [
            "generate",
            "--experimental-kv-offload-write-back",
            "--experimental-kv-offload-write-through-threshold",
            "3",
        ]
    )
    with caplog.at_level("WARNING", logger="cluster.cli"):
        config = build_config(args)
    assert not config.scheduler.kv_offload_config.is_active
    [record] = caplog.records
    assert "--experimental-kv-offload-write-back" in record.message
    assert "--experimental-kv-offload-write-through-threshold" in record.message


def test_cli_ratio_zero_leaves_the_tier_off_silently(caplog):
    from cluster.cli import build_config, build_parser

    args = build_parser().parse_args(
        ["generate", "--experimental-kv-offload-host-memory-ratio", "0"]
    )
    with caplog.at_level("WARNING"):
        config = build_config(args)
    assert not config.scheduler.kv_offload_config.is_active and not caplog.records


def test_options_naming_registered_things_offer_what_is_registered():
    """The config's choices are read from the registries, and a bad one is one sentence."""
    model = ReplicaModelConfig.model_fields
    offered = {
        "retention": KVOffloadConfig.model_fields["retention"],
        "kv_cache_dtype": model["kv_cache_dtype"],
        "quantization": model["quantization"],
        "decoder_stack": model["decoder_stack"],
        "int4_kernel": model["int4_kernel"],
    }
    registered = {
        "retention": policy_names(),
        "kv_cache_dtype": ("auto", *KV_FORMATS),
        "quantization": ("auto", *QUANTIZATIONS),
        "decoder_stack": DECODER_STACKS,
        "int4_kernel": INT4_KERNELS,
    }
    for name, field in offered.items():
        assert typing.get_args(field.annotation) == registered[name], name
    with pytest.raises(
        ValidationError, match=r"retention\n.*Input should be 'fixed' or 'adaptive'"
    ):
        KVOffloadConfig(retention="lru")


def test_the_dtype_table_still_reads_from_the_config_with_a_warning():
    with pytest.warns(DeprecationWarning, match="replicas.dtypes"):
        assert replica_config.TORCH_DTYPES is dtypes.TORCH_DTYPES
    with pytest.warns(DeprecationWarning, match="replicas.dtypes"):
        assert replica_config.dtype_name_of is dtypes.dtype_name_of
