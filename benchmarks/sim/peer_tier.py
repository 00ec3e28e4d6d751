"""The simulator's peer tier: ``replicas.kv.tiers.peer.PeerStore`` without Ray.

The router names a *source* for a request when another replica holds a longer prefix of its
prompt (``Router._with_peer_source``, the real router); the simulated replica offers the
source's blocks to its ``SimPeerStore`` as ``Engine._offer_peer_blocks`` does, and the real
``KVCacheManager`` onboards them as it onboards any backing tier: when its cost rule
(``replicas.kv.onboarding.reload_pays``) says reading them beats computing them, it plans
their reads into host blocks, the request waits for them, then loads them to NPU as host
hits, counted under the ``peer`` tier (``CacheStats.hits_by_source``)::

    router            chosen replica lacks blocks k..n that replica s holds -> source s
    simulated engine  offer(hashes[:n], s); onboarding: blocks k..n-1 -> host, read from s
    transfer          one pull per source and batch: lands PullCost.pull_s(bytes) later; a
                      block the source no longer holds (NPU or host) is a miss, recomputed

Pricing (``PullCost``): a pull of b bytes takes ``fixed_s + b / bytes_per_s``. ``MEASURED`` is
fit by least squares to the ``cluster-cache`` benchmark (``benchmarks/results/cluster-cache``:
two Ray replicas of SmolLM2-135M on this 2-core machine, float32 KV, 737,280 bytes per
16-token block): pulled minus local-hit TTFT, medians, at 1k, 2k and 4k tokens (64, 128 and 256
blocks): 94.9, 161.4 and 338.0 ms, i.e. 6.6 ms + 1.74 ns per byte (575 MB/s; blocks sent as
numpy bytes: as tensors, 2026-12-05, it was 0.523 s + 288 MB/s). On a GPU profile
the per-byte part is charged for that profile's block bytes (a transport that moves KV bytes
at the measured rate whatever produced them, an assumption: the measured path is the CPU,
crc32 on both sides and Ray's object store), the fixed part as measured.

The cost rule weighs ``read_seconds_fixed`` once per pull and ``read_seconds_per_block`` per
block: as the real store's, fitted to the pulls made so far (``replicas.kv.tiers.pull_fit``).
Before the first one the real store assumes 1 GB/s, which on the H200 profile (64 MiB blocks: 67
ms against 11 ms to recompute one) would forbid the first pull and so every later one whatever
the transport; the simulated replica starts instead from the two parts of its ``PullCost``, as
if it had measured them.
"""

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from replicas.kv.events import Tier
from replicas.kv.hashing import BlockHash
from replicas.kv.records import BackingCopy, CacheStats, TierUsage
from replicas.kv.tiers.peer import OFFER_TTL_S
from replicas.kv.tiers.pull_fit import PullFit
from replicas.kv.tiers.registry import plugin
from router.config import RoutingConfig

if TYPE_CHECKING:
    from benchmarks.sim.simulator import SimConfig

PEER = "peer"
PEER_PULL_MIN_BLOCKS = RoutingConfig.model_fields["peer_pull_min_blocks"].default
"""The router's default: it names a source holding at least this many more blocks."""
MEASURED_BLOCK_BYTES = 30 * 3 * 64 * 2 * 4 * 16
"""SmolLM2-135M's KV of one 16-token block in float32: 30 layers x 3 KV heads x 64 x K and V."""
MEASURED_MS = {64: (154.2, 59.3), 128: (262.4, 101.0), 256: (461.0, 123.0)}
"""``cluster-cache`` medians by pulled blocks: (pulled TTFT, local-hit TTFT), ms."""


class PullCost(NamedTuple):
    """What one pull from one source costs: ``fixed_s`` plus its bytes at ``bytes_per_s``."""

    fixed_s: float
    bytes_per_s: float

    def pull_s(self, num_bytes: float) -> float:
        return self.fixed_s + num_bytes / self.bytes_per_s


def fit_pull_cost(
    samples: dict[int, tuple[float, float]] = MEASURED_MS, block_bytes: int = MEASURED_BLOCK_BYTES
) -> PullCost:
    """Least squares of (pulled - local) TTFT against the bytes pulled."""
    xs = [n * block_bytes for n in samples]
    ys = [(pulled - local) / 1000 for pulled, local in samples.values()]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return PullCost(mean_y - slope * mean_x, 1 / slope)


MEASURED = fit_pull_cost()
GPU_PATH = PullCost(0.010, 25e9)
"""An assumed GPU-to-GPU path (not measured): 10 ms to reach the source and wait for its step,
then 25 GB/s (a 200 Gb/s RDMA link at line rate)."""


