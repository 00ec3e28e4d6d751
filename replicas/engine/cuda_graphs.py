"""Decode steps replayed as CUDA graphs: one launch a step instead of hundreds of kernels.

A decode step of an 8B model is about a thousand small kernels, each launched by Python; at
batch 32 the GPU would wait on the host. Each batch-size bucket's forward (embedding, layers,
norm, LM head) is captured once at start-up over persistent device buffers, and a step copies
its integers into them and replays the smallest bucket that holds its batch::

    small [4 + groups, max_seqs]:  ids | positions | seq_lens | (unused) | slots per group
    tables[group] [max_seqs, max_blocks]: block tables, row i = sequence i
    padding rows (batch < bucket): seq_len 0 (no key read), slot -1 (nothing written)

Captured largest first into one memory pool; a replay's logits are read (sampled) before the
next replay, so buckets may share it. A batch with a prefill chunk, more sequences than the
largest bucket or a longer context than the tables hold runs eagerly.
"""

import bisect
import logging
import time

import torch

from replicas.engine.cuda_batch import GroupGeometry, HostBatch
from replicas.model.batch import ForwardBatch
from replicas.model.paged_attention import PagedAttentionMetadata, decode_splits
from replicas.model.transformer import Transformer

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
_IDS, _POSITIONS, _SEQ_LENS = 0, 1, 2
_FIRST_SLOTS = 4  # row of the first group's slots in ``small``


class DecodeGraphs:
    """The captured decode forwards of one model runner (see the module docstring)."""

    def __init__(
        self,
        model: Transformer,
        kv_caches: dict[str, torch.Tensor],
        groups: list[GroupGeometry],
        max_seqs: int,
        max_blocks: int,
        num_sms: int,
    ) -> None:
        self.model, self.kv_caches, self.groups = model, kv_caches, groups
        self.buckets = sorted({b for b in BUCKETS if b < max_seqs} | {max_seqs})
        self.max_blocks = max_blocks
        device = next(iter(kv_caches.values())).device
        largest = self.buckets[-1]
        rows = _FIRST_SLOTS + len(groups)
        self._small = torch.zeros((rows, largest), dtype=torch.int32, device=device)
        self._small_host = torch.zeros((rows, largest), dtype=torch.int32).pin_memory()
        shape = (largest, max_blocks)
        self._tables = [torch.zeros(shape, dtype=torch.int32, device=device) for _ in groups]
        self._tables_host = [torch.zeros(shape, dtype=torch.int32).pin_memory() for _ in groups]
        self._sequences = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self._block_size = next(iter(kv_caches.values())).shape[3]
        self._num_sms = num_sms
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, into one memory pool."""
        started = time.perf_counter()
        self._small[_SEQ_LENS:].fill_(0)
        self._small[_FIRST_SLOTS:].fill_(-1)
        pool = None
        for size in reversed(self.buckets):
            batch = self._batch(size)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compiles the kernels; no allocation is captured
                for _ in range(2):
                    self._forward(batch)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._forward(batch)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "cuda graphs: %d decode buckets (1 to %d sequences, %d blocks each) captured in %.1f s",
            len(self.buckets),
            self.buckets[-1],
            self.max_blocks,
            time.perf_counter() - started,
        )

    def can_run(self, host: HostBatch) -> bool:
        if not host.is_decode_only or len(host.seq_lens) > self.buckets[-1]:
            return False
        return all(len(row) <= self.max_blocks for b in host.block_rows for row in b.values())

    @torch.inference_mode()
    def run(self, host: HostBatch) -> torch.Tensor:
        """Replays the bucket of ``host`` (``can_run``); returns the logits [S, vocab], row i
        of sequence i, valid until the next ``run``."""
        num_seqs = len(host.seq_lens)
        size = self.buckets[bisect.bisect_left(self.buckets, num_seqs)]
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies out of the pinned buffers
        small = self._small_host.numpy()
        small[_IDS, :num_seqs] = host.input_ids
        small[_POSITIONS, :num_seqs] = host.positions
        small[_SEQ_LENS, :num_seqs] = host.seq_lens
        small[_SEQ_LENS, num_seqs:size] = 0
        for g, geometry in enumerate(self.groups):
            small[_FIRST_SLOTS + g, :num_seqs] = host.slots[geometry.name]
            small[_FIRST_SLOTS + g, num_seqs:size] = -1
            table = self._tables_host[g].numpy()
            for i, blocks in enumerate(host.block_rows):
                row = blocks[geometry.name]
                table[i, : len(row)] = row
            self._tables[g][:size].copy_(self._tables_host[g][:size], non_blocking=True)
        self._small.copy_(self._small_host, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        self._graphs[size].replay()
        return self._logits[size][:num_seqs]

    def _batch(self, size: int) -> ForwardBatch:
        sequences = self._sequences[:size]
        seq_lens = self._small[_SEQ_LENS, :size]
        max_keys = self.max_blocks * self._block_size
        paged = {
            geometry.name: PagedAttentionMetadata(
                slot_mapping=self._small[_FIRST_SLOTS + g, :size],
                block_table=self._tables[g][:size],
                seq_lens=seq_lens,
                query_start=self._sequences[: size + 1],
                decode_seqs=sequences,
                num_decode_splits=decode_splits(
                    size, geometry.num_kv_heads, max_keys, self._num_sms
                ),
                prefill_tiles=None,
                dense=(),
                sliding_window=geometry.sliding_window,
                kv_format=geometry.kv_format,
            )
            for g, geometry in enumerate(self.groups)
        }
        return ForwardBatch(
            input_ids=self._small[_IDS, :size],
            positions=self._small[_POSITIONS, :size],
            query_start_loc=list(range(size + 1)),
            seq_lens=[1] * size,
            block_tables={name: meta.block_table for name, meta in paged.items()},
            slot_mapping={name: meta.slot_mapping for name, meta in paged.items()},
            logits_indices=sequences,
            paged=paged,
        )

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model(batch, self.kv_caches))
