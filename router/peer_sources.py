"""Which replica a routed request pulls its prefix from (``replicas.kv.tiers.peer``).

The router places a request by its usual score first; then, when another live replica holds
computed (NPU or host) more leading blocks of the prompt than the chosen one, that replica is
named the *source* if pulling the difference beats computing it on the chosen replica::

    pull      = the source's wait + blocks x (read from a peer + load to the NPU), per block
                as the chosen replica measured them (``PullCosts``)
    recompute = prefill of those tokens after the chosen replica's cached ones
    wait      = 0 where the source reads its blocks while it computes a step (on the CPU,
                ``replicas.engine.export_window``); else the step it is computing (its
                export runs between steps): its queued prefill tokens, at most one step's
                budget, at its prefill cost

Each replica reports its ``PullCosts`` when it starts and again when its pulls have measured
them anew; until a replica has reported, a source is named for at least
``routing.peer_pull_min_blocks`` more blocks (which is also the floor after), and the replica's
own cost rule (``replicas.kv.onboarding.reload_pays``) still decides whether it reads them.
``routing.peer_pull_min_blocks: 0`` turns pulling off.

The policy scores a replica that could pull as holding part of what it would pull
(``scored_matches``): the blocks a pull that pays would bring, scaled by the share of their
recompute time the pull saves, as host blocks. So a burst of requests sharing a prefix that one
replica holds (a fan-out) spreads to the others when the holder's load outweighs the pull,
instead of queueing behind the holder because the others would have to compute the prefix.
"""

from collections.abc import Sequence

from replicas.kv.events import Tier
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
        self._last_held: tuple[object, tuple[int, ...], list[int]] = (None, (), [])

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

    def scored_matches(
        self, block_hashes: Sequence[BlockHash], matches: Sequence[IndexMatch], live: Sequence[int]
    ) -> Sequence[IndexMatch]:
        """``matches`` with each replica that reported its costs credited for a pull that
        pays, as host blocks (see the module docstring); ``matches`` itself when none is."""
        most = max((matches[r].num_blocks for r in live), default=0)
        if not self._costs or all(most - matches[r].num_blocks < self.min_blocks for r in live):
            return matches
        held = self._caches.held(block_hashes, live)
        self._last_held = (block_hashes, tuple(live), held)  # for with_source, this route's
        scored = list(matches)
        for replica in live:
            costs = self._costs.get(replica)
            have = matches[replica].num_blocks
            source = max((r for r in live if r != replica), key=held.__getitem__)
            extra = held[source] - have
            if costs is None or extra < self.min_blocks:
                continue
            wait_s = self._costs.get(source, costs).source_wait_s(self._load.queued_tokens[source])
            recompute_s = costs.recompute_s(extra, have * self.block_size)
            saved = 1.0 - costs.pull_s(extra, wait_s) / recompute_s if recompute_s > 0 else 0.0
            if saved > 0:
                host = matches[replica].num_blocks_in(Tier.HOST) + int(extra * saved)
                scored[replica] = matches[replica].with_blocks({Tier.HOST: host})
        return scored

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
        last, self._last_held = self._last_held, (None, (), [])  # scored_matches' lookup
        min_blocks = self.min_blocks
        chosen = decision.replica_index
        have = matches[chosen].num_blocks  # what it holds, not what a pull was credited
        if all(matches[r].num_blocks - have < min_blocks for r in live if r != chosen):
            return decision, False
        fresh = last[0] is not block_hashes or last[1] != tuple(live)
        held = self._caches.held(block_hashes, live) if fresh else last[2]
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
