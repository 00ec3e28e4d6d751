"""tenants: a noisy neighbour on one replica: agent sessions beside a batch sweep and sporadic use.

Three tenants (``cache_salt``) share one in-process replica. ``agent`` runs ``sessions``
multi-turn sessions, interleaved; each turn's prompt is the previous turn's prompt and
``turn_len`` new tokens, a context growing from ``first_len`` tokens. ``batch`` sweeps over
``docs`` distinct documents of ``doc_len`` tokens, each with a short question; ``repeated_docs``
of them get a second question a few batch requests later. ``sporadic`` now and then repeats one
of ``sporadic_prompts`` prompts. Every prompt starts with one system prompt of ``system_len``
tokens, the same tokens for all three. The three streams are merged in a seeded random order
that keeps each stream's own order. The NPU tier holds ``npu_sessions`` agent sessions (at their
longest); the host tier, ``host_memory_ratio`` x that, a few more; it stores every block the NPU
tier evicts (write-back), so the sweep, many times both tiers, floods host as well as NPU.
Five engines serve the identical sequence, taking turns request by request (the order
rotates): ``one-lru`` (no tenant classes: one LRU per tier), ``batch-class``
(``batch_tenants: [batch]``: the sweep's blocks are evicted before the others') and
``batch-class+shared`` (also ``shared_prefixes: [the system prompt]``: one copy of it for all
tenants); ``fixed-quotas`` (no classes; ``tenant_quotas`` set by hand, ``FIXED_QUOTAS``: agent
0.6 of the host tier, batch and sporadic 0.2 each) and ``auto-quotas`` (no classes;
``tenant_quotas: auto``: each tenant's share of the host tier sized from its own miss-ratio
curve each time a capacity's worth of blocks was looked up, its blocks evicted first past it).
Greedy first tokens must be the same in all five (the correctness reference). The hit rate an
unbounded cache would reach on the same sequence is each tenant's ceiling.
"""

import random
from dataclasses import asdict, dataclass
from pathlib import Path

from matplotlib.figure import Figure

from benchmarks.report import Report, new_figure
from benchmarks.workload import (
    BLOCK_SIZE,
    build_llm,
    cache_counters,
    counters_delta,
    percentile,
    prompt_vocab,
    random_tokens,
    rotated,
    timed_request,
)
from cluster import LLM, KVOffloadConfig, PrefixCacheConfig
from replicas.model.resolve import DEFAULT_MODEL

NAME = "tenants"
VARIANTS = ("one-lru", "batch-class", "batch-class+shared", "fixed-quotas", "auto-quotas")
TENANTS = ("agent", "batch", "sporadic")
AGENT_CEILING_SHARE_TARGET = 0.9  # batch-class agent hit rate / its unbounded ceiling
AGENT_OVER_ONE_LRU_TARGET = 1.25  # batch-class agent hit rate / one-lru's
TOTAL_OVER_ONE_LRU_TARGET = 1.0  # batch-class total hit rate / one-lru's
CURVE_SHARE_TARGET = 0.9  # auto-quotas: a tenant's hit rate / what its curve predicts there
FIXED_QUOTAS = {"agent": 0.6, "batch": 0.2, "sporadic": 0.2}  # fixed-quotas: shares by hand


@dataclass(frozen=True, slots=True)
class Settings:
    # Lengths are whole blocks, so a turn's cached prefix is its whole previous prompt.
    system_len: int = 160
    sessions: int = 4
    turns: int = 14  # per session
    first_len: int = 608  # a session's first prompt, system prompt included
    turn_len: int = 48  # new tokens per turn
    docs: int = 40
    repeated_docs: int = 12  # docs asked a second question
    doc_len: int = 704
    question_len: int = 16
    sporadic_prompts: int = 3
    sporadic_len: int = 192  # after the system prompt
    sporadic_requests: int = 12
    npu_sessions: float = 1.5  # NPU tier = this many agent sessions at their longest
    host_memory_ratio: float = 3.0  # host blocks per NPU block
    seed: int = 0

    @property
    def session_len(self) -> int:
        """A session's longest prompt (its last turn's)."""
        return self.first_len + (self.turns - 1) * self.turn_len


