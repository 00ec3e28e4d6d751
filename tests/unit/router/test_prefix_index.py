import random

import pytest

from replicas.kv.events import KVEvent, KVEventBatch, KVSnapshot
from replicas.kv.hashing import block_hashes
from router.prefix_index import IndexMatch, PrefixIndex


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def store(index: PrefixIndex, replica: int, tier: str, hashes) -> None:
    events = tuple(KVEvent("stored", tier, bh) for bh in hashes)
    index.apply(KVEventBatch(replica, 0, events))


def remove(index: PrefixIndex, replica: int, tier: str, hashes) -> None:
    events = tuple(KVEvent("removed", tier, bh) for bh in hashes)
    index.apply(KVEventBatch(replica, 0, events))


def test_match_is_the_leading_run_counted_per_tier():
    index = PrefixIndex(3)
    prompt = [h(i) for i in range(6)]
    store(index, 0, "npu", prompt[:4])
    store(index, 1, "npu", [prompt[0], prompt[2]])
    store(index, 1, "host", [prompt[1], prompt[3], prompt[4]])
    store(index, 2, "npu", prompt[1:])  # no block 0: nothing matches
    assert index.match(prompt, [0, 1, 2]) == [
        IndexMatch((4, 0, 0)),
        IndexMatch((2, 3, 0)),  # npu, host, npu, host, host, then a miss
        IndexMatch((0, 0, 0)),
    ]
    index.check_integrity()


def test_a_block_in_both_tiers_counts_as_npu_and_a_gap_ends_the_run():
    index = PrefixIndex(2)
    prompt = [h(i) for i in range(5)]
    store(index, 1, "host", prompt)
    store(index, 1, "npu", prompt[:2])
    remove(index, 1, "host", [prompt[3]])
    assert index.match(prompt, [1]) == [IndexMatch((0, 0, 0)), IndexMatch((2, 1, 0))]
    assert index.num_npu_blocks(1) == 2 and index.num_host_blocks(1) == 4
    index.check_integrity()


def test_replicas_not_asked_for_get_nothing():
    index = PrefixIndex(3)
    prompt = [h(i) for i in range(3)]
    for replica in range(3):
        store(index, replica, "npu", prompt)
    assert index.match(prompt, [2]) == [
        IndexMatch((0, 0, 0)),
        IndexMatch((0, 0, 0)),
        IndexMatch((3, 0, 0)),
    ]
    assert index.match(prompt, []) == [IndexMatch((0, 0, 0))] * 3
    assert index.match([], [0, 1, 2]) == [IndexMatch((0, 0, 0))] * 3


def test_events_are_idempotent_and_removing_the_last_holder_deletes_the_entry():
    index = PrefixIndex(2)
    store(index, 0, "npu", [h(1), h(1)])
    store(index, 0, "host", [h(1)])
    remove(index, 0, "npu", [h(1), h(1), h(2)])
    assert len(index) == 1
    assert index.match([h(1)], [0, 1]) == [IndexMatch((0, 1, 0)), IndexMatch((0, 0, 0))]
    remove(index, 0, "host", [h(1)])
    assert len(index) == 0
    assert index.num_npu_blocks(0) == 0 and index.num_host_blocks(0) == 0
    index.check_integrity()


def test_snapshot_replaces_the_replicas_content_and_clear_forgets_it():
    index = PrefixIndex(2)
    store(index, 0, "npu", [h(1), h(2)])
    store(index, 1, "npu", [h(1)])
    index.load_snapshot(KVSnapshot(0, 10, {"full": {"npu": (h(3),), "host": (h(1), h(3))}}))
    assert index.match([h(1)], [0, 1]) == [IndexMatch((0, 1, 0)), IndexMatch((1, 0, 0))]
    assert index.match([h(3)], [0]) == [IndexMatch((1, 0, 0)), IndexMatch((0, 0, 0))]
    assert index.match([h(2)], [0, 1]) == [IndexMatch((0, 0, 0)), IndexMatch((0, 0, 0))]
    assert (index.num_npu_blocks(0), index.num_host_blocks(0)) == (1, 2)
    index.check_integrity()
    index.clear_replica(0)
    assert len(index) == 1 and index.match([h(1)], [0, 1])[1] == IndexMatch((1, 0, 0))
    index.check_integrity()


