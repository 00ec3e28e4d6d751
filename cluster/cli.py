"""The ``strata`` command line: ``serve`` (HTTP API on Ray) and ``generate`` (offline).

Flags override the YAML config (``--config``); only flags given on the command line override.
Every invalid combination exits with status 2 and one sentence, before anything starts.
"""

import argparse
import logging
import math
import sys
import time
import warnings
from typing import Any

from pydantic import BaseModel, ValidationError

from cluster.config import ClusterConfig, ModelConfig, RayConfig, ServerConfig
from replicas.config import (
    DISK_GB_OPTION,
    DISK_PATH_OPTION,
    HOST_GB_OPTION,
    HOST_RATIO_OPTION,
    RETAINED_SHARE_OPTION,
    RETENTION_OPTION,
    SPECULATIVE_NGRAM_OPTION,
    WRITE_BACK_OPTION,
    WRITE_THROUGH_OPTION,
    KVOffloadConfig,
    PrefixCacheConfig,
    SchedulerConfig,
)
from replicas.model.resolve import DEFAULT_MODEL
from router.config import RoutingConfig

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = [
    "You are Strata's demo assistant. Answer briefly and precisely. Question: what is a KV cache?",
    "You are Strata's demo assistant. Answer briefly and precisely. Question: why reuse prefixes?",
    "You are Strata's demo assistant. Answer briefly and precisely. Question: what is a block?",
]

FLAG_GROUPS = ("deployment", "model", "cache", "scheduler", "host tier", "routing", "server", "Ray")
"""The argument groups of ``serve`` and ``generate`` (``generate`` adds ``generation``)."""


def field_help(
    model: type[BaseModel], name: str, text: str | None = None, default: str | None = None
) -> str:
    """Help of a flag that sets ``model``'s field ``name``: ``text`` (else the field's
    description, less a leading ``--flag:``) and ``default`` (else the field's), so help
    follows the config."""
    field = model.model_fields[name]
    description = text or field.description or ""
    if description.startswith("--"):
        description = description.split(": ", 1)[-1]
        description = description[:1].upper() + description[1:]
    if default is None:
        default = str(field.get_default(call_default_factory=True))
    return f"{description} Default: {default}.".replace("%", "%%")


