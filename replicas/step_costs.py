"""A replica's step costs, the message a replica reports to the router: what the router's
``ttft`` profile predicts a time to first token from (``router.config.TTFTCosts``) when the
config gives none.

Like ``replicas.kv.hashing`` and ``replicas.kv.events``, this module is part of the contract
between replicas and the router, so it imports neither torch nor the engine. The measurement
itself lives in ``replicas.calibration``.
"""

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