@pytest.mark.parametrize(("kind", "tier"), [("stored", "tape"), ("evicted", "npu")])
def test_unknown_event_kind_or_tier_is_an_error(kind, tier):
    index = PrefixIndex(1)
    with pytest.raises(ValueError, match="unknown KV event"):
        index.apply(KVEventBatch(0, 0, (KVEvent(kind, tier, h(1)),)))


def test_out_of_range_replica_is_an_error():
    index = PrefixIndex(2)
    with pytest.raises(ValueError, match="out of range"):
        store(index, 2, "npu", [h(1)])
    with pytest.raises(ValueError, match="out of range"):
        index.match([h(1)], [5])


def reference_match(tiers: dict, prompt: list, replica: int) -> IndexMatch:
    """Brute force: walk the prompt until the replica lacks a block."""
    num_npu = num_host = 0
    for bh in prompt:
        held = tiers.get((replica, bh), set())
        if "npu" in held:
            num_npu += 1
        elif "host" in held:
            num_host += 1
        else:
            break
    return IndexMatch((num_npu, num_host, 0))


@pytest.mark.parametrize("num_replicas", [1, 3, 8, 9, 16, 20])
def test_match_agrees_with_brute_force_on_random_states(num_replicas):
    """Covers every record layout: 4-byte (<= 8 replicas), 8-byte (<= 16), and wider."""
    rng = random.Random(num_replicas)
    index = PrefixIndex(num_replicas)
    tiers: dict = {}
    universe = [h(i) for i in range(40)]
    for step in range(3000):
        replica = rng.randrange(num_replicas)
        tier = rng.choice(("npu", "host"))
        bh = rng.choice(universe[: 8 + step // 100])
        kind = rng.choice(("stored", "stored", "removed"))
        index.apply(KVEventBatch(replica, 0, (KVEvent(kind, tier, bh),)))
        held = tiers.setdefault((replica, bh), set())
        if kind == "stored":
            held.add(tier)
        else:
            held.discard(tier)
        if step % 50 == 0:
            prompt = universe[: rng.randrange(1, 40)]
            asked = [r for r in range(num_replicas) if rng.random() < 0.8]
            expected = [
                reference_match(tiers, prompt, r) if r in asked else IndexMatch((0, 0, 0))
                for r in range(num_replicas)
            ]
            assert index.match(prompt, asked) == expected
    index.check_integrity()


def test_a_large_index_matches_exactly():
    """250k blocks over 8 replicas: every replica finds exactly its own chains."""
    num_replicas, block_size, num_chains, chain_len = 8, 16, 488, 512
    index = PrefixIndex(num_replicas)
    chains = []
    for c in range(num_chains):
        chain = block_hashes(list(range(chain_len * block_size)), block_size, salt=f"tenant-{c}")
        replica = c % num_replicas
        store(index, replica, "npu", chain[:384])
        store(index, replica, "host", chain[256:])  # 256..383 in both tiers: they count as NPU
        chains.append(chain)
    assert len(index) == num_chains * chain_len
    all_replicas = list(range(num_replicas))
    for c in (0, 1, 7, 250, 487):
        expected = [IndexMatch((0, 0, 0))] * num_replicas
        expected[c % num_replicas] = IndexMatch((384, 128, 0))
        assert index.match(chains[c], all_replicas) == expected
    shared = chains[0][:100]
    store(index, 5, "host", shared)
    result = index.match(chains[0], all_replicas)
    assert result[0] == IndexMatch((384, 128, 0)) and result[5] == IndexMatch((0, 100, 0))
    index.clear_replica(0)
    assert index.match(chains[0], all_replicas)[0] == IndexMatch((0, 0, 0))
    assert index.num_npu_blocks(0) == 0 and len(index) == (num_chains - 61) * chain_len + 100
    index.check_integrity()
