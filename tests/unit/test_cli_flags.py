"""The cluster flags generated from the config fields (``cluster.flags``) keep the names,
groups, defaults and meanings the hand-written flags had."""

import argparse
import warnings

import pytest

from cluster.cli import add_cluster_flags, build_config, build_parser
from cluster.flags import FLAG_GROUPS, config_field, flag_help

# Every flag of ``serve``/``generate``/``cluster.job`` before the flags were generated:
# (group, option strings, kind, metavar as --help shows it).
TODAY_FLAGS = [
    ("deployment", ("--config",), "value", "FILE"),
    ("deployment", ("--data-parallel-size", "-dp"), "value", "N"),
    ("model", (), "positional", None),
    ("model", ("--revision",), "value", None),
    ("model", ("--served-model-name",), "value", "NAME"),
    ("model", ("--seed",), "value", None),
    ("model", ("--device",), "value", None),
    ("model", ("--dtype",), "value", None),
    ("model", ("--quantization",), "value", "{auto,none,int8,int4}"),  # was QUANTIZATION
    ("model", ("--decoder-stack",), "value", "{auto,native,eager}"),
    ("model", ("--int4-kernel",), "value", "{auto,strata,torch}"),
    ("model", ("--torch-compile",), "switch", None),
    ("model", ("--enforce-eager",), "switch", None),
    ("model", ("--max-model-len",), "value", "TOKENS"),
    ("cache", ("--block-size",), "value", "TOKENS"),
    ("cache", ("--num-npu-blocks",), "value", "N"),
    ("cache", ("--npu-kv-memory-gb",), "value", "GIB"),
    ("cache", ("--npu-kv-memory-fraction",), "value", "F"),
    ("cache", ("--kv-cache-dtype",), "value", "{auto,float32,bfloat16,float16,fp8_e4m3,int8}"),
    ("cache", ("--no-enable-prefix-caching",), "switch", None),
    ("cache", ("--prefix-reservation-share",), "value", "SHARE"),
    ("scheduler", ("--max-num-seqs",), "value", "N"),
    ("scheduler", ("--max-num-batched-tokens",), "value", "TOKENS"),
    ("scheduler", ("--speculative-ngram",), "value", "K"),
    ("host tier", ("--experimental-kv-offload-host-memory-gb",), "value", "GIB"),
    ("host tier", ("--experimental-kv-offload-host-memory-ratio",), "value", "R"),
    ("host tier", ("--experimental-kv-offload-write-through-threshold",), "value", "HITS"),
    ("host tier", ("--experimental-kv-offload-write-back",), "switch", None),
    ("host tier", ("--experimental-kv-offload-retention",), "value", "{fixed,adaptive}"),
    ("host tier", ("--experimental-kv-offload-retained-share",), "value", "S"),
    ("host tier", ("--experimental-kv-offload-retained-priority",), "value", "{decay,pin}"),
    ("host tier", ("--experimental-kv-offload-disk-path",), "value", "DIR"),
    ("host tier", ("--experimental-kv-offload-disk-gb",), "value", "GIB"),
    ("routing", ("--data-parallel-routing-policy",), "value", "{scoring,round-robin}"),
    (
        "routing",
        ("--data-parallel-scoring-profile",),
        "value",
        "{balanced,locality,load,custom,ttft}",
    ),
    ("routing", ("--data-parallel-prefix-weight",), "value", "W"),
    ("routing", ("--data-parallel-load-weight",), "value", "W"),
    ("routing", ("--data-parallel-host-hit-weight",), "value", "W"),
    ("routing", ("--data-parallel-disk-hit-weight",), "value", "W"),
    ("server", ("--host",), "value", None),
    ("server", ("--port",), "value", None),
    ("server", ("--api-key",), "repeated", "KEY"),
    *(
        ("scaling", (f"--scaling-{name}",), "value", metavar)
        for name, metavar in (
            ("min-replicas", "N"),
            ("max-replicas", "N"),
            ("target-queue-s", "S"),
            ("downscale-queue-fraction", "F"),
            ("metrics-interval-s", "S"),
            ("look-back-period-s", "S"),
            ("upscale-delay-s", "S"),
            ("downscale-delay-s", "S"),
            ("upscaling-factor", "F"),
            ("downscaling-factor", "F"),
            ("cooldown-s", "S"),
        )
    ),
    ("Ray", ("--address",), "value", None),
    ("Ray", ("--num-cpus",), "value", "CPUS"),
    ("Ray", ("--cpus-per-replica",), "value", "CPUS"),
    ("Ray", ("--gpus-per-replica",), "value", "GPUS"),
]

HOST = ["--experimental-kv-offload-host-memory-ratio", "1"]

