"""The n-gram prompt-lookup proposer: exact drafts, the longest suffix first, the latest match."""

import pytest

from replicas.engine.ngram_proposer import NGRAM_MAX_LEN, NGRAM_MIN_LEN, NgramProposer


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