QUICK = Settings(
    system_len=64,
    sessions=2,
    turns=5,
    first_len=256,
    turn_len=32,
    docs=10,
    repeated_docs=3,
    doc_len=256,
    sporadic_prompts=2,
    sporadic_len=64,
    sporadic_requests=4,
    host_memory_ratio=2.0,
)


@dataclass(frozen=True, slots=True)
class Request:
    tenant: str
    prompt: list[int]


@dataclass(frozen=True, slots=True)
class Served:
    """What one engine returned for one request."""

    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    host_cached_tokens: int
    token_ids: tuple[int, ...]


Prompts = list[list[int]]


def agent_stream(s: Settings, system: list[int], rng: random.Random, vocab: int) -> Prompts:
    """Every session's turns, one round of turns at a time, the sessions in a new order each
    round; a turn's prompt is the previous one's and ``turn_len`` new tokens."""
    first = s.first_len - s.system_len
    contexts = [system + random_tokens(rng, first, vocab) for _ in range(s.sessions)]
    prompts = []
    for turn in range(s.turns):
        for session in rng.sample(range(s.sessions), s.sessions):
            if turn:
                contexts[session] = contexts[session] + random_tokens(rng, s.turn_len, vocab)
            prompts.append(contexts[session])
    return prompts


def batch_stream(s: Settings, system: list[int], rng: random.Random, vocab: int) -> Prompts:
    """Each document once in order; ``repeated_docs`` of them again 1-4 documents later, with
    another question."""
    docs = [system + random_tokens(rng, s.doc_len, vocab) for _ in range(s.docs)]
    keyed = [(float(k), k) for k in range(s.docs)]
    keyed += [(k + rng.uniform(1.5, 4.5), k) for k in rng.sample(range(s.docs), s.repeated_docs)]
    return [docs[k] + random_tokens(rng, s.question_len, vocab) for _, k in sorted(keyed)]


def sporadic_stream(s: Settings, system: list[int], rng: random.Random, vocab: int) -> Prompts:
    """``sporadic_requests`` requests, each one of ``sporadic_prompts`` prompts."""
    prompts = [
        system + random_tokens(rng, s.sporadic_len, vocab) for _ in range(s.sporadic_prompts)
    ]
    return [rng.choice(prompts) for _ in range(s.sporadic_requests)]


def build_trace(s: Settings, vocab: int) -> tuple[list[int], list[Request]]:
    """The system prompt and the merged requests of the three tenants: the ``k``-th of a
    stream of ``n`` sorts at ``(k + u) / n``, ``u`` uniform in [0, 1)."""
    rng = random.Random(s.seed)
    system = random_tokens(rng, s.system_len, vocab)
    streams = {
        "agent": agent_stream(s, system, rng, vocab),
        "batch": batch_stream(s, system, rng, vocab),
        "sporadic": sporadic_stream(s, system, rng, vocab),
    }
    keyed = [
        ((k + rng.random()) / len(prompts), tenant, prompt)
        for tenant, prompts in streams.items()
        for k, prompt in enumerate(prompts)
    ]
    keyed.sort(key=lambda item: item[0])
    return system, [Request(tenant, prompt) for _, tenant, prompt in keyed]


def build_engines(
    s: Settings, system: list[int], model: str, names: tuple[str, ...] = VARIANTS
) -> dict[str, LLM]:
    """One engine per variant in ``names``, with the same NPU and host tiers (write-back);
    ``system`` is the shared prefix of ``batch-class+shared``."""
    offload = KVOffloadConfig(enabled=True, host_memory_ratio=s.host_memory_ratio, write_back=True)
    return {
        name: build_llm(
            num_npu_blocks=npu_blocks(s),
            max_model_len=max_prompt_len(s) + BLOCK_SIZE,
            offload=offload,
            model=model,
            prefix_cache=PrefixCacheConfig(
                batch_tenants=["batch"] if name.startswith("batch-class") else [],
                shared_prefixes=[system] if name == "batch-class+shared" else [],
                tenant_quotas={"auto-quotas": "auto", "fixed-quotas": FIXED_QUOTAS}.get(name, {}),
            ),
        )
        for name in names
    }


