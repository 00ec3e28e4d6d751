"""What the host tier keeps, what it would keep with more memory or write-back, and, with the
adaptive policy, which blocks leaving the NPU tier are worth storing.

One ``RetentionTracker`` per cache type of a manager with a host tier, fed by the manager:

* **Ghost records**: hashes of blocks recently *dropped* (evicted from the NPU tier with no host
  copy) and recently *evicted from the host tier*, each an LRU list bounded by ``GHOST_FACTOR``
  (4) x the host tier's capacity in blocks. A *ghost hit* is a prompt block of a later request,
  past the prefix the cache served, found in one of them: a block the host tier would have
  served had it kept it. The walk stops at the first block that is nowhere (a prefix hit is
  contiguous). Hashes carry the tenant's salt, so a ghost hit never crosses tenants.
* **Shadow host tiers**: hash-only copies of the host tier at 0.5x, 2x and 4x its capacity under
  the running policy, and at 1x with write-back off and on (and adaptive, when it runs). Each
  sees the events the real tier sees (promotion candidates, NPU evictions, each new request's
  prompt and the landing of each step's transfers) and applies the same rules (LRU by last
  store or load, a step's stores before its loads; a block already present is not stored
  again; write-back stores an NPU-only block the NPU tier evicts; an adaptive shadow stores a
  promotion candidate when it is evicted, as the policy does), so the host blocks each
  would have served are the miss-ratio curve (``RetentionStats.estimated_host_hit_tokens``).
  The 1x shadow of the running policy equals the real tier; the tests check it. A shadow sees
  one replica's traffic as it was routed: in a cluster, a host tier of another size would also
  change where the router sends requests, which no per-replica estimate captures.
* **The adaptive policy** (``retention="adaptive"``): every store is made when the NPU tier
  evicts a block, none before. A block that reaches the promotion threshold is not copied then
  but marked (its hit count), and stored when the NPU tier evicts it: a block that stays on the
  NPU tier to the end costs no store, and every other promoted block is stored as promotion
  would have stored it, one eviction later (a host copy serves only once the NPU copy is gone).
  The threshold itself is not moved (at 1 it promoted every block requested twice, one-off
  ones included). Every block the NPU tier evicts falls in a bucket by its hits while on the
  NPU tier (0, 1, 2, 3 or more) and whether it was reused after an earlier eviction, and its
  reuse is watched (a later hit on its host copy, or a ghost hit). An eviction counts in its
  bucket once it is *resolved*: reused, or not reused within a horizon of ``HORIZON_FACTOR``
  (0.5) x the host capacity in later NPU evictions (at write-back's rate of stores, halfway
  through a stored block's host lifetime); until then it counts nothing, so a kind of block is
  not judged by evictions too recent to have come back (a reuse after the horizon still counts
  as a reuse).
  A block with no host copy, short of the promotion threshold, is stored when its bucket's
  observed reuse probability ``p`` pays for the copy::

      p - z * se(p) > store / (recompute - reload)      while the host tier has room
      p > store / (recompute - reload) + q + bar        once a store would evict a host block

  with ``recompute``, ``reload`` and ``store`` the measured seconds per block (never stored
  when a reload costs as much as a recompute), ``se(p)`` the estimate's standard error and
  ``z`` = ``CONFIDENCE_Z`` (0.5: a kind seen reused once in a hundred evictions is not stored
  on that alone), ``q`` the reuse probability of what the host
  tier evicts to make room (its ghost hits per eviction) and ``bar`` a margin that starts at
  ``MIN_REUSE`` (0.4) and follows the shadows: every ``CONTROL_PERIOD`` (256) evictions it
  rises by 0.05 when the 1x shadow without write-back (the same promotion, no store at
  eviction) served more host blocks than the policy did, and falls by 0.05 when the one with
  write-back (a store at every eviction) did; so the policy sits between the two fixed ones
  and moves toward the better. Counts halve every ``max(256, 2 x capacity)`` evictions (a
  reuse or an expiry counts with the weight its eviction has by then), so it follows changing
  traffic.

Memory: one tracked hash costs about ``BYTES_PER_TRACKED_BLOCK`` (160) bytes. The ghost lists, the
policy's reuse watch and its record of reused blocks hold at most 4 x capacity hashes each, the
open evictions 0.5 x capacity records (about 105 bytes each: an ordered-dict entry keyed by its
index; the record itself is shared with the ghost lists), and the shadows 8.5 x capacity (0.5 + 1 +
1 + 2 + 4; 9.5 with adaptive). Shadows are kept smallest first while they fit in
``MAX_SHADOW_BLOCKS`` hashes per cache type (2M, about 320 MiB: every shadow up to 220k host
blocks); a larger one is not kept and its estimate is absent.
"""

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from replicas.kv.hashing import BlockHash

