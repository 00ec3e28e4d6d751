"""The only component that builds tensors: KV tensors, batch tensors, the forward pass.

On a GPU the batch goes to the device in one pinned copy with the paged attention kernels'
metadata, and decode steps replay CUDA graphs (``replicas.engine.cuda_batch``,
``replicas.engine.cuda_graphs``)."""

from collections.abc import Sequence
from typing import NamedTuple

import torch

from replicas.engine.cuda_batch import CudaBatchBuilder, HostBatch, geometries
from replicas.engine.cuda_graphs import DecodeGraphs
from replicas.engine.request import Request
from replicas.engine.scheduler import ScheduledRequest
from replicas.kv.host_memory import hugepage_zeros
from replicas.kv.records import BlockCopy
from replicas.model import ForwardBatch, LoadedModel
from replicas.model.fusion import fuse_projections
from replicas.model.paged_attention import uses_gpu_kernels
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
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        self.model = loaded.model
        self.device = device
        self.block_size = block_size
        self.specs = self.model.kv_cache_specs(dtype, kv_cache_dtype)
        self.kv_format = next(iter(self.specs.values())).kv_format
        self.kv_caches = {
            group: _zeros(spec.shape(num_npu_blocks[group], block_size), spec.storage_dtype, device)
            for group, spec in self.specs.items()
        }
        self._cuda_batches: CudaBatchBuilder | None = None
        self.graphs: DecodeGraphs | None = None
        if uses_gpu_kernels(device):
            self._set_up_gpu(max_num_seqs, max_model_len, cuda_graphs)

    def _set_up_gpu(self, max_num_seqs: int, max_model_len: int | None, graphs: bool) -> None:
        """Fused float products, the one-copy batches of the paged kernels, and decode graphs
        (``replicas.engine.cuda_batch``, ``replicas.engine.cuda_graphs``)."""
        fuse_projections(self.model)
        args = self.model.args
        num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        geometry = geometries(self.specs, args.num_heads // args.num_kv_heads)
        self._cuda_batches = CudaBatchBuilder(geometry, self.block_size, self.device, num_sms)
        if graphs:
            max_len = max_model_len or args.max_position_embeddings
            max_blocks = -(-max_len // self.block_size)
            self.graphs = DecodeGraphs(
                self.model, self.kv_caches, geometry, max_num_seqs, max_blocks, num_sms
            )
            self.graphs.capture()

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
        host, sampled = self._host_batch(scheduled)
        if self.graphs is not None and self.graphs.can_run(host):
            logits = self.graphs.run(host)  # decodes only: no prompt to score
            if host.logits_indices != list(range(len(host.seq_lens))):
                logits = logits[torch.tensor(host.logits_indices, device=self.device)]
            return logits, sampled, []
        batch = self._batch(host)
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

    def _host_batch(self, scheduled: list[ScheduledRequest]) -> tuple[HostBatch, list[int]]:
        """The integers of the batch of the scheduled tokens, sequence ``i`` being
        ``scheduled[i]``. A request with draft tokens is its last token there, and each draft
        token is a sequence of its own after all of them (position after position, on the
        same blocks), so that it attends as the decode it stands for does: alone
        (``ForwardBatch.num_solo_seqs``), so that it neither pads the decodes' group nor is
        padded by it; the model writes every new token's KV before any attends, so each draft
        token sees those before it."""
        groups = list(self.kv_caches)
        host = HostBatch([], [], [0], [], [], {g: [] for g in groups}, [], 0)
        drafted: list[tuple[Request, tuple[int, ...], dict[str, list[int]]]] = []
        sampled: list[int] = []
        size = self.block_size

        def add(token_ids: list[int] | tuple[int, ...], start: int, blocks: dict) -> None:
            span = range(start, start + len(token_ids))
            host.input_ids.extend(token_ids)
            host.positions.extend(span)
            host.query_start_loc.append(host.query_start_loc[-1] + len(token_ids))
            host.seq_lens.append(span.stop)
            host.block_rows.append(blocks)
            for group in groups:
                table = blocks[group]
                host.slots[group].extend(table[p // size] * size + p % size for p in span)

        for i, item in enumerate(scheduled):
            request, drafts = item.request, item.draft_token_ids
            start = request.num_computed_tokens
            end = start + item.num_new_tokens - len(drafts)
            blocks = {g: [b or 0 for b in item.block_tables[g]] for g in groups}
            add(request.all_token_ids[start:end], start, blocks)
            if item.is_sampled:
                host.logits_indices.append(host.query_start_loc[-1] - 1)
                sampled.append(i)
            if drafts:
                drafted.append((request, drafts, blocks))
        for request, drafts, blocks in drafted:
            for j, token_id in enumerate(drafts):
                add([token_id], request.num_tokens + j, blocks)
                host.logits_indices.append(host.query_start_loc[-1] - 1)
        host.num_solo_seqs = sum(len(drafts) for _, drafts, _ in drafted)
        return host, sampled

    def _batch(self, host: HostBatch) -> ForwardBatch:
        """The batch's tensors: through one pinned copy on a GPU, one by one elsewhere."""
        if self._cuda_batches is not None:
            return self._cuda_batches.build(host)
        max_blocks = max(len(b) for blocks in host.block_rows for b in blocks.values())
        groups = list(self.kv_caches)

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return ForwardBatch(
            input_ids=tensor(host.input_ids),
            positions=tensor(host.positions),
            query_start_loc=host.query_start_loc,
            seq_lens=host.seq_lens,
            block_tables={  # one row per sequence, padded with block 0
                g: tensor([b[g] + [0] * (max_blocks - len(b[g])) for b in host.block_rows])
                for g in groups
            },
            slot_mapping={g: tensor(host.slots[g]) for g in groups},
            logits_indices=tensor(host.logits_indices),
            num_solo_seqs=host.num_solo_seqs,
        )


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A KV cache: on the CPU on transparent hugepages (``hugepage_zeros``)."""
    if device.type == "cpu":
        return hugepage_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)
