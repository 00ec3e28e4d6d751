"""Prompt log-probabilities kept by block, so that scoring a prompt does not recompute a cached
prefix.

A prompt token's score comes from the logits of the position before it, which a cached prefix
never computes again. So the scores a request computed are kept here, one entry per block::

    prompt   | block k-1 |  block k  | ...
    entry k  scores tokens (k-1)B+1 .. kB: the logits of block k-1's positions, each applied to
             the token after it, the last of which is block k's first token

Entry ``k`` is keyed by the hash of block ``k - 1`` (which fixes every token before it, salt
included) and the token at ``kB``, which fixes everything the entry holds. A request asking
for prompt logprobs may start after a cached prefix of ``j`` blocks only where its scores of
tokens ``1 .. jB`` are known: its own (kept across a preemption) or entries ``1 .. j``. The
scheduler asks ``num_usable_blocks`` before matching; ``fill`` then copies the entries in.

Entries are float32/int32 tensors (about 2.7 KB a block of 16 tokens with 20 alternatives), at
most ``capacity_tokens`` tokens, least recently used first out.
"""

from collections import OrderedDict
from typing import NamedTuple

import torch

from replicas.engine.request import Request
from replicas.kv.hashing import BlockHash
from replicas.outputs import TokenLogprob

DEFAULT_CAPACITY_TOKENS = 1 << 16


class _Entry(NamedTuple):
    token_ids: torch.Tensor  # [B] int32, the scored tokens
    logprobs: torch.Tensor  # [B] float32
    top_ids: torch.Tensor  # [B, K] int32
    top_logprobs: torch.Tensor  # [B, K] float32


class PromptLogprobsCache:
    def __init__(self, block_size: int, capacity_tokens: int = DEFAULT_CAPACITY_TOKENS) -> None:
        self.block_size = block_size
        self.capacity_blocks = max(1, capacity_tokens // block_size)
        self._entries: OrderedDict[tuple[BlockHash, int], _Entry] = OrderedDict()
        self.num_filled_tokens = 0  # prompt scores served from here, since start

    def __len__(self) -> int:
        return len(self._entries)

    def _key(self, request: Request, k: int) -> tuple[BlockHash, int]:
        return request.block_hashes[k - 1], request.prompt_token_ids[k * self.block_size]

    def num_usable_blocks(self, request: Request) -> int:
        """Blocks of ``request``'s prompt it may take from the prefix cache: those whose tokens'
        scores it has or can fill from here (no mutation)."""
        block = self.block_size
        num_blocks = (request.num_prompt_tokens - 1) // block
        k = 1
        while k <= num_blocks and (
            k * block < request.num_scored_prompt_tokens or self._key(request, k) in self._entries
        ):
            k += 1
        return k - 1

    def fill(self, request: Request) -> None:
        """Extend ``request``'s prompt scores through its computed tokens from the entries."""
        block = self.block_size
        scores = request.prompt_logprobs
        while len(scores) <= min(request.num_computed_tokens, request.num_prompt_tokens - 1):
            k = len(scores) // block + 1  # the entry holding position len(scores)
            entry = self._entries[self._key(request, k)]
            self._entries.move_to_end(self._key(request, k))
            first = (k - 1) * block + 1
            for offset in range(len(scores) - first, block):
                scores.append(_token_logprob(entry, offset))
                self.num_filled_tokens += 1

    def record(self, request: Request, num_scored_before: int) -> None:
        """Keep the entries that ``request``'s scores completed since it had
        ``num_scored_before`` of them."""
        block = self.block_size
        scores = request.prompt_logprobs
        last = min(len(scores) - 1, request.num_prompt_tokens - 1) // block
        for k in range(max(1, (num_scored_before - 1) // block + 1), last + 1):
            key = self._key(request, k)
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            self._entries[key] = _entry(scores[(k - 1) * block + 1 : k * block + 1])
            if len(self._entries) > self.capacity_blocks:
                self._entries.popitem(last=False)


def _entry(scores: list[TokenLogprob]) -> _Entry:
    return _Entry(
        torch.tensor([s.token_id for s in scores], dtype=torch.int32),
        torch.tensor([s.logprob for s in scores], dtype=torch.float32),
        torch.tensor([[t for t, _ in s.top] for s in scores], dtype=torch.int32),
        torch.tensor([[v for _, v in s.top] for s in scores], dtype=torch.float32),
    )


def _token_logprob(entry: _Entry, offset: int) -> TokenLogprob:
    top = tuple(zip(entry.top_ids[offset].tolist(), entry.top_logprobs[offset].tolist()))
    return TokenLogprob(int(entry.token_ids[offset]), float(entry.logprobs[offset]), top)