def gib(text: str) -> int:
    """A GiB amount on the command line, in bytes."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return int(value * 2**30)


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """The flags shared by ``serve``, ``generate`` and ``python -m cluster.job``, in groups."""
    group = {title: parser.add_argument_group(title) for title in FLAG_GROUPS}

    a = group["deployment"].add_argument
    a(
        "--config",
        metavar="FILE",
        help="YAML ClusterConfig (see configs/); its values replace the defaults below and "
        "flags given override them. Default: none.",
    )
    a(
        "--data-parallel-size",
        "-dp",
        type=int,
        metavar="N",
        help=field_help(ClusterConfig, "data_parallel_size"),
    )

    a = group["model"].add_argument
    a(
        "model",
        nargs="?",
        default=None,
        help=field_help(ModelConfig, "model", default=f"the config's model, else {DEFAULT_MODEL}"),
    )
    a("--revision", help=field_help(ModelConfig, "revision"))
    a("--served-model-name", metavar="NAME", help=field_help(ModelConfig, "served_model_name"))
    a("--seed", type=int, help=field_help(ModelConfig, "seed"))
    a("--device", help=field_help(ModelConfig, "device"))
    a("--dtype", help=field_help(ModelConfig, "dtype"))
    a("--quantization", help=field_help(ModelConfig, "quantization"))
    a("--max-model-len", type=int, metavar="TOKENS", help=field_help(ModelConfig, "max_model_len"))

    a = group["cache"].add_argument
    a("--block-size", type=int, metavar="TOKENS", help=field_help(ModelConfig, "block_size"))
    a("--num-npu-blocks", type=int, metavar="N", help=field_help(ModelConfig, "num_npu_blocks"))
    a(
        "--no-enable-prefix-caching",
        action="store_true",
        default=None,
        help=field_help(
            PrefixCacheConfig,
            "enabled",
            "Turn prefix caching off: never reuse cached KV of matching prompt prefixes.",
            default="prefix caching on",
        ),
    )
    a(
        "--prefix-reservation-share",
        type=float,
        metavar="SHARE",
        help=field_help(PrefixCacheConfig, "reservation_share"),
    )

    a = group["scheduler"].add_argument
    a("--max-num-seqs", type=int, metavar="N", help=field_help(SchedulerConfig, "max_num_seqs"))
    a(
        "--max-num-batched-tokens",
        type=int,
        metavar="TOKENS",
        help=field_help(SchedulerConfig, "max_num_batched_tokens"),
    )
    a(
        SPECULATIVE_NGRAM_OPTION,
        type=int,
        metavar="K",
        help=field_help(SchedulerConfig, "speculative_ngram"),
    )

    a = group["host tier"].add_argument
    a(
        HOST_GB_OPTION,
        type=gib,
        dest="host_memory_bytes",
        metavar="GIB",
        help=field_help(
            KVOffloadConfig,
            "host_memory_bytes",
            "Host KV budget in GiB (positive) for the whole deployment, divided equally among "
            "the replicas; turns the host tier on. Exclusive with the ratio.",
            default="none",
        ),
    )
    a(
        HOST_RATIO_OPTION,
        type=float,
        dest="host_memory_ratio",
        metavar="R",
        help=field_help(
            KVOffloadConfig,
            "host_memory_ratio",
            "Host blocks per NPU block, per replica and cache type (floor); a positive value "
            "turns the host tier on, 0 leaves it off. Exclusive with the GiB budget.",
        ),
    )
    a(
        WRITE_THROUGH_OPTION,
        type=int,
        dest="write_through_threshold",
        metavar="HITS",
        help=field_help(
            KVOffloadConfig,
            "write_through_threshold",
            "Copy an NPU block to host when its hit count reaches this; 0 disables "
            "write-through. Needs a host capacity.",
        ),
    )
    a(
        WRITE_BACK_OPTION,
        action="store_true",
        default=None,
        dest="write_back",
        help=field_help(
            KVOffloadConfig,
            "write_back",
            "Copy NPU-only cached blocks to host when NPU pressure evicts them. Needs a host "
            "capacity.",
        ),
    )
    a(
        RETENTION_OPTION,
        choices=("fixed", "adaptive"),
        default=None,
        dest="retention",
        help=field_help(
            KVOffloadConfig,
            "retention",
            "fixed: write-through promotion and write-back as set; adaptive: every store made "
            "when the NPU tier evicts a block: one that reached the write-through threshold is "
            "stored then, any other when the reuse observed for its kind pays for the copy. "
            "Needs a host capacity; exclusive with write-back.",
        ),
    )
    a(
        RETAINED_SHARE_OPTION,
        type=float,
        default=None,
        dest="retained_share",
        metavar="S",
        help=field_help(
            KVOffloadConfig,
            "retained_share",
            "Share (0 to 1) of each host and disk tier that prefixes kept for a prompt-cache "
            "lifetime (prompt_cache_options.ttl, prompt_cache_retention, "
            "prompt_cache_breakpoint) may hold ahead of ordinary blocks.",
        ),
    )
    a(
        DISK_PATH_OPTION,
        dest="disk_path",
        metavar="DIR",
        help=field_help(
            KVOffloadConfig,
            "disk_path",
            "Directory of the disk KV tier behind the host tier: blocks leave host for it by "
            "the host tier's rules, survive restarts and are read by every replica of the "
            "node. Needs a host capacity and the disk budget.",
            default="none",
        ),
    )
    a(
        DISK_GB_OPTION,
        type=gib,
        dest="disk_bytes",
        metavar="GIB",
        help=field_help(
            KVOffloadConfig,
            "disk_bytes",
            "Disk KV budget in GiB (positive) for the whole deployment, divided equally "
            "among the replicas; needs the disk path.",
            default="none",
        ),
    )

    a = group["routing"].add_argument
    a(
        "--data-parallel-routing-policy",
        choices=["scoring", "round-robin"],
        dest="policy",
        help=field_help(RoutingConfig, "policy"),
    )
    a(
        "--data-parallel-scoring-profile",
        dest="profile",
        choices=["balanced", "locality", "load", "custom", "ttft"],
        help=field_help(RoutingConfig, "scoring_profile"),
    )
    a(
        "--data-parallel-prefix-weight",
        type=float,
        dest="prefix_weight",
        metavar="W",
        help=field_help(RoutingConfig, "prefix_weight"),
    )
    a(
        "--data-parallel-load-weight",
        type=float,
        dest="load_weight",
        metavar="W",
        help=field_help(RoutingConfig, "load_weight"),
    )
    a(
        "--data-parallel-host-hit-weight",
        type=float,
        dest="host_hit_weight",
        metavar="W",
        help=field_help(RoutingConfig, "host_hit_weight"),
    )
    a(
        "--data-parallel-disk-hit-weight",
        type=float,
        dest="disk_hit_weight",
        metavar="W",
        help=field_help(RoutingConfig, "disk_hit_weight"),
    )

    a = group["server"].add_argument
    a("--host", help=field_help(ServerConfig, "host"))
    a("--port", type=int, help=field_help(ServerConfig, "port"))
    a(
        "--api-key",
        metavar="KEY",
        action="append",
        help=field_help(
            ServerConfig,
            "api_key",
            "Bearer key required on every endpoint but /health (and /metrics when "
            "metrics_public); repeat the flag for several keys (stored responses are kept "
            "per key).",
        ),
    )

    a = group["Ray"].add_argument
    a("--address", help=field_help(RayConfig, "address"))
    a("--num-cpus", type=float, metavar="CPUS", help=field_help(RayConfig, "num_cpus"))
    a(
        "--cpus-per-replica",
        type=float,
        metavar="CPUS",
        help=field_help(RayConfig, "cpus_per_replica"),
    )
    a(
        "--gpus-per-replica",
        type=float,
        metavar="GPUS",
        help=field_help(RayConfig, "gpus_per_replica"),
    )


def build_config(args: argparse.Namespace) -> ClusterConfig:
    """The YAML file, overridden by the flags given; raises ValueError/ValidationError. The
    config's warnings (options that cannot take effect) are logged once each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = _build_config(args)
    for message in dict.fromkeys(str(w.message) for w in caught):
        logger.warning("%s", message)
    return config


