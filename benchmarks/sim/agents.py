"""Routing agents: what picks a replica for each arriving request in the simulator.

Every agent sees only what it would see in its own system: the request (token ids and block
hashes), the delayed step reports of the replicas (KV events, generated tokens, completions),
and, for agents whose systems scrape or probe replicas, the read-only ``ClusterView``. Strata's
agent is the real ``router.Router`` fed by KV events; peers live in ``peers.py``.
"""

import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from benchmarks.sim.engine import SimulatedEngine, StepReport
from replicas.engine.request import Request
from replicas.kv.events import Tier
from router.config import RoutingConfig
from router.router import Router


class ClusterView:
    """Gauges a serving system can read from its replicas (metrics scrapes, queue probes)."""

    def __init__(self, engines: Sequence[SimulatedEngine]) -> None:
        self._engines = engines

    @property
    def num_replicas(self) -> int:
        return len(self._engines)

    def num_waiting(self, replica: int) -> int:
        return self._engines[replica].num_waiting

    def num_ongoing(self, replica: int) -> int:
        return self._engines[replica].num_unfinished

    def npu_usage(self, replica: int) -> float:
        """Fraction of NPU blocks referenced by running requests (vLLM's KV cache usage)."""
        usage = next(iter(self._engines[replica].kv_cache.views.usage().values()))
        npu = usage.of(Tier.NPU)
        return npu.num_used / npu.num_blocks


class RoutingAgent(ABC):
    name: ClassVar[str]
    source: ClassVar[str] = ""
    """Where the policy is published, and the parameters used (for reports)."""
    peer_hint: tuple[int, int] | None = None
    """After ``route``: the replica named as the source to pull the prompt's prefix from and
    the leading tokens it holds (Strata's router: ``RouteDecision.peer_source``), or None."""

    def __init__(self, view: ClusterView, block_size: int, token_scale: float) -> None:
        self.view = view
        self.num_replicas = view.num_replicas
        self.block_size = block_size
        self.token_scale = token_scale

    @abstractmethod
    def route(self, request: Request, now: float) -> int:
        """Pick a replica for a new request (may update the agent's own state)."""

    def on_report(self, report: StepReport, now: float) -> None:
        """A replica's step report, delivered after the event delay. Default: ignored."""
        return

    def summary(self) -> dict[str, object]:
        return {}


class StrataAgent(RoutingAgent):
    """Strata's own ``router.Router``: virtual prefix index from KV events, load from reports."""

    name = "strata"
    source = "router/ (this repository): scoring, DESIGN section 6"

    def __init__(
        self,
        view: ClusterView,
        block_size: int,
        token_scale: float,
        config: RoutingConfig,
        sliding_window: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: the router's (a simulation passes its simulated time)."""
        super().__init__(view, block_size, token_scale)
        self.router = Router(view.num_replicas, block_size, config, sliding_window, clock)
        self.num_event_gaps = 0

    def route(self, request: Request, now: float) -> int:
        decision = self.router.route(
            request.request_id,
            request.num_prompt_tokens,
            request.block_hashes,
            cache_key=request.cache_key,
        )
        source = decision.peer_source
        self.peer_hint = None if source is None else (source, decision.num_peer_tokens)
        return decision.replica_index

    def on_report(self, report: StepReport, now: float) -> None:
        if not self.router.on_events(report.events):
            self.num_event_gaps += 1
        for request_id in report.generated:
            self.router.add_generated(request_id, 1)
        for request in report.finished:
            self.router.release(request.request_id)

    def summary(self) -> dict[str, object]:
        stats = self.router.stats()
        return {
            "num_event_gaps": self.num_event_gaps,
            "num_indexed_hashes": stats.num_indexed_hashes,
            "requests_per_replica": [r.num_requests_routed for r in stats.replicas],
        }


@dataclass(slots=True)
class _Flight:
    replica: int
    num_tokens: int
    block_hashes: Sequence[bytes] = ()
    num_prefill_tokens: int = 0


class PeerAgent(RoutingAgent):
    """A peer's shared bookkeeping (``peers.py``): what a router knows from its own dispatches
    and the completions, a seeded random tie-break, and character-to-block conversion."""

    def __init__(
        self, view: ClusterView, block_size: int, token_scale: float, seed: int = 0
    ) -> None:
        super().__init__(view, block_size, token_scale)
        self.rng = random.Random(seed)
        self.in_flight = [0] * self.num_replicas  # requests
        self.load_tokens = [0] * self.num_replicas  # prompt + generated tokens
        self._flights: dict[str, _Flight] = {}

    def dispatch(self, request: Request, replica: int, **extra: object) -> int:
        self._flights[request.request_id] = _Flight(replica, request.num_prompt_tokens, **extra)
        self.in_flight[replica] += 1
        self.load_tokens[replica] += request.num_prompt_tokens
        return replica

    def on_report(self, report: StepReport, now: float) -> None:
        for request_id in report.generated:
            flight = self._flights[request_id]
            flight.num_tokens += 1
            self.load_tokens[flight.replica] += 1
        for request in report.finished:
            flight = self._flights.pop(request.request_id)
            self.in_flight[flight.replica] -= 1
            self.load_tokens[flight.replica] -= flight.num_tokens

    def pick(self, candidates: Sequence[int], key: Sequence[float]) -> int:
        """The candidate with the lowest ``key``; ties at random."""
        best = min(key[r] for r in candidates)
        return self.rng.choice([r for r in candidates if key[r] == best])

    def blocks_for_chars(self, num_chars: int, chars_per_token: float) -> int:
        """Simulated blocks holding ``num_chars`` characters of prompt (at least one)."""
        tokens = num_chars / chars_per_token / self.token_scale
        return max(1, int(tokens / self.block_size))
