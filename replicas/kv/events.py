"""Messages a replica publishes about its cache, for the router's virtual prefix index.

Together with ``replicas.kv.hashing`` and ``replicas.step_costs`` this is the whole contract
between replicas and the router: the router imports nothing else from ``replicas``. Every batch
carries the replica's sequence numbers, so a router that sees a gap knows its index missed events
and asks for a snapshot.

``KVEventKind`` and ``Tier`` are string enums: each member equals (and serialises as) its plain
string value, so events, metric labels and JSON read the same as plain strings.
"""

from collections.abc import Iterator, Mapping, Sequence
from enum import StrEnum
from typing import NamedTuple

from replicas.kv.hashing import BlockHash


class TierTraits(NamedTuple):
    """What every component must know of a tier, by name (the router included; the factories
    that build a tier's stores are the replica's, ``replicas.kv.tiers``).

    ``pooled``: a request adopts the tier's blocks directly (NPU, host: block pools); otherwise
    the tier is a *backing* tier behind host, whose blocks are read into host blocks before use
    and written from them. ``shared_by_node``: the replicas of one node read each other's blocks
    (a router credits a block to each of them). ``hit_weight``: the router's default credit for
    a matched block that only this tier holds, against 1.0 for an NPU block."""

    name: str
    pooled: bool = False
    shared_by_node: bool = False
    hit_weight: float = 0.5


class _TierType(type):
    """Iterating ``Tier`` gives the registered tiers, nearest to compute first."""

    def __iter__(cls) -> "Iterator[Tier]":
        return iter(_ORDER)

    def __len__(cls) -> int:
        return len(_ORDER)


class Tier(str, metaclass=_TierType):
    """A tier of KV blocks, by its registered name: NPU memory, host memory behind it, local
    disk behind that (shared by the replicas of one node), other replicas' blocks pulled over
    Ray (``peer``), and any backing tier registered since (``register_tier``). Equal to (and
    serialised as) its plain name; ``Tier(name)`` raises for a name nobody registered."""

    __slots__ = ()
    NPU: "Tier"
    HOST: "Tier"
    DISK: "Tier"

    def __new__(cls, name: str) -> "Tier":
        tier = _BY_NAME.get(str(name))
        if tier is None:
            names = ", ".join(repr(t) for t in _ORDER)
            raise ValueError(f"unknown KV tier {name!r}; the registered tiers are {names}")
        return tier

    @property
    def value(self) -> str:
        return str.__str__(self)

    @property
    def traits(self) -> TierTraits:
        return _TRAITS[self]

    def __repr__(self) -> str:
        return f"Tier({str.__str__(self)!r})"

    def __str__(self) -> str:
        return str.__str__(self)

    def __reduce__(self) -> tuple:
        return (str, (str.__str__(self),))  # a plain name: another process may not register it


_BY_NAME: dict[str, Tier] = {}
_TRAITS: dict[str, TierTraits] = {}
_ORDER: list[Tier] = []
_TIER_INDEX: dict[str, int] = {}


def register_tier(traits: TierTraits) -> Tier:
    """Register a tier's name and traits (idempotent for equal traits): pooled tiers come
    first, in registration order, then backing tiers in registration order. Returns the tier."""
    existing = _TRAITS.get(traits.name)
    if existing is not None:
        if existing != traits:
            raise ValueError(f"KV tier {traits.name!r} is registered already as {existing}")
        return _BY_NAME[traits.name]
    if not traits.name or not traits.name.isidentifier() or traits.name == "all":
        raise ValueError(f"a KV tier's name is an identifier other than 'all': {traits.name!r}")
    if traits.pooled and len(_ORDER) >= 2:
        raise ValueError(f"KV tier {traits.name!r}: a tier added to NPU and host is behind host")
    tier = str.__new__(Tier, traits.name)
    _BY_NAME[traits.name], _TRAITS[traits.name] = tier, traits
    num_pooled = sum(1 for t in _ORDER if _TRAITS[t].pooled)
    _ORDER.insert(num_pooled if traits.pooled else len(_ORDER), tier)
    _TIER_INDEX.clear()
    _TIER_INDEX.update({t: i for i, t in enumerate(_ORDER)})
    return tier