class SimPeerStore:
    """One replica's peer tier for one cache type: the blocks sources offer (hash -> source,
    offered at, oldest first), what the cost rule reads, and the pulls' counters."""

    def __init__(
        self,
        holds: Callable[[int, BlockHash], bool],
        cost: PullCost,
        block_bytes: float,
        clock: Callable[[], float],
    ) -> None:
        """``holds(source, hash)``: whether replica ``source`` holds the block in NPU or host
        now; ``clock``: simulated seconds (offers expire after ``OFFER_TTL_S``)."""
        self._holds = holds
        self.cost = cost
        self.block_bytes = block_bytes
        self._clock = clock
        self._offers: OrderedDict[BlockHash, tuple[int, float]] = OrderedDict()
        self._fit = PullFit(cost.fixed_s, block_bytes / cost.bytes_per_s)
        self.num_pulls = self.blocks_pulled = self.pull_failures = 0
        self.seconds = 0.0

    def offer(self, hashes: Sequence[BlockHash], source: int) -> None:
        now = self._clock()
        for block_hash in hashes:
            self._offers[block_hash] = (source, now)
            self._offers.move_to_end(block_hash)

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._offers

    def read(self, copies: Sequence[BackingCopy], now: float) -> list[tuple[float, list]]:
        """Pull ``copies`` (one batch): per source, when its pull lands and each copy with
        whether the source still held it when asked."""
        by_source: dict[int, list[BackingCopy]] = {}
        for copy in copies:
            source, _ = self._offers.get(copy.block_hash, (None, 0.0))
            by_source.setdefault(source, []).append(copy)
        reads = []
        for source, mine in by_source.items():
            if source is None:  # withdrawn since it was planned: a miss at once
                reads.append((now, [(copy, False) for copy in mine]))
                continue
            seconds = self.cost.pull_s(len(mine) * self.block_bytes)
            found = [(copy, self._holds(source, copy.block_hash)) for copy in mine]
            self.num_pulls += 1
            self.blocks_pulled += sum(ok for _, ok in found)
            self.pull_failures += sum(not ok for _, ok in found)
            self.seconds += seconds
            self._fit.add(len(mine), seconds)
            reads.append((now + seconds, found))
        return reads

    def read_seconds_per_block(self) -> float:
        """A pull's time per block (see the module docstring)."""
        return self._fit.parts()[1]

    def read_seconds_fixed(self) -> float:
        """A pull's time whatever its size."""
        return self._fit.parts()[0]

    def discard(self, block_hash: BlockHash) -> None:
        self._offers.pop(block_hash, None)

    def expire(self) -> None:
        oldest = self._clock() - OFFER_TTL_S
        while self._offers and next(iter(self._offers.values()))[1] < oldest:
            self._offers.popitem(last=False)

    def touch(self, block_hash: BlockHash) -> None:
        return None

    def retain(self, block_hash: BlockHash, until: float) -> bool:
        return False

    def usage(self) -> TierUsage:
        return TierUsage(0, 0, 0)

    def cached_hashes(self) -> list[BlockHash]:
        return []  # the sources' blocks, which they announce themselves

    def reset(self) -> list[BlockHash]:
        self._offers.clear()
        return []

    def track_changes(self) -> None:
        return None

    def drain_changes(self) -> list[tuple[bool, BlockHash]]:
        return []

    def store(self, block_hash, block=None, retained_until=0.0, weight=0.0, batch=False) -> None:
        raise RuntimeError("the peer tier is only read")

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        return None

    def stats(self) -> dict[str, float]:
        return {
            "num_pulls": self.num_pulls,
            "blocks_pulled": self.blocks_pulled,
            "pull_failures": self.pull_failures,
            "pull_seconds": self.seconds,
        }


def peer_stores(
    config: "SimConfig",
    cache_types: Sequence[str],
    block_bytes: float,
    holds: Callable[[int, str, BlockHash], bool],
    clock: Callable[[], float],
) -> list[dict[str, SimPeerStore] | None]:
    """Every replica's peer tier, a store per cache type, priced and primed as ``config`` says
    (None each without ``peer_pull``); ``holds(replica, cache_type, hash)``: whether a replica
    holds a block in NPU or host now; ``clock``: simulated seconds."""
    if not config.peer_pull:
        return [None] * config.data_parallel_size
    cost = PullCost(config.peer_pull_fixed_s, config.peer_pull_bytes_per_s)

    def holder(name: str) -> Callable[[int, BlockHash], bool]:
        return lambda replica, block_hash: holds(replica, name, block_hash)

    return [
        {name: SimPeerStore(holder(name), cost, block_bytes, clock) for name in cache_types}
        for _ in range(config.data_parallel_size)
    ]


def peer_tier() -> Tier:
    """The peer tier, registered (as a deployment whose config names it registers it)."""
    plugin(PEER)
    return Tier(PEER)


def peer_figures(
    stats: Sequence[CacheStats], pulls: Sequence[dict[str, float]], num_sources: int
) -> dict[str, object]:
    """A run's peer-tier figures over all replicas: the hits its pulls served apart from the
    local ones (tokens over the prompt tokens queried: ``hit_rate`` = ``local_hit_rate`` +
    ``peer_hit_rate``; ``host_hit_rate`` becomes the local host hits), the requests offered a
    source, the cost rule's answers and the pulls made."""
    tier = peer_tier()
    queries = sum(s.queries for s in stats)
    peer_hits = sum(s.hits_by_source.get(tier, 0) for s in stats)
    hits = sum(s.hits for s in stats)
    host_hits = sum(s.host_hits for s in stats)
    figures: dict[str, object] = {
        "peer_hit_rate": peer_hits / queries if queries else 0.0,
        "local_hit_rate": (hits - peer_hits) / queries if queries else 0.0,
        "host_hit_rate": (host_hits - peer_hits) / queries if queries else 0.0,
        "peer_sources_named": num_sources,
    }
    for counter in ("reloads", "recomputes", "load_timeouts"):
        figures[f"peer_{counter}"] = sum(getattr(s, f"{PEER}_{counter}") for s in stats)
    for counter in ("num_pulls", "blocks_pulled", "pull_failures", "pull_seconds"):
        figures[f"peer_{counter}"] = sum(p.get(counter, 0) for p in pulls)
    return figures