def npu_blocks(s: Settings) -> int:
    return round(s.npu_sessions * s.session_len / BLOCK_SIZE)


def max_prompt_len(s: Settings) -> int:
    return max(
        s.session_len,
        s.system_len + s.doc_len + s.question_len,
        s.system_len + s.sporadic_len,
    )


def serve_in_turns(llms: dict[str, LLM], requests: list[Request]) -> tuple[dict, dict]:
    """Every request through every engine, one at a time, the engines taking turns in a
    rotating order; what each engine returned per request, and its cache counters."""
    before = {name: cache_counters(llm) for name, llm in llms.items()}
    served: dict[str, list[Served]] = {name: [] for name in llms}
    for i, request in enumerate(requests):
        for name in rotated(list(llms), i):
            out = timed_request(llms[name], request.prompt, cache_salt=request.tenant)
            served[name].append(
                Served(
                    out.ttft_s,
                    len(request.prompt),
                    out.num_cached_tokens,
                    out.num_cached_tokens_in("host"),
                    tuple(out.token_ids),
                )
            )
        if (i + 1) % max(1, len(requests) // 10) == 0:
            print(f"{i + 1}/{len(requests)} requests", flush=True)
    counters = {}
    for name, llm in llms.items():
        llm.check_integrity()
        counters[name] = counters_delta(cache_counters(llm), before[name])
    return served, counters


def check_same_tokens(served: dict[str, list[Served]], requests: list[Request]) -> None:
    """Every variant's greedy tokens equal the first variant's, request by request."""
    reference, *others = served
    for name in others:
        for i, (a, b) in enumerate(zip(served[reference], served[name], strict=True)):
            if a.token_ids != b.token_ids:
                raise AssertionError(
                    f"request {i} ({requests[i].tenant}): {name} gave {b.token_ids}, "
                    f"{reference} {a.token_ids}"
                )


def tenant_summary(served: list[Served], requests: list[Request]) -> dict[str, dict]:
    """Per tenant and in total: token hit rate (cached / prompt tokens), host share, TTFTs."""
    groups = {tenant: [] for tenant in TENANTS} | {"total": served}
    for request, one in zip(requests, served, strict=True):
        groups[request.tenant].append(one)
    summary = {}
    for tenant, group in groups.items():
        prompt_tokens = sum(one.prompt_tokens for one in group)
        ttfts = [one.ttft_s for one in group]
        summary[tenant] = {
            "requests": len(group),
            "prompt_tokens": prompt_tokens,
            "hit_rate": sum(one.cached_tokens for one in group) / prompt_tokens,
            "host_hit_rate": sum(one.host_cached_tokens for one in group) / prompt_tokens,
            "mean_ttft_s": sum(ttfts) / len(ttfts),
            "p50_ttft_s": percentile(ttfts, 50),
            "p99_ttft_s": percentile(ttfts, 99),
        }
    return summary


def unbounded_hit_rates(requests: list[Request], shared_blocks: int) -> dict[str, float]:
    """Per tenant and in total, the token hit rate of a cache that never evicts: a request's
    leading run of blocks seen before under its salt (the first ``shared_blocks`` under none),
    at most ``(len - 1) // BLOCK_SIZE`` blocks."""
    seen: set[tuple[str, int]] = set()
    hits = dict.fromkeys([*TENANTS, "total"], 0)
    tokens = dict.fromkeys([*TENANTS, "total"], 0)
    for request in requests:
        chain, keys = 0, []
        for b in range(len(request.prompt) // BLOCK_SIZE):
            chain = hash((chain, tuple(request.prompt[b * BLOCK_SIZE : (b + 1) * BLOCK_SIZE])))
            keys.append(("" if b < shared_blocks else request.tenant, chain))
        run = 0
        while run < (len(request.prompt) - 1) // BLOCK_SIZE and keys[run] in seen:
            run += 1
        seen.update(keys)
        for name in (request.tenant, "total"):
            hits[name] += run * BLOCK_SIZE
            tokens[name] += len(request.prompt)
    return {name: hits[name] / tokens[name] for name in hits}


def add_tables(report: Report, summaries: dict, ceilings: dict, counters: dict) -> None:
    rows = []
    for tenant in [*TENANTS, "total"]:
        for name in VARIANTS:
            c = summaries[name][tenant]
            ceiling = ceilings["shared" if name.endswith("shared") else "salted"][tenant]
            rows.append(
                [tenant, name, c["requests"], c["hit_rate"], c["host_hit_rate"], ceiling]
                + [1e3 * c[f"{k}_ttft_s"] for k in ("p50", "p99", "mean")]
            )
    report.add_table(
        "Per tenant: token hit rate (cached / prompt tokens; from host), its unbounded-cache "
        "ceiling, TTFT",
        ["tenant", "variant", "requests", "hit rate", "from host", "unbounded"]
        + ["p50 TTFT (ms)", "p99 (ms)", "mean (ms)"],
        rows,
    )
    names = ["npu_evictions", "host_evictions", "write_backs", "blocks_loaded", "blocks_stored"]
    report.add_table(
        "Cache counters (blocks)",
        ["variant", *names],
        [[name, *(counters[name][k] for k in names)] for name in VARIANTS],
    )


def targets(
    summaries: dict, ceilings: dict, predicted: dict | None = None
) -> dict[str, tuple[float, float]]:
    """Each target's measured ratio and the least it must be; with ``auto_predictions``, each
    tenant's auto-quotas hit rate over the run against what its curve predicts with each
    access at the share in force when it came (first accesses, which miss in any cache, are in
    both), and auto-quotas' total against one LRU's."""
    one_lru, batch = summaries["one-lru"], summaries["batch-class"]
    by_curve = {
        f"auto-quotas {tenant} hit rate / its curve's": (
            summaries["auto-quotas"][tenant]["hit_rate"] / p["predicted_served_hit_rate"],
            CURVE_SHARE_TARGET,
        )
        for tenant, p in (predicted or {}).items()
        if p.get("predicted_served_hit_rate")
    }
    if predicted:
        by_curve["auto-quotas total hit rate / one-lru"] = (
            summaries["auto-quotas"]["total"]["hit_rate"] / one_lru["total"]["hit_rate"],
            TOTAL_OVER_ONE_LRU_TARGET,
        )
    return by_curve | {
        "batch-class agent hit rate / unbounded": (
            batch["agent"]["hit_rate"] / ceilings["salted"]["agent"],
            AGENT_CEILING_SHARE_TARGET,
        ),
        "batch-class agent hit rate / one-lru": (
            batch["agent"]["hit_rate"] / one_lru["agent"]["hit_rate"],
            AGENT_OVER_ONE_LRU_TARGET,
        ),
        "batch-class total hit rate / one-lru": (
            batch["total"]["hit_rate"] / one_lru["total"]["hit_rate"],
            TOTAL_OVER_ONE_LRU_TARGET,
        ),
    }


def run(
    output_dir: Path, *, quick: bool, command: str, model: str = DEFAULT_MODEL
) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    llms = build_engines(settings, [], model, VARIANTS[:1])  # no shared prefix
    system, requests = build_trace(settings, prompt_vocab(llms[VARIANTS[0]]))
    llms |= build_engines(settings, system, model, VARIANTS[1:])
    served, counters = serve_in_turns(llms, requests)
    predicted = auto_predictions(llms["auto-quotas"])
    check_same_tokens(served, requests)
    summaries = {name: tenant_summary(served[name], requests) for name in VARIANTS}
    ceilings = {
        "salted": unbounded_hit_rates(requests, 0),
        "shared": unbounded_hit_rates(requests, settings.system_len // BLOCK_SIZE),
    }
    met = targets(summaries, ceilings, predicted)
    report = Report(
        NAME,
        f"Tenants: agent sessions, a batch sweep and sporadic requests on one replica "
        f"(NPU {npu_blocks(settings)} blocks, host {settings.host_memory_ratio:g}x), "
        f"model {model}",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    add_tables(report, summaries, ceilings, counters)
    report.add_table(
        "Targets",
        ["ratio", "value", "target", "met"],
        [
            [name, value, f">= {bound}", "pass" if value >= bound else "FAIL"]
            for name, (value, bound) in met.items()
        ],
    )
    report.sections.append(
        f"Greedy first tokens: the same in all {len(VARIANTS)} variants for all "
        f"{len(requests)} requests."
    )
    add_auto_table(report, predicted, summaries["auto-quotas"])
    report.figures["tenants.png"] = _plot(summaries, ceilings, served, requests)
    report.results = {
        "model": model,
        "settings": asdict(settings),
        "num_npu_blocks": npu_blocks(settings),
        "num_requests": len(requests),
        "outputs_match": True,
        "unbounded_hit_rate": ceilings,
        "variants": summaries,
        "counters": counters,
        "targets": {name: {"value": v, "target": b} for name, (v, b) in met.items()},
        "target_met": all(value >= bound for value, bound in met.values()),
        "ttft_s": {name: [one.ttft_s for one in served[name]] for name in VARIANTS},
        "tenants": [request.tenant for request in requests],
        "auto_quotas": predicted,
    }
    return report.write(output_dir)


def _plot(summaries: dict, ceilings: dict, served: dict, requests: list[Request]) -> Figure:
    figure, (left, right) = new_figure(2)
    width = 0.8 / len(VARIANTS)
    for v, name in enumerate(VARIANTS):
        xs = [t + (v - (len(VARIANTS) - 1) / 2) * width for t in range(len(TENANTS) + 1)]
        rates = [summaries[name][tenant]["hit_rate"] for tenant in [*TENANTS, "total"]]
        left.bar(xs, rates, width, label=name)
    ceiling = [ceilings["salted"][tenant] for tenant in [*TENANTS, "total"]]
    left.scatter(range(len(ceiling)), ceiling, marker="_", s=600, color="black", label="unbounded")
    left.set_xticks(range(len(TENANTS) + 1), [*TENANTS, "total"])
    left.set_ylim(0, 1.25)
    left.set_ylabel("token hit rate")
    left.set_title("hit rate per tenant")
    left.legend(loc="upper center", ncol=2, fontsize=8)
    for name in VARIANTS:
        ttfts = sorted(
            1e3 * one.ttft_s
            for one, request in zip(served[name], requests, strict=True)
            if request.tenant == "agent"
        )
        right.plot(ttfts, [(k + 1) / len(ttfts) for k in range(len(ttfts))], label=name)
    right.set_xscale("log")
    right.set_xlabel("TTFT (ms, log)")
    right.set_ylabel("fraction of agent requests")
    right.set_title("agent TTFT distribution")
    right.legend()
    return figure


def add_auto_table(report: Report, predicted: dict, measured: dict) -> None:
    if predicted:
        report.add_table(
            "auto-quotas: each tenant's share at the end, the hit rate its own curve predicts "
            "there (recent blocks, decayed; and over the whole run, first accesses included), "
            "the one it predicts with each access at the share in force when it came (served), "
            "and the hit rate it got over the run",
            ["tenant", "share", "predicted (recent)", "(run)", "(served)", "measured"],
            [
                [
                    t,
                    p["share"],
                    p["predicted_hit_rate"],
                    p["predicted_run_hit_rate"],
                    p["predicted_served_hit_rate"],
                    measured[t]["hit_rate"],
                ]
                for t, p in predicted.items()
            ],
        )


def auto_predictions(llm: LLM) -> dict[str, dict]:
    """Per tenant, the share ``tenant_quotas: auto`` gave it last and the hit rate its curve
    predicts there (empty before the first resize: a quick run)."""
    kv = llm.engine.kv_cache
    auto = kv.auto_quotas
    if auto is None or not auto.quota:
        return {}
    index = kv.tenants.known()
    return {
        tenant: {
            "share": auto.quota[index[tenant]] / auto.capacity,
            "predicted_hit_rate": auto.predicted_hit_rate(index[tenant]),
            "predicted_run_hit_rate": auto.predicted_hit_rate(index[tenant], "run"),
            "predicted_served_hit_rate": auto.predicted_hit_rate(index[tenant], "served"),
        }
        for tenant in TENANTS
        if tenant in index and index[tenant] in auto.quota
    }
