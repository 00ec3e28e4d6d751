"""Draft tokens by n-gram prompt lookup: guess what a request says next from what it said before.

For a sequence ``t[0 .. L-1]`` (prompt and output so far) and ``n`` from ``NGRAM_MAX_LEN`` down
to ``NGRAM_MIN_LEN``, find the most recent earlier occurrence of its last ``n`` tokens and
propose the tokens that followed it::

    t:   ... a b c d e f g ... a b c          n = 3: the suffix "a b c" occurred before "d",
                                                so the draft is "d e f g" (k = 4)

When the occurrence ends fewer than k tokens before the end of ``t``, the sequence is in a loop
of that period and the draft goes round it again: ``x y x y x y`` proposes ``x y x y`` for
k = 4, not just ``x y``.

The longest matching ``n`` wins; a suffix seen nowhere before gives no draft. Shorter n-grams
match more often and more often wrongly: n = 1 guesses from any repeated token, and every
rejected draft token costs a position of the forward pass, so the lookup stops at 2.

Each request has an index (n-gram -> the end of its latest occurrence) that grows with its
tokens: a proposal indexes the positions added since the last one (one dictionary write per
token and n), then looks each suffix up once, so a step costs the same at any context length
and the whole context is searched, for two dictionary entries per token (far less memory than
the token's KV). Tokens are never taken back (a preempted request keeps its outputs), so an
index stays valid until ``release``.
"""

from collections.abc import Sequence

NGRAM_MAX_LEN = 3
"""Longest suffix looked up (tried first)."""
NGRAM_MIN_LEN = 2
"""Shortest suffix looked up."""


class _Index:
    """Per n: n-gram -> the end (exclusive) of its latest occurrence among those indexed."""

    __slots__ = ("end", "last_end")

    def __init__(self) -> None:
        self.last_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(NGRAM_MAX_LEN + 1)]
        self.end = 0  # every occurrence that ends before this is indexed

    def extend(self, token_ids: Sequence[int], end: int) -> None:
        """Index the occurrences that end from ``self.end`` up to (not including) ``end``."""
        for stop in range(max(self.end, NGRAM_MIN_LEN), end):
            for n in range(NGRAM_MIN_LEN, min(NGRAM_MAX_LEN, stop) + 1):
                self.last_end[n][tuple(token_ids[stop - n : stop])] = stop
        self.end = max(self.end, end)


class NgramProposer:
    """Proposes up to ``num_draft_tokens`` per request and step (see the module docstring); one
    index per live request, dropped by ``release``."""

    def __init__(self, num_draft_tokens: int) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be at least 1, got {num_draft_tokens}")
        self.num_draft_tokens = num_draft_tokens
        self._indexes: dict[str, _Index] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The draft after ``token_ids`` (at most ``min(num_draft_tokens, max_tokens)`` tokens).
        ``token_ids`` must extend the ones given for the same request before."""
        limit = min(self.num_draft_tokens, max_tokens)
        if limit <= 0:
            return []
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _Index()
        length = len(token_ids)
        # Every occurrence but the suffix itself is followed by a token to propose.
        index.extend(token_ids, length)
        for n in range(min(NGRAM_MAX_LEN, length - 1), NGRAM_MIN_LEN - 1, -1):
            end = index.last_end[n].get(tuple(token_ids[length - n :]))
            if end is not None:
                period = length - end
                return [token_ids[end + j % period] for j in range(limit)]
        return []

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