# What each flag did before the flags were generated: the config fields that differ from the
# defaults' (``serve`` with no flag), recorded from the hand-written parser.
TODAY_MEANINGS = [
    (["-dp", "3"], {"data_parallel_size": 3}),
    (["--data-parallel-size", "2"], {"data_parallel_size": 2}),
    (["tiny"], {"model.model": "tiny"}),
    (["--revision", "v2"], {"model.revision": "v2"}),
    (["--served-model-name", "m"], {"model.served_model_name": "m"}),
    (["--seed", "7"], {"model.seed": 7}),
    (["--device", "cpu"], {"model.device": "cpu"}),
    (["--dtype", "float32"], {"model.dtype": "float32"}),
    (["--quantization", "int8"], {"model.quantization": "int8"}),
    (["--decoder-stack", "eager"], {"model.decoder_stack": "eager"}),
    (["--int4-kernel", "torch"], {"model.int4_kernel": "torch"}),
    (["--torch-compile"], {"model.torch_compile": True}),
    (["--enforce-eager"], {"model.cuda_graphs": False}),
    (["--max-model-len", "64"], {"model.max_model_len": 64}),
    (["--block-size", "8"], {"model.block_size": 8}),
    (["--num-npu-blocks", "40"], {"model.num_npu_blocks": 40}),
    (["--npu-kv-memory-gb", "0.5"], {"model.npu_kv_memory_bytes": 2**29}),
    (["--npu-kv-memory-fraction", "0.3"], {"model.npu_kv_memory_fraction": 0.3}),
    (["--kv-cache-dtype", "int8"], {"model.kv_cache_dtype": "int8"}),
    (
        ["--no-enable-prefix-caching"],
        {"routing.enable_prefix_caching": False, "scheduler.prefix_cache_config.enabled": False},
    ),
    (
        ["--prefix-reservation-share", "0.25"],
        {"scheduler.prefix_cache_config.reservation_share": 0.25},
    ),
    (["--max-num-seqs", "5"], {"scheduler.max_num_seqs": 5}),
    (["--max-num-batched-tokens", "300"], {"scheduler.max_num_batched_tokens": 300}),
    (["--speculative-ngram", "3"], {"scheduler.speculative_ngram": 3}),
    (
        ["--experimental-kv-offload-host-memory-gb", "0.5"],
        {
            "scheduler.kv_offload_config.enabled": True,
            "scheduler.kv_offload_config.host_memory_bytes": 536870912,
        },
    ),
    (
        ["--experimental-kv-offload-host-memory-ratio", "1"],
        {
            "scheduler.kv_offload_config.enabled": True,
            "scheduler.kv_offload_config.host_memory_ratio": 1.0,
        },
    ),
    (["--experimental-kv-offload-host-memory-ratio", "0"], {}),
    (
        [*HOST, "--experimental-kv-offload-write-through-threshold", "3"],
        {
            "scheduler.kv_offload_config.enabled": True,
            "scheduler.kv_offload_config.host_memory_ratio": 1.0,
            "scheduler.kv_offload_config.write_through_threshold": 3,
        },
    ),
    (
        [*HOST, "--experimental-kv-offload-write-back"],
        {
            "scheduler.kv_offload_config.enabled": True,
            "scheduler.kv_offload_config.host_memory_ratio": 1.0,
            "scheduler.kv_offload_config.write_back": True,
        },
    ),
    (
        [*HOST, "--experimental-kv-offload-retention", "adaptive"],
        {
            "scheduler.kv_offload_config.enabled": True,
            "scheduler.kv_offload_config.host_memory_ratio": 1.0,
            "scheduler.kv_offload_config.retention": "adaptive",
        },
    ),
    (
        [*HOST, "--experimental-kv-offload-retained-share", "0.5"],
        {
            "scheduler.kv_offload_config.enabled": True,
            "scheduler.kv_offload_config.host_memory_ratio": 1.0,
            "scheduler.kv_offload_config.retained_share": 0.5,
        },
    ),
    (
        [*HOST, "--experimental-kv-offload-retained-priority", "pin"],
        {
            "scheduler.kv_offload_config.enabled": True,
            "scheduler.kv_offload_config.host_memory_ratio": 1.0,
            "scheduler.kv_offload_config.retained_priority": "pin",
        },
    ),
    (
        [
            *HOST,
            "--experimental-kv-offload-disk-path",
            "/tmp/d",
            "--experimental-kv-offload-disk-gb",
            "1.5",
        ],
        {
            "scheduler.kv_offload_config.disk_bytes": 1610612736,
            "scheduler.kv_offload_config.disk_path": "/tmp/d",
            "scheduler.kv_offload_config.enabled": True,
            "scheduler.kv_offload_config.host_memory_ratio": 1.0,
        },
    ),
    (["--data-parallel-routing-policy", "round-robin"], {"routing.policy": "round-robin"}),
    (["--data-parallel-scoring-profile", "locality"], {"routing.scoring_profile": "locality"}),
    (
        [
            "--data-parallel-scoring-profile",
            "custom",
            "--data-parallel-prefix-weight",
            "0.3",
            "--data-parallel-load-weight",
            "0.7",
        ],
        {
            "routing.load_weight": 0.7,
            "routing.prefix_weight": 0.3,
            "routing.scoring_profile": "custom",
        },
    ),
    (["--data-parallel-host-hit-weight", "0.5"], {"routing.host_hit_weight": 0.5}),
    (["--data-parallel-disk-hit-weight", "0.4"], {"routing.disk_hit_weight": 0.4}),
    (["--host", "0.0.0.0"], {"server.host": "0.0.0.0"}),
    (["--port", "9000"], {"server.port": 9000}),
    (["--api-key", "a"], {"server.api_key": "a"}),
    (["--api-key", "a", "--api-key", "b"], {"server.api_key": ["a", "b"]}),
    (  # one scaling flag turns the section on, with Ray Serve-like defaults for the rest
        ["--scaling-max-replicas", "3"],
        {
            "scaling.max_replicas": 3,
            "scaling.min_replicas": 1,
            "scaling.target_queue_s": 2.0,
            "scaling.downscale_queue_fraction": 0.25,
            "scaling.metrics_interval_s": 5.0,
            "scaling.look_back_period_s": 30.0,
            "scaling.upscale_delay_s": 30.0,
            "scaling.downscale_delay_s": 600.0,
            "scaling.cooldown_s": 60.0,
        },
    ),
    (
        [
            *("--scaling-min-replicas", "2", "--scaling-max-replicas", "4"),
            *("--scaling-target-queue-s", "0.5", "--scaling-downscale-queue-fraction", "0.1"),
            *("--scaling-metrics-interval-s", "1", "--scaling-look-back-period-s", "10"),
            *("--scaling-upscale-delay-s", "3", "--scaling-downscale-delay-s", "20"),
            *("--scaling-upscaling-factor", "2", "--scaling-downscaling-factor", "0.5"),
            *("--scaling-cooldown-s", "0", "-dp", "2"),
        ],
        {
            "data_parallel_size": 2,
            "scaling.min_replicas": 2,
            "scaling.max_replicas": 4,
            "scaling.target_queue_s": 0.5,
            "scaling.downscale_queue_fraction": 0.1,
            "scaling.metrics_interval_s": 1.0,
            "scaling.look_back_period_s": 10.0,
            "scaling.upscale_delay_s": 3.0,
            "scaling.downscale_delay_s": 20.0,
            "scaling.upscaling_factor": 2.0,
            "scaling.downscaling_factor": 0.5,
            "scaling.cooldown_s": 0.0,
        },
    ),
    (["--address", "auto"], {"ray.address": "auto"}),
    (["--num-cpus", "3"], {"ray.num_cpus": 3.0}),
    (["--cpus-per-replica", "1.5"], {"ray.cpus_per_replica": 1.5}),
    (["--gpus-per-replica", "0.5"], {"ray.gpus_per_replica": 0.5}),
]


