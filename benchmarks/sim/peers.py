"""Peer routing policies, implemented from their published descriptions with default parameters.

Each peer keeps the state its own system keeps: its own in-flight counts and approximate prefix
trees built from its own routing decisions, KV events only where the system consumes them
(Dynamo), and replica gauges only where it scrapes or probes them (llm-d, Ray). Ties that the
published code breaks arbitrarily are broken by a seeded ``random.Random(seed)``.

Token and character units: SGLang, Ray and llm-d measure prompts in characters; one token is
taken as ``CHARS_PER_TOKEN = 4`` characters, and a simulated token stands for ``token_scale``
trace tokens, so character limits are converted to simulated blocks (at least one).
"""

import math
from collections import Counter

from benchmarks.sim.agents import ClusterView, PeerAgent
from benchmarks.sim.engine import StepReport
from benchmarks.sim.prefix_tree import ApproxPrefixTree, make_tenant_tree
from replicas.engine.request import Request
from replicas.kv.events import Tier
from router.prefix_index import PrefixIndex

CHARS_PER_TOKEN = 4


class RoundRobinPeer(PeerAgent):
    name = "round-robin"
    source = "cyclic order over replicas (Strata --data-parallel-routing-policy round-robin)"

    def __init__(
        self, view: ClusterView, block_size: int, token_scale: float, seed: int = 0
    ) -> None:
        super().__init__(view, block_size, token_scale, seed)
        self._next = 0

    def route(self, request: Request, now: float) -> int:
        replica, self._next = self._next, (self._next + 1) % self.num_replicas
        return self.dispatch(request, replica)


class LeastLoadPeer(PeerAgent):
    name = "least-load"
    source = (
        "fewest outstanding tokens (prompt + generated) by the router's own count; ties to "
        "the lowest index"
    )

    def route(self, request: Request, now: float) -> int:
        loads = self.load_tokens
        return self.dispatch(request, min(range(self.num_replicas), key=loads.__getitem__))


class SGLangCacheAwarePeer(PeerAgent):
    """SGLang model gateway (sgl-router) ``cache_aware``: if (max - min load) > abs threshold and
    max > rel threshold x min, the least loaded worker; else the worker whose approximate radix
    tree matches the most of the prompt if the match ratio exceeds cache_threshold, else the
    worker with the smallest tree. The prompt is then inserted into the chosen worker's tree;
    every eviction interval each tree is pruned (LRU leaves) to max_tree_size. Load is the
    router's count of in-flight requests per worker."""

    name = "sglang-cache-aware"
    source = (
        "sgl-router / SGLang model gateway cache_aware policy (RouterArgs defaults): "
        "cache_threshold=0.5, balance_abs_threshold=32, balance_rel_threshold=1.0001, "
        "eviction_interval=60 s, max_tree_size=2**24 characters per worker"
    )
    cache_threshold = 0.5
    balance_abs_threshold = 32
    balance_rel_threshold = 1.0001
    eviction_interval_s = 60.0
    max_tree_chars = 2**24

    def __init__(
        self, view: ClusterView, block_size: int, token_scale: float, seed: int = 0
    ) -> None:
        super().__init__(view, block_size, token_scale, seed)
        self.tree = ApproxPrefixTree(self.num_replicas)
        self.max_tree_blocks = self.blocks_for_chars(self.max_tree_chars, CHARS_PER_TOKEN)
        self._next_eviction_s: float | None = None
        self.num_imbalanced = self.num_cache_hits = 0

    def route(self, request: Request, now: float) -> int:
        self._evict(now)
        loads = self.in_flight
        everyone = range(self.num_replicas)
        max_load, min_load = max(loads), min(loads)
        hashes = request.block_hashes
        if (
            max_load - min_load > self.balance_abs_threshold
            and max_load > self.balance_rel_threshold * min_load
        ):
            self.num_imbalanced += 1
            replica = min(everyone, key=loads.__getitem__)
        else:
            matched = self.tree.match(hashes)
            best = max(matched)
            ratio = best * self.block_size / request.num_prompt_tokens
            if ratio > self.cache_threshold:
                self.num_cache_hits += 1
                replica = self.pick(everyone, [-m for m in matched])
            else:
                replica = self.pick(everyone, [self.tree.size_blocks(r) for r in everyone])
        self.tree.insert(replica, hashes)
        return self.dispatch(request, replica)

    def _evict(self, now: float) -> None:
        if self._next_eviction_s is None:
            self._next_eviction_s = now + self.eviction_interval_s
        while now >= self._next_eviction_s:
            for replica in range(self.num_replicas):
                self.tree.prune(replica, self.max_tree_blocks)
            self._next_eviction_s += self.eviction_interval_s

    def summary(self) -> dict[str, object]:
        return {"num_imbalanced": self.num_imbalanced, "num_cache_routed": self.num_cache_hits}