def _build_config(args: argparse.Namespace) -> ClusterConfig:
    data: dict[str, Any] = {}
    if args.config:
        data = ClusterConfig.from_yaml(args.config).model_dump(exclude_unset=True)

    def put(path: str, value: object) -> None:
        if value is None:
            return
        node = data
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    put("data_parallel_size", args.data_parallel_size)
    if args.model is None and "model" not in data.get("model", {}):
        args.model = DEFAULT_MODEL
    for field in (
        "model",
        "revision",
        "served_model_name",
        "seed",
        "device",
        "dtype",
        "quantization",
        "block_size",
        "num_npu_blocks",
        "max_model_len",
    ):
        put(f"model.{field}", getattr(args, field))
    put("scheduler.max_num_seqs", args.max_num_seqs)
    put("scheduler.max_num_batched_tokens", args.max_num_batched_tokens)
    put("scheduler.speculative_ngram", args.speculative_ngram)
    if args.no_enable_prefix_caching:
        put("scheduler.prefix_cache_config.enabled", False)
    put("scheduler.prefix_cache_config.reservation_share", args.prefix_reservation_share)
    _put_offload(args, data)
    put("routing.policy", args.policy)
    put("routing.scoring_profile", args.profile)
    put("routing.prefix_weight", args.prefix_weight)
    put("routing.load_weight", args.load_weight)
    put("routing.host_hit_weight", args.host_hit_weight)
    put("routing.disk_hit_weight", args.disk_hit_weight)
    put("server.host", args.host)
    put("server.port", args.port)
    if args.api_key is not None:  # one flag: one key, as before; several: a list
        put("server.api_key", args.api_key[0] if len(args.api_key) == 1 else args.api_key)
    put("ray.address", args.address)
    put("ray.num_cpus", args.num_cpus)
    put("ray.cpus_per_replica", args.cpus_per_replica)
    put("ray.gpus_per_replica", args.gpus_per_replica)
    return ClusterConfig.model_validate(data)


