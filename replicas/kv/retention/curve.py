"""Ghost records and shadow host tiers: the miss-ratio curve of one cache type, estimated on a
spatial sample of block hashes.

* **Ghost records**: hashes of blocks recently *dropped* (evicted from the NPU tier with no host
  copy) and recently *evicted from the host tier*, each an LRU list bounded by ``GHOST_FACTOR``
  (4) x the host tier's capacity in blocks. A *ghost hit* is a prompt block of a later request,
  past the prefix the cache served, found in one of them: a block the host tier would have
  served had it kept it. The walk stops at the first block that is nowhere (a prefix hit is
  contiguous). Hashes carry the tenant's salt, so a ghost hit never crosses tenants.
* **Shadow host tiers**: hash-only copies of the host tier at 0.5x, 2x and 4x its capacity under
  the running policy, and at 1x under it and under the fixed policy with write-back off and on.
  Each sees the events the real tier sees (promotion candidates, NPU evictions, each new
  request's prompt and the landing of each step's transfers) and applies the same rules (LRU by
  last store or load, a step's stores before its loads; a block already present is not stored
  again; a policy that decides at eviction stores a promoted block only when it is evicted, and
  any block its ``should_store`` accepts, asked with the shadow's own fullness), so the host
  blocks each would have served are the miss-ratio curve
  (``RetentionStats.estimated_host_hit_tokens``). Unsampled, the 1x shadow of the running policy
  equals the real tier; the tests check it. A shadow sees one replica's traffic as it was
  routed: in a cluster, a host tier of another size would also change where the router sends
  requests, which no per-replica estimate captures.

**Sampling** (SHARDS, Waldspurger et al., FAST '15): only block hashes below a threshold, a
share ``sample_rate`` of all hashes, enter the ghost records and the shadows; their bounds and
capacities are ``sample_rate`` x the full ones, and every count they report is divided by
``sample_rate``. Block hashes are uniform digests (``replicas.kv.hashing``), so a hash is in the
sample or not for good, in every replica. A sampled walk steps over the unsampled blocks: it
stops at the first *sampled* block that is nowhere (or missing from a shadow).

The rate (``sample_rate_for``) is ``DEFAULT_TRACKED_SHARE`` (1%) of the host capacity in
tracked hashes over the hashes tracked at rate 1 (``tracked_factor``: 16.5 x the capacity, 17.5
with a policy outside the fixed pair), but never below ``MIN_SAMPLED_BLOCKS`` (1,024) / capacity,
so that the 1x shadow samples at least 1,024 blocks, and at most 1 (every hash, below 1,024
host blocks). The 1% bound therefore holds from ``tracked_factor x MIN_SAMPLED_BLOCKS /
DEFAULT_TRACKED_SHARE`` host blocks: 1.69M (fixed policy) or 1.79M (adaptive); below that the
curve tracks ``tracked_factor x MIN_SAMPLED_BLOCKS`` hashes (about 17k, 2.7 MiB), and below 1,024
host blocks every hash. A rate of 1 (``KVOffloadConfig.miss_ratio_curve_sample_rate``) keeps
exact shadows.

Memory: one tracked hash costs about ``BYTES_PER_TRACKED_BLOCK`` (160) bytes. Shadows are kept
smallest first while they fit in ``MAX_SHADOW_BLOCKS`` hashes per cache type (2M, about 320 MiB:
every exact shadow up to 220k host blocks); a larger one is not kept and its estimate is absent.
"""

from collections import OrderedDict
from itertools import compress
from typing import NamedTuple

from replicas.kv.hashing import BlockHash
from replicas.kv.retention.fixed import OFF, ON, FixedPolicy
from replicas.kv.retention.policy import PolicyContext, RetentionPolicy

CAPACITY_FACTORS = (0.5, 2.0, 4.0)
"""Host capacities, as multiples of the real one, estimated under the running policy."""

MAX_SHADOW_BLOCKS = 1 << 21
"""Most hashes the shadows of one cache type hold together."""

BYTES_PER_TRACKED_BLOCK = 160
"""Measured with tracemalloc: a 16-byte block hash as ``bytes`` (about 57 bytes once allocated)
plus its ``OrderedDict`` entry (about 105)."""

GHOST_FACTOR = 4
"""Each ghost list holds this many times the host capacity: a block stored to host may outlive
that many stores when the policy stores few."""

