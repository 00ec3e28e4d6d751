"""The ``strata`` command line: ``serve`` (HTTP API on Ray) and ``generate`` (offline).

Flags override the YAML config (``--config``); only flags given on the command line override.
Every invalid combination exits with status 2 and one sentence, before anything starts.
"""

import argparse
import logging
import sys
import time
import warnings
from typing import Any

from pydantic import ValidationError

from cluster.config import ClusterConfig
from cluster.flags import add_config_flags, add_flag_groups, flag_values
from replicas.model.resolve import DEFAULT_MODEL

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS = [
    "You are Strata's demo assistant. Answer briefly and precisely. Question: what is a KV cache?",
    "You are Strata's demo assistant. Answer briefly and precisely. Question: why reuse prefixes?",
    "You are Strata's demo assistant. Answer briefly and precisely. Question: what is a block?",
]


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """The flags shared by ``serve``, ``generate`` and ``python -m cluster.job``, in groups:
    ``--config``, then one flag per config field (``cluster.flags``)."""
    groups = add_flag_groups(parser)
    groups["deployment"].add_argument(
        "--config",
        metavar="FILE",
        help="YAML ClusterConfig (see configs/); its values replace the defaults below and "
        "flags given override them. Default: none.",
    )
    add_config_flags(groups)


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
    if args.model is None and "model" not in data.get("model", {}):
        args.model = DEFAULT_MODEL
    for path, value in flag_values(args).items():
        node = data
        *sections, name = path.split(".")
        for section in sections:
            if node.get(section) is None:  # an optional section (scaling) the flag turns on
                node[section] = {}
            node = node[section]
        node[name] = value
    _put_capacity(args, data)
    return ClusterConfig.model_validate(data)


def _put_capacity(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """A capacity flag replaces the file's capacity and turns the host tier on (a ratio of 0
    leaves it off); ``KVOffloadConfig`` checks every value."""
    num_bytes, ratio = args.host_memory_bytes, args.host_memory_ratio
    if num_bytes is not None or ratio is not None:
        offload = data.setdefault("scheduler", {}).setdefault("kv_offload_config", {})
        offload.update(
            enabled=num_bytes is not None or ratio != 0,
            host_memory_bytes=num_bytes,
            host_memory_ratio=ratio or 0.0,
        )


def _serve(args: argparse.Namespace) -> int:
    from cluster.server import serve

    reload = (lambda: build_config(args)) if args.config else None  # SIGHUP re-reads the file
    serve(build_config(args), reload)
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
