"""The n-gram prompt-lookup proposer: exact drafts, the longest suffix first, the latest match;
the backoff of a request whose drafts keep failing, and its one-token probes."""

import math

import pytest

from replicas.engine.ngram_proposer import (
    BACKOFF_DRAFT_LEN,
    MAX_DRAFT_INTERVAL,
    NGRAM_MAX_LEN,
    NGRAM_MIN_LEN,
    NgramProposer,
)


def propose(token_ids: list[int], k: int = 4, max_tokens: int = 100) -> list[int]:
    return NgramProposer(k).propose("r", token_ids, max_tokens)


def test_the_tokens_after_the_earlier_occurrence_of_the_suffix():
    assert propose([1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3]) == [4, 5, 6, 7]
    assert propose([1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3], k=2) == [4, 5]
    assert propose([1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3], max_tokens=3) == [4, 5, 6]


def test_the_longest_suffix_wins_then_the_latest_occurrence():
    # "2 3" last occurred before 8, but "1 2 3" only before 4: n = 3 is tried first.
    assert propose([1, 2, 3, 4, 0, 2, 3, 8, 0, 1, 2, 3]) == [4, 0, 2, 3]
    # Two occurrences of "5 6": the later one (before 8) is the draft.
    assert propose([5, 6, 7, 0, 5, 6, 8, 0, 9, 5, 6]) == [8, 0, 9, 5]


def test_shorter_suffixes_down_to_the_minimum():
    assert NGRAM_MAX_LEN == 3 and NGRAM_MIN_LEN == 2
    assert propose([7, 8, 1, 2, 9, 7, 8]) == [1, 2, 9, 7]  # n = 2
    assert propose([7, 1, 2, 9, 0, 7]) == []  # only n = 1 would match
    assert propose([4]) == [] and propose([4, 4]) == []


def test_a_match_near_the_end_repeats_with_its_period():
    assert propose([3, 7, 8, 7, 8, 7, 8]) == [7, 8, 7, 8]  # period 2
    assert propose([9, 9, 9], k=3) == [9, 9, 9]  # period 1
    assert propose([5, 1, 2, 3, 1, 2, 3], k=5) == [1, 2, 3, 1, 2]  # period 3


def test_nothing_to_propose():
    assert propose([1, 2, 3, 4, 5, 6]) == []
    assert propose([1, 2, 3, 1, 2, 3], max_tokens=0) == []
    with pytest.raises(ValueError, match="num_draft_tokens"):
        NgramProposer(0)


def test_the_index_grows_with_the_request_and_is_released():
    proposer = NgramProposer(3)
    tokens = [1, 2, 3, 4, 5]
    assert proposer.propose("a", tokens, 10) == []
    tokens += [1, 2]  # two tokens at once, as after an accepted draft
    assert proposer.propose("a", tokens, 10) == [3, 4, 5]
    tokens += [3, 4, 5, 6]
    assert proposer.propose("a", tokens, 10) == []
    tokens += [4, 5]  # "4 5" now also occurs before 6, later than before 1
    assert proposer.propose("a", tokens, 10) == [6, 4, 5]
    assert proposer.propose("b", [4, 5, 0, 4, 5], 10) == [0, 4, 5]  # its own index
    proposer.release("a")
    proposer.release("a")  # released twice: no error
    # A fresh index for a reused id sees only the tokens it is given.
    assert proposer.propose("a", [9, 4, 5], 10) == []


def test_matches_a_brute_force_search():
    import random

    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        expected: list[int] = []
        for n in range(min(NGRAM_MAX_LEN, len(tokens) - 1), NGRAM_MIN_LEN - 1, -1):
            suffix = tokens[-n:]
            ends = [e for e in range(n, len(tokens)) if tokens[e - n : e] == suffix]
            if ends:
                end = ends[-1]
                expected = [tokens[end + j % (len(tokens) - end)] for j in range(4)]
                break
        assert propose(tokens) == expected, tokens


# ---- the backoff -----------------------------------------------------------------------------

LOOP = [1, 2, 3, 4, 5]  # after one lap, every suffix has occurred before: a draft every step


def drive(proposer: NgramProposer, num_steps: int, accept) -> list[int]:
    """Propose for request "r" at each step (one token more each time), telling the proposer
    ``accept(step, draft)`` tokens were accepted of each draft; returns the steps that drafted."""
    tokens = LOOP * 2
    drafted = []
    for step in range(num_steps):
        draft = proposer.propose("r", tokens, 100)
        if draft:
            drafted.append(step)
            proposer.record("r", len(draft), accept(step, draft))
        tokens.append(LOOP[len(tokens) % len(LOOP)])
    return drafted


def test_a_request_whose_drafts_are_never_accepted_drafts_log_times():
    assert MAX_DRAFT_INTERVAL == 32
    proposer = NgramProposer(4)
    num_steps = 200
    lengths = []

    def reject(step: int, draft: list[int]) -> int:
        lengths.append(len(draft))
        return 0

    drafted = drive(proposer, num_steps, reject)
    # Steps 1, 2, 4, 8, ... (1-based) while the interval doubles, then every 32nd; the first
    # draft is K tokens long, each after it a one-token probe.
    assert drafted == [0, 1, 3, 7, 15, 31, 63, 95, 127, 159, 191]
    assert lengths == [4] + [BACKOFF_DRAFT_LEN] * (len(drafted) - 1)
    for n in range(1, 2 * MAX_DRAFT_INTERVAL + 1):
        assert sum(step < n for step in drafted) <= math.log2(n) + 1
    assert len(drafted) <= math.log2(64) + 1 + (num_steps - 64) / MAX_DRAFT_INTERVAL


def test_a_request_whose_drafts_are_accepted_drafts_k_every_step():
    proposer = NgramProposer(4)
    lengths = []

    def accept_all(step: int, draft: list[int]) -> int:
        lengths.append(len(draft))
        return len(draft)

    assert drive(proposer, 50, accept_all) == list(range(50))
    assert lengths == [4] * 50


def test_an_accepted_token_ends_the_backoff():
    proposer = NgramProposer(4)
    lengths = []

    def accept(step: int, draft: list[int]) -> int:
        lengths.append(len(draft))
        return 1 if step == 7 else 0  # one token of the draft at step 8 (1-based)

    # Failures at 1, 2, 4; the probe verified at 8 passes its token, so 9 drafts K tokens again;
    # failures at 9 and 10 start the backoff afresh (one failure alone drops nothing).
    assert drive(proposer, 20, accept) == [0, 1, 3, 7, 8, 9, 11, 15]
    assert lengths == [4, 1, 1, 1, 4, 1, 1, 1]


def test_release_drops_the_index_and_the_backoff():
    proposer = NgramProposer(4)
    drive(proposer, 4, lambda step, draft: 0)  # two failures: the next draft found is dropped
    assert proposer.num_requests == 1
    proposer.release("r")
    assert proposer.num_requests == 0
    proposer.record("r", 4, 0)  # a released request: nothing to learn, nothing kept
    assert proposer.num_requests == 0
    assert proposer.propose("r", LOOP * 2, 100) == [1, 2, 3, 4]  # afresh: no backoff
    proposer.record("unknown", 4, 0)
    assert proposer.num_requests == 1
