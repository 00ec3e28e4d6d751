"""Load pressure of each replica as the router sees it: active context tokens."""

from dataclasses import dataclass


@dataclass(slots=True)
class _Charge:
    replica: int
    num_tokens: int


class LoadTracker:
    """Active context tokens per replica: a request's prompt tokens are charged when it is routed,
    its generated tokens as the replica reports them, and all of it is released at completion or
    abort.

    Invariants: ``load_tokens[r]`` is the sum of the charges of the requests routed to replica r
    and not yet released; every charge is non-negative. ``release`` of a released or unknown
    request is a no-op, because completion and abort may both arrive; so is ``add_generated``.
    """

    def __init__(self, num_replicas: int) -> None:
        self.load_tokens: list[int] = [0] * num_replicas
        """Read-only view for policies; only this class writes it."""
        self.queued_tokens: list[int] = [0] * num_replicas
        """Uncached prompt tokens of requests not yet past prefill (no token reported)."""
        self.num_requests: list[int] = [0] * num_replicas
        """Requests holding a charge, per replica."""
        self._charges: dict[str, _Charge] = {}
        self._queued: dict[str, int] = {}

    def add_replica(self) -> int:
        """Grow by one replica carrying nothing; its index (mutates)."""
        self.load_tokens.append(0)
        self.queued_tokens.append(0)
        self.num_requests.append(0)
        return len(self.load_tokens) - 1

    def __len__(self) -> int:
        """Number of requests holding a charge."""
        return len(self._charges)

    def charge(
        self, request_id: str, replica: int, num_prompt_tokens: int, num_uncached_tokens: int = 0
    ) -> None:
        """Charge a newly routed request's prompt tokens to ``replica``, ``num_uncached_tokens``
        of them queued for prefill until its first token is reported (mutates). Raises
        ValueError if ``request_id`` already holds a charge."""
        if request_id in self._charges:
            raise ValueError(f"request {request_id!r} is already routed")
        if num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be non-negative, got {num_prompt_tokens}")
        self._charges[request_id] = _Charge(replica, num_prompt_tokens)
        self.load_tokens[replica] += num_prompt_tokens
        self.num_requests[replica] += 1
        if num_uncached_tokens > 0:
            self._queued[request_id] = num_uncached_tokens
            self.queued_tokens[replica] += num_uncached_tokens

    def _unqueue(self, request_id: str, replica: int) -> None:
        num_tokens = self._queued.pop(request_id, 0)
        self.queued_tokens[replica] -= num_tokens

    def add_generated(self, request_id: str, num_tokens: int) -> None:
        """Charge ``num_tokens`` newly generated tokens to the request's replica (mutates)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
        charge = self._charges.get(request_id)
        if charge is not None:
            charge.num_tokens += num_tokens
            self.load_tokens[charge.replica] += num_tokens
            self._unqueue(request_id, charge.replica)  # a token out: its prefill is done

    def release(self, request_id: str) -> None:
        """Release everything charged for the request (mutates)."""
        charge = self._charges.pop(request_id, None)
        if charge is not None:
            self.load_tokens[charge.replica] -= charge.num_tokens
            self.num_requests[charge.replica] -= 1
            self._unqueue(request_id, charge.replica)

    def replica_of(self, request_id: str) -> int | None:
        """The replica a request holding a charge was routed to, else None."""
        charge = self._charges.get(request_id)
        return None if charge is None else charge.replica

    def clear_replica(self, replica: int) -> None:
        """Drop every charge on ``replica`` (mutates): its requests died with it, and their later
        completion or abort then finds nothing to release."""
        for request_id in [r for r, c in self._charges.items() if c.replica == replica]:
            del self._charges[request_id]
            self._queued.pop(request_id, None)
        self.load_tokens[replica] = 0
        self.queued_tokens[replica] = 0
        self.num_requests[replica] = 0

    def check_integrity(self) -> None:
        """Raise AssertionError unless each replica's load is the sum of its live charges."""
        expected = [0] * len(self.load_tokens)
        queued = [0] * len(self.load_tokens)
        counts = [0] * len(self.load_tokens)
        for request_id, charge in self._charges.items():
            assert charge.num_tokens >= 0, f"request {request_id!r} has a negative charge"
            expected[charge.replica] += charge.num_tokens
            queued[charge.replica] += self._queued.get(request_id, 0)
            counts[charge.replica] += 1
        assert expected == self.load_tokens, f"loads {self.load_tokens} != charges {expected}"
        assert queued == self.queued_tokens, f"queued {self.queued_tokens} != charges {queued}"
        assert counts == self.num_requests, f"requests {self.num_requests} != charges {counts}"
        assert set(self._queued) <= set(self._charges), "a queued prefill outlived its charge"
