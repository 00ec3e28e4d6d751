"""retention: prompt-cache retention as a priority that decays, against hard pins (no model).

A session trace replayed through the replica's real ``KVCacheManager`` on a simulated clock
(requests are admitted, computed and released at their arrival; no tensors, no model). Two
kinds of traffic share one replica:

- *sessions*, interactive and multi-turn, arriving at ``session_rate_per_s`` (Poisson) for
  ``duration_s``. Each turn's prompt is the previous turn's and ``turn_blocks`` new blocks
  (the first, ``first_blocks``), sent with its ``prompt_cache_key`` and a retention of the whole
  prompt for a lifetime drawn from ``TTLS`` (the API's 5m, 30m, 1h). A session's own gaps
  between turns are its typical gap (log-normal: median ``gap_median_s``, ``gap_sigma``; most
  within 5 minutes, some far longer) times a log-normal jitter (``jitter_sigma``). After each
  turn it leaves for good with probability ``leave_p`` (at most ``max_turns`` turns): every
  session ends, most after a few turns, and its blocks are dead from its last turn on.
- *ordinary* requests, with no hints, at ``ordinary_rate_per_s`` (Poisson): one of ``docs``
  documents of ``doc_blocks`` blocks, drawn by a Zipf law (``zipf_s``), and a new question of
  one block. They reuse documents and press the host tier.

The NPU tier holds ``npu_blocks``, less than the live sessions' contexts, so a returning turn
mostly hits host (``host_blocks``; every block the NPU tier evicts is written back, and a
retained prefix is stored at once). Variants, each on the identical trace: ``none``
(``retained_share`` 0: one LRU), ``pin`` (the hard pin, the lifetime as asked), ``decay`` (the
decaying priority, ``kv_offload_config.retained_priority: decay``), and each of the last two
with ``+learned``: the lifetime bounded by the session's learned lifetime
(``replicas.kv.session_gaps``, as the engine bounds it). Reported per variant: the hit rate
(cached over prompt tokens) of returning turns (a session's second turn on), of ordinary
requests and of all; and the host block-seconds of ended sessions' blocks after their last
turn, in all and while still retained (sampled every ``sample_s`` simulated seconds).
"""

import itertools
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from benchmarks.report import Report, new_figure
from replicas.cache_hints import RETENTION_TTLS_S, CacheHints
from replicas.engine.request import Request
from replicas.kv.block_pool import INTERACTIVE_LIFETIME_S
from replicas.kv.hashing import BlockHash
from replicas.kv.manager import KVCacheManager
from replicas.kv.session_gaps import SessionGaps
from replicas.sampling_params import SamplingParams

NAME = "retention"
BLOCK_SIZE = 16
TTLS = {"5m": 0.2, "30m": 0.5, "1h": 0.3}  # the lifetime a session asks for, by share
VARIANTS = {  # name -> retained_priority (None: nothing retained), learned lifetime
    "none": (None, False),
    "pin": ("pin", False),
    "pin+learned": ("pin", True),
    "decay": ("decay", False),
    "decay+learned": ("decay", True),
}
PARAMS = SamplingParams(max_tokens=1)


@dataclass(frozen=True, slots=True)
class Settings:
    duration_s: float = 3600.0
    session_rate_per_s: float = 0.1
    first_blocks: int = 40
    turn_blocks: int = 4
    leave_p: float = 0.25
    max_turns: int = 12
    gap_median_s: float = 60.0
    gap_sigma: float = 1.0
    jitter_sigma: float = 0.3
    ordinary_rate_per_s: float = 2.0
    docs: int = 2000
    doc_blocks: int = 24
    zipf_s: float = 0.9
    npu_blocks: int = 512
    host_blocks: int = 4096
    retained_share: float = 0.25
    sample_s: float = 10.0
    seed: int = 0


QUICK = Settings(duration_s=600.0, docs=500, npu_blocks=256, host_blocks=1024)


@dataclass(frozen=True, slots=True)
class Event:
    """One request of the trace: a session's turn (``session`` >= 0) or an ordinary one."""

    time: float
    tokens: list[int]
    session: int = -1
    turn: int = 0
    ttl: str = ""
    last: bool = False  # the session's last turn


