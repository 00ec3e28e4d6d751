"""The only component that builds tensors: KV tensors, batch tensors, the forward pass."""

import torch

from replicas.model import ForwardBatch, LoadedModel
from replicas.scheduler import ScheduledRequest


class ModelRunner:
    """Runs the model over one step's scheduled tokens and returns the logits to sample.

    Every cache group gets its own NPU KV tensor of ``num_npu_blocks[group]`` blocks, laid out
    block-major (``[block, layer, k|v, token, kv_head, head_dim]``) so that one block of every
    layer is one contiguous run, which is what the tier transfers copy. Each group has its own
    block table per request; released sliding blocks appear as block 0 and are never read.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        num_npu_blocks: dict[str, int],
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = loaded.model
        self.device = device
        self.block_size = block_size
        self.specs = self.model.kv_cache_specs(dtype)
        self.kv_caches = {
            group: torch.zeros(
                spec.shape(num_npu_blocks[group], block_size), dtype=dtype, device=device
            )
            for group, spec in self.specs.items()
        }

    @property
    def block_bytes(self) -> int:
        """Bytes of one block position across every cache group."""
        return sum(spec.block_bytes(self.block_size) for spec in self.specs.values())

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, list[int]]:
        """Forward the scheduled tokens. Returns the logits ``[S, vocab]`` of the ``S`` requests
        whose context is complete after this step (to be sampled) and their batch indices."""
        batch, sampled = self._build_batch(scheduled)
        hidden = self.model(batch, self.kv_caches)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return logits, sampled

    def _build_batch(self, scheduled: list[ScheduledRequest]) -> tuple[ForwardBatch, list[int]]:
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampled: list[int] = []
        groups = list(self.kv_caches)
        slot_mapping: dict[str, list[torch.Tensor]] = {g: [] for g in groups}
        max_blocks = max(len(s.block_ids) for s in scheduled)
        tables = {g: torch.zeros((len(scheduled), max_blocks), dtype=torch.long) for g in groups}
        for i, (request, num_new, _, block_tables) in enumerate(scheduled):
            start = request.num_computed_tokens
            end = start + num_new
            input_ids.extend(request.all_token_ids[start:end])
            pos = torch.arange(start, end, dtype=torch.long)
            positions.append(pos)
            for group in groups:
                blocks = torch.tensor([b or 0 for b in block_tables[group]], dtype=torch.long)
                tables[group][i, : len(blocks)] = blocks
                slot_mapping[group].append(
                    blocks[pos // block_size] * block_size + pos % block_size
                )
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
            if end == request.num_tokens:
                logits_indices.append(query_start_loc[-1] - 1)
                sampled.append(i)
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.cat(positions).to(self.device),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables={g: t.to(self.device) for g, t in tables.items()},
            slot_mapping={g: torch.cat(s).to(self.device) for g, s in slot_mapping.items()},
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=self.device),
        )
        return batch, sampled
