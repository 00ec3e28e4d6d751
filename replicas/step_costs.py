"""A replica's step costs, the message a replica reports to the router: what the router's
``ttft`` profile predicts a time to first token from (``router.config.TTFTCosts``) when the
config gives none.

Like ``replicas.kv.hashing`` and ``replicas.kv.events``, this module is part of the contract
between replicas and the router, so it imports neither torch nor the engine. The measurement
itself lives in ``replicas.calibration``.
"""

import math
import statistics
from collections.abc import Sequence
from typing import NamedTuple


class StepCosts(NamedTuple):
    """Seconds of one engine step's parts (names as ``router.config.TTFTCosts``)."""

    step_s: float
    prefill_s_per_token: float
    prefill_s_per_token_context: float
    decode_s_per_seq: float
    decode_s_per_context_token: float
    reload_s_per_block: float
    disk_reload_s_per_block: float
    max_num_batched_tokens: int
    fit_error: float  # median relative error of the fit over its samples
    seconds: float  # how long the measurement took

    def ttft_costs(self) -> dict[str, float | int]:
        """The fields ``TTFTCosts`` takes."""
        return {k: v for k, v in self._asdict().items() if k not in ("fit_error", "seconds")}


def median_costs(costs: Sequence[StepCosts]) -> StepCosts:
    """Each field's median over several replicas' measurements."""
    fields = zip(*costs)
    values = [statistics.median(f) for f in fields]
    values[StepCosts._fields.index("max_num_batched_tokens")] = min(
        c.max_num_batched_tokens for c in costs
    )
    return StepCosts(*values)


class PullCosts(NamedTuple):
    """What pulling a prefix's blocks from another replica costs one replica against computing
    them (``replicas.kv.tiers.peer``): the router names a source only where the pull pays
    (``router.peer_sources``). Prefill costs as in ``StepCosts``; ``read_s_per_block``: a block
    from a peer into host (measured by the replica's pulls, assumed before its first),
    ``load_s_per_block``: host -> NPU; ``read_s_fixed``: a pull's round trip, whatever its size
    (``replicas.kv.tiers.pull_fit``)."""

    prefill_s_per_token: float
    prefill_s_per_token_context: float
    read_s_per_block: float
    load_s_per_block: float
    max_num_batched_tokens: int
    block_size: int
    exports_in_steps: bool = False  # a source's export reads while it computes a step
    read_s_fixed: float = 0.0

    def recompute_s(self, num_blocks: int, context_tokens: int) -> float:
        """Computing ``num_blocks`` blocks after ``context_tokens`` cached ones."""
        n = num_blocks * self.block_size
        return n * (
            self.prefill_s_per_token + self.prefill_s_per_token_context * (context_tokens + n / 2)
        )

    def pull_s(self, num_blocks: int, wait_s: float) -> float:
        """Pulling ``num_blocks`` blocks and loading them, after ``wait_s`` for the source."""
        per_block = self.read_s_per_block + self.load_s_per_block
        return wait_s + self.read_s_fixed + num_blocks * per_block

    def pays(self, num_blocks: int, context_tokens: int, wait_s: float) -> bool:
        return self.pull_s(num_blocks, wait_s) < self.recompute_s(num_blocks, context_tokens)

    def source_wait_s(self, queued_tokens: int) -> float:
        """How long this replica, as a source, makes a pull wait: nothing where it exports while
        it computes a step (``replicas.engine.export_window``), else the step it is computing
        (an export runs between steps), at most its step's token budget of queued prefill."""
        if self.exports_in_steps:
            return 0.0
        return min(queued_tokens, self.max_num_batched_tokens) * self.prefill_s_per_token

    def break_even_blocks(self, wait_s: float = 0.0) -> float:
        """The fewest blocks whose pull beats computing them at the start of a prompt, after
        ``wait_s`` for the source; ``inf`` when no length pays (the context term, which only
        favours pulling, left out)."""
        margin = self.block_size * self.prefill_s_per_token - (
            self.read_s_per_block + self.load_s_per_block
        )
        if margin <= 0:
            return math.inf
        return float(math.floor((wait_s + self.read_s_fixed) / margin) + 1)
