"""The retention policy protocol and its registry.

A retention policy decides which blocks the host tier keeps: whether a block the NPU tier evicts
with no host copy is stored to host (``should_store``), whether a block the write-through
threshold promotes is stored then or only when the NPU tier evicts it
(``decides_at_eviction``), and, with a disk tier, whether the block the host tier evicts next
is stored to disk (``may_store_to_disk``, ``should_store_to_disk``). It may watch the events
the manager reports (the ``admitted`` ... ``set_costs`` hooks; a policy that needs none of
them inherits these no-op defaults by subclassing the protocol).

Policies are chosen by name (``KVOffloadConfig.retention``): ``make_policy(name, context)``
builds one from the factory ``register_policy`` filed under that name. Adding a policy is one
file holding its class and one ``register_policy`` call::

    @register_policy("mine")
    class MyPolicy(RetentionPolicy):
        def __init__(self, context: PolicyContext) -> None: ...
        def should_store(self, block_hash, num_hits, host_full): ...
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, TypeVar

from replicas.kv.hashing import BlockHash

if TYPE_CHECKING:
    from replicas.kv.retention.curve import MissRatioCurve


class BlockCosts(NamedTuple):
    """Seconds per block: computing its KV again, loading it host -> NPU, storing NPU -> host."""

    recompute_s: float
    reload_s: float
    store_s: float


DEFAULT_COSTS = BlockCosts(recompute_s=1.0, reload_s=0.05, store_s=0.05)
"""Until the engine has measured its own: a reload or store at 5% of a recompute."""


IMMEDIATE = "immediate"
"""The write-through threshold that copies every block to host when it is first written."""

WriteThrough = int | Literal["immediate"]
"""``write_through_threshold``, with one meaning from the config to the simulator: a number of
hits (later requests matching a block) that promotes it to host, 0 for never, or ``IMMEDIATE``
for every block when it is first written."""


def hit_threshold(write_through: WriteThrough) -> int | None:
    """The hits that promote a block, or None when hits never do (off, or every block promoted
    at its first write)."""
    if write_through == IMMEDIATE or write_through <= 0:
        return None
    return write_through


def is_promoted(write_through: WriteThrough, num_hits: int) -> bool:
    """Whether a block with ``num_hits`` hits has reached the threshold (every block has under
    ``IMMEDIATE``, none under 0)."""
    threshold = hit_threshold(write_through)
    return write_through == IMMEDIATE or (threshold is not None and num_hits >= threshold)


class PolicyContext(NamedTuple):
    """What a policy is built from: one cache type's host tier and the configured rules."""

    num_host_blocks: int
    write_back: bool = False  # KVOffloadConfig.write_back
    write_through_threshold: WriteThrough = 2


class RetentionPolicy(Protocol):
    """What the host tier keeps, for one cache type. ``should_store`` is required; every other
    method has a default (subclass the protocol to inherit them). Decisions must not mutate:
    the miss-ratio curve asks ``should_store`` again for its shadow host tiers."""

    curve_name: str = "policy"
    """The policy's point on the miss-ratio curve (``ShadowKey.write_back``)."""
    decides_at_eviction: bool = False
    """True: a block the write-through threshold promotes is not copied then but when the NPU
    tier evicts it (``should_store`` sees its hits), and the manager counts every decision
    (``RetentionStats.adaptive_stores``/``adaptive_skips``). False: promotion copies at once."""
    may_store_to_disk: bool = False
    """Whether the host tier's evictions may go to a disk tier at all (``should_store_to_disk``
    decides each)."""

    def should_store(self, block_hash: BlockHash, num_hits: int, host_full: bool) -> bool:
        """Whether a block the NPU tier evicts, with no host copy and ``num_hits`` hits while on
        the NPU tier, is stored to host; ``host_full``: every host block holds a cached block
        (a store would evict one). No mutation."""
        ...

    def should_store_to_disk(self, disk_read_s: float) -> bool:
        """Whether the block the host tier evicts next is stored to disk (asked only when
        ``may_store_to_disk``). No mutation."""
        return True

    # ---- what the manager reports (no-ops unless a policy watches) ----------------------------
    def watch_curve(self, curve: "MissRatioCurve") -> None:
        """The cache type's miss-ratio curve, for a policy that steers by its shadows."""

    def disk_attached(self) -> None:
        """A disk tier now sits behind the host tier (a host-only block may come back from it)."""

    def admitted(self, hashes: list[BlockHash], on_npu: list[bool], on_host: list[bool]) -> None:
        """A new request's prompt blocks with their residency before the cache serves it."""

    def npu_evicted(self, block_hash: BlockHash, num_hits: int, kept: bool) -> None:
        """The NPU tier evicted a cached block; ``kept``: it has a host copy now."""

    def host_evicted(self, block_hash: BlockHash) -> None:
        """The host tier evicted a cached block."""

    def host_reset(self) -> None:
        """The host tier was emptied."""

    def set_costs(self, costs: BlockCosts) -> None:
        """Measured seconds per block."""


PolicyFactory = Callable[[PolicyContext], RetentionPolicy]
_REGISTRY: dict[str, PolicyFactory] = {}
F = TypeVar("F", bound=PolicyFactory)


def register_policy(name: str) -> Callable[[F], F]:
    """File a policy factory (a class taking a ``PolicyContext``) under ``name``."""

    def register(factory: F) -> F:
        if name in _REGISTRY:
            raise ValueError(f"a retention policy named {name!r} is registered already")
        _REGISTRY[name] = factory
        return factory

    return register


def policy_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def make_policy(policy: "str | PolicyFactory", context: PolicyContext) -> RetentionPolicy:
    """The policy registered as ``policy``, or built by ``policy`` when it is a factory."""
    if callable(policy):
        return policy(context)
    factory = _REGISTRY.get(policy)
    if factory is None:
        raise ValueError(f"retention must be one of {policy_names()}, got {policy!r}")
    return factory(context)
