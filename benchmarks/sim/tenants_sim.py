"""tenants-sim: the noisy neighbour of the ``tenants`` benchmark at cluster scale, in the trace
simulator.

Three tenants (``cache_salt``) share a deployment of ``data_parallel_size`` replicas (real
``Router`` and ``EngineCore``s, cost model ``h200-llama8b``, each replica's NPU tier
``npu_blocks`` blocks, its host tier ``host_memory_ratio`` times that, write-back), routed by
the default scoring policy, the managers reading the simulated clock:

    agent     ``sessions`` multi-turn sessions (Poisson arrivals), each turn its previous prompt
              and ``turn_blocks`` new blocks, the next turn ``turn_gap_s`` (exponential) after;
              each session its own ``prompt_cache_key``
    batch     a sweep over ``docs`` documents of ``doc_blocks`` blocks at ``batch_rps``, each
              with a question of its own; ``repeat_share`` of them asked again a little later
    sporadic  now and then (``sporadic_rps``) one of ``sporadic_prompts`` prompts again

Every prompt starts with one system prompt of ``system_blocks`` blocks. Variants on the
identical trace: ``one-lru`` (no classes: one LRU per tier), ``batch-class`` (the sweep's
requests are ``service_tier: flex``, so batch: its blocks are evicted first) and ``auto-quotas``
(no classes; ``tenant_quotas: auto``, each tenant's share of the host tier sized from its own
miss-ratio curve); and ``without batch``, the same trace less the batch tenant (one LRU): what
the others reach at this capacity with no noisy neighbour. Reported per tenant: the
prompt-token hit rate and TTFT p50 / p99, and the total hit rate; the unbounded hit rate (a
cache that never evicts) is each tenant's ceiling (bars: the variants; x: without batch; -:
unbounded).
"""

import dataclasses
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.report import Report, new_figure
from benchmarks.sim.cost_model import CostModel, HardwareProfile
from benchmarks.sim.simulator import SimConfig, Simulator
from benchmarks.sim.trace import TRACE_TOKENS_PER_HASH_ID, TraceRecord, TraceRequest, expand

NAME = "tenants-sim"
HARDWARE = "h200-llama8b"
TENANTS = ("agent", "batch", "sporadic")
VARIANTS = ("one-lru", "batch-class", "auto-quotas")
ALONE = "without batch"  # the same trace less the batch tenant: what the others reach alone


@dataclass(frozen=True, slots=True)
class Settings:
    data_parallel_size: int = 8
    sessions: int = 96
    session_rps: float = 0.1  # new sessions a second
    turns: int = 12
    first_blocks: int = 32  # a session's first prompt after the system prompt
    turn_blocks: int = 3
    turn_gap_s: float = 40.0
    docs: int = 2400
    doc_blocks: int = 40
    batch_rps: float = 2.0
    repeat_share: float = 0.3
    sporadic_prompts: int = 32
    sporadic_blocks: int = 12
    sporadic_rps: float = 0.3
    system_blocks: int = 8
    output_tokens: int = 128  # trace tokens
    npu_blocks: int = 256  # per replica
    host_memory_ratio: float = 2.0
    seed: int = 0


QUICK = Settings(data_parallel_size=2, sessions=8, turns=4, docs=60, npu_blocks=256)


class _Ids:
    """Fresh hash ids, one per new block."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))


def _agent(s: Settings, rng: random.Random, ids: _Ids, system: list[int]) -> list:
    """(arrival s, tenant, hash ids, session key) of every agent turn."""
    out, start = [], 0.0
    for session in range(s.sessions):
        start += rng.expovariate(s.session_rps)
        history, when = system + ids.take(s.first_blocks), start
        for _ in range(s.turns):
            out.append((when, "agent", list(history), f"session-{session}"))
            history += ids.take(s.turn_blocks)
            when += rng.expovariate(1 / s.turn_gap_s)
    return out


def _batch(s: Settings, rng: random.Random, ids: _Ids, system: list[int]) -> list:
    out, when, docs = [], 0.0, []
    for _ in range(s.docs):
        when += rng.expovariate(s.batch_rps)
        doc = system + ids.take(s.doc_blocks)
        docs.append(doc)
        out.append((when, "batch", doc + ids.take(1), None))
        if rng.random() < s.repeat_share:  # asked again a few requests later
            again = when + rng.expovariate(s.batch_rps / 8)
            out.append((again, "batch", doc + ids.take(1), None))
    return out


def _sporadic(s: Settings, rng: random.Random, ids: _Ids, system: list[int], end: float):
    prompts = [system + ids.take(s.sporadic_blocks) for _ in range(s.sporadic_prompts)]
    out, when = [], 0.0
    while when < end:
        when += rng.expovariate(s.sporadic_rps)
        out.append((when, "sporadic", rng.choice(prompts) + ids.take(1), None))
    return out


def build_trace(s: Settings) -> list[TraceRequest]:
    """Every tenant's requests, merged by arrival time (seeded)."""
    rng, ids = random.Random(s.seed), _Ids()
    system = ids.take(s.system_blocks)
    rows = _agent(s, rng, ids, system) + _batch(s, rng, ids, system)
    rows += _sporadic(s, rng, ids, system, max(r[0] for r in rows))
    rows.sort(key=lambda r: r[0])
    records = [
        TraceRecord(
            1000.0 * when, len(blocks) * TRACE_TOKENS_PER_HASH_ID, s.output_tokens, tuple(blocks)
        )
        for when, _, blocks, _ in rows
    ]
    requests = expand(records, SimConfig().tokens_per_hash_id)
    return [
        dataclasses.replace(request, cache_salt=tenant, cache_key=key)
        for request, (_, tenant, _, key) in zip(requests, rows, strict=True)
    ]