CAPACITY_FACTORS = (0.5, 2.0, 4.0)
"""Host capacities, as multiples of the real one, estimated under the running policy."""

MAX_SHADOW_BLOCKS = 1 << 21
"""Most hashes the shadows of one cache type hold together."""

BYTES_PER_TRACKED_BLOCK = 160
"""Measured with tracemalloc: a 16-byte block hash as ``bytes`` (about 57 bytes once allocated)
plus its ``OrderedDict`` entry (about 105)."""

HIT_CLASSES = 4  # NPU hits before eviction: 0, 1, 2, 3 or more
NUM_BUCKETS = 2 * HIT_CLASSES  # ... and whether the block was reused after an eviction before
GHOST_FACTOR = 4
"""Each ghost list (and the policy's reuse watch) holds this many times the host capacity: a
block stored to host may outlive that many stores when the policy stores few."""
MIN_REUSE = 0.4
"""The bar's starting value: a block must be reused four times in ten to be stored until the
shadows show that storing more (or less) would have served more."""
MIN_WINDOW = 256
CONFIDENCE_Z = 0.5  # standard errors taken off a reuse estimate while the host tier has room
HORIZON_FACTOR = 0.5
"""An eviction counts in its bucket once it is reused or once this many host capacities of NPU
evictions have passed without a reuse; until then it is open and counts nothing."""
CONTROL_PERIOD = 256  # NPU evictions between two looks at the shadows
BAR_STEP, BAR_MAX = 0.05, 1.0


class BlockCosts(NamedTuple):
    """Seconds per block: computing its KV again, loading it host -> NPU, storing NPU -> host."""

    recompute_s: float
    reload_s: float
    store_s: float


DEFAULT_COSTS = BlockCosts(recompute_s=1.0, reload_s=0.05, store_s=0.05)
"""Until the engine has measured its own: a reload or store at 5% of a recompute."""


OFF, ON, ADAPTIVE = "off", "on", "adaptive"
"""What a host tier does with an NPU-only block the NPU tier evicts: drop it, store it, or
let the adaptive policy decide."""


class ShadowKey(NamedTuple):
    capacity_factor: float  # host blocks, as a multiple of the real tier's
    write_back: str  # OFF, ON or ADAPTIVE


@dataclass(slots=True)
class RetentionStats:
    """One cache type's ghost records, miss-ratio curve and adaptive decisions. Every field is a
    count (or a current size) and adds up across replicas; the estimated host hit rate at a point
    of the curve is ``estimated_host_hit_tokens[key] / CacheStats.queries``, comparable with the
    measured ``CacheStats.host_hits / CacheStats.queries``."""

    ghost_hits_dropped: int = 0  # blocks that would have been host hits had write-back kept them
    ghost_hits_host_evicted: int = 0  # blocks the host tier would have served with more room
    num_ghosts_dropped: int = 0
    num_ghosts_host_evicted: int = 0
    estimated_host_hit_tokens: dict[ShadowKey, int] = field(default_factory=dict)
    adaptive_stores: int = 0  # blocks the adaptive policy stored when the NPU tier evicted them
    adaptive_skips: int = 0  # blocks it let go


class _Eviction(NamedTuple):
    bucket: int
    window_index: int
    index: int  # the tracker's count of NPU evictions before this one


