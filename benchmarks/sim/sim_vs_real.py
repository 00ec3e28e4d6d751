"""sim-vs-real: the shipped trace through the real engine and through the simulator, side by side.

A prefix of ``synthetic_trace.jsonl`` (one hash id = 16 tokens = one block) is served one request
at a time (each request's KV events reach the router before the next one is routed):

* real, dp 1: one in-process engine (``cluster.LLM``, built-in ``tiny`` model);
* real, hybrid dp 1: the same with ``tiny-hybrid`` (global and sliding-window layers), simulated
  with its sliding window;
* real, dp 2: two in-process engines and the real ``router.Router`` fed by their KV events (as
  ``replicas.actor`` reports them), scoring policy, balanced profile;
* the simulator in ``sequential`` mode on the same configuration, hardware profile ``cpu-tiny``
  with token scale 1 (a simulated token is a real one).

Hit counts are a function of the request order and the cache code, which both sides share, so
they must agree exactly; the simulated TTFT is the cpu-tiny cost model's prediction of the
measured one (a check of the calibration, on a noisy machine).
"""

from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.report import Report, new_figure
from benchmarks.sim.cli import DEFAULT_TRACE
from benchmarks.sim.cost_model import CostModel, HardwareProfile
from benchmarks.sim.simulator import SimConfig, Simulator
from benchmarks.sim.trace import TraceRequest, expand, load_trace
from benchmarks.workload import median
from cluster import LLM, KVOffloadConfig, SamplingParams, SchedulerConfig
from replicas.kv.events import KVEventBatch
from replicas.model.builtin import BUILTIN_MODEL_ARGS
from router.config import RoutingConfig
from router.router import Router

NAME = "sim-vs-real"
BLOCK_SIZE = 16
COUNTERS = ("queries", "hits", "npu_hits", "host_hits")


@dataclass(frozen=True, slots=True)
class Settings:
    num_requests: int = 200
    num_npu_blocks: int = 1024  # per replica: 16k tokens, a fraction of the prefix's blocks
    host_memory_ratio: float = 1.0
    write_through_threshold: int = 2
    write_back: bool = True  # so that host hits occur on this short prefix of the trace
    trace: str = str(DEFAULT_TRACE)


QUICK = Settings(num_requests=60)
CONFIGS = [("dp1", "tiny", 1), ("dp2", "tiny", 2), ("hybrid dp1", "tiny-hybrid", 1)]


def _engines(settings: Settings, num: int, model: str) -> list[LLM]:
    offload = KVOffloadConfig(
        enabled=True,
        host_memory_ratio=settings.host_memory_ratio,
        write_through_threshold=settings.write_through_threshold,
        write_back=settings.write_back,
    )
    return [
        LLM(
            model,
            block_size=BLOCK_SIZE,
            num_npu_blocks=settings.num_npu_blocks,
            max_model_len=settings.num_npu_blocks * BLOCK_SIZE,
            scheduler_config=SchedulerConfig(kv_offload_config=offload),
        )
        for _ in range(num)
    ]


def run_real(
    settings: Settings, requests: list[TraceRequest], dp: int, model: str
) -> dict[str, object]:
    """Serve the requests one at a time on ``dp`` in-process engines behind the real router."""
    llms = _engines(settings, dp, model)
    router = Router(dp, BLOCK_SIZE, RoutingConfig())
    next_seq = [0] * dp
    for llm in llms:
        llm.engine.kv_cache.views.enable_events()  # as replicas.actor turns them on
    ttfts, routed = [], [0] * dp
    for trace in tqdm(requests, desc=f"real dp={dp}", leave=False):
        prompt = trace.prompt_token_ids
        replica = router.route(trace.request_id, len(prompt), _hashes(llms[0], prompt))
        replica = replica.replica_index
        routed[replica] += 1
        params = SamplingParams(max_tokens=trace.max_tokens, ignore_eos=True)
        output = llms[replica].generate(prompt, params)
        ttfts.append(output.first_token_time - output.arrival_time)
        events = tuple(llms[replica].engine.kv_cache.views.drain_events())
        router.on_events(KVEventBatch(replica, next_seq[replica], events))
        next_seq[replica] += len(events)
        router.release(trace.request_id)
    counters = {c: sum(getattr(llm.stats().cache, c) for llm in llms) for c in COUNTERS}
    for llm in llms:
        llm.check_integrity()
        llm.shutdown()
    return {**counters, "median_ttft_s": median(ttfts), "requests_per_replica": routed}


