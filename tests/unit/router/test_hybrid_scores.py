"""The router's score of a hybrid model's prompt equals the replica's own safe prefix: the
router follows the sliding blocks too and applies the same rule (``safe_prefix_length``)."""

import random

from replicas.engine.request import Request
from replicas.kv.events import KVEventBatch, KVEventKind, Tier
from replicas.kv.manager import KVCacheManager
from replicas.kv.records import CacheTypeSpec
from replicas.sampling_params import SamplingParams
from router.config import RoutingConfig
from router.router import Router

BS = 4
WINDOW = 8  # a token at position p sees p-7 .. p: the window spans the last two blocks
PROMPT = list(range(13))  # 3 full blocks + 1 token


class Replica:
    """A hybrid replica's cache manager publishing its events to a router."""

    def __init__(self, num_npu: int = 16, num_sliding: int = 16, num_host: int = 0, **kw):
        self.manager = KVCacheManager(
            block_size=BS,
            cache_types=[
                CacheTypeSpec("full", num_npu, num_host),
                CacheTypeSpec("sliding", num_sliding, num_host, WINDOW),
            ],
            **kw,
        )
        self.manager.views.enable_events()
        self.router = Router(1, BS, RoutingConfig(), sliding_window=WINDOW)
        self.seq = 0
        self.count = 0

    def publish(self) -> None:
        events = tuple(self.manager.views.drain_events())
        assert self.router.on_events(KVEventBatch(0, self.seq, events))
        self.seq += len(events)

    def run(self, tokens: list[int]) -> Request:
        m = self.manager
        self.count += 1
        request = Request(f"r{self.count}", tokens, SamplingParams(), BS)
        match = m.match_prefix(request)
        assert m.allocate_slots(request, request.num_tokens - match.num_blocks * BS, match)
        m.record_admission(request, match)
        request.num_computed_tokens = request.num_tokens
        m.cache_blocks(request)
        m.free(request)
        m.complete_transfer(m.take_transfer_plan())
        self.publish()
        return request

    def agree(self, tokens: list[int]) -> int:
        """The router's and the replica's cached prefix of ``tokens`` (asserted equal)."""
        request = Request("probe", tokens, SamplingParams(), BS)
        replica = self.manager.match_prefix(request)
        hashes = request.block_hashes[: (len(tokens) - 1) // BS]
        (routed,) = self.router._caches.match(hashes, self.router.live_replicas())
        for tier in Tier:
            assert routed.num_blocks_in(tier) == replica.num_blocks_in(tier), tier
        return routed.num_blocks


def test_window_present():
    replica = Replica()
    replica.run(PROMPT)
    assert replica.agree(PROMPT) == 3


def test_window_on_host_only():
    replica = Replica(num_host=16, write_through_threshold="immediate")
    replica.run(PROMPT)
    replica.manager.reset_prefix_cache("npu")
    replica.publish()
    assert replica.agree(PROMPT) == 3
    hashes = replica.run(PROMPT).block_hashes[:3]
    (routed,) = replica.router._caches.match(hashes, replica.router.live_replicas())
    assert routed.num_blocks == 3


def test_window_missing_cuts_the_score_to_the_safe_prefix():
    replica = Replica()
    first = replica.run(list(range(25)))  # 6 full blocks
    manager = replica.manager
    sliding = manager._cache_types[1]
    for index in (4, 1):  # drop sliding blocks 4 and 1 from the only tier that has them
        block_hash = first.block_hashes[index]
        block = sliding.npu.lookup(block_hash)
        sliding.npu.touch([block])
        sliding.npu._uncache(sliding.npu.blocks[block])
        sliding.npu.free([block])
        manager.views.events.emit(sliding.name, KVEventKind.REMOVED, Tier.NPU, block_hash)
    replica.publish()
    # Global KV matches 6 blocks; L=6 needs sliding 4..5 (4 gone); L=5 needs 3..4; L=4: 2..3.
    assert replica.agree(list(range(25))) == 4
    # The global index alone would credit all 6 blocks: the false residency the cut removes.
    assert replica.router._caches._index.match(first.block_hashes[:6], [0])[0].num_blocks == 6


def test_random_hybrid_traffic_router_and_replica_always_agree():
    rng = random.Random(5)
    replica = Replica(num_npu=24, num_sliding=12, num_host=12, write_back=True)
    bases = [[rng.randrange(200) for _ in range(40)] for _ in range(4)]
    for _ in range(60):
        base = rng.choice(bases)
        prompt = base[: rng.randrange(5, 40)] + [rng.randrange(200) for _ in range(3)]
        replica.run(prompt)
        for probe in bases:
            replica.agree(probe[: rng.randrange(9, 40)])
    replica.router.check_integrity()