class ShadowHostTier:
    """A host tier of ``capacity`` blocks holding hashes only, LRU by last store or load."""

    __slots__ = ("_landing", "_lru", "capacity", "num_host_hit_blocks", "write_back")

    def __init__(self, capacity: int, write_back: str) -> None:
        self.capacity = capacity
        self.write_back = write_back
        self.num_host_hit_blocks = 0
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()
        self._landing: list[BlockHash] = []  # loaded, until the step's transfers land

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def store(self, block_hash: BlockHash) -> None:
        """Store a block not yet held (a held one is left where it is, like the real tier)."""
        lru = self._lru
        if block_hash in lru:
            return
        lru[block_hash] = None
        if len(lru) > self.capacity:
            lru.popitem(last=False)

    def load(self, block_hash: BlockHash) -> bool:
        """A prompt block not on the NPU tier: True (and most recently used) if held."""
        if block_hash not in self._lru:
            return False
        self._lru.move_to_end(block_hash)
        self._landing.append(block_hash)
        self.num_host_hit_blocks += 1
        return True

    def landed(self) -> None:
        """A step's transfers landed: like the real tier, which unlocks a step's stored blocks
        before its loaded ones, make the loaded blocks the most recently used."""
        lru = self._lru
        for block_hash in self._landing:
            if block_hash in lru:
                lru.move_to_end(block_hash)
        self._landing.clear()

    def clear(self) -> None:
        self._lru.clear()
        self._landing.clear()


def _bounded_put(ghosts: OrderedDict, key: BlockHash, value: object, bound: int) -> None:
    ghosts[key] = value
    ghosts.move_to_end(key)
    if len(ghosts) > bound:
        ghosts.popitem(last=False)


DISK_WARMUP_EVICTIONS = 64
"""Host evictions the adaptive policy stores to a disk tier before it decides by their reuse."""