class DynamoKvPeer(PeerAgent):
    """NVIDIA Dynamo KV router: a global radix index fed by the workers' KV events, and per
    worker the router's own active-sequence accounting. For each worker::

        overlap  = device-matched blocks + host_credit x host-only matched blocks
        prefill  = (active prefill tokens + prompt tokens - overlap x block) / block
        decode   = active blocks (deduplicated) + the request's blocks not already active
        cost     = overlap_score_weight x prefill + decode

    lowest cost wins (temperature 0: deterministic; ties at random). A request's prefill tokens
    leave the account at its first token, its blocks at completion."""

    name = "dynamo-kv"
    source = (
        "NVIDIA Dynamo KV router docs (router guide, cost function): overlap_score_weight=1.0, "
        "router_temperature=0.0, KV events on, track_active_blocks and assume_kv_reuse on, "
        "host (KVBM G2) overlap credit 0.75 of a device block"
    )
    overlap_score_weight = 1.0
    host_credit = 0.75

    def __init__(
        self, view: ClusterView, block_size: int, token_scale: float, seed: int = 0
    ) -> None:
        super().__init__(view, block_size, token_scale, seed)
        self.index = PrefixIndex(self.num_replicas)
        self.active_prefill_tokens = [0] * self.num_replicas
        self.active_blocks = [Counter() for _ in range(self.num_replicas)]

    def route(self, request: Request, now: float) -> int:
        hashes = request.block_hashes
        num_prompt, block = request.num_prompt_tokens, self.block_size
        matches = self.index.match(hashes, range(self.num_replicas))
        num_request_blocks = math.ceil(num_prompt / block)
        partial = num_request_blocks - len(hashes)
        costs, new_prefill = [], []
        for replica, match in enumerate(matches):
            npu, host = match.num_blocks_in(Tier.NPU), match.num_blocks_in(Tier.HOST)
            overlap = npu + self.host_credit * host
            prefill_tokens = max(num_prompt - overlap * block, 0.0)
            active = self.active_blocks[replica]
            fresh = sum(1 for h in hashes if h not in active) + partial
            prefill = (self.active_prefill_tokens[replica] + prefill_tokens) / block
            costs.append(self.overlap_score_weight * prefill + len(active) + fresh)
            new_prefill.append(round(prefill_tokens))
        replica = self.pick(range(self.num_replicas), costs)
        self.active_prefill_tokens[replica] += new_prefill[replica]
        self.active_blocks[replica].update(hashes)
        return self.dispatch(
            request, replica, block_hashes=list(hashes), num_prefill_tokens=new_prefill[replica]
        )

    def on_report(self, report: StepReport, now: float) -> None:
        self.index.apply(report.events)
        for request_id in report.first_token:
            flight = self._flights[request_id]
            self.active_prefill_tokens[flight.replica] -= flight.num_prefill_tokens
            flight.num_prefill_tokens = 0
        for request in report.finished:
            flight = self._flights[request.request_id]
            active = self.active_blocks[flight.replica]
            for h in flight.block_hashes:
                if active[h] <= 1:
                    del active[h]
                else:
                    active[h] -= 1
        super().on_report(report, now)


