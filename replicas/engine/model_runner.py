"""The only component that builds tensors: KV tensors, batch tensors, the forward pass."""

from collections.abc import Sequence
from typing import NamedTuple

import torch

from replicas.engine.request import Request
from replicas.engine.scheduler import ScheduledRequest
from replicas.kv.records import BlockCopy
from replicas.model import ForwardBatch, LoadedModel
from replicas.sampling_params import MAX_TOP_LOGPROBS

SCORE_ROWS = 64  # prompt positions turned into logits at a time (a row is vocab floats)


class PromptScores(NamedTuple):
    """Log-probabilities of prompt tokens ``first_position .. first_position + n - 1`` of the
    ``index``-th scheduled request, each from the logits of the position before it, with the
    ``MAX_TOP_LOGPROBS`` likeliest tokens there."""

    index: int
    first_position: int
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class ModelRunner:
    """Runs the model over one step's scheduled tokens and returns the logits to sample.

    Every cache group gets its own NPU KV tensor of ``num_npu_blocks[group]`` blocks, laid out
    block-major (``[block, layer, k|v, token, kv_head, row]``, rows of the KV format
    ``kv_cache_dtype``) so that one block of every layer is one contiguous run, which is what
    the tier transfers copy as it is. Each group has its own
    block table per request; released sliding blocks appear as block 0 and are never read.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        num_npu_blocks: dict[str, int],
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = loaded.model
        self.device = device
        self.block_size = block_size
        self.specs = self.model.kv_cache_specs(dtype, kv_cache_dtype)
        self.kv_format = next(iter(self.specs.values())).kv_format
        self.kv_caches = {
            group: torch.zeros(
                spec.shape(num_npu_blocks[group], block_size),
                dtype=spec.storage_dtype,
                device=device,
            )
            for group, spec in self.specs.items()
        }

    @property
    def block_bytes(self) -> int:
        """Bytes of one block position across every cache group."""
        return sum(spec.block_bytes(self.block_size) for spec in self.specs.values())

    @torch.inference_mode()
    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Copy whole blocks within the NPU tier, each of every layer at once (a partial block's
        computed tokens for the request that continues them; ``TransferPlan.block_copies``)."""
        for copy in copies:
            cache = self.kv_caches[copy.cache_type]
            cache[copy.dst].copy_(cache[copy.src])

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledRequest], vocab_size: int | None = None
    ) -> tuple[torch.Tensor, list[int], list[PromptScores]]:
        """Forward the scheduled tokens. Returns the logits ``[S + D, vocab]``: first one row
        for each of the ``S`` requests whose context is complete after this step (to be
        sampled: the position after its last token), then one row per draft token of those
        requests, in batch order (the position after each draft token, to verify the drafts);
        the sampled requests' batch indices; and the scores of the prompt tokens this step's
        positions predict for requests that asked for prompt logprobs (the first
        ``vocab_size`` logits only)."""
        batch, sampled = self._build_batch(scheduled)
        hidden = self.model(batch, self.kv_caches, self.kv_format)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        scores = [
            self._score_prompt(hidden, batch, i, request, vocab_size)
            for i, (request, *_) in enumerate(scheduled)
            if request.prompt_logprobs is not None
            and request.num_computed_tokens < request.num_prompt_tokens - 1
        ]
        return logits, sampled, scores

    def _score_prompt(
        self, hidden: torch.Tensor, batch: ForwardBatch, index: int, request, vocab_size
    ) -> PromptScores:
        """Position ``p`` of this step scores prompt token ``p + 1``; the last prompt position
        predicts the first output token, which the sampler scores."""
        start = request.num_computed_tokens
        row = batch.query_start_loc[index]
        end = min(batch.seq_lens[index], request.num_prompt_tokens - 1)
        targets = torch.tensor(request.prompt_token_ids[start + 1 : end + 1], device=self.device)
        logprobs, top_ids, top_logprobs = [], [], []
        for offset in range(0, end - start, SCORE_ROWS):
            rows = hidden[row + offset : row + min(offset + SCORE_ROWS, end - start)]
            scores = torch.log_softmax(self.model.compute_logits(rows)[:, :vocab_size], dim=-1)
            chunk_targets = targets[offset : offset + len(rows), None]
            logprobs += scores.gather(1, chunk_targets).squeeze(1).tolist()
            values, ids = scores.topk(min(MAX_TOP_LOGPROBS, scores.shape[-1]), dim=-1)
            top_ids += ids.tolist()
            top_logprobs += values.tolist()
        return PromptScores(index, start + 1, logprobs, top_ids, top_logprobs)

    def _build_batch(self, scheduled: list[ScheduledRequest]) -> tuple[ForwardBatch, list[int]]:
        """The batch of the scheduled tokens, sequence ``i`` being ``scheduled[i]``. A request
        with draft tokens is its last token there, and each draft token is a sequence of its
        own after all of them (position after position, on the same blocks), so that it
        attends as the decode it stands for does: alone (``ForwardBatch.num_solo_seqs``), so that
        it neither pads the decodes' group nor is padded by it; the model writes every new
        token's KV before any attends, so each draft token sees those before it."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampled: list[int] = []
        groups = list(self.kv_caches)
        block_rows: list[dict[str, list[int]]] = []
        slots: dict[str, list[int]] = {g: [] for g in groups}  # each token's KV slot
        drafted: list[tuple[Request, tuple[int, ...], dict[str, list[int]]]] = []
        size = self.block_size

        def add(token_ids: list[int] | tuple[int, ...], start: int, blocks: dict) -> None:
            span = range(start, start + len(token_ids))
            input_ids.extend(token_ids)
            positions.extend(span)
            query_start_loc.append(query_start_loc[-1] + len(token_ids))
            seq_lens.append(span.stop)
            block_rows.append(blocks)
            for group in groups:
                table = blocks[group]
                slots[group].extend(table[p // size] * size + p % size for p in span)

        for i, item in enumerate(scheduled):
            request, drafts = item.request, item.draft_token_ids
            start = request.num_computed_tokens
            end = start + item.num_new_tokens - len(drafts)
            blocks = {g: [b or 0 for b in item.block_tables[g]] for g in groups}
            add(request.all_token_ids[start:end], start, blocks)
            if item.is_sampled:
                logits_indices.append(query_start_loc[-1] - 1)
                sampled.append(i)
            if drafts:
                drafted.append((request, drafts, blocks))
        for request, drafts, blocks in drafted:
            for j, token_id in enumerate(drafts):
                add([token_id], request.num_tokens + j, blocks)
                logits_indices.append(query_start_loc[-1] - 1)

        max_blocks = max(len(b) for blocks in block_rows for b in blocks.values())
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables={  # one row per sequence, padded with block 0
                g: torch.tensor(
                    [b[g] + [0] * (max_blocks - len(b[g])) for b in block_rows],
                    dtype=torch.long,
                    device=self.device,
                )
                for g in groups
            },
            slot_mapping={
                g: torch.tensor(slots[g], dtype=torch.long, device=self.device) for g in groups
            },
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=self.device),
            num_solo_seqs=sum(len(drafts) for _, drafts, _ in drafted),
        )
        return batch, sampled
