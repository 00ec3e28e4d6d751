"""cluster-handover: the hit rate right after a resize across two Ray nodes, with a replica's hot
blocks handed over through the peer tier against without.

A Ray cluster of two nodes of one CPU each (``ray.cluster_utils``, in a child process) runs a
deployment with round-robin routing, in three modes: ``no-peer`` (no peer tier: each replica's
cache is its own, as before the peer tier), ``pulls`` (the peer tier, a request pulling what a
peer holds when the router names it, no hand-over: ``server.warm_start_budget_s: 0``) and
``handover`` (the peer tier and the hand-over: ``cluster.peer_handover``).

Scale-out: one replica serves ``prefixes`` random prefixes of ``prefix_len`` tokens (each twice:
hot); ``scale(2)`` adds a replica on the other node; each prefix is asked again (a new last
block), so half go to the new replica: the report gives the cached share of their prompt tokens
and their TTFT. Scale-in: the two replicas serve ``prefixes`` fresh prefixes, alternately (each
replica holds half); ``scale(1)`` removes one; each prefix is asked again on the survivor: the
cached share and TTFT there. Greedy tokens must be the same in every mode (``no-peer``'s
computes every prompt the new replica or the survivor lacks).
"""

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.report import Report, new_figure
from benchmarks.workload import BLOCK_SIZE, DEFAULT_MODEL, median

NAME = "cluster-handover"
MODES = ("no-peer", "pulls", "handover")


@dataclass(frozen=True, slots=True)
class Settings:
    prefixes: int = 8
    prefix_len: int = 1024
    max_tokens: int = 4
    events_s: float = 0.5  # KV events reach the router


QUICK = Settings(prefixes=2, prefix_len=128)
QUICK_MODES = ("handover",)  # one child process: the report's frame, not the comparison


def run(
    output_dir: Path, *, quick: bool, command: str, model: str = DEFAULT_MODEL
) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    results = {}
    for mode in QUICK_MODES if quick else MODES:  # each in a child: its own two-node cluster
        child = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.cluster_handover",
                mode,
                model,
                json.dumps(asdict(settings)),
            ],
            capture_output=True,
            text=True,
            timeout=1800,
            cwd=Path(__file__).resolve().parents[1],
        )
        line = next((x for x in child.stdout.splitlines() if x.startswith("{")), None)
        if child.returncode or line is None:
            raise RuntimeError(f"cluster-handover {mode} failed: {child.stderr[-2000:]}")
        results[mode] = json.loads(line)
    return _report(results, settings, model, command, quick).write(output_dir)


