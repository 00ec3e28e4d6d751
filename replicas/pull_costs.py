"""What pulling a prefix from a peer costs this replica, reported to the router
(``router.peer_sources``): the prefill and host -> NPU costs it measured at start-up
(``replicas.calibration``), the read time its pulls measure (``replicas.kv.tiers.peer``, assumed
before its first pull), and the host loads its transfers measure."""

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from replicas.step_costs import PullCosts, StepCosts

if TYPE_CHECKING:
    from replicas.engine.engine import Engine

logger = logging.getLogger(__name__)

PEER = "peer"
REPORT_INTERVAL_S = 10.0
"""The costs are looked at again at most this often, and sent when they moved."""
CHANGE_TO_SEND = 0.1
"""A cost that moved by more than this fraction is sent again."""


class PullCostReport:
    """Sends ``PullCosts`` through ``send`` when the replica starts and when they move."""

    def __init__(
        self,
        engine: "Engine",
        replica_index: int,
        step_costs: StepCosts,
        send: Callable[[PullCosts], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._replica_index = replica_index
        self._step_costs = step_costs
        self._send = send
        self._clock = clock
        self._sent: PullCosts | None = None
        self._next = 0.0

    def costs(self) -> PullCosts:
        step = self._step_costs
        reload = self._engine.kv_cache.onboarding.reload_costs()
        read_s = reload.read_s.get(PEER, 0.0) if reload is not None else 0.0
        fixed_s = reload.read_fixed_s.get(PEER, 0.0) if reload is not None else 0.0
        load_s = reload.host_load_s if reload is not None and reload.host_load_s else 0.0
        return PullCosts(
            prefill_s_per_token=step.prefill_s_per_token,
            prefill_s_per_token_context=step.prefill_s_per_token_context,
            read_s_per_block=read_s,
            load_s_per_block=load_s or step.reload_s_per_block,
            max_num_batched_tokens=step.max_num_batched_tokens,
            block_size=self._engine.block_size,
            exports_in_steps=self._engine.exports_in_steps,
            read_s_fixed=fixed_s,
        )

    def send_now(self) -> None:
        """Look at the costs now, whenever they were looked at last (sent if they moved)."""
        self._next = 0.0
        self.maybe_send()

    def maybe_send(self) -> None:
        """Send the costs if none were sent yet or they moved (looked at every
        ``REPORT_INTERVAL_S``)."""
        now = self._clock()
        if now < self._next:
            return
        self._next = now + REPORT_INTERVAL_S
        costs = self.costs()
        if self._sent is None or _moved(self._sent, costs):
            self._sent = costs
            self._send(costs)
            logger.info("replica %d: %s", self._replica_index, describe(costs))


def _moved(before: PullCosts, now: PullCosts) -> bool:
    return any(abs(a - b) > CHANGE_TO_SEND * max(abs(a), abs(b)) for a, b in zip(before, now))


def describe(costs: PullCosts) -> str:
    """One line: from how many missing blocks a pull from an idle peer pays, and why."""
    parts = (
        f"recompute {1e3 * costs.block_size * costs.prefill_s_per_token:.3g} ms per block, "
        f"pull {1e3 * costs.read_s_fixed:.3g} ms a call + {1e3 * costs.read_s_per_block:.3g} ms "
        f"and load {1e3 * costs.load_s_per_block:.3g} ms a block"
    )
    blocks = costs.break_even_blocks()
    if math.isinf(blocks):
        return f"a pull from a peer never pays: {parts}"
    n = int(blocks)
    return (
        f"a pull from an idle peer pays from {n} missing blocks ({n * costs.block_size} "
        f"tokens): {parts}"
    )


def has_peer_tier(engine: "Engine") -> bool:
    return PEER in engine.backing


def start_report(
    engine: "Engine", replica_index: int, step_costs: StepCosts | None, router: Any
) -> PullCostReport | None:
    """With the peer tier and a router: a report of what a pull costs ``replica_index``, sent
    to ``router`` now and when it moves; None otherwise."""
    if router is None or step_costs is None or not has_peer_tier(engine):
        return None
    report = PullCostReport(
        engine,
        replica_index,
        step_costs,
        lambda costs: router.set_pull_costs.remote(replica_index, costs),
    )
    report.maybe_send()
    return report