class RetentionTracker:
    """Ghost records, shadow host tiers and the adaptive policy of one cache type.

    With a disk tier behind the host tier (``behind_disk``), the adaptive policy also decides
    whether a block the host tier evicts is stored to disk: after ``DISK_WARMUP_EVICTIONS``,
    when the reuse of host-evicted blocks (ghost hits, and disk hits of blocks host evicted)
    beats ``store / (recompute - reload - disk read)``."""

    def __init__(
        self,
        num_host_blocks: int,
        write_back: bool,
        adaptive: bool = False,
        max_shadow_blocks: int = MAX_SHADOW_BLOCKS,
        promotion_threshold: int | None = None,
    ) -> None:
        if num_host_blocks < 1:
            raise ValueError("a retention tracker needs a host tier")
        self.capacity = num_host_blocks
        self.promotion_threshold = promotion_threshold  # adaptive: stored at eviction from there
        self._ghost_bound = GHOST_FACTOR * num_host_blocks
        self.adaptive = adaptive
        self.write_back = write_back and not adaptive
        self.costs = DEFAULT_COSTS
        self.stats = RetentionStats()
        # hash -> (bucket, window) of its NPU eviction; None for a block never NPU-evicted
        self._dropped: OrderedDict[BlockHash, _Eviction] = OrderedDict()
        self._host_evicted: OrderedDict[BlockHash, _Eviction | None] = OrderedDict()
        self._kept: OrderedDict[BlockHash, _Eviction] = OrderedDict()  # copy on host
        self._proven: OrderedDict[BlockHash, None] = OrderedDict()  # reused after an eviction
        self._evicted = [0.0] * NUM_BUCKETS  # resolved: reused, or unused past the horizon
        self._reused = [0.0] * NUM_BUCKETS
        self._horizon = max(1, int(HORIZON_FACTOR * num_host_blocks))
        self._open: OrderedDict[int, _Eviction] = OrderedDict()  # by index: not yet resolved
        self._host_evictions = 0.0
        self._host_ghost_hits = 0.0
        self._num_host_evictions_seen = 0  # not halved: the disk decision's warm-up
        self.behind_disk = False  # set by the manager when a disk tier is on
        self._window = max(MIN_WINDOW, 2 * num_host_blocks)
        self._window_index = 0  # counts halve at the end of each window
        self._num_evictions = 0
        self._bar = MIN_REUSE  # added to the reuse a store must beat; the shadows move it
        self._served_at_window: dict[ShadowKey, int] = {}
        running = ADAPTIVE if adaptive else (ON if self.write_back else OFF)
        points = [ShadowKey(1.0, running)]
        points += [ShadowKey(1.0, policy) for policy in (OFF, ON) if policy != running]
        points += [ShadowKey(factor, running) for factor in CAPACITY_FACTORS]
        self._shadows: dict[ShadowKey, ShadowHostTier] = {}
        budget = max_shadow_blocks
        for key in sorted(points, key=lambda k: k.capacity_factor):
            capacity = max(1, int(key.capacity_factor * num_host_blocks))
            if capacity > budget:
                break  # this one and every larger one
            budget -= capacity
            self._shadows[key] = ShadowHostTier(capacity, key.write_back)

    # ---- events ------------------------------------------------------------------------------
    def admitted(self, hashes: list[BlockHash], on_npu: list[bool], on_host: list[bool]) -> None:
        """A new request's prompt blocks (those a match may cover) with their residency before
        the cache serves it."""
        num_blocks = len(hashes)
        served = 0
        while served < num_blocks and (on_npu[served] or on_host[served]):
            if not on_npu[served]:
                eviction = self._kept.pop(hashes[served], None)
                if eviction is not None:
                    self._reuse(hashes[served], eviction)
                if self.behind_disk and hashes[served] in self._host_evicted:
                    self._host_evicted.pop(hashes[served])  # back from disk: a reuse
                    self._host_ghost_hits += 1
            served += 1
        for index in range(served, num_blocks):
            block_hash = hashes[index]
            if on_npu[index] or on_host[index]:
                continue
            eviction = self._dropped.pop(block_hash, None)
            if eviction is not None:
                self.stats.ghost_hits_dropped += 1
                self._reuse(block_hash, eviction)
                continue
            if block_hash in self._host_evicted:
                eviction = self._host_evicted.pop(block_hash)
                self.stats.ghost_hits_host_evicted += 1
                self._host_ghost_hits += 1
                if eviction is not None:
                    self._reuse(block_hash, eviction)
                continue
            break
        for shadow in self._shadows.values():
            for index in range(num_blocks):
                if not on_npu[index] and not shadow.load(hashes[index]):
                    break

    def promotion_candidate(self, block_hash: BlockHash) -> None:
        """A block on the NPU tier reached the promotion threshold (or was written, at 0): the
        shadows of the fixed policies store it now; the adaptive ones when it is evicted."""
        for shadow in self._shadows.values():
            if shadow.write_back != ADAPTIVE:
                shadow.store(block_hash)

    def should_store(self, block_hash: BlockHash, num_hits: int, host_full: bool) -> bool:
        """Whether a block the NPU tier evicts, with no host copy, is stored to host;
        ``host_full``: every host block holds a cached block (a store would evict one)."""
        if not self.adaptive:
            return self.write_back
        return self._adaptive_stores(self._bucket(block_hash, num_hits), num_hits, host_full)

    def _adaptive_stores(self, bucket: int, num_hits: int, host_full: bool) -> bool:
        """The adaptive decision: a promoted block (its hits at the threshold) is stored whenever
        a reload beats a recompute; any other when its bucket's reuse pays (``_pays``)."""
        threshold = self.promotion_threshold
        if threshold is not None and num_hits >= threshold:
            recompute, reload, _ = self.costs
            return recompute > reload
        return self._pays(bucket, host_full)

    def _bucket(self, block_hash: BlockHash, num_hits: int) -> int:
        proven = HIT_CLASSES if block_hash in self._proven else 0
        return proven + min(num_hits, HIT_CLASSES - 1)

    def _reuse(self, block_hash: BlockHash, eviction: "_Eviction") -> None:
        """A block evicted earlier was requested again: it counts in its bucket with the weight
        its eviction has now (halved at every window's end, like the eviction counts)."""
        bucket, window_index, index = eviction
        weight = 0.5 ** (self._window_index - window_index)
        self._reused[bucket] += weight
        if self._open.pop(index, None) is not None:  # reused within the horizon: resolved now
            self._evicted[bucket] += weight
        _bounded_put(self._proven, block_hash, None, self._ghost_bound)

    def _resolve_expired(self) -> None:
        """Evictions followed by ``horizon`` more and not reused count as not reused."""
        oldest = self._num_evictions - self._horizon
        while self._open and next(iter(self._open)) < oldest:
            bucket, window_index, _ = self._open.popitem(last=False)[1]
            self._evicted[bucket] += 0.5 ** (self._window_index - window_index)

    def npu_evicted(self, block_hash: BlockHash, num_hits: int, kept: bool) -> None:
        """The NPU tier evicted a cached block; ``kept``: it has a host copy now."""
        bucket = self._bucket(block_hash, num_hits)
        if self.adaptive:  # as should_store decided, for a full and a roomy shadow
            pays = {full: self._adaptive_stores(bucket, num_hits, full) for full in (True, False)}
        eviction = _Eviction(bucket, self._window_index, self._num_evictions)
        self._open[eviction.index] = eviction
        if kept:
            _bounded_put(self._kept, block_hash, eviction, self._ghost_bound)
        else:
            _bounded_put(self._dropped, block_hash, eviction, self._ghost_bound)
        for shadow in self._shadows.values():
            if shadow.write_back == ON or (
                shadow.write_back == ADAPTIVE and pays[len(shadow) >= shadow.capacity]
            ):
                shadow.store(block_hash)
        self._num_evictions += 1
        self._resolve_expired()
        if self.adaptive and self._num_evictions % CONTROL_PERIOD == 0:
            self._follow_shadows()
        if self._num_evictions % self._window == 0:
            self._end_window()

    def adaptive_decision(self, stored: bool) -> None:
        if stored:
            self.stats.adaptive_stores += 1
        else:
            self.stats.adaptive_skips += 1

    def disk_write_back_pays(self, disk_read_s: float) -> bool:
        """Whether the block the host tier evicts next is stored to disk (adaptive policy)."""
        if self._num_host_evictions_seen < DISK_WARMUP_EVICTIONS:
            return True
        recompute, reload, store = self.costs
        gain = recompute - reload - disk_read_s
        if gain <= 0:
            return False
        return self._host_ghost_hits / (self._host_evictions + 1.0) > store / gain

    def host_evicted(self, block_hash: BlockHash) -> None:
        self._num_host_evictions_seen += 1
        self._host_evictions += 1
        _bounded_put(
            self._host_evicted, block_hash, self._kept.pop(block_hash, None), self._ghost_bound
        )

    def transfers_landed(self) -> None:
        for shadow in self._shadows.values():
            shadow.landed()

    def host_reset(self) -> None:
        """The host tier was emptied: so is every shadow."""
        self._kept.clear()
        for shadow in self._shadows.values():
            shadow.clear()

    def set_costs(self, costs: BlockCosts) -> None:
        self.costs = costs

    # ---- the policy --------------------------------------------------------------------------
    def reuse_probability(self, bucket: int) -> float:
        """Observed share of the bucket's evicted blocks requested again (prior: 1 in 2)."""
        return (self._reused[bucket] + 0.5) / (self._evicted[bucket] + 1.0)

    def _confident_reuse(self, bucket: int) -> float:
        """The reuse probability less ``CONFIDENCE_Z`` standard errors: a store must pay even if
        the bucket reuses somewhat less than observed so far."""
        p = self.reuse_probability(bucket)
        return p - CONFIDENCE_Z * math.sqrt(p * (1 - p) / (self._evicted[bucket] + 1.0))

    def _pays(self, bucket: int, host_full: bool) -> bool:
        """Whether storing a block of ``bucket`` pays. While the host tier has room, a store
        displaces nothing: its reuse (less ``CONFIDENCE_Z`` standard errors, so that a kind seen a
        few times is not stored on luck) must beat the copy's cost. Once a store would evict a host
        block, the observed reuse must also beat that block's and the bar, which the shadows
        steer."""
        recompute, reload, store = self.costs
        gain = recompute - reload
        if gain <= 0:
            return False
        if not host_full:
            return self._confident_reuse(bucket) > store / gain
        displaced = self._host_ghost_hits / (self._host_evictions + 1.0)
        return self.reuse_probability(bucket) > store / gain + displaced + self._bar

    def _end_window(self) -> None:
        self._window_index += 1
        self._evicted = [count / 2 for count in self._evicted]
        self._reused = [count / 2 for count in self._reused]
        self._host_evictions /= 2
        self._host_ghost_hits /= 2

    def _follow_shadows(self) -> None:
        """Over the last ``CONTROL_PERIOD`` evictions, compare the host blocks the policy served
        with what never storing at eviction (write-back off) and always storing (on) would have
        served at the same capacity: raise the bar when storing less would have served more, lower
        it when storing more would have."""
        served = {}
        for key in (ShadowKey(1.0, ADAPTIVE), ShadowKey(1.0, OFF), ShadowKey(1.0, ON)):
            shadow = self._shadows.get(key)
            if shadow is None:
                return
            served[key.write_back] = shadow.num_host_hit_blocks - self._served_at_window.get(key, 0)
            self._served_at_window[key] = shadow.num_host_hit_blocks
        if served[OFF] > served[ADAPTIVE] and served[OFF] >= served[ON]:
            self._bar = min(BAR_MAX, self._bar + BAR_STEP)
        elif served[ON] > served[ADAPTIVE]:
            self._bar = max(0.0, self._bar - BAR_STEP)

    # ---- views -------------------------------------------------------------------------------
    def snapshot(self, block_size: int) -> RetentionStats:
        stats = self.stats
        return RetentionStats(
            stats.ghost_hits_dropped,
            stats.ghost_hits_host_evicted,
            len(self._dropped),
            len(self._host_evicted),
            {k: shadow.num_host_hit_blocks * block_size for k, shadow in self._shadows.items()},
            stats.adaptive_stores,
            stats.adaptive_skips,
        )

    @property
    def shadow_keys(self) -> list[ShadowKey]:
        return list(self._shadows)


