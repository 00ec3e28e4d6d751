"""The ``strata`` command line: ``serve`` (HTTP API on Ray) and ``generate`` (offline).

Flags override the YAML config (``--config``); only flags given on the command line override.
Every invalid combination exits with status 2 and one sentence, before anything starts.
"""

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from replicas.model.resolve import DEFAULT_MODEL

if TYPE_CHECKING:
    from cluster.config import ClusterConfig

DEFAULT_PROMPTS = [
    "You are Strata's demo assistant. Answer briefly and precisely. Question: what is a KV cache?",
    "You are Strata's demo assistant. Answer briefly and precisely. Question: why reuse prefixes?",
    "You are Strata's demo assistant. Answer briefly and precisely. Question: what is a block?",
]


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """The flags shared by ``serve``, ``generate`` and ``python -m cluster.job``."""
    a = parser.add_argument
    a(
        "model",
        nargs="?",
        default=None,
        help="built-in name (smollm2-135m, tiny, tiny-hybrid), Hugging Face directory, .gguf "
        f"file or hub id (org/name); default: the config's model, else {DEFAULT_MODEL}",
    )
    a("--config", default=None, help="YAML ClusterConfig (see configs/)")
    a("--revision", help="hub branch, tag or commit of a hub id (default: its main branch)")
    a("--served-model-name", help="model name in the API (default: the model as given)")
    a("--data-parallel-size", "-dp", type=int, dest="data_parallel_size")
    a("--seed", type=int)
    a("--device")
    a("--dtype")
    a("--block-size", type=int)
    a("--num-npu-blocks", type=int)
    a("--max-model-len", type=int)
    a("--max-num-seqs", type=int)
    a("--max-num-batched-tokens", type=int)
    a("--no-enable-prefix-caching", action="store_true", default=None)
    a("--experimental-kv-offload-host-memory-gb", type=float, dest="host_gb")
    a("--experimental-kv-offload-host-memory-ratio", type=float, dest="host_ratio")
    a("--experimental-kv-offload-write-through-threshold", type=int, dest="wt_threshold")
    a("--experimental-kv-offload-write-back", action="store_true", default=None, dest="write_back")
    a("--data-parallel-routing-policy", choices=["scoring", "round-robin"], dest="policy")
    a(
        "--data-parallel-scoring-profile",
        dest="profile",
        choices=["balanced", "locality", "load", "custom"],
    )
    a("--data-parallel-prefix-weight", type=float, dest="prefix_weight")
    a("--data-parallel-load-weight", type=float, dest="load_weight")
    a("--data-parallel-host-hit-weight", type=float, dest="host_hit_weight")
    a("--host")
    a("--port", type=int)
    a("--api-key")
    a("--address", help="join this Ray cluster instead of starting an embedded one")
    a("--num-cpus", type=float, help="CPUs of the embedded Ray")
    a(
        "--gpus-per-replica",
        type=float,
        help="GPUs reserved per replica (default: 1 when the cluster has one per replica, else 0)",
    )


def build_config(args: argparse.Namespace) -> "ClusterConfig":
    """The YAML file, overridden by the flags given; raises ValueError/ValidationError."""
    from cluster.config import ClusterConfig

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
        "block_size",
        "num_npu_blocks",
        "max_model_len",
    ):
        put(f"model.{field}", getattr(args, field))
    put("scheduler.max_num_seqs", args.max_num_seqs)
    put("scheduler.max_num_batched_tokens", args.max_num_batched_tokens)
    if args.no_enable_prefix_caching:
        put("scheduler.prefix_cache_config.enabled", False)
    _put_offload(args, data)
    put("routing.policy", args.policy)
    put("routing.scoring_profile", args.profile)
    put("routing.prefix_weight", args.prefix_weight)
    put("routing.load_weight", args.load_weight)
    put("routing.host_hit_weight", args.host_hit_weight)
    put("server.host", args.host)
    put("server.port", args.port)
    put("server.api_key", args.api_key)
    put("ray.address", args.address)
    put("ray.num_cpus", args.num_cpus)
    put("ray.gpus_per_replica", args.gpus_per_replica)
    return ClusterConfig.model_validate(data)


def _put_offload(args: argparse.Namespace, data: dict[str, Any]) -> None:
    if args.host_gb is not None and args.host_gb < 0:
        raise ValueError(
            f"--experimental-kv-offload-host-memory-gb must be non-negative, got {args.host_gb}"
        )
    if args.wt_threshold is not None and args.wt_threshold < 0:
        raise ValueError(
            "--experimental-kv-offload-write-through-threshold must be >= 0 "
            f"(0 disables promotion), got {args.wt_threshold}"
        )
    offload = data.setdefault("scheduler", {}).setdefault("kv_offload_config", {})
    if args.host_gb and args.host_ratio:
        raise ValueError(
            "--experimental-kv-offload-host-memory-gb and "
            "--experimental-kv-offload-host-memory-ratio are mutually exclusive"
        )
    if args.host_gb is not None:
        offload.update(
            enabled=args.host_gb > 0,
            host_memory_bytes=int(args.host_gb * 2**30) or None,
            host_memory_ratio=0.0,
        )
    if args.host_ratio is not None:
        offload.update(
            enabled=args.host_ratio != 0, host_memory_ratio=args.host_ratio, host_memory_bytes=None
        )
    if args.wt_threshold is not None:
        offload["write_through_threshold"] = args.wt_threshold or None
    if args.write_back:
        offload["write_back"] = True


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
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API on Ray")
    add_cluster_flags(serve)
    serve.set_defaults(func=_serve)
    generate = commands.add_parser("generate", help="generate completions offline")
    add_cluster_flags(generate)
    generate.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--sampling-seed", type=int, default=None)
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
