"""A step's batch on a GPU: the host lists become device tensors in one copy.

On a CPU the model runner hands the model a ``ForwardBatch`` of tensors made one by one. On a
GPU each ``torch.tensor(..., device="cuda")`` is a synchronous copy, about ten a step; here
every integer the forward reads is packed into one pinned int32 buffer, copied with
``non_blocking``, and viewed as the batch's tensors and each cache group's
``PagedAttentionMetadata``::

    pinned | ids T | positions T | logits rows | seq_lens B | query_start B+1 | decodes |
           | per group: slots T | tiles 2 x n | block table B x max_blocks |

The copy is queued on the current stream before the forward, so it lands first; the pinned
buffer is refilled only once the previous step's copy is done (an event).
"""

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from replicas.model.batch import ForwardBatch
from replicas.model.config import KVCacheSpec
from replicas.model.kv_format import KVFormat
from replicas.model.paged_attention import PagedAttentionMetadata, decode_splits, tile_queries


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """What the paged metadata of one cache group depends on besides the batch."""

    name: str
    sliding_window: int  # 0: none
    kv_format: KVFormat
    num_kv_heads: int
    heads_per_kv: int
    dense_prefill: bool  # a prefill with no cached keys may attend by SDPA over its own K/V


def geometries(specs: "dict[str, KVCacheSpec]", heads_per_kv: int) -> list[GroupGeometry]:
    """The geometry of each cache group of ``specs``. A prefill with no cached keys attends by
    SDPA over its own K/V only where the cache holds them as they are (a float cache in the
    model's dtype) and without a window."""
    return [
        GroupGeometry(
            name=group,
            sliding_window=spec.sliding_window or 0,
            kv_format=spec.kv_format,
            num_kv_heads=spec.num_kv_heads,
            heads_per_kv=heads_per_kv,
            dense_prefill=not spec.sliding_window
            and not spec.kv_format.is_quantized
            and spec.storage_dtype == spec.dtype,
        )
        for group, spec in specs.items()
    ]


@dataclass(slots=True)
class HostBatch:
    """The integers of one step's forward, on the host (``ModelRunner._host_batch``)."""

    input_ids: list[int]
    positions: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_rows: list[dict[str, list[int]]]  # per sequence, per group: its block table
    slots: dict[str, list[int]]  # per group: each token's flat KV slot
    logits_indices: list[int]
    num_solo_seqs: int

    @property
    def is_decode_only(self) -> bool:
        """Every sequence has one new token (drafts being verified are sequences too)."""
        return len(self.input_ids) == len(self.seq_lens)


class CudaBatchBuilder:
    """Turns ``HostBatch``es into ``ForwardBatch``es with paged metadata on ``device``."""

    def __init__(
        self, groups: list[GroupGeometry], block_size: int, device: torch.device, num_sms: int
    ) -> None:
        self.groups = groups
        self.block_size = block_size
        self.device = device
        self.num_sms = num_sms
        self._pinned = torch.empty(0, dtype=torch.int32)
        self._copied: torch.cuda.Event | None = None  # the last copy out of ``_pinned``

    def build(self, host: HostBatch) -> ForwardBatch:
        parts: list[np.ndarray] = []
        decodes = [i for i in range(len(host.seq_lens)) if _q_len(host, i) == 1]
        for values in (host.input_ids, host.positions, host.logits_indices, host.seq_lens):
            parts.append(np.asarray(values, dtype=np.int32))
        parts += [np.asarray(host.query_start_loc, dtype=np.int32), np.asarray(decodes, np.int32)]
        per_group = [self._group_parts(host, g) for g in self.groups]
        for slots, tiles, table, _ in per_group:
            parts += [slots, tiles.reshape(-1), table.reshape(-1)]
        views = iter(self._copy(parts))
        ids, positions, logits_rows, seq_lens, query_start, decode_seqs = (
            next(views) for _ in range(6)
        )
        max_keys = max((host.seq_lens[i] for i in decodes), default=0)
        paged = {}
        for geometry, (_, tiles, table, dense) in zip(self.groups, per_group, strict=True):
            slots, tile_view, table_view = next(views), next(views), next(views)
            paged[geometry.name] = PagedAttentionMetadata(
                slot_mapping=slots,
                block_table=table_view.view(table.shape),
                seq_lens=seq_lens,
                query_start=query_start,
                decode_seqs=decode_seqs if decodes else None,
                num_decode_splits=decode_splits(
                    len(decodes), geometry.num_kv_heads, max_keys, self.num_sms
                ),
                prefill_tiles=tile_view.view(tiles.shape) if tiles.shape[1] else None,
                dense=dense,
                sliding_window=geometry.sliding_window,
                kv_format=geometry.kv_format,
            )
        return ForwardBatch(
            input_ids=ids,
            positions=positions,
            query_start_loc=host.query_start_loc,
            seq_lens=host.seq_lens,
            block_tables={g.name: paged[g.name].block_table for g in self.groups},
            slot_mapping={g.name: paged[g.name].slot_mapping for g in self.groups},
            logits_indices=logits_rows,
            num_solo_seqs=host.num_solo_seqs,
            paged=paged,
        )

    def _group_parts(
        self, host: HostBatch, geometry: GroupGeometry
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[tuple[int, int], ...]]:
        """Slots, prefill tiles [2, n], block table [B, width] and dense prefills."""
        tiles: list[tuple[int, int]] = []
        dense: list[tuple[int, int]] = []
        step = tile_queries(geometry.heads_per_kv)
        for i, seq_len in enumerate(host.seq_lens):
            q_len = _q_len(host, i)
            if q_len == 1:
                continue
            if geometry.dense_prefill and q_len == seq_len:
                dense.append((host.query_start_loc[i], q_len))
                continue
            tiles += [(i, q0) for q0 in range(0, q_len, step)]
        rows = [blocks[geometry.name] for blocks in host.block_rows]
        width = max(1, max(len(r) for r in rows))
        table = np.zeros((len(rows), width), dtype=np.int32)
        for i, row in enumerate(rows):
            table[i, : len(row)] = row
        tile_array = np.asarray(tiles, dtype=np.int32).reshape(-1, 2).T.copy()
        slots = np.asarray(host.slots[geometry.name], dtype=np.int32)
        return slots, tile_array, table, tuple(dense)

    def _copy(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """One pinned buffer holding ``parts`` end to end, copied to the device; their views
        (on a CPU, where the kernels' tests run them, the buffer itself)."""
        if self.device.type != "cuda":
            flat = torch.from_numpy(np.concatenate([p.reshape(-1) for p in parts]))
            bounds = np.cumsum([0] + [p.size for p in parts])
            return [flat[a:b] for a, b in itertools.pairwise(bounds)]
        total = sum(p.size for p in parts)
        if self._copied is not None:
            self._copied.synchronize()  # the copy still reading the buffer has landed
        if self._pinned.numel() < total:
            self._pinned = torch.empty(max(total, 2 * self._pinned.numel()), dtype=torch.int32)
            self._pinned = self._pinned.pin_memory()
        staging = self._pinned.numpy()
        offset = 0
        bounds = []
        for part in parts:
            staging[offset : offset + part.size] = part.reshape(-1)
            bounds.append((offset, part.size))
            offset += part.size
        device = self._pinned[:total].to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return [device[start : start + size] for start, size in bounds]


def _q_len(host: HostBatch, i: int) -> int:
    return host.query_start_loc[i + 1] - host.query_start_loc[i]
