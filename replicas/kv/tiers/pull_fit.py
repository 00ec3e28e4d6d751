"""What a pull from a peer costs, as a fixed part per call and a part per block, fitted to the
pulls a replica made (``replicas.kv.tiers.peer``).

A pull is one call to one source (``export_blocks``) for a batch of blocks: its time is a round
trip and the source's lookup, whatever the batch, plus a copy and a checksum per block. The mean
time per block mixes the two, so it priced a 4-block pull (mostly the round trip) like a
256-block one. ``PullFit`` keeps both parts::

    seconds(n) = fixed_s + n x per_block_s

fitted by least squares over every pull so far (one sample per call), each part at least 0.
While every pull had the same size the two cannot be told apart: the fixed part stays its prior
(at most the mean pull) and the rest counts per block.
"""

import math


class PullFit:
    """Least-squares ``fixed_s + n x per_block_s`` over the pulls added so far, from a prior."""

    def __init__(self, fixed_s: float, per_block_s: float) -> None:
        self._prior = (fixed_s, per_block_s)
        self._count = 0
        self._sum_n = self._sum_s = self._sum_nn = self._sum_ns = 0.0

    def add(self, num_blocks: int, seconds: float) -> None:
        """One pull of ``num_blocks`` blocks took ``seconds`` (a pull of none is ignored)."""
        if num_blocks <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        self._count += 1
        self._sum_n += num_blocks
        self._sum_s += seconds
        self._sum_nn += num_blocks * num_blocks
        self._sum_ns += num_blocks * seconds

    @property
    def num_pulls(self) -> int:
        return self._count

    def parts(self) -> tuple[float, float]:
        """``(fixed_s, per_block_s)``: the prior before any pull, else the fit."""
        count = self._count
        if not count:
            return self._prior
        mean_n, mean_s = self._sum_n / count, self._sum_s / count
        spread = self._sum_nn / count - mean_n * mean_n
        if spread <= 1e-9 * max(1.0, mean_n * mean_n):  # one size only: keep the prior's split
            fixed = min(self._prior[0], mean_s)
            return fixed, (mean_s - fixed) / mean_n
        per_block = (self._sum_ns / count - mean_n * mean_s) / spread
        fixed = mean_s - per_block * mean_n
        if per_block < 0:  # bigger pulls were no slower: all of it is the round trip
            return mean_s, 0.0
        if fixed < 0:  # through the origin instead
            return 0.0, self._sum_ns / self._sum_nn
        return fixed, per_block

    def seconds(self, num_blocks: int) -> float:
        fixed, per_block = self.parts()
        return fixed + num_blocks * per_block