def tiers() -> tuple[Tier, ...]:
    """Every registered tier, nearest first: the order of a per-tier tuple, whose entry i counts
    ``tiers()[i]``. Records that count per tier (a router's match, a request's cached tokens)
    carry such a tuple, so a new tier adds an entry, not a field."""
    return tuple(_ORDER)


def backing_tiers() -> tuple[Tier, ...]:
    """The registered tiers behind host, nearest first."""
    return tuple(t for t in _ORDER if not _TRAITS[t].pooled)


Tier.NPU = register_tier(TierTraits("npu", pooled=True, hit_weight=1.0))
Tier.HOST = register_tier(TierTraits("host", pooled=True, hit_weight=0.9))
Tier.DISK = register_tier(TierTraits("disk", shared_by_node=True, hit_weight=0.7))
"""The tiers every process knows, registered here so that every process numbers them alike (a
per-tier tuple crosses processes). A tier registered later (``peer`` when a config names it,
any other tier) comes after them, in registration order, which every process registering it
keeps (they register the tiers a config names, in its order); a process that never registered
it reads its entries as 0 (``tier_count``)."""


def per_tier(counts: Mapping[str, int]) -> tuple[int, ...]:
    """``counts`` as a per-tier tuple: one entry per tier of ``tiers()``, 0 where ``counts``
    has none."""
    return tuple(counts.get(tier, 0) for tier in _ORDER)


def tier_count(counts: Sequence[int], tier: str) -> int:
    """The entry of the per-tier tuple ``counts`` for ``tier`` (0 past its end)."""
    i = _TIER_INDEX[tier]
    return counts[i] if i < len(counts) else 0


class KVEventKind(StrEnum):
    """What happened to a block hash in one tier."""

    STORED = "stored"  # the tier holds the hash from now on
    REMOVED = "removed"  # the tier no longer holds it


FULL = "full"
SLIDING = "sliding"
"""Cache types: global attention's KV (every model) and sliding-window attention's (hybrid)."""


def window_start(num_tokens: int, block_size: int, sliding_window: int | None) -> int:
    """First block a token at position ``num_tokens`` still attends to (0 for global)."""
    if sliding_window is None:
        return 0
    return max(0, num_tokens - sliding_window + 1) // block_size


def safe_prefix_length(
    present: Sequence[bool], limit: int, block_size: int, sliding_window: int | None
) -> int:
    """Longest ``L <= limit`` whose window (blocks ``window_start(L * block_size)`` to
    ``L - 1``) is all ``present`` (``present[i]``: block i is cached in some tier). A replica's
    prefix match and the router's score of a hybrid model's prompt both apply this rule."""
    last_missing = -1
    best = 0
    for length in range(limit + 1):
        first = window_start(length * block_size, block_size, sliding_window)
        if last_missing < first:
            best = length
        if length < limit and not present[length]:
            last_missing = length
    return best


class KVEvent(NamedTuple):
    """A block hash entered (``stored``) or left (``removed``) one tier of one cache type of one
    replica. A hybrid model's replica publishes its ``sliding`` blocks too, so a router can
    credit a prefix only as far as its sliding window is cached (the safe prefix)."""

    kind: KVEventKind
    tier: Tier
    block_hash: BlockHash
    cache_type: str = FULL


class KVEventBatch(NamedTuple):
    """Events ``first_seq .. first_seq + len(events) - 1`` of one replica, in order."""

    replica_index: int
    first_seq: int
    events: tuple[KVEvent, ...]

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self.events)


class KVSnapshot(NamedTuple):
    """Every cached hash of one replica, per cache type and tier, as of just before event
    ``next_seq``: ``block_hashes[cache_type][tier]`` (a hybrid model's ``sliding`` cache type beside
    the global ``full`` one; a tier the replica lacks is absent)."""

    replica_index: int
    next_seq: int
    block_hashes: Mapping[str, Mapping[Tier, tuple[BlockHash, ...]]]

    def hashes(self, tier: Tier, cache_type: str = FULL) -> tuple[BlockHash, ...]:
        """The hashes one tier of one cache type holds (none for a tier it lacks)."""
        return self.block_hashes.get(cache_type, {}).get(Tier(tier), ())
