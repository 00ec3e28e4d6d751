"""Each tenant's own miss-ratio curve, and the quotas (``tenant_quotas: auto``) that maximise the
cache's hits over them.

**Curves.** Every new request's prompt blocks are accesses of its tenant (``TenantTable``; the
shared pool is not a tenant: it has no quota). Per tenant, an LRU stack of the block hashes it
accessed gives each access its *reuse distance*: how many distinct blocks of the same tenant
were accessed since this one was last, i.e. the fewest blocks the tenant must hold for the
access to hit under LRU within its quota. A histogram of distances is the tenant's hit curve
``hits(c)`` = accesses at distance < ``c``. Sampled as SHARDS does (Waldspurger et al.,
FAST '15): only hashes below ``sample_rate`` of the hash space enter the stacks, distances are
scaled by ``1 / sample_rate``, and each stack keeps at most ``max_tracked`` hashes (distances
beyond are misses at any quota this cache can give).

**Quotas.** ``AutoQuotas`` looks at the curves each time the requests have looked up a
capacity's worth of blocks (``LOOK_EVERY``; an eighth of that with a tenant without a quota
among them: ``NEWCOMER_LOOK``). Every tenant that accessed blocks since the last look first
gets ``min_share`` of the capacity (at most an equal share); the rest goes, ``STEPS`` blocks at
a time, to the tenant whose next blocks gain the most hits per block (looking as far ahead as
the capacity left, so a working set that hits only once whole is seen). A look applies the new
quotas only when they would gain more than ``MIN_GAIN`` of the hits the current ones give
(hysteresis), and scales the histograms by ``DECAY``, so the curves follow the recent traffic.
The quota pool and the disk tier's own slots each have an ``AutoQuotas`` of their own
(``KVCacheManager.auto_quotas``, ``disk_quotas``), sized and sampled at their capacity: a disk
many times the host's holds reuse distances the host's curve never tracks.
"""

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from itertools import accumulate
from typing import NamedTuple

from replicas.kv.hashing import BlockHash
from replicas.kv.tenants import NO_TENANT

STEPS = 64
"""The capacity is shared out in this many steps."""
DECAY = 0.5
"""Each resize multiplies every count by this: the curves weigh the recent traffic most."""
MIN_GAIN = 0.02
"""A resize applies new quotas only when they gain this share of the hits more."""
_SAMPLE_SPACE = 1 << 32


class TenantCurves:
    """Per tenant: a sampled LRU stack of its blocks and a histogram of reuse distances."""

    def __init__(self, sample_rate: float, max_tracked: int) -> None:
        self.sample_rate = sample_rate
        self.max_tracked = max_tracked
        self._threshold = int(sample_rate * _SAMPLE_SPACE)
        self._stacks: dict[int, OrderedDict[BlockHash, None]] = {}
        self.histograms: dict[int, dict[int, float]] = {}  # tenant -> distance -> accesses
        self.accesses: dict[int, float] = {}  # tenant -> sampled accesses, scaled
        # the same, never decayed: the whole run's curve, first accesses (misses) and all
        self.run_histograms: dict[int, dict[int, float]] = {}
        self.run_accesses: dict[int, float] = {}
        # accesses that hit at the quota in force when they came (``access``'s ``quota``)
        self.served_hits: dict[int, float] = {}

    def access(self, tenant: int, hashes: Iterable[BlockHash], quota: float = float("inf")) -> None:
        """A request of ``tenant`` looked up these blocks, in order, while it held ``quota``
        blocks at most."""
        stack = self._stacks.setdefault(tenant, OrderedDict())
        histogram = self.histograms.setdefault(tenant, {})
        run_histogram = self.run_histograms.setdefault(tenant, {})
        weight = 1.0 / self.sample_rate
        for block_hash in hashes:
            if int.from_bytes(block_hash[:4], "little") >= self._threshold:
                continue
            self.accesses[tenant] = self.accesses.get(tenant, 0.0) + weight
            self.run_accesses[tenant] = self.run_accesses.get(tenant, 0.0) + weight
            if block_hash in stack:
                distance = _depth(stack, block_hash)
                bucket = int(distance / self.sample_rate)
                histogram[bucket] = histogram.get(bucket, 0.0) + weight
                run_histogram[bucket] = run_histogram.get(bucket, 0.0) + weight
                if bucket < quota:
                    self.served_hits[tenant] = self.served_hits.get(tenant, 0.0) + weight
                stack.move_to_end(block_hash)
            else:
                stack[block_hash] = None
                if len(stack) > self.max_tracked:
                    stack.popitem(last=False)

    def hits(self, tenant: int, capacity: int) -> float:
        """Accesses of ``tenant`` that hit had it held ``capacity`` blocks (LRU)."""
        return self.curve(tenant).hits(capacity)

    def curve(self, tenant: int, over_run: bool = False) -> "HitCurve":
        """``tenant``'s recent hit curve (decayed), or its whole run's (``over_run``)."""
        histogram = (self.run_histograms if over_run else self.histograms).get(tenant, {})
        distances = sorted(histogram)
        return HitCurve(distances, list(accumulate(histogram[d] for d in distances)))

    def decay(self) -> None:
        """Scale every count by ``DECAY``; a tenant whose accesses fall below one is idle."""
        for histogram in self.histograms.values():
            for distance in histogram:
                histogram[distance] *= DECAY
        self.accesses = {t: n * DECAY for t, n in self.accesses.items() if n * DECAY >= 1.0}

    def active(self) -> list[int]:
        return [t for t, n in self.accesses.items() if n > 0]