def simulate(s: Settings, requests: list[TraceRequest], variant: str) -> dict:
    config = SimConfig(
        data_parallel_size=s.data_parallel_size,
        num_npu_blocks=s.npu_blocks,
        host_memory_ratio=s.host_memory_ratio,
        write_back=True,
        live_clock=True,
        tenant_quotas="auto" if variant == "auto-quotas" else "",
    )
    if variant == "batch-class":
        requests = [dataclasses.replace(r, batch=r.cache_salt == "batch") for r in requests]
    cost_model = CostModel(HardwareProfile.load(HARDWARE), config.block_size, config.token_scale)
    return Simulator(config, cost_model, requests).run()


def ceilings(requests: list[TraceRequest], block_size: int) -> dict[str, float]:
    """Each tenant's hit rate with a cache that never evicts (whole blocks, per salt)."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    hits: dict[str, int] = {}
    totals: dict[str, int] = {}
    for request in requests:
        tenant, prompt = request.cache_salt, request.prompt_token_ids
        num_blocks = len(prompt) // block_size
        cached = 0
        while cached < num_blocks and (tenant, request.hash_ids[: cached + 1]) in seen:
            cached += 1
        # the last prompt token is always computed (a partial block's copy reuses the rest)
        hits[tenant] = hits.get(tenant, 0) + min(cached * block_size, len(prompt) - 1)
        totals[tenant] = totals.get(tenant, 0) + len(prompt)
        seen.update((tenant, request.hash_ids[: i + 1]) for i in range(num_blocks))
    return {t: hits[t] / totals[t] for t in sorted(totals)}


def run(output_dir: Path, *, quick: bool, command: str) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    requests = build_trace(settings)
    records = {variant: simulate(settings, requests, variant) for variant in VARIANTS}
    others = [r for r in requests if r.cache_salt != "batch"]
    records[ALONE] = simulate(settings, others, "one-lru")
    ceiling = ceilings(requests, SimConfig().block_size)
    report = Report(
        NAME,
        f"Tenants at dp {settings.data_parallel_size}: agent sessions, a batch sweep and "
        "sporadic requests (simulator)",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    rows = []
    for variant, record in records.items():
        for tenant, figures in record["tenants"].items():
            rows.append(
                [
                    variant,
                    tenant,
                    figures["num_requests"],
                    figures["hit_rate"],
                    ceiling[tenant],
                    figures["ttft_p50_s"],
                    figures["ttft_p99_s"],
                ]
            )
        rows.append([variant, "total", record["num_finished"], record["hit_rate"], "", "", ""])
    report.add_table(
        f"Per tenant ({len(requests)} requests; NPU {settings.npu_blocks} blocks per replica, "
        f"host {settings.host_memory_ratio:g}x)",
        ["variant", "tenant", "requests", "hit rate", "unbounded", "TTFT p50 (s)", "TTFT p99 (s)"],
        rows,
    )
    report.results = {
        "settings": asdict(settings),
        "ceilings": ceiling,
        "variants": {
            v: {"tenants": r["tenants"], "hit_rate": r["hit_rate"]} for v, r in records.items()
        },
    }
    report.figures["tenants.png"] = _figure(records, ceiling)
    return report.write(output_dir)


def _figure(records: dict, ceiling: dict):
    figure, (axis,) = new_figure(1, width=7)
    for offset, variant in zip((-0.27, 0.0, 0.27), VARIANTS):
        values = [records[variant]["tenants"][t]["hit_rate"] for t in TENANTS]
        axis.bar([i + offset for i in range(len(TENANTS))], values, width=0.27, label=variant)
    alone = records[ALONE]["tenants"]
    axis.scatter(
        [i for i, t in enumerate(TENANTS) if t in alone],
        [alone[t]["hit_rate"] for t in TENANTS if t in alone],
        marker="x",
        c="r",
        label=ALONE,
    )
    axis.scatter(range(len(TENANTS)), [ceiling[t] for t in TENANTS], marker="_", s=400, c="k")
    axis.set_xticks(range(len(TENANTS)), TENANTS)
    axis.set_ylabel("prompt-token hit rate")
    axis.legend()
    return figure