def _kind(action: argparse.Action) -> str:
    if not action.option_strings:
        return "positional"
    if action.nargs == 0:
        return "switch"
    return "repeated" if isinstance(action, argparse._AppendAction) else "value"


def _flags(parser: argparse.ArgumentParser) -> list[tuple]:
    return [
        (group.title, tuple(action.option_strings), _kind(action), action.metavar)
        for group in parser._action_groups
        for action in group._group_actions
        if not isinstance(action, argparse._HelpAction)
    ]


def _changed(argv: list[str]) -> dict[str, object]:
    def flat(data: dict, prefix: str = "") -> dict[str, object]:
        out: dict[str, object] = {}
        for key, value in data.items():
            if isinstance(value, dict) and value:
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = flat(build_config(build_parser().parse_args(["serve"])).model_dump())
        got = flat(build_config(build_parser().parse_args(["serve", *argv])).model_dump())
    return {key: got[key] for key in sorted(got) if got[key] != base.get(key)}


def test_the_generated_flags_are_todays_flags():
    parser = argparse.ArgumentParser()
    add_cluster_flags(parser)
    assert _flags(parser) == TODAY_FLAGS
    assert all(action.default is None for action in parser._actions if action.dest != "help")


@pytest.mark.parametrize(("argv", "changed"), TODAY_MEANINGS, ids=lambda v: " ".join(v))
def test_every_flag_keeps_its_meaning(argv, changed):
    assert _changed(argv) == changed


def test_every_flag_appears_in_the_meanings_table():
    given = {option for argv, _ in TODAY_MEANINGS for option in argv if option.startswith("-")}
    options = {
        option for _, names, kind, _ in TODAY_FLAGS if kind != "positional" for option in names
    }
    assert options - given == {"--config"}


@pytest.mark.parametrize("flag", [f for flags in FLAG_GROUPS.values() for f in flags])
def test_each_flag_helps_with_its_fields_description_and_default(flag):
    field = config_field(flag.path)
    text = flag_help(flag.path, field)
    description = (field.description or "").split(": ", 1)[-1]
    assert description[1:40] in text
    assert "Default:" in text


def test_serve_help_lists_every_flag_once_under_its_group():
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    lines = text.splitlines()
    heading = ""
    seen: dict[str, str] = {}
    for line in lines:
        if line and not line.startswith(" ") and line.endswith(":"):
            heading = line[:-1]
        elif line.startswith("  ") and not line.startswith("   "):
            name = line.split()[0].rstrip(",")
            assert name not in seen, name
            seen[name] = heading
    for group, names, _, _ in TODAY_FLAGS:
        assert seen[names[0] if names else "model"] == group, names
