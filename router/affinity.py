"""``prompt_cache_key`` affinity: which replica served each key last.

Requests that share a key usually share a prefix the router cannot see yet (the first one's
blocks are not indexed until it runs) or that only part of the prompt covers. The router keeps
the requests of one key on the replica that served the key last: the scoring policy credits
that replica as if it cached the whole prompt, while the load rule allows
(``RoutingPolicy.is_overloaded``); a request routed elsewhere moves the key with it.

The map is a bounded LRU (``max_keys``): a key unused for a while is forgotten first, and
forgetting one costs only that its next request is routed as if it had no key.
"""

from collections import OrderedDict


class KeyAffinity:
    """A bounded LRU map key -> replica index. Not thread-safe: the router serialises calls."""

    def __init__(self, max_keys: int) -> None:
        if max_keys < 0:
            raise ValueError(f"max_keys must be non-negative, got {max_keys}")
        self.max_keys = max_keys
        self._replicas: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replicas)

    def replica_of(self, key: str | None) -> int | None:
        """The replica that served ``key`` last, or None (no mutation)."""
        return self._replicas.get(key) if key is not None else None

    def record(self, key: str | None, replica: int) -> None:
        """``key``'s request went to ``replica`` (mutates; most recently used now)."""
        if key is None or not self.max_keys:
            return
        self._replicas[key] = replica
        self._replicas.move_to_end(key)
        while len(self._replicas) > self.max_keys:
            self._replicas.popitem(last=False)

    def clear_replica(self, replica: int) -> None:
        """Forget the keys of a replica that left the live set (mutates)."""
        for key in [k for k, r in self._replicas.items() if r == replica]:
            del self._replicas[key]
