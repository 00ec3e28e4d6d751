"""The replicas of one Ray deployment, by replica index, and where each is in its life.

    joining ──(ready: health watches it, the router routes to it)──▶ serving
    serving ──(a scale-in chose it)──▶ draining ──(its requests ended, actor killed)──▶ retired

One ``Member`` record per replica: its actor, its output link, its role (the router's own
``ReplicaRole``), what it reported at start-up and this process's requests on it (``in_flight``:
submitted, not ended; a drain waits for it to reach zero). Indices are never reused: a new
replica gets the next unused one, a removed one keeps its record, retired. The router keeps the
same roles; this is the deployment's own copy, which it tells a restarted router.
"""

from dataclasses import dataclass, field
from typing import Any

from cluster.replica_link import ReplicaLink
from router.router import ReplicaRole


@dataclass(slots=True)
class Member:
    """One replica of the deployment."""

    replica: Any  # its actor handle
    link: ReplicaLink
    role: ReplicaRole
    info: dict[str, Any] = field(default_factory=dict)  # ReplicaActor.info(): empty until ready
    in_flight: int = 0

    @property
    def node_id(self) -> str:
        """Its node (empty until it reported)."""
        return str(self.info.get("node_id", ""))


class Membership:
    """Owns the deployment's replica records."""

    def __init__(self, replicas: list[Any], infos: list[dict[str, Any]]) -> None:
        self._members = [
            Member(replica, ReplicaLink(replica), ReplicaRole.SERVING, dict(info))
            for replica, info in zip(replicas, infos, strict=True)
        ]
        self.target_size = len(replicas)
        """The size asked for last: replicas live or starting."""

    def __getitem__(self, index: int) -> Member:
        return self._members[index]

    def add(self, replica: Any) -> int:
        """A new replica, joining; its index (the next unused one)."""
        self._members.append(Member(replica, ReplicaLink(replica), ReplicaRole.JOINING))
        return len(self._members) - 1

    def set_info(self, index: int, info: dict[str, Any]) -> None:
        self._members[index].info = info

    def start_serving(self, index: int) -> None:
        """A joining replica is ready: requests may go to it."""
        if self._members[index].role is ReplicaRole.JOINING:
            self._members[index].role = ReplicaRole.SERVING

    def drain(self, index: int) -> None:
        """A scale-in chose it: no new request goes to it."""
        self._members[index].role = ReplicaRole.DRAINING

    def retire(self, index: int) -> None:
        self._members[index].role = ReplicaRole.RETIRED

    @property
    def replicas(self) -> list[Any]:
        """Every replica actor by index (retired ones included)."""
        return [m.replica for m in self._members]

    @property
    def links(self) -> list[ReplicaLink]:
        return [m.link for m in self._members]

    @property
    def node_ids(self) -> list[str]:
        return [m.node_id for m in self._members]

    def with_role(self, role: ReplicaRole) -> set[int]:
        return {i for i, m in enumerate(self._members) if m.role is role}

    def members(self) -> list[int]:
        """Replicas that joined and are not retired (draining ones included), ascending."""
        return [
            i
            for i, m in enumerate(self._members)
            if m.role in (ReplicaRole.SERVING, ReplicaRole.DRAINING)
        ]

    def num_members(self) -> int:
        return len(self.members())

    def is_routable(self, index: int) -> bool:
        """Whether a request may go to replica ``index`` (joining, or serving: a joining one is
        not routed to by the router until it is ready)."""
        return self._members[index].role in (ReplicaRole.JOINING, ReplicaRole.SERVING)

    def roles(self) -> list[ReplicaRole]:
        """Each replica's role by index."""
        return [m.role for m in self._members]