class RayPrefixAffinityPeer(PeerAgent):
    """Ray Serve LLM ``PrefixCacheAffinityRouter``: if replica queue lengths differ by at most
    imbalanced_threshold, match the prompt in the shared prefix tree; below match_rate_threshold
    the candidates are the replicas with the least text in the tree, else the replicas owning
    the deepest match; the candidate with the shortest queue wins. When imbalanced, power of
    two choices. The prompt is inserted for the chosen replica; no tree eviction (do_eviction
    defaults to False). Queue length = ongoing requests on the replica (Ray probes replicas)."""

    name = "ray-prefix-affinity"
    source = (
        "Ray Serve LLM PrefixCacheAffinityRouter (ray 2.60 initialize_state defaults): "
        "imbalanced_threshold=inf, match_rate_threshold=0.1, do_eviction=False"
    )
    imbalanced_threshold = float("inf")
    match_rate_threshold = 0.1

    def __init__(
        self, view: ClusterView, block_size: int, token_scale: float, seed: int = 0
    ) -> None:
        super().__init__(view, block_size, token_scale, seed)
        self.tree = make_tenant_tree(self.num_replicas)

    def route(self, request: Request, now: float) -> int:
        everyone = range(self.num_replicas)
        queues = [self.view.num_ongoing(r) for r in everyone]
        if max(queues) - min(queues) > self.imbalanced_threshold:
            pair = self.rng.sample(list(everyone), min(2, self.num_replicas))
            replica = self.pick(pair, queues)
        else:
            num_matched, deepest = self.tree.match(request)
            if num_matched / request.num_prompt_tokens < self.match_rate_threshold:
                replica = self.pick(self.tree.smallest_tenants(), queues)
            else:
                replica = self.pick(deepest, queues)
        self.tree.insert(request, replica, now)
        return self.dispatch(request, replica)

    def summary(self) -> dict[str, object]:
        return {"prefix_tree": self.tree.implementation}


class LlmdPrefixPeer(PeerAgent):
    """llm-d inference scheduler (Gateway API Inference Extension endpoint picker) with its
    default scorers and max-score picker::

        score = 3 x prefix-cache + 2 x kv-cache-utilization + 2 x queue
        prefix-cache = matched / total prompt blocks (first maxPrefixBlocksToMatch blocks), from
                       an LRU index of block hashes per server updated by routing decisions
        kv-cache-utilization = 1 - KV cache usage (scraped)
        queue        = (max waiting - waiting) / (max waiting - min waiting), 1 if all equal

    Highest score wins; ties at random."""

    name = "llm-d-prefix"
    source = (
        "llm-d inference scheduler default profile: prefix-cache-scorer weight 3 (approximate: "
        "hashBlockSize=64 characters, maxPrefixBlocksToMatch=256, lruCapacityPerServer=31250), "
        "kv-cache-utilization-scorer weight 2, queue-scorer weight 2, max-score-picker"
    )
    prefix_weight, kv_weight, queue_weight = 3.0, 2.0, 2.0
    hash_block_chars = 64
    max_prefix_blocks = 256
    lru_capacity_per_server = 31_250

    def __init__(
        self, view: ClusterView, block_size: int, token_scale: float, seed: int = 0
    ) -> None:
        super().__init__(view, block_size, token_scale, seed)
        chars, per_token = self.hash_block_chars, CHARS_PER_TOKEN
        self.max_match_blocks = self.blocks_for_chars(chars * self.max_prefix_blocks, per_token)
        capacity = self.blocks_for_chars(chars * self.lru_capacity_per_server, per_token)
        self.tree = ApproxPrefixTree(self.num_replicas, capacity_blocks=capacity)

    def route(self, request: Request, now: float) -> int:
        everyone = range(self.num_replicas)
        hashes = request.block_hashes[: self.max_match_blocks]
        matched = self.tree.match(hashes)
        waiting = [self.view.num_waiting(r) for r in everyone]
        low, high = min(waiting), max(waiting)
        scores = []
        for r in everyone:
            prefix = matched[r] / len(hashes) if hashes else 0.0
            queue = (high - waiting[r]) / (high - low) if high > low else 1.0
            kv = 1.0 - self.view.npu_usage(r)
            score = self.prefix_weight * prefix + self.kv_weight * kv + self.queue_weight * queue
            scores.append(-score)
        replica = self.pick(everyone, scores)
        self.tree.insert(replica, hashes)
        return self.dispatch(request, replica)


PEERS: dict[str, type[PeerAgent]] = {
    peer.name: peer
    for peer in (
        RoundRobinPeer,
        LeastLoadPeer,
        SGLangCacheAwarePeer,
        DynamoKvPeer,
        RayPrefixAffinityPeer,
        LlmdPrefixPeer,
    )
}
"""Peer policies by ``--policy`` name."""
