"""The single-cache ideal: the cluster's KV memory as one prefix cache that every request reaches.

A bound on what moving blocks between replicas (the peer tier) could win, defined as one LRU
cache of block hashes holding ``capacity_blocks`` (the sum over replicas of their NPU and host
blocks), fed the simulated requests in arrival order with nothing queued::

    request    hits = its leading blocks the cache holds (whole blocks, at most (length - 1) /
               block size: the last token is always computed, as in the engine); then every
               full block of its prompt is put in or touched, last block first, so that the
               oldest blocks of a prefix are its deepest (evicted first, as the engine frees)
    TTFT       one step with nothing ahead: the profile's fixed step cost plus the prefill of
               the uncached suffix after the cached prefix (as ``metrics.ideal_ttft_s``)

It leaves out what a real cluster pays: the blocks running requests pin, output blocks, queueing
and the copies between tiers; it counts no partial-block reuse (which the engine has). It is no
bound on TTFT under load, only on TTFT from the cache's side.
"""

from collections import OrderedDict
from collections.abc import Sequence

from benchmarks.sim.cost_model import CostModel
from benchmarks.sim.metrics import ttft_figures
from benchmarks.sim.trace import TraceRequest
from replicas.kv.hashing import block_hashes


def single_cache(
    requests: Sequence[TraceRequest], capacity_blocks: int, block_size: int, cost_model: CostModel
) -> dict[str, object]:
    """Hit rate (tokens hit over prompt tokens) and TTFT figures of the single-cache ideal."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    queried = hit = 0
    ttfts = []
    scale, fixed_s = cost_model.token_scale, cost_model.profile.step_fixed_s
    for request in requests:
        length = len(request.prompt_token_ids)
        hashes = block_hashes(request.prompt_token_ids, block_size)
        limit = (length - 1) // block_size
        matched = 0
        while matched < min(limit, len(hashes)) and hashes[matched] in cache:
            matched += 1
        for block_hash in reversed(hashes):
            cache[block_hash] = None
            cache.move_to_end(block_hash)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
        cached = matched * block_size
        queried += length
        hit += cached
        ttfts.append(fixed_s + cost_model.prefill_s((length - cached) * scale, cached * scale))
    figures = ttft_figures(ttfts)
    return {
        "hit_rate": hit / queried if queried else 0.0,
        "capacity_blocks": capacity_blocks,
        "ttft_mean_s": figures["ttft_mean_s"],
        "ttft_p50_s": figures["ttft_p50_s"],
        "ttft_p90_s": figures["ttft_quantiles_s"][90] if ttfts else 0.0,
        "ttft_p99_s": figures["ttft_p99_s"],
    }
