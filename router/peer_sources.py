"""Which replica a routed request pulls its prefix from (``replicas.kv.tiers.peer``).

The router places a request by its usual score first; then, when another live replica holds
computed (NPU or host) more leading blocks of the prompt than the chosen one, that replica is
named the *source* if pulling the difference beats computing it on the chosen replica::

    pull      = the source's wait + blocks x (read from a peer + load to the NPU), per block
                as the chosen replica measured them (``PullCosts``)
    recompute = prefill of those tokens after the chosen replica's cached ones
    wait      = the step the source is computing (an export runs between its steps): its
                queued prefill tokens, at most one step's budget, at its prefill cost

Each replica reports its ``PullCosts`` when it starts and again when its pulls have measured
them anew; until a replica has reported, a source is named for at least
``routing.peer_pull_min_blocks`` more blocks (which is also the floor after), and the replica's
own cost rule (``replicas.kv.onboarding.reload_pays``) still decides whether it reads them.
``routing.peer_pull_min_blocks: 0`` turns pulling off.
"""

from collections.abc import Sequence

from replicas.kv.hashing import BlockHash
from replicas.step_costs import PullCosts
from router.load import LoadTracker
from router.policies import RouteDecision
from router.prefix_index import IndexMatch
from router.replica_caches import ReplicaCaches


class PeerSources:
    """Names the source of a routing decision; keeps each replica's reported pull costs."""

    def __init__(
        self, min_blocks: int, block_size: int, caches: ReplicaCaches, load: LoadTracker
    ) -> None:
        self.min_blocks = min_blocks
        self.block_size = block_size
        self._caches = caches
        self._load = load
        self._costs: dict[int, PullCosts] = {}

    def set_costs(self, replica: int, costs: PullCosts) -> None:
        """Replica ``replica``'s pull costs from now on (it logs its break-even length)."""
        self._costs[replica] = costs

    def forget(self, replica: int) -> None:
        """A retired replica's costs are gone (a restarted one reports again)."""
        self._costs.pop(replica, None)

    def break_even_blocks(self, replica: int) -> float | None:
        """The fewest missing blocks a pull to ``replica`` pays for, from an idle source;
        ``inf``: none; None: the replica has not reported its costs."""
        costs = self._costs.get(replica)
        return None if costs is None else max(costs.break_even_blocks(), float(self.min_blocks))

    def with_source(
        self,
        decision: RouteDecision,
        block_hashes: Sequence[BlockHash],
        matches: Sequence[IndexMatch],
        live: Sequence[int],
    ) -> tuple[RouteDecision, bool]:
        """``decision`` with the live replica that holds the most more blocks of the prompt
        than the chosen one as its source, when the pull pays (see the module docstring), and
        whether a source was priced out. ``matches`` (the scored ones, which count at least
        those blocks) skip the lookup when no replica can be a source."""
        min_blocks = self.min_blocks
        chosen = decision.replica_index
        have = decision.num_matched_tokens // self.block_size
        if all(matches[r].num_blocks - have < min_blocks for r in live if r != chosen):
            return decision, False
        held = self._caches.held(block_hashes, live)
        source = max((r for r in live if r != chosen), key=held.__getitem__)
        extra = held[source] - have
        if extra < min_blocks:
            return decision, False
        costs = self._costs.get(chosen)
        if costs is not None:
            wait_s = self._costs.get(source, costs).source_wait_s(self._load.queued_tokens[source])
            if not costs.pays(extra, have * self.block_size, wait_s):
                return decision, True
        num_tokens = held[source] * self.block_size
        return decision._replace(peer_source=source, num_peer_tokens=num_tokens), False
