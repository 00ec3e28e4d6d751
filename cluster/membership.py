"""The replicas of one Ray deployment, by replica index, and where each is in its life.

    joining ──(ready: health watches it, the router routes to it)──▶ serving
    serving ──(a scale-in chose it)──▶ draining ──(its requests ended, actor killed)──▶ retired

Indices are never reused: a new replica gets the next unused one, a removed one stays in every
list, marked retired. ``in_flight`` counts this process's requests on each replica (submitted,
not ended): a drain waits for it to reach zero. The router keeps the same roles
(``router.router.ReplicaRole``); this is the deployment's own copy, which it tells a restarted
router.
"""

from typing import Any

from cluster.replica_link import ReplicaLink


class Membership:
    """Owns the deployment's replica handles, their output links and their roles."""

    def __init__(self, replicas: list[Any], infos: list[dict[str, Any]]) -> None:
        self.replicas = list(replicas)
        self.links = [ReplicaLink(replica) for replica in replicas]
        self.infos = list(infos)
        self.node_ids = [str(info["node_id"]) for info in infos]
        self.in_flight = [0] * len(replicas)
        self.retired: set[int] = set()
        self.joining: set[int] = set()
        self.draining: set[int] = set()
        self.target_size = len(replicas)
        """The size asked for last: replicas live or starting."""

    def add(self, replica: Any) -> int:
        """A new replica, joining; its index (the next unused one)."""
        self.replicas.append(replica)
        self.links.append(ReplicaLink(replica))
        self.infos.append({})
        self.node_ids.append("")
        self.in_flight.append(0)
        index = len(self.replicas) - 1
        self.joining.add(index)
        return index

    def set_info(self, index: int, info: dict[str, Any]) -> None:
        self.infos[index] = info
        self.node_ids[index] = str(info["node_id"])

    def members(self) -> list[int]:
        """Replicas that joined and are not retired (draining ones included), ascending."""
        return [
            i for i in range(len(self.replicas)) if i not in self.retired and i not in self.joining
        ]

    def num_members(self) -> int:
        return len(self.replicas) - len(self.retired) - len(self.joining)

    def is_routable(self, index: int) -> bool:
        """Whether a request may go to replica ``index`` (not draining, not retired)."""
        return index not in self.draining and index not in self.retired

    def retire(self, index: int) -> None:
        self.retired.add(index)
        self.joining.discard(index)
        self.draining.discard(index)

    def roles(self) -> list[str]:
        """Each replica's role by index, as ``router.router.ReplicaRole`` names them."""
        return [self._role(i) for i in range(len(self.replicas))]

    def _role(self, index: int) -> str:
        if index in self.retired:
            return "retired"
        if index in self.draining:
            return "draining"
        if index in self.joining:
            return "joining"
        return "serving"
