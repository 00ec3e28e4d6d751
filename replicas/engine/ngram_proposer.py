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

A request also stops paying for drafts that keep failing. Every rejected draft token costs a
row of the forward pass and an attention call per layer, so on output that does not copy its
context, drafting at every step is slower than plain decoding. After each verification the
proposer is told how many of the draft's tokens the model accepted (``record``); after f drafts
in a row with none accepted, the request verifies only every ``min(2^(f-1),
MAX_DRAFT_INTERVAL)``-th draft its lookup finds, and drops the others::

    drafts found      1  2  3  4  5  6  7  8  9 ... 16 ... 32 ... 64 ... 96
    never accepted    v  v  .  v  .  .  .  v  . ...  v ...  v ...  v ...  v    (v: verified)

so of its first n drafts found it verifies at most log2(n) + 1 while n <= 2 x
``MAX_DRAFT_INTERVAL``, then one in every ``MAX_DRAFT_INTERVAL``. One failure alone drops
nothing, and one accepted token ends the backoff, so a request that copies its context keeps
drafting at every match.

While it backs off, a request's verified drafts are ``BACKOFF_DRAFT_LEN`` tokens long: a probe
of whether it has started copying, which costs one row where a whole draft costs K (the step
times with and without rejected draft tokens: benchmarks/README.md, ``engine-vs-llamacpp``,
"Probes"). Once a token is accepted, drafts are K long again.
Otherwise a draft's length stays K: after a partial acceptance the next draft comes from another
match, which the rejected tail says nothing about, and an accepted token saves a whole step
where a rejected one costs a row.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

NGRAM_MAX_LEN = 3
"""Longest suffix looked up (tried first)."""
NGRAM_MIN_LEN = 2
"""Shortest suffix looked up."""
BACKOFF_DRAFT_LEN = 1
"""Tokens in a draft of a request whose last verified draft had none accepted (a probe)."""
MAX_DRAFT_INTERVAL = 32
"""Longest backoff: a request whose drafts keep failing verifies at least every this-many-th
draft its lookup finds. It bounds what a request that starts copying late loses (the drafts of
up to this many matches), while one whose drafts never pass adds K rows to only one step in
this many that find a draft."""


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


@dataclass(slots=True)
class _RequestDrafts:
    """A request's index and its backoff (see the module docstring)."""

    index: _Index = field(default_factory=_Index)
    num_failures: int = 0  # verified drafts in a row with no token accepted
    num_to_skip: int = 0  # drafts the lookup finds that are dropped before the next is verified

    def record(self, num_accepted: int) -> None:
        if num_accepted:
            self.num_failures = self.num_to_skip = 0
        else:
            self.num_failures += 1
            self.num_to_skip = min(2 ** (self.num_failures - 1), MAX_DRAFT_INTERVAL) - 1


class NgramProposer:
    """Proposes up to ``num_draft_tokens`` per request and step (see the module docstring); one
    index and backoff per live request, dropped by ``release``."""

    def __init__(self, num_draft_tokens: int) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be at least 1, got {num_draft_tokens}")
        self.num_draft_tokens = num_draft_tokens
        self._requests: dict[str, _RequestDrafts] = {}

    @property
    def num_requests(self) -> int:
        """Requests with an index (proposed for and not released)."""
        return len(self._requests)

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The draft after ``token_ids`` (at most ``min(num_draft_tokens, max_tokens)`` tokens,
        ``BACKOFF_DRAFT_LEN`` while the request backs off; none for a match it drops).
        ``token_ids`` must extend the ones given for the same request before."""
        limit = min(self.num_draft_tokens, max_tokens)
        if limit <= 0:
            return []
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestDrafts()
        index = state.index
        length = len(token_ids)
        # Every occurrence but the suffix itself is followed by a token to propose.
        index.extend(token_ids, length)
        for n in range(min(NGRAM_MAX_LEN, length - 1), NGRAM_MIN_LEN - 1, -1):
            end = index.last_end[n].get(tuple(token_ids[length - n :]))
            if end is not None:
                if state.num_to_skip:
                    state.num_to_skip -= 1
                    return []
                if state.num_failures:
                    limit = min(limit, BACKOFF_DRAFT_LEN)
                period = length - end
                return [token_ids[end + j % period] for j in range(limit)]
        return []

    def record(self, request_id: str, num_draft_tokens: int, num_accepted: int) -> None:
        """How a draft of the request fared: ``num_accepted`` of its ``num_draft_tokens``
        tokens were accepted. A request without an index (released) is ignored."""
        state = self._requests.get(request_id)
        if state is not None and num_draft_tokens > 0:
            state.record(num_accepted)

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
