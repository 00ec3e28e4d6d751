"""Prometheus metrics of a deployment: prefix ``strata_``, label ``replica`` (DESIGN section 8).

Two sources, one exposition:

* replica counters and gauges come from ``Backend.stats()`` at scrape time: the ``/metrics``
  handler awaits a ``ClusterStats`` snapshot and ``render`` turns it into metric families (the
  engines already count everything; nothing is double-counted here);
* request latencies are observed by the HTTP app as outputs stream through it (``track``), on
  the app's clock, so they include routing and queueing as a client sees them.

Each app owns its ``CollectorRegistry``; nothing lives in module globals. Router metrics come
from ``ClusterStats.router`` through ``router_metric_families`` (``cluster.router_metrics``).
"""

import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)

from cluster.backend import ClusterStats, FrontStats, ReplicaStats
from cluster.router_metrics import router_metric_families
from cluster.tenant_metrics import tenant_metric_families
from replicas.engine.engine import EngineStats
from replicas.kv.events import Tier, backing_tiers, tiers
from replicas.kv.records import BackingStats, CacheTypeStats
from replicas.kv.retention import estimated_hit_rates
from replicas.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

# (name without _total, help, value) of per-replica counters with no label but ``replica``.
_COUNTERS: list[tuple[str, str, Callable[[EngineStats], float]]] = [
    ("strata_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     lambda s: s.cache.queries),
    ("strata_prefix_cache_hits", "Prompt tokens served from the prefix cache (any tier).",
     lambda s: s.cache.hits),
    ("strata_kv_write_through_promotions", "NPU blocks copied to host after repeated hits.",
     lambda s: s.cache.write_through_promotions),
    ("strata_kv_write_backs", "NPU-only blocks copied to host when NPU pressure evicted them.",
     lambda s: s.cache.write_backs),
    ("strata_kv_blocks_loaded", "Blocks reloaded from host into NPU memory.",
     lambda s: s.cache.blocks_loaded),
    ("strata_kv_blocks_stored", "Blocks offloaded from NPU into host memory.",
     lambda s: s.cache.blocks_stored),
    ("strata_kv_bytes_loaded", "Bytes reloaded from host into NPU memory.",
     lambda s: s.transfer.bytes_loaded if s.transfer else 0),
    ("strata_kv_bytes_stored", "Bytes offloaded from NPU into host memory.",
     lambda s: s.transfer.bytes_stored if s.transfer else 0),
    ("strata_kv_transfer_seconds", "Time spent issuing and completing host <-> NPU copies.",
     lambda s: s.transfer.seconds if s.transfer else 0.0),
    ("strata_num_preemptions", "Requests preempted for lack of NPU blocks.",
     lambda s: s.num_preemptions),
    ("strata_kv_reservations", "Waiting requests whose cached prefix was reserved.",
     lambda s: s.cache.reservations),
    ("strata_kv_prefetched_blocks",
     "Host-only blocks loaded into NPU blocks while their request waited.",
     lambda s: s.cache.prefetched_blocks),
    ("strata_kv_prefetched_blocks_used", "Prefetched blocks their request adopted.",
     lambda s: s.cache.prefetched_blocks_used),
    ("strata_kv_reservations_dropped",
     "Reservations that gave way to running requests or earlier arrivals.",
     lambda s: s.cache.reservations_dropped),
    ("strata_engine_steps", "Engine steps run.", lambda s: s.steps.num_steps),
    ("strata_engine_step_seconds", "Time spent inside engine steps.",
     lambda s: s.steps.step_seconds),
    ("strata_engine_gap_seconds",
     "Time between engine steps while requests were unfinished (serving-layer overhead).",
     lambda s: s.steps.gap_seconds),
    ("strata_spec_decode_draft_tokens",
     "Draft tokens (n-gram speculative decoding) verified by the model.",
     lambda s: s.spec_decode.num_draft_tokens),
    ("strata_spec_decode_accepted_tokens",
     "Draft tokens the model confirmed (each saved a decode step).",
     lambda s: s.spec_decode.num_accepted_tokens),
]  # fmt: skip

_GAUGES: list[tuple[str, str, Callable[[EngineStats], float]]] = [
    ("strata_num_requests_running", "Requests scheduled on the replica.", lambda s: s.num_running),
    ("strata_num_requests_waiting", "Requests queued on the replica.", lambda s: s.num_waiting),
    ("strata_kv_reserved_blocks", "NPU blocks held for waiting requests' cached prefixes.",
     lambda s: s.cache.reserved_blocks),
]  # fmt: skip


# (``event`` label, value) of ``strata_kv_cache_type_blocks``.
_PER_TYPE_EVENTS: list[tuple[str, Callable[[CacheTypeStats], int]]] = [
    ("npu_eviction", lambda c: c.npu_evictions),
    ("host_eviction", lambda c: c.host_evictions),
    ("write_through_promotion", lambda c: c.write_through_promotions),
    ("write_back", lambda c: c.write_backs),
    ("loaded", lambda c: c.blocks_loaded),
    ("stored", lambda c: c.blocks_stored),
    ("released_out_of_window", lambda c: c.blocks_freed_out_of_window),
]


_DISK_EVENTS = ("blocks_loaded", "load_failures", "blocks_stored", "reloads", "recomputes")
_DISK_EVENTS += ("load_timeouts",)
"""The ``BackingStats`` counters ``strata_kv_disk_tier`` shows (``strata_kv_backing_tier``
shows them all, for every tier)."""


def _replica_families(replicas: list[ReplicaStats]) -> list[Metric]:
    up = GaugeMetricFamily("strata_replica_up", "1 while the replica is alive.", labels=["replica"])
    counters = [CounterMetricFamily(n, h, labels=["replica"]) for n, h, _ in _COUNTERS]
    gauges = [GaugeMetricFamily(n, h, labels=["replica"]) for n, h, _ in _GAUGES]
    cache = _CacheFamilies()
    retention = _RetentionFamilies()
    for replica in replicas:
        label = str(replica.replica_index)
        stats = replica.engine
        up.add_metric([label], 1.0 if replica.is_alive else 0.0)
        if stats is None:
            continue
        for family, (_, _, value) in zip(counters, _COUNTERS):
            family.add_metric([label], value(stats))
        for family, (_, _, value) in zip(gauges, _GAUGES):
            family.add_metric([label], value(stats))
        cache.add(label, stats)
        retention.add(label, stats)
    return [up, *counters, *cache.families(), *gauges, *retention.families()]


class _CacheFamilies:
    """Hits, evictions and blocks by tier and cache type, and the disk tier's events."""

    def __init__(self) -> None:
        by_type = ["replica", "tier", "cache_type"]
        self.hits_by_tier = CounterMetricFamily(
            "strata_prefix_cache_hits_by_tier",
            "Prompt tokens served from the prefix cache, by the tier they came from.",
            labels=["replica", "tier"],
        )
        self.evictions = CounterMetricFamily(
            "strata_kv_evictions", "Cached blocks evicted, by tier.", labels=["replica", "tier"]
        )
        self.used = GaugeMetricFamily(
            "strata_kv_blocks_used",
            "KV blocks held by requests or transfers (neither free nor evictable), by tier and "
            "cache type.",
            labels=by_type,
        )
        self.cached = GaugeMetricFamily(
            "strata_kv_blocks_cached",
            "KV blocks holding a reusable cached prefix (in use or evictable), by tier and cache "
            "type.",
            labels=by_type,
        )
        self.capacity = GaugeMetricFamily(
            "strata_kv_blocks_capacity",
            "KV blocks of the pool, by tier and cache type.",
            labels=by_type,
        )
        self.retained = GaugeMetricFamily(
            "strata_kv_retained_blocks",
            "Cached blocks kept ahead of ordinary ones for a prompt-cache lifetime, by tier "
            "(host, disk) and cache type.",
            labels=by_type,
        )
        self.per_type = CounterMetricFamily(
            "strata_kv_cache_type_blocks",
            "Block events per cache type: npu_eviction, host_eviction, write_through_promotion, "
            "write_back, loaded, stored, released_out_of_window.",
            labels=["replica", "cache_type", "event"],
        )
        self.disk_events = CounterMetricFamily(
            "strata_kv_disk_tier",
            "Disk tier events (replicas with one): blocks_loaded, load_failures, blocks_stored, "
            "reloads and recomputes (the cost rule's choices per waiting request), "
            "load_timeouts.",
            labels=["replica", "event"],
        )
        self.backing_events = CounterMetricFamily(
            "strata_kv_backing_tier",
            "Events of each tier behind host that counted any (disk, peer, ...): the "
            "replicas.kv.records.BackingStats counters by name.",
            labels=["replica", "tier", "event"],
        )
        self.block_costs = GaugeMetricFamily(
            "strata_kv_reload_rule_seconds_per_block",
            "The cost rule's inputs (onboarding from a tier behind host pays when its read plus "
            "a host load costs less than recompute, per block): recompute, host_load and "
            "<tier>_read.",
            labels=["replica", "cost"],
        )

    def _add_backing(self, label: str, stats: EngineStats) -> None:
        for tier, counts in stats.cache.backing.items():
            for event in BackingStats.__slots__:
                self.backing_events.add_metric([label, tier, event], getattr(counts, event))
        costs = stats.reload_costs
        if costs is not None:
            self.block_costs.add_metric([label, "recompute"], costs.recompute_s)
            self.block_costs.add_metric([label, "host_load"], costs.host_load_s)
            for tier, read_s in costs.read_s.items():
                self.block_costs.add_metric([label, f"{tier}_read"], read_s)

    def add(self, label: str, stats: EngineStats) -> None:
        # Pooled tiers' series always exist; a backing tier's once the replica has it on.
        backing_on = {
            tier
            for tier in backing_tiers()
            if any(u.of(tier).num_blocks for u in stats.cache_types.values())
        }
        hits = stats.cache.hits_by_tier()
        evictions = _evictions_by_tier(stats)
        for tier in tiers():
            if tier in hits or tier in backing_on:
                self.hits_by_tier.add_metric([label, tier], hits.get(tier, 0))
            if tier.traits.pooled or tier in backing_on:
                self.evictions.add_metric([label, tier], evictions.get(tier, 0))
        if Tier.DISK in backing_on:
            disk = stats.cache.backing.get(Tier.DISK, BackingStats())
            for event in _DISK_EVENTS:
                self.disk_events.add_metric([label, event], getattr(disk, event))
        self._add_backing(label, stats)
        for cache_type, counts in stats.cache.by_cache_type.items():
            for event, value in _PER_TYPE_EVENTS:
                self.per_type.add_metric([label, cache_type, event], value(counts))
        pooled = {tier for tier in tiers() if tier.traits.pooled}
        for cache_type, usage in stats.cache_types.items():
            tiers_on = usage.by_tier()
            tiers_on.setdefault(Tier.HOST, (0, 0, 0))  # host series exist with the tier off too
            for tier, (num_blocks, num_used, num_cached) in tiers_on.items():
                if tier in pooled:  # a backing tier's slots are never held by a request
                    self.used.add_metric([label, tier, cache_type], num_used)
                self.cached.add_metric([label, tier, cache_type], num_cached)
                self.capacity.add_metric([label, tier, cache_type], num_blocks)
            for tier, num_retained in usage.retained_by_tier().items():
                self.retained.add_metric([label, tier, cache_type], num_retained)

    def families(self) -> list[Metric]:
        return [
            self.hits_by_tier,
            self.evictions,
            self.per_type,
            self.used,
            self.cached,
            self.capacity,
            self.retained,
            self.disk_events,
            self.backing_events,
            self.block_costs,
        ]


def _evictions_by_tier(stats: EngineStats) -> dict[str, int]:
    """Cached blocks evicted per tier: the prefix cache's counts, and for disk its stores' own
    (blocks overwritten in the replica's slab)."""
    evictions: dict[str, int] = dict(stats.cache.evictions)
    disk = stats.backing.get(Tier.DISK)
    if disk:
        evictions[Tier.DISK] = sum(d.evictions for d in disk.values())
    return evictions


class _RetentionFamilies:
    """Ghost records, the miss-ratio curve and adaptive decisions (``EngineStats.retention``)."""

    def __init__(self) -> None:
        self.estimate = GaugeMetricFamily(
            "strata_kv_host_hit_rate_estimate",
            "Host hit rate (host-served prompt tokens / prompt tokens since start) the host tier "
            "would have had at capacity_factor x its capacity, with write_back off, on or "
            "adaptive; from shadow host tiers fed with live traffic (capacity_factor 1 with the "
            "running policy is the measured rate).",
            labels=["replica", "cache_type", "capacity_factor", "write_back"],
        )
        self.ghost_hits = CounterMetricFamily(
            "strata_kv_ghost_hits",
            "Prompt blocks that would have been host hits had the host tier kept them: "
            "ghost=dropped (evicted from NPU without a host copy), host_evicted.",
            labels=["replica", "cache_type", "ghost"],
        )
        self.ghosts = GaugeMetricFamily(
            "strata_kv_ghost_blocks",
            "Block hashes in the ghost records (each list bounded by the host capacity).",
            labels=["replica", "cache_type", "ghost"],
        )
        self.decisions = CounterMetricFamily(
            "strata_kv_adaptive_decisions",
            "Blocks leaving the NPU tier without a host copy that the adaptive retention policy "
            "stored (decision=store) or let go (skip).",
            labels=["replica", "cache_type", "decision"],
        )

    def add(self, label: str, stats: EngineStats) -> None:
        queries = stats.cache.queries
        for cache_type, retention in stats.retention.items():
            for key, rate in estimated_hit_rates(retention, queries).items():
                factor = f"{key.capacity_factor:g}"
                self.estimate.add_metric([label, cache_type, factor, key.write_back], rate)
            for ghost, hits, size in (
                ("dropped", retention.ghost_hits_dropped, retention.num_ghosts_dropped),
                (
                    "host_evicted",
                    retention.ghost_hits_host_evicted,
                    retention.num_ghosts_host_evicted,
                ),
            ):
                self.ghost_hits.add_metric([label, cache_type, ghost], hits)
                self.ghosts.add_metric([label, cache_type, ghost], size)
            self.decisions.add_metric([label, cache_type, "store"], retention.adaptive_stores)
            self.decisions.add_metric([label, cache_type, "skip"], retention.adaptive_skips)

    def families(self) -> list[Metric]:
        return [self.estimate, self.ghost_hits, self.ghosts, self.decisions]


# (name without _total, help, value) of the serving front's counters (Ray deployments).
_FRONT_COUNTERS: list[tuple[str, str, Callable[[FrontStats], float]]] = [
    ("strata_front_routes", "Routing decisions the front waited for.", lambda f: f.num_routes),
    ("strata_front_route_calls", "Calls to the router carrying them (coalesced per loop turn).",
     lambda f: f.num_route_calls),
    ("strata_front_route_seconds", "Time requests waited for routing decisions.",
     lambda f: f.route_seconds),
    ("strata_front_stream_messages", "Messages read from the replicas' output streams.",
     lambda f: f.num_stream_messages),
    ("strata_front_stream_items", "Request outputs those messages carried.",
     lambda f: f.num_stream_items),
    ("strata_front_stream_seconds",
     "Time from a stream message being announced to its outputs reaching their requests "
     "(fetch, deserialization, dispatch, event-loop waits).",
     lambda f: f.stream_seconds),
    ("strata_requests_resumed",
     "Requests resumed on a live replica after theirs was lost mid-stream.",
     lambda f: f.num_resumed),
]  # fmt: skip


def front_metric_families(front: FrontStats | None) -> list[Metric]:
    if front is None:
        return []
    families = []
    for name, help_text, value in _FRONT_COUNTERS:
        family = CounterMetricFamily(name, help_text)
        family.add_metric([], value(front))
        families.append(family)
    return families


def size_metric_families(stats: ClusterStats) -> list[Metric]:
    """The deployment's size (``state``: target, the size asked for last; live, the replicas
    answering) and its resizes by ``direction`` (out, in). A replica removed by a scale-in
    leaves every per-replica series: ``ClusterStats.replicas`` is the live set."""
    size = GaugeMetricFamily(
        "strata_replicas", "Replicas of the deployment: target and live.", labels=["state"]
    )
    size.add_metric(["target"], stats.num_target_replicas)
    size.add_metric(["live"], sum(r.is_alive for r in stats.replicas))
    events = CounterMetricFamily(
        "strata_scale_events", "Resizes of the deployment, by direction.", labels=["direction"]
    )
    for direction in ("out", "in"):
        events.add_metric([direction], stats.num_scale_events.get(direction, 0))
    return [size, events]


def cluster_metric_families(stats: ClusterStats | None) -> list[Metric]:
    """Every metric family of a stats snapshot; empty when the backend did not answer."""
    if stats is None:
        return []
    return (
        _replica_families(stats.replicas)
        + tenant_metric_families(stats.replicas)
        + router_metric_families(stats.router)
        + front_metric_families(stats.front)
        + size_metric_families(stats)
    )


class _Scrape:
    """The app's registry plus one snapshot's families, as one collector."""

    def __init__(self, registry: CollectorRegistry, families: list[Metric]) -> None:
        self.registry = registry
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()
        yield from self.families


class RequestMetrics:
    """Latencies of one request, observed as its outputs pass through the app."""

    def __init__(self, metrics: "StrataMetrics") -> None:
        self._metrics = metrics
        self._start_s = time.monotonic()
        self._last_token_s: float | None = None
        self._replica = "none"  # until an output says which replica serves it
        self._is_done = False

    def observe(self, output: RequestOutput) -> None:
        if output.replica_index is not None:
            self._replica = str(output.replica_index)
        num_new = len(output.new_token_ids)
        if num_new == 0:
            return
        now = time.monotonic()
        if self._last_token_s is None:
            self._metrics.time_to_first_token.labels(self._replica).observe(now - self._start_s)
            num_new -= 1  # the rest of this output's tokens came with the first one
        else:
            gap = (now - self._last_token_s) / num_new
            for _ in range(num_new):
                self._metrics.inter_token_latency.labels(self._replica).observe(gap)
        self._last_token_s = now

    def finish(self, finish_reason: str | None) -> None:
        """Count the request once, as finished for ``finish_reason`` ("abort" when the client
        left, "error" when it failed)."""
        if self._is_done:
            return
        self._is_done = True
        elapsed = time.monotonic() - self._start_s
        self._metrics.e2e_request_latency.labels(self._replica).observe(elapsed)
        self._metrics.requests.labels(self._replica, finish_reason or "error").inc()


class StrataMetrics:
    """The metrics of one app: its own histograms and counters, plus replica stats on scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "strata_time_to_first_token_seconds",
            "Time from a request's arrival at the API to its first token.",
            ["replica"],
            buckets=_TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "strata_inter_token_latency_seconds",
            "Time between consecutive output tokens of a request.",
            ["replica"],
            buckets=_ITL_BUCKETS_S,
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            "strata_e2e_request_latency_seconds",
            "Time from a request's arrival at the API to its end.",
            ["replica"],
            buckets=_E2E_BUCKETS_S,
            registry=self.registry,
        )
        self.requests = Counter(
            "strata_requests",
            "Requests that ended, by replica and finish reason (stop, length, abort, error).",
            ["replica", "finish_reason"],
            registry=self.registry,
        )
        self.autoscale_decisions: Counter | None = None  # with an autoscaling policy
        self.autoscale_desired_replicas: Gauge | None = None

    def track(self) -> RequestMetrics:
        return RequestMetrics(self)

    def record_autoscale(self, direction: str, num_replicas: int) -> None:
        """One decision of the autoscaling policy (``cluster.autoscale``): its direction (up,
        down, hold) and the size it wants. The families appear with the first decision."""
        if self.autoscale_decisions is None:
            self.autoscale_decisions = Counter(
                "strata_autoscale_decisions",
                "Decisions of the autoscaling policy, one per tick, by direction (up, down, hold).",
                ["direction"],
                registry=self.registry,
            )
            self.autoscale_desired_replicas = Gauge(
                "strata_autoscale_desired_replicas",
                "Replicas the autoscaling policy wants at its last decision.",
                registry=self.registry,
            )
        self.autoscale_decisions.labels(direction).inc()
        self.autoscale_desired_replicas.set(num_replicas)

    def render(self, stats: ClusterStats | None) -> bytes:
        """The Prometheus text exposition of this app's metrics and of ``stats``."""
        return generate_latest(_Scrape(self.registry, cluster_metric_families(stats)))