def _report(results: dict, settings: Settings, model: str, command: str, quick: bool) -> Report:
    report = Report(
        NAME,
        f"Hit rate after a resize across two Ray nodes, model {model}, "
        f"{settings.prefixes} prefixes of {settings.prefix_len} tokens",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    rows, summary = [], {}
    for mode, phases in results.items():
        for phase in ("scale_out", "scale_in"):
            measured = phases[phase]
            share = sum(measured["cached"]) / sum(measured["prompt"])
            ttft = median(measured["ttft_s"])
            summary.setdefault(mode, {})[phase] = {"cached_share": share, "median_ttft_s": ttft}
            reference = results.get("no-peer", {}).get(phase)
            same = measured["tokens"] == reference["tokens"] if reference else "n/a"
            rows.append([mode, phase, share, 1e3 * ttft, same])
    report.add_table(
        "After the resize: the cached share of the prompt tokens of the requests measured "
        "(scale-out: those the new replica served; scale-in: all, on the survivor) and their "
        "median TTFT (ms)",
        ["mode", "phase", "cached share", "median TTFT", "greedy tokens as no-peer's"],
        rows,
    )
    report.results = {"settings": asdict(settings), "summary": summary, "samples": results}
    report.figures["handover.png"] = _figure(summary)
    return report


def _figure(summary: dict):
    figure, axes = new_figure(2)
    modes = list(summary)
    for axis, key, label in zip(
        axes, ("cached_share", "median_ttft_s"), ("cached share", "median TTFT (s)")
    ):
        for offset, phase in ((-0.2, "scale_out"), (0.2, "scale_in")):
            values = [summary[m][phase][key] for m in modes]
            axis.bar([i + offset for i in range(len(modes))], values, width=0.4, label=phase)
        axis.set_xticks(range(len(modes)), modes)
        axis.set_ylabel(label)
        axis.legend()
    figure.suptitle("after a resize across two Ray nodes")
    return figure


# ---- the child process: one mode on its own two-node Ray cluster ------------------------------
def _config(mode: str, model: str, settings: Settings):
    from cluster.config import ClusterConfig

    offload = {"enabled": True, "host_memory_ratio": 1.0}
    if mode != "no-peer":
        offload["tiers"] = {"peer": {}}
    num_blocks = 2 * settings.prefixes * (settings.prefix_len // BLOCK_SIZE + 2)
    return ClusterConfig.model_validate(
        {
            "data_parallel_size": 1,
            "model": {
                "model": model,
                "num_npu_blocks": num_blocks,
                "max_model_len": settings.prefix_len + 4 * BLOCK_SIZE,
            },
            "scheduler": {"kv_offload_config": offload},
            "routing": {"policy": "round-robin"},
            "server": {"warm_start_budget_s": 0.0 if mode == "pulls" else 30.0},
            "ray": {"cpus_per_replica": 1},
        }
    )


async def _timed(backend, request_id: str, prompt: list[int], max_tokens: int):
    from replicas.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start, first, final = time.perf_counter(), None, None
    async for output in backend.generate(request_id, prompt, params):
        if first is None and output.token_ids:
            first = time.perf_counter() - start
        final = output
    return first, final


async def _serve_all(backend, tag: str, prompts: list[list[int]], settings: Settings) -> list:
    return [
        await _timed(backend, f"{tag}-{i}", p, settings.max_tokens) for i, p in enumerate(prompts)
    ]


def _measured(after: list, prompts: list[list[int]], keep) -> dict:
    kept = [i for i, (_, output) in enumerate(after) if keep(output)]
    return {
        "cached": [after[i][1].num_cached_tokens for i in kept],
        "prompt": [len(prompts[i]) for i in kept],
        "ttft_s": [after[i][0] for i in kept],
        "replicas": [after[i][1].replica_index for i in kept],
        "tokens": [list(output.token_ids) for _, output in after],
    }


def _prompts(rng, settings: Settings, vocab: int) -> tuple[list, list]:
    """Per prefix: a first prompt and a second one sharing all but its last block."""
    firsts, seconds = [], []
    for _ in range(settings.prefixes):
        prefix = [rng.randrange(3, vocab) for _ in range(settings.prefix_len)]
        firsts.append(prefix + [rng.randrange(3, vocab) for _ in range(BLOCK_SIZE)])
        seconds.append(prefix + [rng.randrange(3, vocab) for _ in range(BLOCK_SIZE)])
    return firsts, seconds


async def _scenario(backend, settings: Settings) -> dict:
    import random

    rng = random.Random(0)
    vocab = backend.tokenizer.vocab_size
    firsts, seconds = _prompts(rng, settings, vocab)
    await _serve_all(backend, "out-first", firsts, settings)
    await _serve_all(backend, "out-hot", firsts, settings)
    await asyncio.sleep(settings.events_s)
    await backend.scale(2)
    after = await _serve_all(backend, "out-again", seconds, settings)
    scale_out = _measured(after, seconds, lambda o: o.replica_index == 1)
    firsts, seconds = _prompts(rng, settings, vocab)
    await _serve_all(backend, "in-first", firsts, settings)
    await asyncio.sleep(settings.events_s)
    await backend.scale(1)
    after = await _serve_all(backend, "in-again", seconds, settings)
    scale_in = _measured(after, seconds, lambda o: True)
    return {"scale_out": scale_out, "scale_in": scale_in}


def _child(mode: str, model: str, settings: Settings) -> None:
    import logging

    import ray
    from ray.cluster_utils import Cluster

    from cluster.deploy import RayBackend

    logging.basicConfig(level=logging.WARNING)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, namespace=f"strata-handover-{mode}", log_to_driver=False)
    backend = RayBackend(_config(mode, model, settings), name=f"handover-{mode}")
    try:
        result = asyncio.run(_scenario(backend, settings))
    finally:
        backend.shutdown()
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], Settings(**json.loads(sys.argv[3])))
