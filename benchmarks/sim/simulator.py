"""Discrete-event replay of a trace through N simulated replicas and one routing agent.

Events, in time order (ties in the order they were scheduled)::

    arrival(i)      build the Request (its block hashes come from replicas.kv.hashing), sample
                    the load imbalance, route it, queue it on the replica; start a step there
                    if the replica is idle
    step_end(r)     SimulatedEngine.end_step: tokens, completions, KV events; the report
                    reaches the agent event_delay_s later; the replica starts its next step
    deliver(report) agent.on_report (KV events to the index, generated tokens, releases)

In ``sequential`` mode (the real-engine comparison) request i+1 arrives when request i has
finished and its report has been delivered, whatever the trace's timestamps. Otherwise arrival
times are the trace's, divided by ``arrival_speedup``; a replicate with ``seed`` > 0 adds a
uniform jitter of up to ``JITTER_S`` to each arrival and seeds the peers' random tie-breaks, so
that replicates show how much a figure owes to one particular interleaving.

``best_replica_match`` judges the routing decisions alone: the prompt blocks cached (either tier)
on the chosen replica at arrival, over those on the replica caching the most of each prompt,
summed over requests (1.0: every request went where most of its prompt was cached).

Requests the cluster could never serve are skipped (``num_skipped``): longer than the model's
context (``max_model_len`` of the hardware profile, in trace tokens) or than one replica's NPU
tier.
"""

import heapq
import itertools
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.sim.agents import ClusterView
from benchmarks.sim.clairvoyant import CLAIRVOYANT, Arrivals, arrivals_by_block, clairvoyant
from benchmarks.sim.cost_model import CostModel
from benchmarks.sim.disk import NodeDisk
from benchmarks.sim.engine import SimulatedEngine, StepReport
from benchmarks.sim.metrics import LoadMeter, hit_rates, tenant_figures, ttft_figures
from benchmarks.sim.peer_tier import (
    MEASURED,
    PEER_PULL_MIN_BLOCKS,
    peer_figures,
    peer_stores,
    peer_tier,
)
from benchmarks.sim.policies import STRATA, make_agent
from benchmarks.sim.trace import TraceRequest
from replicas.cache_hints import CacheHints
from replicas.config import EngineConfig, KVOffloadConfig, SchedulerConfig
from replicas.engine.request import Request
from replicas.kv.block_pool import INTERACTIVE_LIFETIME_S
from replicas.kv.capacity import (
    host_blocks_per_replica,
    plan_host_blocks,
    plan_npu_blocks,
    replica_host_bytes,
)
from replicas.kv.events import Tier
from replicas.kv.hashing import block_hashes
from replicas.kv.manager import KVCacheManager
from replicas.kv.records import CacheStats, CacheTypeSpec
from replicas.kv.reservations import ReservationPolicy
from replicas.kv.retention import BlockCosts, PolicyFactory, WriteThrough
from replicas.model import KVCacheSpec
from replicas.prefix_cache_config import PrefixCacheConfig
from replicas.sampling_params import SamplingParams

FULL, SLIDING = "full", "sliding"
ARRIVAL, STEP_END, DELIVER, WAKE = 0, 1, 2, 3
JITTER_S = 0.01
TENANT_MIN_SHARE = PrefixCacheConfig.model_fields["tenant_min_share"].default