DEFAULT_TRACKED_SHARE = 0.01
"""By default the curve tracks this share of the host capacity in hashes (above the floor)."""

MIN_SAMPLED_BLOCKS = 1024
"""The floor: the default rate samples at least this many blocks of the 1x shadow."""


class ShadowKey(NamedTuple):
    capacity_factor: float  # host blocks, as a multiple of the real tier's
    write_back: str  # the policy's ``curve_name``: OFF, ON, ADAPTIVE, ...


def tracked_factor(num_shadows_at_1x: int) -> float:
    """Hashes tracked at rate 1 per host block: two ghost lists, the 1x shadows (the running
    policy's, and write-back off and on where the running policy is neither: 2 or 3) and the
    other capacities'."""
    return 2 * GHOST_FACTOR + num_shadows_at_1x + sum(CAPACITY_FACTORS)


def sample_rate_for(num_host_blocks: int, factor: float) -> float:
    """The default rate: 1% of the host capacity in tracked hashes, at least
    ``MIN_SAMPLED_BLOCKS`` sampled blocks in the 1x shadow, at most every hash."""
    share = DEFAULT_TRACKED_SHARE / factor
    return min(1.0, max(share, MIN_SAMPLED_BLOCKS / num_host_blocks))


class ShadowHostTier:
    """A host tier of ``capacity`` blocks holding hashes only, LRU by last store or load, kept
    by the rules of ``policy``."""

    __slots__ = ("_landing", "_lru", "capacity", "num_host_hit_blocks", "policy")

    def __init__(self, capacity: int, policy: RetentionPolicy) -> None:
        self.capacity = capacity
        self.policy = policy
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


def bounded_put(records: OrderedDict, key: BlockHash, value: object, bound: int) -> None:
    """Record ``key`` as the most recent, forgetting the oldest beyond ``bound``."""
    records[key] = value
    records.move_to_end(key)
    if len(records) > bound:
        records.popitem(last=False)


class GhostRecords:
    """Two LRU lists of hashes, blocks dropped at NPU eviction and blocks the host tier evicted,
    each bounded; a value rides along with each hash (the adaptive policy's eviction record)."""

    __slots__ = ("bound", "dropped", "host_evicted")

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.dropped: OrderedDict[BlockHash, object] = OrderedDict()
        self.host_evicted: OrderedDict[BlockHash, object] = OrderedDict()

    def add_dropped(self, block_hash: BlockHash, value: object = None) -> None:
        bounded_put(self.dropped, block_hash, value, self.bound)

    def add_host_evicted(self, block_hash: BlockHash, value: object = None) -> None:
        bounded_put(self.host_evicted, block_hash, value, self.bound)