# ---- the tuning hint -------------------------------------------------------------------------
NOTABLE_POINTS = 1.0
"""Hit-rate points (of prompt tokens) below which the hint calls a difference negligible."""


def estimated_hit_rates(stats: RetentionStats, num_query_tokens: int) -> dict[ShadowKey, float]:
    """Host hit rate (host-served tokens / prompt tokens) at each point of the curve."""
    if num_query_tokens <= 0:
        return {}
    return {
        key: tokens / num_query_tokens for key, tokens in stats.estimated_host_hit_tokens.items()
    }


_POLICY_NAMES = {OFF: "write-back off", ON: "write-back on", ADAPTIVE: "adaptive retention"}


def tuning_hint(
    cache_type: str,
    stats: RetentionStats,
    num_query_tokens: int,
    policy: str,
) -> str | None:
    """One line for the server log: the curve, and which step of the tuning sequence (write-back
    first, then more host memory, then a higher threshold or less host memory) the traffic
    since start-up supports. ``policy``: OFF, ON or ADAPTIVE. None before any query."""
    rates = estimated_hit_rates(stats, num_query_tokens)
    current = rates.get(ShadowKey(1.0, policy))
    if current is None:
        return None

    def points(key: ShadowKey) -> float | None:
        rate = rates.get(key)
        return None if rate is None else 100 * (rate - current)

    off, on = points(ShadowKey(1.0, OFF)), points(ShadowKey(1.0, ON))
    more = {f: points(ShadowKey(f, policy)) for f in CAPACITY_FACTORS}
    curve = ", ".join(
        f"{f:g}x {'+' if p >= 0 else ''}{p:.1f}" for f, p in more.items() if p is not None
    )
    parts = [
        f"host tier [{cache_type}] ({_POLICY_NAMES[policy]}): host hit rate "
        f"{100 * current:.1f}% of {num_query_tokens} prompt tokens; points of hit rate with "
        f"other host memory: {curve}",
        f"ghost hits: {stats.ghost_hits_dropped} blocks dropped without a host copy, "
        f"{stats.ghost_hits_host_evicted} evicted from host",
    ]
    served = stats.estimated_host_hit_tokens
    if policy == OFF and on is not None and on >= NOTABLE_POINTS:
        now, then = served[ShadowKey(1.0, OFF)], served[ShadowKey(1.0, ON)]
        more_served = f"{100 * (then / now - 1):.0f}% more" if now else f"{then} prompt tokens"
        advice = (
            f"write-back would have served {more_served} from host (+{on:.1f} points): try "
            "--experimental-kv-offload-write-back or --experimental-kv-offload-retention adaptive"
        )
    elif more.get(2.0) is not None and more[2.0] >= NOTABLE_POINTS:
        advice = f"2x host memory would add {more[2.0]:.1f} points of hit rate: raise it"
    elif policy == ON and off is not None and off >= NOTABLE_POINTS:
        advice = (
            f"write-back costs {off:.1f} points (blocks evicted once crowd out reused ones): "
            "turn it off, raise the write-through threshold, or try adaptive retention"
        )
    elif more.get(0.5) is not None and -more[0.5] < NOTABLE_POINTS / 2 and current > 0:
        advice = "half the host memory would serve as much: this traffic needs less"
    else:
        advice = "the current settings fit this traffic"
    return "; ".join([*parts, advice])