@dataclass(slots=True)
class Tally:
    """Prompt and cached tokens of one kind of request."""

    prompt: int = 0
    cached: int = 0

    def add(self, prompt: int, cached: int) -> None:
        self.prompt += prompt
        self.cached += cached

    @property
    def hit_rate(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0


@dataclass(slots=True)
class Waste:
    """Host block-seconds of ended sessions' blocks after their last turn, sampled."""

    held: float = 0.0  # resident in host
    retained: float = 0.0  # resident and still retained
    ended: list[list[BlockHash]] = field(default_factory=list)  # still resident somewhere


def session_events(s: Settings, rng: random.Random, new_tokens) -> list[Event]:
    """Every session's turns: arrivals by a Poisson process, gaps per session, leaving at
    random after each turn."""
    events = []
    start, session = rng.expovariate(s.session_rate_per_s), 0
    ttls, weights = list(TTLS), list(TTLS.values())
    while start < s.duration_s:
        typical = s.gap_median_s * math.exp(rng.gauss(0.0, s.gap_sigma))
        ttl = rng.choices(ttls, weights)[0]
        num_turns = 1
        while num_turns < s.max_turns and rng.random() >= s.leave_p:
            num_turns += 1
        tokens, time = new_tokens(s.first_blocks), start
        for turn in range(num_turns):
            if turn:
                time += min(3600.0, typical * math.exp(rng.gauss(0.0, s.jitter_sigma)))
                tokens = tokens + new_tokens(s.turn_blocks)
            events.append(Event(time, tokens, session, turn, ttl, turn == num_turns - 1))
        start += rng.expovariate(s.session_rate_per_s)
        session += 1
    return events


def ordinary_events(s: Settings, rng: random.Random, new_tokens) -> list[Event]:
    """Ordinary requests: a Zipf-drawn document and a new one-block question."""
    docs = [new_tokens(s.doc_blocks) for _ in range(s.docs)]
    weights = [1.0 / (k + 1) ** s.zipf_s for k in range(s.docs)]
    events, time = [], rng.expovariate(s.ordinary_rate_per_s)
    while time < s.duration_s:
        doc = rng.choices(docs, weights)[0]
        events.append(Event(time, doc + new_tokens(1)))
        time += rng.expovariate(s.ordinary_rate_per_s)
    return events


def build_trace(s: Settings) -> list[Event]:
    """Sessions' turns and ordinary requests, by time; every block's tokens are new ids, so
    two prompts share exactly the blocks they were built to share."""
    rng = random.Random(s.seed)
    ids = itertools.count()

    def new_tokens(num_blocks: int) -> list[int]:
        return list(itertools.islice(ids, num_blocks * BLOCK_SIZE))

    events = session_events(s, rng, new_tokens) + ordinary_events(s, rng, new_tokens)
    return sorted(events, key=lambda e: e.time)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def serve(manager: KVCacheManager, request: Request) -> int:
    """Admit, compute and release one request at once; its cached prompt tokens."""
    match = manager.match_prefix(request)
    cached = match.num_tokens(BLOCK_SIZE)
    if not manager.allocate_slots(request, request.num_tokens - cached, match):
        raise RuntimeError("the NPU tier is smaller than one prompt")
    manager.record_admission(request, match)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request)
    manager.free(request)
    manager.complete_transfer(manager.take_transfer_plan())
    return cached


def sample_waste(manager: KVCacheManager, waste: Waste, now: float, dt: float) -> None:
    """Add ``dt`` seconds of the ended sessions' host blocks (all, and retained at ``now``);
    forget a session none of whose blocks is left in any tier."""
    host, npu = manager.host, manager.npu
    alive = []
    for hashes in waste.ended:
        ids = [host.lookup(h) for h in hashes]
        held = [i for i in ids if i is not None]
        waste.held += dt * len(held)
        waste.retained += dt * sum(1 for i in held if host.blocks[i].retained_until > now)
        if held or any(npu.contains(h) for h in hashes):
            alive.append(hashes)
    waste.ended = alive


def replay(s: Settings, trace: list[Event], variant: str) -> dict[str, object]:
    """The trace through one variant's manager; its hit rates, waste and counters."""
    priority, learned = VARIANTS[variant]
    clock = Clock()
    manager = KVCacheManager(
        s.npu_blocks,
        BLOCK_SIZE,
        num_host_blocks=s.host_blocks,
        write_back=True,
        retained_share=s.retained_share if priority else 0.0,
        retained_priority=priority or "decay",
        clock=clock,
    )
    sessions = SessionGaps(INTERACTIVE_LIFETIME_S, clock)
    tallies = {kind: Tally() for kind in ("returning", "first", "ordinary", "total")}
    waste, next_sample = Waste(), s.sample_s
    for i, event in enumerate(trace):
        while next_sample <= event.time:
            sample_waste(manager, waste, next_sample, s.sample_s)
            next_sample += s.sample_s
        clock.now = event.time
        manager.expire_retained()  # once per engine step
        request = make_request(event, i, sessions, learned)
        cached = serve(manager, request)
        kind = "ordinary" if event.session < 0 else "returning" if event.turn else "first"
        for name in (kind, "total"):
            tallies[name].add(request.num_tokens, cached)
        if event.last:
            waste.ended.append(request.block_hashes)
    manager.check_integrity()
    return {
        **{f"{kind}_hit_rate": tally.hit_rate for kind, tally in tallies.items()},
        "ended_sessions_host_block_s": waste.held,
        "ended_sessions_retained_block_s": waste.retained,
        "counters": {
            "host_evictions": manager.stats.host_evictions,
            "blocks_stored": manager.stats.blocks_stored,
            "blocks_loaded": manager.stats.blocks_loaded,
        },
    }


