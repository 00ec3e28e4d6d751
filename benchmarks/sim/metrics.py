"""Figures of one simulated run: hit rates, TTFT percentiles, load imbalance, throughput.

Load of a replica = outstanding tokens: prompt tokens of the requests routed to it and not yet
finished, plus the tokens they have generated (the quantity Strata's router charges). Two
imbalance figures, both max over replicas divided by the mean over replicas:

* ``load_imbalance``: of each replica's *time-averaged* load over the run (from the first
  arrival to the last completion): does a policy systematically load some replicas more?
* ``load_imbalance_at_arrivals``: of the instantaneous loads, sampled just before each arrival
  is routed (samples with no load anywhere skipped), averaged. This one also counts transient
  skew, and is large for every policy when few requests are in flight (one request on one of
  eight idle replicas is an imbalance of 8).
"""

from collections.abc import Sequence

import numpy as np

from benchmarks.sim.cost_model import CostModel
from benchmarks.sim.trace import TraceRecord, scaled_length, unbounded_cached_blocks


class LoadMeter:
    """Outstanding tokens per replica over simulated time (piecewise constant)."""

    def __init__(self, num_replicas: int) -> None:
        self.load = [0] * num_replicas
        self._area = [0.0] * num_replicas
        self._since = [0.0] * num_replicas
        self._start: float | None = None
        self._end = 0.0
        self._ratios: list[float] = []

    def add(self, replica: int, num_tokens: int, now: float) -> None:
        if self._start is None:
            self._start = now
            self._since = [now] * len(self.load)
        self._area[replica] += self.load[replica] * (now - self._since[replica])
        self._since[replica] = now
        self.load[replica] += num_tokens
        self._end = max(self._end, now)

    def add_replica(self) -> None:
        """Grow by one replica carrying nothing (a scale-out)."""
        self.load.append(0)
        self._area.append(0.0)
        self._since.append(self._end)

    def sample(self) -> None:
        """Record the instantaneous imbalance (call before routing an arrival)."""
        total = sum(self.load)
        if total > 0:
            self._ratios.append(max(self.load) * len(self.load) / total)

    def time_averaged(self) -> list[float]:
        if self._start is None or self._end <= self._start:
            return [0.0] * len(self.load)
        for replica in range(len(self.load)):
            self.add(replica, 0, self._end)
        return [area / (self._end - self._start) for area in self._area]

    def imbalance(self) -> float:
        averages = self.time_averaged()
        mean = sum(averages) / len(averages)
        return max(averages) / mean if mean > 0 else 1.0

    def imbalance_at_arrivals(self) -> float:
        return float(np.mean(self._ratios)) if self._ratios else 1.0


def ttft_figures(ttfts_s: Sequence[float]) -> dict[str, object]:
    if not ttfts_s:
        return {"ttft_p50_s": 0.0, "ttft_p99_s": 0.0, "ttft_mean_s": 0.0, "ttft_quantiles_s": []}
    values = np.asarray(ttfts_s, dtype=float)
    return {
        "ttft_p50_s": float(np.percentile(values, 50)),
        "ttft_p99_s": float(np.percentile(values, 99)),
        "ttft_mean_s": float(values.mean()),
        "ttft_quantiles_s": [float(q) for q in np.percentile(values, np.arange(101))],
    }


def tenant_figures(finished: Sequence) -> dict[str, object]:
    """Per tenant (``cache_salt``) of the finished requests: prompt-token hit rate and TTFT
    p50 / p99; nothing when no request has a tenant."""
    by_tenant: dict[str, list] = {}
    for request in finished:
        if request.cache_salt is not None:
            by_tenant.setdefault(request.cache_salt, []).append(request)
    if not by_tenant:
        return {}
    figures = {}
    for tenant, requests in sorted(by_tenant.items()):
        prompt = sum(r.num_prompt_tokens for r in requests)
        ttfts = np.array([r.first_token_time - r.arrival_time for r in requests])
        figures[tenant] = {
            "num_requests": len(requests),
            "hit_rate": sum(r.num_cached_tokens or 0 for r in requests) / prompt,
            "ttft_p50_s": float(np.percentile(ttfts, 50)),
            "ttft_p99_s": float(np.percentile(ttfts, 99)),
        }
    return {"tenants": figures}


def hit_rates(queries: int, hits: int, npu_hits: int, host_hits: int) -> dict[str, float]:
    """Token hit rates over all replicas (hits / prompt tokens queried at admission)."""
    if queries == 0:
        return {"hit_rate": 0.0, "npu_hit_rate": 0.0, "host_hit_rate": 0.0}
    return {
        "hit_rate": hits / queries,
        "npu_hit_rate": npu_hits / queries,
        "host_hit_rate": host_hits / queries,
    }


def ideal_ttft_s(
    records: Sequence[TraceRecord], cost_model: CostModel, tokens_per_hash_id: int
) -> list[float]:
    """Each request's time to first token with nothing ahead of it and an unbounded prefix
    cache (every block whose whole prefix was seen before is cached, wherever it lands): one
    step that prefills the uncached suffix after the cached prefix. Lengths are the simulated
    ones (``trace.scaled_length``), priced in trace tokens like a run's steps, so no run of the
    same trace can give a request a lower TTFT; requests the profile's context cannot hold are
    skipped, as in a run."""
    cached_blocks, _ = unbounded_cached_blocks(records)
    profile, scale = cost_model.profile, cost_model.token_scale
    times = []
    for record, num_cached in zip(records, cached_blocks):
        if record.input_length > profile.max_model_len:
            continue
        length = scaled_length(record.input_length, tokens_per_hash_id)
        cached = min(num_cached * tokens_per_hash_id, length - 1)
        suffix = (length - cached) * scale
        times.append(profile.step_fixed_s + cost_model.prefill_s(suffix, cached * scale))
    return times
