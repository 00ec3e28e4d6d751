import random

import pytest

from replicas.kv.events import KVEvent, KVEventBatch
from replicas.kv.hashing import block_hashes
from router.config import RoutingConfig
from router.pending import MAX_COMPARED, PendingPrompts
from router.router import Router

BLOCK = 16


def chain(*token_blocks: int) -> list[bytes]:
    """Chained block hashes of a prompt whose i-th block is ``BLOCK`` copies of a token id."""
    tokens = [t for token in token_blocks for t in [token] * BLOCK]
    return block_hashes(tokens, BLOCK)


def test_runs_are_the_longest_shared_leading_run_per_replica():
    pending = PendingPrompts()
    pending.add("a", 0, chain(1, 2, 3, 4))
    pending.add("b", 0, chain(1, 2))
    pending.add("c", 2, chain(1, 2, 3, 9, 9))
    pending.add("d", 1, chain(5, 2, 3))  # another first block: never shares anything below
    assert pending.runs(chain(1, 2, 3, 4, 5)) == {0: 4, 2: 3}
    assert pending.runs(chain(1, 7)) == {0: 1, 2: 1}
    assert pending.runs(chain(6, 2, 3)) == {}
    assert pending.runs([]) == {}
    assert pending.runs(tuple(chain(1, 2, 3))) == {0: 3, 2: 3}  # any sequence type
    pending.check_integrity()


def test_remove_is_idempotent_and_clear_replica_forgets_its_requests():
    pending = PendingPrompts()
    pending.add("a", 0, chain(1, 2))
    pending.add("b", 1, chain(1, 2, 3))
    pending.add("empty", 1, [])  # no full block: nothing to share, not kept
    with pytest.raises(ValueError, match="already pending"):
        pending.add("a", 1, chain(1))
    assert len(pending) == 2
    pending.remove("a")
    pending.remove("a")
    pending.remove("never-routed")
    assert pending.runs(chain(1, 2, 3)) == {1: 3}
    pending.add("c", 0, chain(1))
    pending.clear_replica(1)
    assert pending.runs(chain(1, 2, 3)) == {0: 1} and len(pending) == 1
    pending.check_integrity()


def test_runs_agree_with_a_brute_force_walk_on_random_prompts():
    rng = random.Random(7)
    pending = PendingPrompts()
    prompts: dict[str, tuple[int, list[bytes]]] = {}
    for step in range(400):
        if prompts and rng.random() < 0.3:
            request_id = rng.choice(sorted(prompts))
            pending.remove(request_id)
            del prompts[request_id]
        else:  # few distinct blocks per position, so prompts share runs of every length
            hashes = chain(*(rng.randrange(2) for _ in range(rng.randrange(1, 12))))
            replica = rng.randrange(4)
            pending.add(f"r{step}", replica, hashes)
            prompts[f"r{step}"] = (replica, hashes)
        query = chain(*(rng.randrange(2) for _ in range(rng.randrange(0, 14))))
        expected: dict[int, int] = {}
        group = [p for p in prompts.values() if query and p[1][0] == query[0]]
        for replica, hashes in group[-MAX_COMPARED:]:  # the newest, as compared
            run = 0
            while run < min(len(query), len(hashes)) and query[run] == hashes[run]:
                run += 1
            if run:
                expected[replica] = max(expected.get(replica, 0), run)
        assert pending.runs(query) == expected
    pending.check_integrity()


def make_router(num_replicas: int = 3, **config) -> Router:
    return Router(num_replicas, BLOCK, RoutingConfig(**config))


def test_a_burst_sharing_a_prompt_follows_it_before_its_events_arrive():
    router = make_router()
    prompt = chain(1, 2, 3, 4)
    first = router.route("a", 64, prompt)
    second = router.route("b", 64, prompt)
    assert second.replica_index == first.replica_index == 0
    assert (second.num_matched_tokens, second.num_matched_tokens_by_tier) == (64, (64, 0, 0))
    third = router.route("c", 64, chain(1, 2, 3, 9))  # 3 of 4 blocks pending on replica 0
    assert (third.replica_index, third.num_matched_tokens) == (0, 48)
    fourth = router.route("d", 80, chain(1, 2, 7, 8, 9))  # 2 of 5: replica 0's load weighs more
    assert (fourth.replica_index, fourth.num_matched_tokens) == (1, 0)
    router.check_integrity()


def test_a_prompt_stops_pending_at_its_first_token_or_when_it_ends():
    router = make_router()
    prompt = chain(1, 2, 3)
    router.route("a", 48, prompt)
    router.add_generated("a", 1)  # computed: from now on the replica's events tell
    assert router.route("b", 48, prompt).num_matched_tokens == 0
    router.release("b")  # aborted before its first token
    assert router.route("c", 48, prompt).num_matched_tokens == 0
    router.on_events(KVEventBatch(2, 0, tuple(KVEvent("stored", "npu", h) for h in prompt)))
    assert router.route("d", 48, prompt).replica_index == 2
    router.check_integrity()


def test_a_dead_replica_takes_its_pending_prompts_along():
    router = make_router(2)
    prompt = chain(1, 2)
    assert router.route("a", 32, prompt).replica_index == 0
    router.mark_dead(0)
    assert router.route("b", 32, prompt).num_matched_tokens == 0
    router.mark_alive(0)
    router.check_integrity()


def test_nothing_is_pending_with_prefix_caching_off():
    router = make_router(2, enable_prefix_caching=False)
    prompt = chain(1, 2)
    assert router.route("a", 32, prompt).replica_index == 0
    second = router.route("b", 32, prompt)
    assert second.replica_index == 1 and second.num_matched_tokens == 0
    router.check_integrity()


def test_only_the_newest_pending_prompts_of_a_hot_prefix_are_compared():
    pending = PendingPrompts()
    pending.add("old", 3, chain(1, 2, 3, 4))
    for i in range(MAX_COMPARED):
        pending.add(f"new{i}", i % 2, chain(1, 2, 9))
    assert pending.runs(chain(1, 2, 3, 4)) == {0: 2, 1: 2}  # "old" is past the newest 64
    pending.remove("new0")
    assert pending.runs(chain(1, 2, 3, 4)) == {0: 2, 1: 2, 3: 4}
    pending.check_integrity()
