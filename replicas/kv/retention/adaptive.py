"""The adaptive retention policy (``retention="adaptive"``): which blocks leaving the NPU tier
are worth storing, learnt from the reuse of earlier evictions.

Every store is made when the NPU tier evicts a block, none before. A block that reaches the
promotion threshold is not copied then but marked (its hit count), and stored when the NPU tier
evicts it: a block that stays on the NPU tier to the end costs no store, and every other
promoted block is stored as promotion would have stored it, one eviction later (a host copy
serves only once the NPU copy is gone). The threshold itself is not moved (at 1 it promoted
every block requested twice, one-off ones included). Every block the NPU tier evicts falls in a
bucket by its hits while on the NPU tier (0, 1, 2, 3 or more) and whether it was reused after an
earlier eviction, and its reuse is watched (a later hit on its host copy, or a ghost hit). An
eviction counts in its bucket once it is *resolved*: reused, or not reused within a horizon of
``HORIZON_FACTOR`` (0.5) x the host capacity in later NPU evictions (at write-back's rate of
stores, halfway through a stored block's host lifetime); until then it counts nothing, so a kind
of block is not judged by evictions too recent to have come back (a reuse after the horizon
still counts as a reuse).

A block with no host copy, short of the promotion threshold, is stored when its bucket's
observed reuse probability ``p`` pays for the copy::

    p - z * se(p) > store / (recompute - reload)      while the host tier has room
    p > store / (recompute - reload) + q + bar        once a store would evict a host block

with ``recompute``, ``reload`` and ``store`` the measured seconds per block (never stored when a
reload costs as much as a recompute), ``se(p)`` the estimate's standard error and ``z`` =
``CONFIDENCE_Z`` (0.5: a kind seen reused once in a hundred evictions is not stored on that
alone), ``q`` the reuse probability of what the host tier evicts to make room (its ghost hits
per eviction) and ``bar`` a margin that starts at ``MIN_REUSE`` (0.4) and follows the
miss-ratio curve's shadows: every ``CONTROL_PERIOD`` (256) evictions it rises by 0.05 when the
1x shadow without write-back (the same promotion, no store at eviction) served more host blocks
than the policy's own did, and falls by 0.05 when the one with write-back (a store at every
eviction) did; so the policy sits between the two fixed ones and moves toward the better. Counts
halve every ``max(256, 2 x capacity)`` evictions (a reuse or an expiry counts with the weight
its eviction has by then), so it follows changing traffic.

With a disk tier behind the host tier, the policy also decides whether a block the host tier
evicts is stored to disk: after ``DISK_WARMUP_EVICTIONS``, when the reuse of host-evicted blocks
(ghost hits, and disk hits of blocks host evicted) beats ``store / (recompute - reload - disk
read)``.

The policy watches every block (not the curve's sample): its own ghost lists, reuse watch and
record of reused blocks hold at most ``GHOST_FACTOR`` (4) x capacity hashes each, and its open
evictions 0.5 x capacity records (about 105 bytes each: an ordered-dict entry keyed by its
index; the record itself is shared with the ghost lists).
"""

import math
from collections import OrderedDict
from typing import NamedTuple

from replicas.kv.hashing import BlockHash
from replicas.kv.retention.curve import (
    GHOST_FACTOR,
    GhostRecords,
    MissRatioCurve,
    ShadowKey,
    bounded_put,
)
from replicas.kv.retention.fixed import OFF, ON
from replicas.kv.retention.policy import (
    DEFAULT_COSTS,
    BlockCosts,
    PolicyContext,
    RetentionPolicy,
    is_promoted,
    register_policy,
)

ADAPTIVE = "adaptive"
"""The adaptive policy's point on the miss-ratio curve."""

HIT_CLASSES = 4  # NPU hits before eviction: 0, 1, 2, 3 or more
NUM_BUCKETS = 2 * HIT_CLASSES  # ... and whether the block was reused after an eviction before
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
DISK_WARMUP_EVICTIONS = 64
"""Host evictions the adaptive policy stores to a disk tier before it decides by their reuse."""


class _Eviction(NamedTuple):
    bucket: int
    window_index: int
    index: int  # the policy's count of NPU evictions before this one


