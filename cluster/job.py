"""Entry point for ``ray job submit --working-dir . -- python -m cluster.job --config FILE``.

Without ``--input`` it deploys and serves the HTTP API until the job is stopped. With
``--input prompts.jsonl --output results.jsonl`` it runs the batch through the router and exits.
Each input line is ``{"prompt": "..."}`` (or ``"prompt_token_ids"``) with optional
``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``cache_salt`` and
``id``; each output line echoes ``id`` and gives ``text``, ``token_ids``, ``finish_reason``,
``num_prompt_tokens``, ``num_cached_tokens`` and ``replica_index``.
"""

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from cluster.cli import add_cluster_flags, build_config, one_line
from cluster.config import ClusterConfig

_PARAM_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")


def run_batch(config: ClusterConfig, input_path: Path, output_path: Path) -> int:
    from cluster.llm import LLM
    from replicas.sampling_params import SamplingParams

    records = []
    for number, line in enumerate(input_path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"--input line {number}: not JSON ({error.msg})") from None
        if not isinstance(record, dict) or not ("prompt" in record or "prompt_token_ids" in record):
            raise ValueError(f"--input line {number}: needs a 'prompt' or 'prompt_token_ids'")
        records.append(record)
    with LLM.from_config(config) as llm:
        outputs = llm.generate(
            [r.get("prompt", r.get("prompt_token_ids")) for r in records],
            [SamplingParams(**{k: r[k] for k in _PARAM_KEYS if k in r}) for r in records],
        )
    with output_path.open("w") as f:
        for i, (record, output) in enumerate(zip(records, outputs)):
            f.write(
                json.dumps(
                    {
                        "id": record.get("id", i),
                        "text": output.text,
                        "token_ids": output.token_ids,
                        "finish_reason": output.finish_reason,
                        "num_prompt_tokens": len(output.prompt_token_ids),
                        "num_cached_tokens": output.num_cached_tokens,
                        "replica_index": output.replica_index,
                    }
                )
                + "\n"
            )
    print(f"strata job: wrote {len(outputs)} results to {output_path}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.job")
    add_cluster_flags(parser)
    parser.add_argument("--input", type=Path, help="JSONL prompts to run as a batch")
    parser.add_argument("--output", type=Path, help="JSONL results of the batch")
    args = parser.parse_args(argv)
    if (args.input is None) != (args.output is None):
        print("strata job: error: --input and --output go together", file=sys.stderr)
        return 2
    if args.address is None:
        args.address = "auto"  # inside `ray job submit`: join the cluster running the job
    try:
        config = build_config(args)
        if args.input is not None:
            return run_batch(config, args.input, args.output)
        from cluster.server import serve

        serve(config)
        return 0
    except (ValueError, ValidationError) as error:
        print(f"strata job: error: {one_line(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