def _stopped_clock() -> float:
    """The managers' clock: their deadlines never pass, since simulated disk reads always land
    (and traces carry no prompt-cache retention, the clock's other reader)."""
    return 0.0


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated cluster. Block counts are per replica; the host budget is process-wide."""

    policy: str = STRATA
    scoring_profile: str = "balanced"
    data_parallel_size: int = 8
    block_size: int = 16
    tokens_per_hash_id: int = 16
    num_npu_blocks: int | None = None  # None: what the hardware profile's KV memory holds
    host_memory_gb: float = 0.0
    host_memory_ratio: float = 0.0
    disk_memory_gb: float = 0.0  # process-wide disk tier, split among replicas (0: none)
    announce_disk_blocks: bool = False  # the router credits the node's disk blocks (sim.disk)
    write_through_threshold: WriteThrough = 2  # as KVOffloadConfig's: 0 off, or 'immediate'
    write_back: bool = False
    retention: str = "fixed"  # "adaptive" (KVOffloadConfig.retention), or CLAIRVOYANT (a bound)
    clairvoyant_window_s: float = 300.0  # CLAIRVOYANT stores what is requested again this soon
    reservation_share: float = 0.0  # PrefixCacheConfig.reservation_share
    reservation_prefetch: bool = True  # False: reservations hold NPU blocks only (an ablation)
    ttft_slack: float = 0.0  # TTFTCosts.slack of the ttft scoring profile
    ttft_forfeit_weight: float = 0.0  # TTFTCosts.forfeit_weight
    key_overload_factor: float = 2.0  # RoutingConfig.key_overload_factor (keyed requests only)
    overload_factor: float = 16.0  # RoutingConfig.overload_factor (0: no bound)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    event_delay_s: float = 0.001
    token_scale: float = 32.0  # trace tokens per simulated token (512 / tokens_per_hash_id)
    arrival_speedup: float = 1.0
    seed: int = 0
    sequential: bool = False
    sliding_window: int | None = None  # tokens: a hybrid model, global and sliding layers
    sliding_layer_fraction: float = 0.5  # of the KV bytes per token, in the sliding layers
    peer_pull: bool = False  # the peer tier: replicas pull prefixes the router names a source for
    peer_pull_fixed_s: float = MEASURED.fixed_s  # a pull's fixed cost (sim.peer_tier.PullCost)
    peer_pull_bytes_per_s: float = MEASURED.bytes_per_s  # ... and its rate
    peer_pull_min_blocks: int = PEER_PULL_MIN_BLOCKS  # RoutingConfig.peer_pull_min_blocks
    tenant_quotas: str = ""  # "auto": PrefixCacheConfig.tenant_quotas (tenants: the salts)
    interactive_lifetime_s: float = INTERACTIVE_LIFETIME_S  # PrefixCacheConfig's
    live_clock: bool = False  # the managers read the simulated clock (lifetimes, quotas)

    def num_host_blocks(self, num_npu_blocks: int, block_bytes: float) -> int:
        """Host blocks per replica (DESIGN section 5): the GiB budget split equally among
        replicas in whole blocks, or floor(ratio x NPU blocks)."""
        return host_blocks_per_replica(
            num_npu_blocks,
            block_bytes,
            self.data_parallel_size,
            host_memory_gib=self.host_memory_gb,
            host_memory_ratio=self.host_memory_ratio,
            gib_option="--host-memory-gb",
            ratio_option="--host-memory-ratio",
        )


class Simulator:
    def __init__(
        self, config: SimConfig, cost_model: CostModel, requests: list[TraceRequest]
    ) -> None:
        self.config = config
        self.cost_model = cost_model
        self.num_npu_blocks = config.num_npu_blocks or cost_model.num_npu_blocks()
        if self.num_npu_blocks < 1:
            raise ValueError(f"{cost_model.profile.name} holds no NPU block of this size")
        self.num_host_blocks = config.num_host_blocks(self.num_npu_blocks, cost_model.block_bytes)
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.max_model_len = self._max_model_len()
        self.cache_types = self._plan_cache_types()
        self.num_host_blocks = self.cache_types[0].num_host_blocks
        self.requests = [
            t for t in requests if len(t.prompt_token_ids) + t.max_tokens <= self.max_model_len
        ]
        self.num_skipped = len(requests) - len(self.requests)
        self._now = 0.0  # the time of the event being handled
        self._arrivals = self._future_arrivals() if config.retention == CLAIRVOYANT else None
        self.disk_views = disks = self._disk_views()
        names = [t.name for t in self.cache_types]
        peers = peer_stores(config, names, cost_model.block_bytes, self._holds, lambda: self._now)
        self.engines = [
            SimulatedEngine(
                r,
                self._kv_cache(disks[r], peers[r]),
                scheduler_config,
                cost_model,
                self.max_model_len,
                disks[r],
                peers[r],
            )
            for r in range(config.data_parallel_size)
        ]
        self.agent = make_agent(config, ClusterView(self.engines), cost_model, lambda: self._now)
        self.meter = LoadMeter(config.data_parallel_size)
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._finished: list[Request] = []
        self._step_ids = [0] * config.data_parallel_size
        self._num_cached_on_chosen = 0  # blocks cached (any tier) on the chosen replica, at arrival
        self._num_cached_on_best = 0  # ... on the replica caching the most of the prompt
        self._num_peer_sources = 0  # requests offered a source's blocks (peer_pull)

    def _max_model_len(self) -> int:
        """Tokens a request may span: one replica's NPU tier or the model's context."""
        npu_tokens = self.num_npu_blocks * self.config.block_size
        model_tokens = self.cost_model.profile.max_model_len / self.config.token_scale
        return int(min(npu_tokens, model_tokens))

    def _future_arrivals(self) -> Arrivals:
        """For the clairvoyant bound: each prompt block's arrival times (the trace's future)."""
        if self.config.sequential:
            raise ValueError(
                "the clairvoyant bound needs the trace's arrival times, not sequential"
            )
        if self.config.sliding_window is not None:
            raise ValueError("the clairvoyant bound covers global attention only")
        size = self.config.block_size
        return arrivals_by_block(
            (arrival_s, block_hashes(t.prompt_token_ids, size))
            for arrival_s, t in zip(self._arrival_times(), self.requests, strict=True)
        )

    def _arrival_times(self) -> list[float]:
        speedup = self.config.arrival_speedup
        times = [t.arrival_s / speedup for t in self.requests]
        if self.config.seed:
            rng = random.Random(self.config.seed)
            times = [t + rng.random() * JITTER_S for t in times]
        return times

    def _plan_cache_types(self) -> list[CacheTypeSpec]:
        """One global cache type; a hybrid model adds a sliding one, its NPU blocks planned by
        the engine's rule (``replicas.kv.capacity``) from the global type's count, and each
        type's host blocks by the engine's rule too, its block bytes the fraction of the KV
        held by its layers."""
        c = self.config
        if c.sliding_window is None:
            return [CacheTypeSpec(FULL, self.num_npu_blocks, self.num_host_blocks)]
        specs = {
            FULL: KVCacheSpec(FULL, 1, 1, 1, None, torch.float32),
            SLIDING: KVCacheSpec(SLIDING, 1, 1, 1, c.sliding_window, torch.float32),
        }
        engine_config = EngineConfig(
            block_size=c.block_size,
            num_npu_blocks=self.num_npu_blocks,
            max_model_len=self.max_model_len,
            scheduler_config=SchedulerConfig(max_num_batched_tokens=c.max_num_batched_tokens),
        )
        npu = plan_npu_blocks(specs, engine_config, self.max_model_len)
        fractions = {FULL: 1 - c.sliding_layer_fraction, SLIDING: c.sliding_layer_fraction}
        block_bytes = {
            g: max(1, round(self.cost_model.block_bytes * f)) for g, f in fractions.items()
        }
        host = plan_host_blocks(self._replica_offload(block_bytes), npu, block_bytes)
        return [CacheTypeSpec(g, npu[g], host.get(g, 0), specs[g].sliding_window) for g in npu]

    def _replica_offload(self, block_bytes: dict[str, int]) -> KVOffloadConfig:
        c = self.config
        if c.host_memory_ratio > 0:
            return KVOffloadConfig(enabled=True, host_memory_ratio=c.host_memory_ratio)
        if c.host_memory_gb <= 0:
            return KVOffloadConfig()
        budget = int(c.host_memory_gb * 2**30)
        share = replica_host_bytes(budget, c.data_parallel_size, sum(block_bytes.values()))
        return KVOffloadConfig(enabled=True, host_memory_bytes=share)

    def _disk_views(self) -> list[dict | None]:
        """Per replica, its view of the one node disk per cache type (all simulated replicas
        share a node), each replica's share of ``disk_memory_gb`` in whole blocks."""
        c = self.config
        if c.disk_memory_gb <= 0:
            return [None] * c.data_parallel_size
        if not all(t.num_host_blocks for t in self.cache_types):
            raise ValueError("--disk-memory-gb needs a host tier (--host-memory-gb or ratio)")
        share = c.disk_memory_gb * 2**30 / c.data_parallel_size
        read_s = self.cost_model.disk_load_s(1)
        total_npu = sum(t.num_npu_blocks for t in self.cache_types)
        views: list[dict | None] = [{} for _ in range(c.data_parallel_size)]
        for spec in self.cache_types:
            slots = int(share * spec.num_npu_blocks / total_npu // self.cost_model.block_bytes)
            if slots < 1:
                raise ValueError(f"--disk-memory-gb {c.disk_memory_gb} holds no block per replica")
            node = NodeDisk(c.data_parallel_size, slots, lambda: self._now, c.announce_disk_blocks)
            for replica, view in enumerate(views):
                view[spec.name] = node.view(replica, read_s)
        return views

    def _holds(self, replica: int, cache_type: str, block_hash: bytes) -> bool:
        return self.engines[replica].kv_cache.views.locate(cache_type, block_hash) is not None

    def _kv_cache(self, disk: dict | None = None, peer: dict | None = None) -> KVCacheManager:
        backing = {Tier.DISK: disk} if disk else {}
        if peer:
            backing[peer_tier()] = peer
        manager = KVCacheManager(
            block_size=self.config.block_size,
            cache_types=self.cache_types,
            write_through_threshold=self.config.write_through_threshold,
            write_back=self.config.write_back,
            retention=self._retention(),
            reservations=ReservationPolicy(
                self.config.reservation_share, self.config.reservation_prefetch
            ),
            backing=backing or None,
            clock=(lambda: self._now) if self.config.live_clock else _stopped_clock,
            reuse_partial_blocks=True,  # as the engine's
            interactive_lifetime_s=self.config.interactive_lifetime_s,
        )
        if self.config.tenant_quotas:
            manager.set_tenant_quotas(self.config.tenant_quotas, TENANT_MIN_SHARE)
        manager.views.enable_events()
        cost = self.cost_model
        recompute_s = cost.prefill_s(self.config.block_size * self.config.token_scale, 0.0)
        manager.set_block_costs(BlockCosts(recompute_s, cost.load_s(1), cost.store_s(1)))
        return manager

    def _retention(self) -> "str | PolicyFactory":
        """The config's policy name, or for the clairvoyant bound (a retention that reads the
        trace's future: a bound, not a policy) its factory."""
        if self._arrivals is None:
            return self.config.retention
        return clairvoyant(self._arrivals, lambda: self._now, self.config.clairvoyant_window_s)

    def _push(self, when: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (when, next(self._seq), kind, payload))

    def run(self, progress: bool = False) -> dict[str, object]:
        """Replay every request; returns the run's record (see ``metrics``)."""
        wall_start = time.perf_counter()
        if self.config.sequential:
            if self.requests:
                self._push(0.0, ARRIVAL, 0)
        else:
            for i, arrival_s in enumerate(self._arrival_times()):
                self._push(arrival_s, ARRIVAL, i)
        bar = tqdm(total=len(self.requests), disable=not progress, desc=self.label, leave=False)
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            self._now = now
            if kind == ARRIVAL:
                self._arrive(payload, now)
                bar.update()
            elif kind == STEP_END:
                self._end_step(payload, now)
            elif kind == WAKE:
                if not self.engines[payload].is_busy:
                    self._begin_step(payload, now)
            elif kind == DELIVER:
                self.agent.on_report(payload, now)
            else:
                self._handle(kind, payload, now)
        bar.close()
        for engine in self.engines:
            engine.kv_cache.check_integrity()
        return self._record(time.perf_counter() - wall_start)

    def _handle(self, kind: int, payload: Any, now: float) -> None:
        """An event of a subclass's own kind (``resize.ResizingSimulator``: RESIZE)."""
        raise ValueError(f"unknown event kind {kind}")

    @property
    def label(self) -> str:
        c = self.config
        name = f"{c.policy}-{c.scoring_profile}" if c.policy == STRATA else c.policy
        return f"{name} dp={c.data_parallel_size}"

    def _arrive(self, index: int, now: float) -> None:
        trace = self.requests[index]
        params = SamplingParams(max_tokens=trace.max_tokens, ignore_eos=True)
        request = Request(
            trace.request_id,
            trace.prompt_token_ids,
            params,
            self.config.block_size,
            arrival_time=now,
            cache_hints=CacheHints(key=trace.cache_key) if trace.cache_key else None,
            cache_salt=trace.cache_salt,
            batch=trace.batch,
        )
        self.meter.sample()
        cached = [e.kv_cache.match_prefix(request).num_blocks for e in self.engines]
        replica = self.agent.route(request, now)
        self._num_cached_on_chosen += cached[replica]
        self._num_cached_on_best += max(cached)
        self.meter.add(replica, request.num_prompt_tokens, now)
        engine = self.engines[replica]
        request.tenant = engine.kv_cache.tenants.index(trace.cache_salt)
        if self.config.peer_pull and self.agent.peer_hint is not None:
            engine.offer_peer_blocks(request, *self.agent.peer_hint)
            self._num_peer_sources += 1
        engine.add_request(request)
        if not engine.is_busy:
            self._begin_step(replica, now)
        else:
            end = engine.interrupt(now)
            if end is not None:
                self._step_ids[replica] += 1  # the step's old end event is now stale
                self._push(end, STEP_END, (replica, self._step_ids[replica]))

    def _begin_step(self, replica: int, now: float) -> None:
        engine = self.engines[replica]
        end = engine.begin_step(now)
        if end is not None:
            self._step_ids[replica] += 1
            self._push(end, STEP_END, (replica, self._step_ids[replica]))
        elif engine.next_disk_landing() is not None:  # idle until its disk reads land
            self._push(engine.next_disk_landing(), WAKE, replica)

    def _end_step(self, step: tuple[int, int], now: float) -> None:
        replica, step_id = step
        if step_id != self._step_ids[replica]:
            return  # an interrupted step's original end
        report: StepReport = self.engines[replica].end_step(now)
        if report.generated:
            self.meter.add(replica, len(report.generated), now)
        for request in report.finished:
            self.meter.add(replica, -request.num_tokens, now)
            self._finished.append(request)
        delivery = now + self.config.event_delay_s
        self._push(delivery, DELIVER, report)
        self._begin_step(replica, now)
        if self.config.sequential and report.finished:
            next_index = len(self._finished)
            if next_index < len(self.requests):
                self._push(delivery, ARRIVAL, next_index)

    def _record(self, wall_s: float) -> dict[str, object]:
        stats = [e.kv_cache.stats for e in self.engines]
        peer = self.config.peer_pull
        finished = self._finished
        ttfts = [r.first_token_time - r.arrival_time for r in finished]
        first = min((r.arrival_time for r in finished), default=0.0)
        last = max((r.finish_time for r in finished), default=0.0)
        makespan = last - first
        return {
            **self._config_record(),
            "num_npu_blocks": self.num_npu_blocks,
            "hardware": self.cost_model.profile.name,
            "num_host_blocks": self.num_host_blocks,
            **self._hybrid_record(),
            "block_bytes": self.cost_model.block_bytes,
            "num_requests": len(self.requests),
            "num_finished": len(finished),
            "num_skipped": self.num_skipped,
            **hit_rates(*(sum(getattr(s, f) for s in stats) for f in _HIT_FIELDS)),
            **(peer_figures(stats, self._pulls(), self._num_peer_sources) if peer else {}),
            **ttft_figures(ttfts),
            "best_replica_match": (
                self._num_cached_on_chosen / self._num_cached_on_best
                if self._num_cached_on_best
                else 1.0
            ),
            "load_imbalance": self.meter.imbalance(),
            "load_imbalance_at_arrivals": self.meter.imbalance_at_arrivals(),
            "mean_load_tokens": sum(self.meter.time_averaged()) / len(self.engines),
            "throughput_rps": len(finished) / makespan if makespan > 0 else 0.0,
            "makespan_s": makespan,
            "utilization": [e.busy_s / makespan if makespan > 0 else 0.0 for e in self.engines],
            "num_preemptions": sum(e.num_preemptions for e in self.engines),
            "blocks_loaded": sum(s.blocks_loaded for s in stats),
            "blocks_stored": sum(s.blocks_stored for s in stats),
            **{
                counter: sum(getattr(s, counter) for s in stats)
                for counter in (
                    "reservations",
                    "reservations_dropped",
                    "prefetched_blocks",
                    "prefetched_blocks_used",
                )
            },
            "host_hit_rate_estimates": self._curve(stats),
            "cache_hits_tokens": sum(s.hits for s in stats),
            "cache_queries_tokens": sum(s.queries for s in stats),
            "agent": {"source": self.agent.source, **self.agent.summary()},
            "sim_wall_s": wall_s,
            **tenant_figures(finished),
        }

    def _pulls(self) -> list[dict[str, float]]:
        return [e.peer_stats() for e in self.engines]

    def _curve(self, stats: list[CacheStats]) -> dict[str, float]:
        """The primary cache type's miss-ratio curve over all replicas: estimated host hit rate
        per ``"{capacity_factor}x/{write_back}"``; empty without a host tier."""
        queries = sum(s.queries for s in stats)
        tokens: dict[str, int] = {}
        for engine in self.engines:
            retention = next(iter(engine.kv_cache.views.retention_stats().values()), None)
            for key, value in retention.estimated_host_hit_tokens.items() if retention else ():
                name = f"{key.capacity_factor:g}x/{key.write_back}"
                tokens[name] = tokens.get(name, 0) + value
        return {name: value / queries for name, value in tokens.items()} if queries else {}

    def _config_record(self) -> dict[str, object]:
        """The config's fields; a model with global attention only leaves out the hybrid ones,
        a cluster without the peer tier its pricing."""
        record = asdict(self.config)
        if self.config.sliding_window is None:
            del record["sliding_window"], record["sliding_layer_fraction"]
        if not self.config.peer_pull:
            for name in [n for n in record if n.startswith("peer_pull")]:
                del record[name]
        if not any(r.cache_salt for r in self.requests):
            for name in ("tenant_quotas", "interactive_lifetime_s", "live_clock"):
                del record[name]
        return record

    def _hybrid_record(self) -> dict[str, object]:
        if self.config.sliding_window is None:
            return {}
        return {
            "cache_types": {t.name: [t.num_npu_blocks, t.num_host_blocks] for t in self.cache_types}
        }


_HIT_FIELDS = ("queries", "hits", "npu_hits", "host_hits")
