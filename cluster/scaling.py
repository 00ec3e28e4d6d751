"""Which replica a scale-in removes: the one whose cached blocks the cluster can best do without.

Each live replica reports its hot blocks (``ReplicaActor.hot_blocks``: every block hash it holds
on NPU or host, with its recent-hit weight). The *loss* of removing replica r is what only r
holds among the replicas that stay::

    loss(r) = sum(weight_r[b] for b in hot(r)
                  if no other staying replica holds b
                  and not (b is on r's node's disk tier and a staying replica shares r's node))

A block another replica holds is not lost; nor is one on the node's shared disk tier while a
survivor on that node can read it back. The lowest loss is removed; ties go to the least loaded
replica (the router's active tokens: less to drain), then to the highest index (the newest).
Removing several replicas picks one at a time, each time among the replicas still staying.

Pure functions, no Ray: ``cluster.deploy`` gathers the inputs and drains the chosen replica.
``choose_random_victims`` draws the replicas at random instead: a baseline for the ``scaling``
benchmark, not a policy to serve with.
"""

import random
from collections.abc import Mapping, Sequence, Set
from typing import NamedTuple

from replicas.kv.hashing import BlockHash

VICTIM_RULES = ("value", "random")
"""How a scale-in picks its replicas: ``choose_victims`` or ``choose_random_victims``."""


class ReplicaValue(NamedTuple):
    """What a scale-in knows of one candidate replica."""

    replica_index: int
    node_id: str
    hot_blocks: Mapping[BlockHash, float]
    """Every block it holds on NPU or host, with its recent-hit weight."""
    load_tokens: int = 0
    """The router's active context tokens on it."""
    is_reachable: bool = True
    """False when it did not report its blocks: it counts as losing everything it might hold
    (an infinite loss), unless it is not live at all (then it holds nothing)."""


class VictimChoice(NamedTuple):
    """One replica chosen for removal, and why."""

    replica_index: int
    loss: float
    losses: dict[int, float]
    """Every candidate's loss when this one was chosen, by replica index."""
    reason: str


def replica_losses(
    replicas: Sequence[ReplicaValue], disk_blocks: Mapping[str, Set[BlockHash]]
) -> dict[int, float]:
    """``loss(r)`` of each replica among ``replicas`` (the module docstring's rule); a replica
    that did not report its blocks loses ``inf``. ``disk_blocks``: the blocks each node's disk
    tier holds, by node id."""
    holders: dict[BlockHash, int] = {}
    for replica in replicas:
        for block_hash in replica.hot_blocks:
            holders[block_hash] = holders.get(block_hash, 0) + 1
    nodes: dict[str, int] = {}
    for replica in replicas:
        nodes[replica.node_id] = nodes.get(replica.node_id, 0) + 1
    losses = {}
    for replica in replicas:
        if not replica.is_reachable:
            losses[replica.replica_index] = float("inf")
            continue
        on_disk = (
            disk_blocks.get(replica.node_id, frozenset()) if nodes[replica.node_id] > 1 else ()
        )
        losses[replica.replica_index] = sum(
            weight
            for block_hash, weight in replica.hot_blocks.items()
            if holders[block_hash] == 1 and block_hash not in on_disk
        )
    return losses


def choose_victims(
    replicas: Sequence[ReplicaValue],
    num_to_remove: int,
    disk_blocks: Mapping[str, Set[BlockHash]] | None = None,
) -> list[VictimChoice]:
    """The ``num_to_remove`` replicas to remove, in the order chosen. Raises ``ValueError``
    unless at least one replica stays."""
    if not 0 <= num_to_remove < len(replicas):
        raise ValueError(
            f"cannot remove {num_to_remove} of {len(replicas)} replicas: at least one must stay"
        )
    disk_blocks = disk_blocks or {}
    staying = list(replicas)
    choices = []
    for _ in range(num_to_remove):
        losses = replica_losses(staying, disk_blocks)
        victim = min(
            staying, key=lambda r: (losses[r.replica_index], r.load_tokens, -r.replica_index)
        )
        loss = losses[victim.replica_index]
        tied = [r for r in staying if losses[r.replica_index] == loss]
        if len(tied) == 1:
            reason = f"it alone holds the least hot-block weight ({loss:g})"
        elif sum(r.load_tokens == victim.load_tokens for r in tied) == 1:
            reason = f"tied at loss {loss:g}; the least loaded ({victim.load_tokens} tokens)"
        else:
            reason = f"tied at loss {loss:g} and load; the highest index"
        choices.append(VictimChoice(victim.replica_index, loss, losses, reason))
        staying.remove(victim)
    return choices


def choose_random_victims(
    replicas: Sequence[ReplicaValue],
    num_to_remove: int,
    disk_blocks: Mapping[str, Set[BlockHash]] | None = None,
    rng: random.Random | None = None,
) -> list[VictimChoice]:
    """``num_to_remove`` replicas drawn at random (a benchmark baseline), each with the losses
    ``choose_victims`` would have weighed. Raises ``ValueError`` unless at least one stays."""
    if not 0 <= num_to_remove < len(replicas):
        raise ValueError(
            f"cannot remove {num_to_remove} of {len(replicas)} replicas: at least one must stay"
        )
    rng = rng or random.Random()
    staying = list(replicas)
    choices = []
    for _ in range(num_to_remove):
        losses = replica_losses(staying, disk_blocks or {})
        victim = staying.pop(rng.randrange(len(staying)))
        loss = losses[victim.replica_index]
        choices.append(VictimChoice(victim.replica_index, loss, losses, "drawn at random"))
    return choices