class MissRatioCurve:
    """Ghost records and shadow host tiers of one cache type, on a sample of the hashes."""

    __slots__ = (
        "_ghosts",
        "_shadows",
        "_threshold",
        "behind_disk",
        "ghost_hits_dropped",
        "ghost_hits_host_evicted",
        "sample_rate",
    )

    def __init__(
        self,
        policy: RetentionPolicy,
        context: PolicyContext,
        sample_rate: float | None = None,
        max_shadow_blocks: int = MAX_SHADOW_BLOCKS,
    ) -> None:
        capacity = context.num_host_blocks
        running = policy.curve_name
        rules: dict[str, RetentionPolicy] = {running: policy}
        for write_back, name in ((False, OFF), (True, ON)):
            if name != running:
                rules[name] = FixedPolicy(context._replace(write_back=write_back))
        if sample_rate is None:
            sample_rate = sample_rate_for(capacity, tracked_factor(len(rules)))
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"the curve's sample rate must be in (0, 1], got {sample_rate}")
        # a hash is sampled when below the threshold (bytes compare as big-endian numbers)
        threshold = round(sample_rate * 2**64)
        self._threshold = None if threshold >= 2**64 else threshold.to_bytes(8, "big")
        self.sample_rate = 1.0 if self._threshold is None else threshold / 2**64
        self.behind_disk = False  # a disk tier behind the host tier: see RetentionTracker
        self._ghosts = GhostRecords(max(1, int(GHOST_FACTOR * capacity * self.sample_rate)))
        self.ghost_hits_dropped = 0  # sampled
        self.ghost_hits_host_evicted = 0
        points = [ShadowKey(1.0, running)]
        points += [ShadowKey(1.0, name) for name in (OFF, ON) if name != running]
        points += [ShadowKey(factor, running) for factor in CAPACITY_FACTORS]
        self._shadows: dict[ShadowKey, ShadowHostTier] = {}
        budget = max_shadow_blocks
        for key in sorted(points, key=lambda k: k.capacity_factor):
            size = max(1, int(key.capacity_factor * capacity * self.sample_rate))
            if size > budget:
                break  # this one and every larger one
            budget -= size
            self._shadows[key] = ShadowHostTier(size, rules[key.write_back])

    def _sampled(self, hashes: list[BlockHash]) -> list[int]:
        """Indices of the sampled hashes."""
        threshold = self._threshold
        if threshold is None:
            return list(range(len(hashes)))
        return list(compress(range(len(hashes)), map(threshold.__gt__, hashes)))

    def is_sampled(self, block_hash: BlockHash) -> bool:
        return self._threshold is None or block_hash < self._threshold

    # ---- events ------------------------------------------------------------------------------
    def admitted(
        self, hashes: list[BlockHash], on_npu: list[bool], on_host: list[bool], served: int
    ) -> None:
        """A new request's prompt blocks and their residency; the cache serves ``served``."""
        sampled = self._sampled(hashes)
        ghosts = self._ghosts
        for index in sampled:
            block_hash = hashes[index]
            if index < served:
                if self.behind_disk and not on_npu[index]:
                    ghosts.host_evicted.pop(block_hash, None)  # back from disk
                continue
            if on_npu[index] or on_host[index]:
                continue
            if ghosts.dropped.pop(block_hash, ghosts) is not ghosts:
                self.ghost_hits_dropped += 1
            elif ghosts.host_evicted.pop(block_hash, ghosts) is not ghosts:
                self.ghost_hits_host_evicted += 1
            else:
                break
        for shadow in self._shadows.values():
            for index in sampled:
                if not on_npu[index] and not shadow.load(hashes[index]):
                    break

    def promotion_candidate(self, block_hash: BlockHash) -> None:
        if not self.is_sampled(block_hash):
            return
        for shadow in self._shadows.values():
            if not shadow.policy.decides_at_eviction:
                shadow.store(block_hash)

    def npu_evicted(self, block_hash: BlockHash, num_hits: int, kept: bool) -> None:
        if not self.is_sampled(block_hash):
            return
        if not kept:
            self._ghosts.add_dropped(block_hash)
        for shadow in self._shadows.values():
            full = len(shadow) >= shadow.capacity
            if shadow.policy.should_store(block_hash, num_hits, full):
                shadow.store(block_hash)

    def host_evicted(self, block_hash: BlockHash) -> None:
        if self.is_sampled(block_hash):
            self._ghosts.add_host_evicted(block_hash)

    def transfers_landed(self) -> None:
        for shadow in self._shadows.values():
            shadow.landed()

    def host_reset(self) -> None:
        for shadow in self._shadows.values():
            shadow.clear()

    # ---- views -------------------------------------------------------------------------------
    def scaled(self, count: int) -> int:
        """A count over the sampled hashes, as an estimate over all of them."""
        return count if self._threshold is None else round(count / self.sample_rate)

    def num_served(self, key: ShadowKey) -> int | None:
        """Blocks the shadow has served from host so far (sampled; None if not kept)."""
        shadow = self._shadows.get(key)
        return None if shadow is None else shadow.num_host_hit_blocks

    def estimated_host_hit_tokens(self, block_size: int) -> dict[ShadowKey, int]:
        return {
            key: self.scaled(shadow.num_host_hit_blocks * block_size)
            for key, shadow in self._shadows.items()
        }

    def num_ghosts(self) -> tuple[int, int]:
        """Hashes in the dropped and host-evicted ghost lists (scaled)."""
        ghosts = self._ghosts
        return self.scaled(len(ghosts.dropped)), self.scaled(len(ghosts.host_evicted))

    def max_tracked(self) -> int:
        """The most hashes the ghost lists and shadows can hold together (their bounds)."""
        shadows = sum(shadow.capacity for shadow in self._shadows.values())
        return 2 * self._ghosts.bound + shadows

    def num_tracked(self) -> int:
        """Hashes held now (the ghost lists and every shadow), unscaled."""
        ghosts = self._ghosts
        held = len(ghosts.dropped) + len(ghosts.host_evicted)
        return held + sum(len(shadow) for shadow in self._shadows.values())

    @property
    def shadow_keys(self) -> list[ShadowKey]:
        return list(self._shadows)