def _hashes(llm: LLM, prompt: list[int]) -> list[bytes]:
    from replicas.kv.hashing import block_hashes  # the app computes them once per request

    return block_hashes(prompt, BLOCK_SIZE)


def run_sim(
    settings: Settings, requests: list[TraceRequest], dp: int, sliding_window: int | None
) -> dict[str, object]:
    config = SimConfig(
        data_parallel_size=dp,
        block_size=BLOCK_SIZE,
        tokens_per_hash_id=BLOCK_SIZE,
        num_npu_blocks=settings.num_npu_blocks,
        host_memory_ratio=settings.host_memory_ratio,
        write_through_threshold=settings.write_through_threshold,
        write_back=settings.write_back,
        token_scale=1.0,
        sequential=True,
        sliding_window=sliding_window,
    )
    cost_model = CostModel(HardwareProfile.load("cpu-tiny"), BLOCK_SIZE, 1.0)
    simulator = Simulator(config, cost_model, requests)
    record = simulator.run()
    stats = [e.kv_cache.stats for e in simulator.engines]
    counters = {c: sum(getattr(s, c) for s in stats) for c in COUNTERS}
    return {
        **counters,
        "median_ttft_s": record["ttft_p50_s"],
        "requests_per_replica": record["agent"]["requests_per_replica"],
        "num_skipped": record["num_skipped"],
    }


def run(output_dir: Path, *, quick: bool, command: str) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    records = load_trace(Path(settings.trace), settings.num_requests)
    limit = settings.num_npu_blocks * BLOCK_SIZE
    requests = [
        r for r in expand(records, BLOCK_SIZE) if len(r.prompt_token_ids) + r.max_tokens < limit
    ]
    results = {}
    for name, model, dp in CONFIGS:
        window = BUILTIN_MODEL_ARGS[model]().sliding_window if "hybrid" in model else None
        results[name] = {
            "real": run_real(settings, requests, dp, model),
            "sim": run_sim(settings, requests, dp, window),
        }
        print(f"{name} done", flush=True)
    return _report(settings, len(requests), results, command, quick).write(output_dir)


def _rate(side: dict, counter: str) -> float:
    return side[counter] / side["queries"] if side["queries"] else 0.0


def _report(
    settings: Settings, num_requests: int, results: dict, command: str, quick: bool
) -> Report:
    report = Report(
        NAME,
        "Simulator vs real engine on the shipped trace",
        command,
        quick,
        __doc__.split("\n\n", 1)[1],
    )
    rows = []
    for name, pair in results.items():
        for side in ("real", "sim"):
            r = pair[side]
            rows.append(
                [
                    name,
                    side,
                    r["queries"],
                    _rate(r, "hits"),
                    _rate(r, "npu_hits"),
                    _rate(r, "host_hits"),
                    r["median_ttft_s"],
                    str(r["requests_per_replica"]),
                ]
            )
        pair["hits_equal"] = all(pair["real"][c] == pair["sim"][c] for c in COUNTERS)
    report.add_table(
        f"{num_requests} requests, {settings.num_npu_blocks} NPU blocks per replica, host ratio "
        f"{settings.host_memory_ratio}, write-through threshold {settings.write_through_threshold}"
        f", write-back {settings.write_back}",
        [
            "config",
            "side",
            "prompt tokens",
            "hit rate",
            "NPU hit",
            "host hit",
            "median TTFT (s)",
            "requests per replica",
        ],
        rows,
    )
    report.add_table(
        "Same hit counts (queries, hits, NPU hits, host hits)?",
        ["config", "equal"],
        [[name, pair["hits_equal"]] for name, pair in results.items()],
    )
    figure, (axis,) = new_figure(1)
    labels = [f"{name} {side}" for name in results for side in ("real", "sim")]
    values = [_rate(results[name][side], "hits") for name in results for side in ("real", "sim")]
    axis.bar(labels, values, color=["tab:blue", "tab:orange"] * len(results))
    axis.set_ylabel("hit rate (tokens)")
    report.figures["sim_vs_real.png"] = figure
    report.results = {"settings": asdict(settings), "num_requests": num_requests, **results}
    return report
