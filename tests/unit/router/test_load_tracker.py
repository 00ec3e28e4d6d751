import pytest

from router.load import LoadTracker


def test_prompt_and_generated_tokens_are_charged_and_released():
    load = LoadTracker(2)
    load.charge("a", 0, 100)
    load.charge("b", 1, 40)
    load.charge("c", 0, 10)
    load.add_generated("a", 5)
    load.add_generated("a", 3)
    assert load.load_tokens == [118, 40]
    load.release("a")
    assert load.load_tokens == [10, 40]
    assert load.replica_of("a") is None and load.replica_of("c") == 0
    load.check_integrity()


def test_release_and_add_generated_after_release_are_no_ops():
    load = LoadTracker(1)
    load.charge("a", 0, 7)
    load.release("a")
    load.release("a")  # completion and abort may both arrive
    load.add_generated("a", 9)
    load.release("never-routed")
    load.add_generated("never-routed", 4)
    assert load.load_tokens == [0] and len(load) == 0
    load.check_integrity()


def test_a_released_id_can_be_routed_again_but_a_live_one_cannot():
    load = LoadTracker(2)
    load.charge("a", 0, 7)
    with pytest.raises(ValueError, match="already routed"):
        load.charge("a", 1, 7)
    load.release("a")
    load.charge("a", 1, 3)
    assert load.load_tokens == [0, 3]


def test_clear_replica_drops_its_requests_only():
    load = LoadTracker(2)
    load.charge("a", 0, 7)
    load.charge("b", 1, 5)
    load.add_generated("a", 1)
    load.clear_replica(0)
    assert load.load_tokens == [0, 5]
    load.release("a")
    load.add_generated("a", 3)
    assert load.load_tokens == [0, 5]
    load.check_integrity()


def test_negative_counts_are_rejected():
    load = LoadTracker(1)
    with pytest.raises(ValueError):
        load.charge("a", 0, -1)
    load.charge("a", 0, 1)
    with pytest.raises(ValueError):
        load.add_generated("a", -1)


def test_queued_prefill_lasts_until_the_first_token_or_release():
    load = LoadTracker(2)
    load.charge("a", 0, 100, num_uncached_tokens=60)
    load.charge("b", 0, 50, num_uncached_tokens=50)
    load.charge("c", 1, 30, num_uncached_tokens=0)
    assert load.queued_tokens == [110, 0] and load.num_requests == [2, 1]
    load.add_generated("a", 1)  # a's prefill is done
    assert load.queued_tokens == [50, 0]
    load.release("b")
    assert load.queued_tokens == [0, 0] and load.num_requests == [1, 1]
    load.charge("d", 1, 20, num_uncached_tokens=20)
    load.clear_replica(1)
    assert load.queued_tokens == [0, 0] and load.num_requests == [1, 0]
    load.check_integrity()