def _put_offload(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """A capacity flag replaces the file's capacity and turns the host tier on (a ratio of 0
    leaves it off); ``KVOffloadConfig`` checks every value."""
    offload = data.setdefault("scheduler", {}).setdefault("kv_offload_config", {})
    num_bytes, ratio = args.host_memory_bytes, args.host_memory_ratio
    if num_bytes is not None or ratio is not None:
        offload.update(
            enabled=num_bytes is not None or ratio != 0,
            host_memory_bytes=num_bytes,
            host_memory_ratio=ratio or 0.0,
        )
    if args.write_through_threshold is not None:
        offload["write_through_threshold"] = args.write_through_threshold or None
    if args.write_back:
        offload["write_back"] = True
    if args.retention is not None:
        offload["retention"] = args.retention
    if args.retained_share is not None:
        offload["retained_share"] = args.retained_share
    if args.disk_path is not None:
        offload["disk_path"] = args.disk_path
    if args.disk_bytes is not None:
        offload["disk_bytes"] = args.disk_bytes


def _serve(args: argparse.Namespace) -> int:
    from cluster.server import serve

    serve(build_config(args))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from cluster.llm import LLM
    from replicas.sampling_params import SamplingParams

    config = build_config(args)
    prompts = args.prompt or DEFAULT_PROMPTS
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed
    )
    with LLM.from_config(config) as llm:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        for output in outputs:
            print(
                f"--- prompt ({len(output.prompt_token_ids)} tokens, "
                f"{output.num_cached_tokens} cached): {output.prompt!r}"
            )
            print(
                f"    output ({len(output.token_ids)} tokens, {output.finish_reason}): "
                f"{output.text!r}"
            )
        print(f"{len(outputs)} requests in {elapsed:.2f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Strata LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    epilog = (
        "Defaults are Strata's own; a --config file's values replace them and flags override "
        "both. Every invalid combination exits with status 2 and one sentence."
    )
    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API on Ray",
        description="Serve the OpenAI-compatible HTTP API from replicas deployed on Ray.",
        epilog=epilog,
    )
    add_cluster_flags(serve)
    serve.set_defaults(func=_serve)
    generate = commands.add_parser(
        "generate",
        help="generate completions offline",
        description="Generate completions offline and print them.",
        epilog=epilog,
    )
    add_cluster_flags(generate)
    a = generate.add_argument_group("generation").add_argument
    a(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="A prompt; repeat for more. Default: three demo prompts.",
    )
    a(
        "--max-tokens",
        type=int,
        default=32,
        metavar="N",
        help="Most output tokens per prompt. Default: %(default)s.",
    )
    a(
        "--temperature",
        type=float,
        default=0.0,
        help="Sampling temperature; 0 is greedy. Default: %(default)s.",
    )
    a(
        "--sampling-seed",
        type=int,
        default=None,
        metavar="SEED",
        help="Seed of every prompt's sampling; None: the --seed of the engine drives it "
        "Default: %(default)s.",
    )
    generate.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, ValidationError) as error:
        print(f"strata: error: {one_line(error)}", file=sys.stderr)
        return 2


def one_line(error: Exception) -> str:
    """One sentence naming the offending option."""
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        message = str(first["msg"]).removeprefix("Value error, ")
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {message}" if where else message
    return str(error)


if __name__ == "__main__":
    sys.exit(main())