def make_request(event: Event, index: int, sessions: SessionGaps, learned: bool) -> Request:
    """The engine's request for an event: a session's turn with its key and retention (its
    ttl bounded by the session's learned lifetime when ``learned``), as ``Engine.add_request``
    builds it."""
    if event.session < 0:
        return Request(f"o{index}", event.tokens, PARAMS, BLOCK_SIZE)
    key = f"s{event.session}"
    hints = CacheHints(key, len(event.tokens), RETENTION_TTLS_S[event.ttl])
    lifetime = sessions.turn(key)
    if learned:
        hints = hints.bounded(sessions.learned_s(key))
    return Request(
        f"s{index}", event.tokens, PARAMS, BLOCK_SIZE, lifetime_s=lifetime, cache_hints=hints
    )


def ratios(results: dict[str, dict]) -> dict[str, float]:
    """The decaying priority against the hard pin, both with the lifetime as asked and both
    bounded by the learned lifetime."""
    out = {}
    for suffix in ("", "+learned"):
        pin, decay = results[f"pin{suffix}"], results[f"decay{suffix}"]
        for metric in ("returning_hit_rate", "ordinary_hit_rate", "total_hit_rate"):
            out[f"decay{suffix} / pin{suffix} {metric}"] = decay[metric] / pin[metric]
        held = "ended_sessions_host_block_s"
        out[f"decay{suffix} / pin{suffix} {held}"] = decay[held] / pin[held]
    return out


def trace_summary(s: Settings, trace: list[Event]) -> dict[str, object]:
    sessions = {e.session for e in trace if e.session >= 0}
    turns = [e for e in trace if e.session >= 0]
    gaps = sorted(
        b.time - a.time
        for a, b in itertools.pairwise(sorted(turns, key=lambda e: (e.session, e.turn)))
        if a.session == b.session
    )
    return {
        "sessions": len(sessions),
        "session_requests": len(turns),
        "ordinary_requests": len(trace) - len(turns),
        "gaps": len(gaps),
        "gap_p50_s": gaps[len(gaps) // 2] if gaps else 0.0,
        "gap_share_within_300_s": sum(g <= 300 for g in gaps) / len(gaps) if gaps else 0.0,
        "gap_max_s": gaps[-1] if gaps else 0.0,
    }


def run(output_dir: Path, *, quick: bool, command: str) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    trace = build_trace(settings)
    results = {name: replay(settings, trace, name) for name in VARIANTS}
    summary = trace_summary(settings, trace)
    report = Report(
        NAME,
        f"Retention: decaying priority against hard pins ({summary['sessions']} sessions, "
        f"{summary['ordinary_requests']} ordinary requests, host {settings.host_blocks} "
        "blocks, no model)",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    report.add_table(
        "Per variant: token hit rates and the host block-seconds of ended sessions' blocks",
        ["variant", "returning", "ordinary", "total", "first turns"]
        + ["ended held (block-s)", "ended retained (block-s)", "host evictions"],
        [
            [name, r["returning_hit_rate"], r["ordinary_hit_rate"], r["total_hit_rate"]]
            + [r["first_hit_rate"], r["ended_sessions_host_block_s"]]
            + [r["ended_sessions_retained_block_s"], r["counters"]["host_evictions"]]
            for name, r in results.items()
        ],
    )
    met = ratios(results)
    report.add_table("Decay over pin", ["ratio", "value"], [[k, v] for k, v in met.items()])
    report.add_table("Trace", ["", ""], [[k, v] for k, v in summary.items()])
    report.figures["retention.png"] = _plot(results)
    report.results = {
        "settings": asdict(settings),
        "trace": summary,
        "variants": results,
        "ratios": met,
    }
    return report.write(output_dir)


def _plot(results: dict[str, dict]) -> Figure:
    """Hit rates per kind of request, and the ended sessions' host block-seconds, by variant."""
    figure, (left, right) = new_figure(2)
    kinds = ("returning", "ordinary", "total")
    width = 0.8 / len(results)
    for v, (name, r) in enumerate(results.items()):
        xs = [k + (v - (len(results) - 1) / 2) * width for k in range(len(kinds))]
        left.bar(xs, [r[f"{kind}_hit_rate"] for kind in kinds], width, label=name)
    left.set_xticks(range(len(kinds)), kinds)
    left.set_ylabel("token hit rate")
    left.set_title("hit rate")
    left.legend(fontsize=8)
    names = list(results)
    held = [results[n]["ended_sessions_host_block_s"] / 1e6 for n in names]
    retained = [results[n]["ended_sessions_retained_block_s"] / 1e6 for n in names]
    right.bar(names, held, label="held")
    right.bar(names, retained, label="of which retained")
    right.set_ylabel("host block-seconds (millions)")
    right.set_title("ended sessions' blocks after their last turn")
    right.tick_params(axis="x", labelsize=8)
    right.legend(fontsize=8)
    return figure
