"""The ``strata`` command line."""

import argparse
import sys
import time

from pydantic import ValidationError

DEFAULT_PROMPTS = [
    "You are Strata's demo assistant. Answer briefly and precisely. Question: what is a KV cache?",
    "You are Strata's demo assistant. Answer briefly and precisely. Question: why reuse prefixes?",
    "You are Strata's demo assistant. Answer briefly and precisely. Question: what is a block?",
]


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default="tiny",
        help="built-in model name (tiny, tiny-hybrid) or a local HF directory",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-npu-blocks", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-enable-prefix-caching", action="store_true")
    parser.add_argument("--experimental-kv-offload-host-memory-gb", type=float, default=0.0)
    parser.add_argument("--experimental-kv-offload-host-memory-ratio", type=float, default=0.0)
    parser.add_argument("--experimental-kv-offload-write-through-threshold", type=int, default=2)
    parser.add_argument("--experimental-kv-offload-write-back", action="store_true")
    parser.add_argument("--device", default="auto")


def _scheduler_config(args: argparse.Namespace):
    from replicas.config import KVOffloadConfig, PrefixCacheConfig, SchedulerConfig

    host_bytes = int(args.experimental_kv_offload_host_memory_gb * 2**30)
    ratio = args.experimental_kv_offload_host_memory_ratio
    if args.experimental_kv_offload_host_memory_gb < 0:
        raise ValueError("--experimental-kv-offload-host-memory-gb must be non-negative")
    threshold = args.experimental_kv_offload_write_through_threshold
    if threshold < 0:
        raise ValueError(
            "--experimental-kv-offload-write-through-threshold must be >= 0 "
            f"(0 disables promotion), got {threshold}"
        )
    offload = KVOffloadConfig(
        enabled=host_bytes > 0 or ratio != 0,
        host_memory_bytes=host_bytes or None,
        host_memory_ratio=ratio,
        write_through_threshold=threshold or None,
        write_back=args.experimental_kv_offload_write_back,
    )
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_cache_config=PrefixCacheConfig(enabled=not args.no_enable_prefix_caching),
        kv_offload_config=offload,
    )


def _generate(args: argparse.Namespace) -> int:
    from cluster.llm import LLM
    from replicas.sampling_params import SamplingParams

    prompts = args.prompt or DEFAULT_PROMPTS
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed
    )
    with LLM(
        args.model,
        seed=args.seed,
        block_size=args.block_size,
        num_npu_blocks=args.num_npu_blocks,
        max_model_len=args.max_model_len,
        scheduler_config=_scheduler_config(args),
        device=args.device,
    ) as llm:
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
        cache = llm.stats().cache
        print(
            f"{len(outputs)} requests in {elapsed:.2f} s; prefix cache hits "
            f"{cache.hits}/{cache.queries} prompt tokens"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Strata LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate completions offline")
    _add_engine_flags(generate)
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
        print(f"strata: error: {_one_line(error)}", file=sys.stderr)
        return 2


def _one_line(error: Exception) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        message = str(first["msg"]).removeprefix("Value error, ")
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {message}" if where else message
    return str(error)


if __name__ == "__main__":
    sys.exit(main())