@register_policy("adaptive")
class AdaptivePolicy(RetentionPolicy):
    """Stores at NPU eviction what the reuse of earlier evictions says pays (module docstring)."""

    curve_name = ADAPTIVE
    decides_at_eviction = True
    may_store_to_disk = True

    def __init__(self, context: PolicyContext) -> None:
        capacity = context.num_host_blocks
        self.write_through = context.write_through_threshold  # stored at eviction from there
        self.behind_disk = False  # a disk tier behind the host tier
        self.costs = DEFAULT_COSTS
        self._bound = GHOST_FACTOR * capacity
        # hash -> its NPU eviction; None for a host-evicted block never NPU-evicted
        self._ghosts = GhostRecords(self._bound)
        self._kept: OrderedDict[BlockHash, _Eviction] = OrderedDict()  # copy on host
        self._proven: OrderedDict[BlockHash, None] = OrderedDict()  # reused after an eviction
        self._evicted = [0.0] * NUM_BUCKETS  # resolved: reused, or unused past the horizon
        self._reused = [0.0] * NUM_BUCKETS
        self._horizon = max(1, int(HORIZON_FACTOR * capacity))
        self._open: OrderedDict[int, _Eviction] = OrderedDict()  # by index: not yet resolved
        self._host_evictions = 0.0
        self._host_ghost_hits = 0.0
        self._num_host_evictions_seen = 0  # not halved: the disk decision's warm-up
        self._window = max(MIN_WINDOW, 2 * capacity)
        self._window_index = 0  # counts halve at the end of each window
        self._num_evictions = 0
        self._bar = MIN_REUSE  # added to the reuse a store must beat; the shadows move it
        self._curve: MissRatioCurve | None = None
        self._served_at_window: dict[ShadowKey, int] = {}

    # ---- decisions ---------------------------------------------------------------------------
    def should_store(self, block_hash: BlockHash, num_hits: int, host_full: bool) -> bool:
        """A promoted block (its hits at the threshold) is stored whenever a reload beats a
        recompute; any other when its bucket's reuse pays (``_pays``)."""
        if is_promoted(self.write_through, num_hits):
            recompute, reload, _ = self.costs
            return recompute > reload
        return self._pays(self._bucket(block_hash, num_hits), host_full)

    def should_store_to_disk(self, disk_read_s: float) -> bool:
        if self._num_host_evictions_seen < DISK_WARMUP_EVICTIONS:
            return True
        recompute, reload, store = self.costs
        gain = recompute - reload - disk_read_s
        if gain <= 0:
            return False
        return self._host_ghost_hits / (self._host_evictions + 1.0) > store / gain

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

    def _bucket(self, block_hash: BlockHash, num_hits: int) -> int:
        proven = HIT_CLASSES if block_hash in self._proven else 0
        return proven + min(num_hits, HIT_CLASSES - 1)

    # ---- what the manager reports ------------------------------------------------------------
    def watch_curve(self, curve: MissRatioCurve) -> None:
        self._curve = curve

    def disk_attached(self) -> None:
        self.behind_disk = True

    def admitted(self, hashes: list[BlockHash], on_npu: list[bool], on_host: list[bool]) -> None:
        num_blocks = len(hashes)
        ghosts = self._ghosts
        served = 0
        while served < num_blocks and (on_npu[served] or on_host[served]):
            if not on_npu[served]:
                eviction = self._kept.pop(hashes[served], None)
                if eviction is not None:
                    self._reuse(hashes[served], eviction)
                if self.behind_disk and hashes[served] in ghosts.host_evicted:
                    ghosts.host_evicted.pop(hashes[served])  # back from disk: a reuse
                    self._host_ghost_hits += 1
            served += 1
        for index in range(served, num_blocks):
            block_hash = hashes[index]
            if on_npu[index] or on_host[index]:
                continue
            eviction = ghosts.dropped.pop(block_hash, None)
            if eviction is not None:
                self._reuse(block_hash, eviction)
                continue
            if block_hash in ghosts.host_evicted:
                eviction = ghosts.host_evicted.pop(block_hash)
                self._host_ghost_hits += 1
                if eviction is not None:
                    self._reuse(block_hash, eviction)
                continue
            break

    def npu_evicted(self, block_hash: BlockHash, num_hits: int, kept: bool) -> None:
        eviction = _Eviction(
            self._bucket(block_hash, num_hits), self._window_index, self._num_evictions
        )
        self._open[eviction.index] = eviction
        if kept:
            bounded_put(self._kept, block_hash, eviction, self._bound)
        else:
            self._ghosts.add_dropped(block_hash, eviction)
        self._num_evictions += 1
        self._resolve_expired()
        if self._num_evictions % CONTROL_PERIOD == 0:
            self._follow_shadows()
        if self._num_evictions % self._window == 0:
            self._end_window()

    def host_evicted(self, block_hash: BlockHash) -> None:
        self._num_host_evictions_seen += 1
        self._host_evictions += 1
        self._ghosts.add_host_evicted(block_hash, self._kept.pop(block_hash, None))

    def host_reset(self) -> None:
        self._kept.clear()

    def set_costs(self, costs: BlockCosts) -> None:
        self.costs = costs

    # ---- learning ----------------------------------------------------------------------------
    def _reuse(self, block_hash: BlockHash, eviction: _Eviction) -> None:
        """A block evicted earlier was requested again: it counts in its bucket with the weight
        its eviction has now (halved at every window's end, like the eviction counts)."""
        bucket, window_index, index = eviction
        weight = 0.5 ** (self._window_index - window_index)
        self._reused[bucket] += weight
        if self._open.pop(index, None) is not None:  # reused within the horizon: resolved now
            self._evicted[bucket] += weight
        bounded_put(self._proven, block_hash, None, self._bound)

    def _resolve_expired(self) -> None:
        """Evictions followed by ``horizon`` more and not reused count as not reused."""
        oldest = self._num_evictions - self._horizon
        while self._open and next(iter(self._open)) < oldest:
            bucket, window_index, _ = self._open.popitem(last=False)[1]
            self._evicted[bucket] += 0.5 ** (self._window_index - window_index)

    def _end_window(self) -> None:
        self._window_index += 1
        self._evicted = [count / 2 for count in self._evicted]
        self._reused = [count / 2 for count in self._reused]
        self._host_evictions /= 2
        self._host_ghost_hits /= 2

    def _follow_shadows(self) -> None:
        """Over the last ``CONTROL_PERIOD`` evictions, compare the host blocks the policy's 1x
        shadow served with what never storing at eviction (write-back off) and always storing
        (on) would have served at the same capacity: raise the bar when storing less would have
        served more, lower it when storing more would have."""
        if self._curve is None:
            return
        served = {}
        for key in (ShadowKey(1.0, self.curve_name), ShadowKey(1.0, OFF), ShadowKey(1.0, ON)):
            num_served = self._curve.num_served(key)
            if num_served is None:
                return
            served[key.write_back] = num_served - self._served_at_window.get(key, 0)
            self._served_at_window[key] = num_served
        if served[OFF] > served[self.curve_name] and served[OFF] >= served[ON]:
            self._bar = min(BAR_MAX, self._bar + BAR_STEP)
        elif served[ON] > served[self.curve_name]:
            self._bar = max(0.0, self._bar - BAR_STEP)
