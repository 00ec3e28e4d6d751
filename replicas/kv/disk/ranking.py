"""Hotness over a node's disk blocks: each block ranked by the hit weight its record keeps,
decayed to now on the node's wall clock (``replicas.kv.hotness``), and which colder own blocks
a batch of new blocks may replace. See the package docstring (``replicas.kv.disk``).
"""

from collections.abc import Callable

from replicas.kv.disk.peers import PeerSlabs
from replicas.kv.disk.record import NO_HEAT, Heat
from replicas.kv.disk.slots import OwnSlots
from replicas.kv.hashing import BlockHash


class HeatRanking:
    """Reads the heat of the own slab's blocks (``OwnSlots``) and the other slabs' (``PeerSlabs``,
    as last read) and ranks them; it keeps no state of its own. ``wall_clock`` is the one the
    node's processes share."""

    def __init__(self, slots: OwnSlots, peers: PeerSlabs, wall_clock: Callable[[], float]) -> None:
        self.slots = slots
        self.peers = peers
        self.wall_clock = wall_clock

    def _heat(self, key: BlockHash) -> Heat | None:
        return self.slots.heat_of(key) or self.peers.heat_of(key)

    def weight(self, key: BlockHash) -> float:
        """The hit weight some slab recorded for ``key``, decayed to now (0.0 if unknown)."""
        heat = self._heat(key)
        return 0.0 if heat is None else heat.now(self.wall_clock())

    def hottest(self, keys: list[BlockHash]) -> list[BlockHash]:
        """``keys`` hottest first: by hit weight decayed to now, then the most recently weighed
        first."""
        now = self.wall_clock()

        def rank(key: BlockHash) -> tuple[float, float]:
            heat = self._heat(key) or NO_HEAT
            return heat.now(now), heat.written_at

        return sorted(keys, key=rank, reverse=True)

    def room_for(self, weights: list[float]) -> tuple[int, list[BlockHash]]:
        """How many new blocks of hit ``weights`` (hottest first) fit in the own slab without
        replacing a hotter block, and the own blocks they replace, coldest first: each takes a
        free slot, else the slot of the coldest own ordinary block left if that is strictly
        colder. Expires the own retentions first, and changes nothing else."""
        self.slots.expire()
        now = self.wall_clock()
        colder = sorted((heat.now(now), key) for key, heat in self.slots.ordinary_heats())
        num_free = self.slots.num_free
        num_fit = num_replaced = 0
        for weight in weights:
            if num_free:
                num_free -= 1
            elif num_replaced < len(colder) and colder[num_replaced][0] < weight:
                num_replaced += 1
            else:
                break
            num_fit += 1
        return num_fit, [key for _, key in colder[:num_replaced]]