class HitCurve(NamedTuple):
    """A tenant's hits by capacity: ``cumulative[i]`` accesses at distance <= ``distances[i]``."""

    distances: list[int]
    cumulative: list[float]

    def hits(self, capacity: int) -> float:
        index = bisect_left(self.distances, capacity)
        return self.cumulative[index - 1] if index else 0.0


def _depth(stack: OrderedDict[BlockHash, None], block_hash: BlockHash) -> int:
    """Distinct blocks accessed since ``block_hash`` (the stack's end is the latest)."""
    for depth, key in enumerate(reversed(stack)):
        if key == block_hash:
            return depth
    raise KeyError(block_hash)


def share_out(
    curves: TenantCurves, tenants: list[int], capacity: int, min_share: float
) -> dict[int, int]:
    """Quotas in blocks maximising the tenants' hits over their curves (module docstring)."""
    if not tenants:
        return {}
    floor = int(capacity * min(min_share, 1.0 / len(tenants)))
    quota = dict.fromkeys(tenants, floor)
    hits = {tenant: curves.curve(tenant).hits for tenant in tenants}
    step = max(1, capacity // STEPS)
    left = capacity - floor * len(tenants)
    while left >= step:
        best, best_gain, best_steps = None, 0.0, 1
        for tenant in tenants:
            base = hits[tenant](quota[tenant])
            for k in range(1, left // step + 1):
                gain = (hits[tenant](quota[tenant] + k * step) - base) / k
                if gain > best_gain:
                    best, best_gain, best_steps = tenant, gain, k
        if best is None:
            break  # no tenant gains from more: the rest stays unassigned (no quota binds it)
        quota[best] += best_steps * step
        left -= best_steps * step
    return quota


def total_hits(curves: TenantCurves, quota: Mapping[int, int]) -> float:
    return sum(curves.hits(tenant, blocks) for tenant, blocks in quota.items())


LOOK_EVERY = 1.0
"""``AutoQuotas`` looks at the curves again once the requests have looked up this many
capacities' worth of blocks since its last look. Traffic, not time: quotas matter as fast as
the cache turns over, which traffic drives, and the same requests give the same quotas."""
NEWCOMER_LOOK = 0.125
"""How soon, in capacities' worth of blocks looked up since the last look, a tenant with no
quota (a new one, one back from idle, or every tenant before the first look) makes
``AutoQuotas`` look again: until then it has no share to keep, so a neighbour over its own
quota evicts it first (benchmarks/README.md, ``tenants`` and ``tenants-sim``)."""
SAMPLED_BLOCKS = 512
"""Each tenant's stack samples about this many blocks of a capacity's worth (all, below it)."""


class AutoQuotas:
    """``tenant_quotas: auto``: the curves of the tenants' requests and, every ``LOOK_EVERY``
    capacities' worth of blocks looked up (sooner for a tenant without a quota:
    ``NEWCOMER_LOOK``), the shares of each tier that maximise their hits."""

    def __init__(self, capacity: int, min_share: float) -> None:
        rate = min(1.0, SAMPLED_BLOCKS / capacity)
        self.curves = TenantCurves(rate, max_tracked=2 * SAMPLED_BLOCKS)
        self.capacity = capacity
        self.min_share = min_share
        self.quota: dict[int, int] = {}  # blocks of ``capacity``, as last applied
        self._looked_up = 0  # blocks the requests looked up since the last look
        self._newcomer = False  # a tenant without a quota has accessed blocks since the last look

    def predicted_hit_rate(self, tenant: int, basis: str = "recent") -> float | None:
        """The share of ``tenant``'s block accesses its curve says hit (None before it has a
        quota). ``basis``: ``recent``, its recent accesses (decayed) at its quota now;
        ``run``, all of them since the start (first accesses included) at its quota now;
        ``served``, all of them, each at the quota in force when it came (the whole capacity
        before the tenant had one)."""
        curves = self.curves
        accesses = (curves.accesses if basis == "recent" else curves.run_accesses).get(tenant)
        if tenant not in self.quota or not accesses:
            return None
        if basis == "served":
            return curves.served_hits.get(tenant, 0.0) / accesses
        return curves.curve(tenant, basis == "run").hits(self.quota[tenant]) / accesses

    def observe(self, tenant: int, hashes: Sequence[BlockHash]) -> None:
        """A new request of ``tenant`` looked up these blocks (the shared pool's too, which
        count towards the next look but have no curve)."""
        self._looked_up += len(hashes)
        if tenant != NO_TENANT:
            self.curves.access(tenant, hashes, self.quota.get(tenant, self.capacity))
            self._newcomer = self._newcomer or tenant not in self.quota

    def resize(self) -> dict[int, float] | None:
        """``look`` once the requests have looked up ``LOOK_EVERY`` capacities' worth of
        blocks since the last look (``NEWCOMER_LOOK``, with a tenant without a quota among
        them); else None."""
        due = LOOK_EVERY if not self._newcomer else min(LOOK_EVERY, NEWCOMER_LOOK)
        if self._looked_up < due * self.capacity:
            return None
        return self.look()

    def look(self) -> dict[int, float] | None:
        """New shares by tenant when they gain enough hits over the current ones, or give a
        newcomer its share (else None); the curves decay either way."""
        self._looked_up = 0
        tenants = self.curves.active()
        self._newcomer = False
        proposed = share_out(self.curves, tenants, self.capacity, self.min_share)
        current = {t: self.quota.get(t, self.capacity) for t in tenants}
        gain = total_hits(self.curves, proposed) - total_hits(self.curves, current)
        changed = set(proposed) != set(self.quota) or gain > MIN_GAIN * total_hits(
            self.curves, current
        )
        self.curves.decay()
        if not changed:
            return None
        self.quota = proposed
        return {t: blocks / self.capacity for t, blocks in proposed.items()}
