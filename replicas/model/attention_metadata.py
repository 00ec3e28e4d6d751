"""The host side of attention over the block KV cache (``replicas.model.attention``): which keys
each sequence reads, in which chunks, grouped how, and through which cache rows.

``AttentionMetadata.build`` does the host work of a forward once (positions, blocks, masks,
chunk lists); the cache row indices, which also depend on the cache's strides and head counts,
are computed at the first layer and reused by the others (``layout_for``), so a layer runs only
tensor ops. The layout, the chunking and the grouping rules are described in
``replicas.model.attention``'s docstring.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from replicas.model.batch import ForwardBatch
from replicas.model.kv_format import KVFormat, float_format

CHUNK_BLOCKS = 32  # blocks per chunk of a long context; see the module docstring
ONE_CHUNK_BLOCKS = 96  # a group whose key spans all fit in this many blocks reads one chunk
DEQUANTIZED_ROWS = 1 << 16  # most 8-bit K/V rows one call of Strata's attention dequantizes


@dataclass(slots=True)
class KeyChunk:
    """Keys of one chunk for the first ``num_seqs`` sequences of a group, ``width`` each.

    Only the query rows ``first_row:end_row`` of each sequence see any of them.
    """

    num_seqs: int
    first_row: int
    end_row: int
    blocks: torch.Tensor  # [n, width] block of each key (the last new token's where hidden)
    offsets: torch.Tensor  # [n, width] offset of each key in its block
    hidden: torch.Tensor | None  # [n, 1, rows, 1, width] bool, True: masked; None: all seen


@dataclass(slots=True)
class AttentionGroup:
    """Sequences whose queries attend together, ``q_len`` rows each, over the same chunks.

    A group of one chunk runs as one SDPA call, with ``is_causal`` (plainly causal from key 0)
    or the mask ``allowed`` ([S, 1, q_len, width], True: seen; None: every key seen).
    """

    rows: torch.Tensor | slice  # [num_seqs * q_len] rows of the queries, sequence-major
    num_seqs: int
    q_len: int
    chunks: list[KeyChunk]
    is_causal: bool
    allowed: torch.Tensor | None


@dataclass(slots=True)
class GroupReads:
    """Where one group's chunks lie in a cache of one layout, and its float32 partials.

    Every layer reads the same rows and overwrites the same parts of the partials; the parts
    no chunk computes stay neutral (m = -inf: weight 0; l = o = 0).
    """

    rows: list[torch.Tensor]  # per chunk: [2 * n * kv_heads * width] rows of k, then of v
    queries: list[slice]  # per chunk: its rows of the group's [.., q_len * heads_per_kv, ..]
    biases: list[torch.Tensor | None]  # per chunk: [n, 1, rows or 1, width], 0 or -inf
    partials: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per chunk: m, l, o views
    m_all: torch.Tensor | None  # [chunks, S * kv_heads, q_len * heads_per_kv, 1] max score
    l_all: torch.Tensor | None  # [chunks, S * kv_heads, q_len * heads_per_kv, 1] sum exp
    o_all: torch.Tensor | None  # [chunks, S * kv_heads, q_len * heads_per_kv, head_dim]


@dataclass(slots=True)
class _CacheLayout:
    """The cache rows (a view of the cache as [-1, row_width], layer 0) of one forward."""

    key: tuple
    kv_format: KVFormat
    write_rows: torch.Tensor  # [2 * T * kv_heads] rows of the new tokens' k, then v
    reads: list[GroupReads]  # per group


@dataclass(slots=True)
class AttentionMetadata:
    """What every layer of one cache group needs for one forward; built once per group.

    ``layout`` is filled at the first layer: row indices depend on the cache's strides and
    head counts, which ``build`` does not know, and are the same for every layer.
    """

    write_blocks: torch.Tensor  # [T] block of each new token
    write_offsets: torch.Tensor  # [T] offset of each new token in its block
    groups: list[AttentionGroup]
    is_one_group: bool  # a single group whose rows are the whole batch, in order
    kv_format: KVFormat | None = None  # how the cache stores K/V; None: values in its dtype
    layout: _CacheLayout | None = None

    @classmethod
    def build(
        cls,
        batch: ForwardBatch,
        group: str,
        block_size: int,
        sliding_window: int | None,
        kv_format: KVFormat | None = None,
        whole_spans: bool = False,
    ) -> "AttentionMetadata":
        """``whole_spans``: every group reads its keys as one chunk, however long (for Strata's
        attention, which reads them in place: ``strata_attends``)."""
        table = batch.block_tables[group]  # [B, max_blocks]
        slots = batch.slot_mapping[group]  # [T]
        decodes, groups = [], []

        def group_of(seqs: list[_Seq]) -> AttentionGroup:
            return _build_group(table, slots, seqs, block_size, sliding_window, whole_spans)

        first_solo = batch.num_seqs - batch.num_solo_seqs
        for i, seq_len in enumerate(batch.seq_lens):
            start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            if end - start == 1 and i >= first_solo:
                seq = _Seq(i, start, seq_len, 1, block_size, sliding_window)
                groups.append(group_of([seq]))
            elif end - start == 1:
                decodes.append(_Seq(i, start, seq_len, 1, block_size, sliding_window))
            elif end > start:
                seq = _Seq(i, start, seq_len, end - start, block_size, sliding_window)
                groups.append(group_of([seq]))
        if decodes:
            decodes.sort(key=lambda s: -s.span)  # stable: batch order where it can
            groups.append(group_of(decodes))
        whole = slice(0, batch.query_start_loc[-1])
        return cls(
            write_blocks=torch.div(slots, block_size, rounding_mode="floor"),
            write_offsets=slots % block_size,
            groups=groups,
            is_one_group=len(groups) == 1
            and isinstance(groups[0].rows, slice)
            and groups[0].rows == whole,
            kv_format=kv_format,
        )

    def layout_for(self, kv_cache: torch.Tensor, heads_per_kv: int, head_dim: int) -> _CacheLayout:
        """The row indices and partials for ``kv_cache``; computed once, then reused."""
        key = (kv_cache.stride(), kv_cache.shape[-2:], heads_per_kv, head_dim, kv_cache.device)
        if self.layout is None or self.layout.key != key:
            self.layout = self._new_layout(key, kv_cache, heads_per_kv, head_dim)
        return self.layout

    def _new_layout(
        self, key: tuple, kv_cache: torch.Tensor, heads_per_kv: int, head_dim: int
    ) -> _CacheLayout:
        fmt = self.kv_format or float_format(kv_cache.dtype)
        num_kv_heads, row_width = kv_cache.shape[-2:]
        if row_width != fmt.row_width(head_dim) or kv_cache.dtype != fmt.storage_dtype:
            raise ValueError(
                f"a {fmt.name} KV cache holds rows of {fmt.row_width(head_dim)} "
                f"{fmt.storage_dtype} for head_dim {head_dim}, got {row_width} {kv_cache.dtype}"
            )
        block, _, kv, offset, head, _ = (s // row_width for s in kv_cache.stride())
        heads = torch.arange(num_kv_heads, device=kv_cache.device) * head

        def kv_rows(blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            k_rows = (blocks * block + offsets * offset)[:, None, :] + heads[None, :, None]
            return torch.stack([k_rows, k_rows + kv]).flatten()  # [2, n, kv_heads, width]

        write = (self.write_blocks * block + self.write_offsets * offset)[:, None] + heads
        reads = []
        for group in self.groups:
            rows = [kv_rows(c.blocks, c.offsets) for c in group.chunks]
            queries = [
                slice(c.first_row * heads_per_kv, c.end_row * heads_per_kv) for c in group.chunks
            ]
            if len(group.chunks) == 1:  # one SDPA call, no partials
                reads.append(GroupReads(rows, queries, [], [], None, None, None))
                continue
            biases = [_bias(c.hidden, heads_per_kv) for c in group.chunks]
            shape = (len(group.chunks), group.num_seqs * num_kv_heads, group.q_len * heads_per_kv)
            m_all = torch.full((*shape, 1), -math.inf, device=kv_cache.device)
            l_all = torch.zeros((*shape, 1), device=kv_cache.device)
            o_all = torch.zeros((*shape, head_dim), device=kv_cache.device)
            partials = []
            for i, (chunk, q) in enumerate(zip(group.chunks, queries, strict=True)):
                n = chunk.num_seqs * num_kv_heads
                partials.append((m_all[i, :n, q], l_all[i, :n, q], o_all[i, :n, q]))
            reads.append(GroupReads(rows, queries, biases, partials, m_all, l_all, o_all))
        return _CacheLayout(key, fmt, torch.stack([write, write + kv]).flatten(), reads)


def _bias(hidden: torch.Tensor | None, heads_per_kv: int) -> torch.Tensor | None:
    """[n, 1, rows, 1, width] hidden keys -> the scores' additive mask [n, 1, rows * hpk, width].

    Adding -inf costs a fraction of a broadcasting masked_fill_; one query row (decodes)
    broadcasts over the heads of its kv head.
    """
    if hidden is None:
        return None
    bias = torch.zeros(hidden.shape, device=hidden.device).masked_fill_(hidden, -math.inf)
    n, _, num_rows, _, width = hidden.shape
    if num_rows == 1:
        return bias.view(n, 1, 1, width)
    return bias.expand(n, 1, num_rows, heads_per_kv, width).reshape(n, 1, -1, width)


@dataclass(slots=True, init=False)
class _Seq:
    """Host-side geometry of one sequence's keys; chunk ``c`` starts at ``grid_start + c * L``."""

    index: int
    first_row: int  # of its queries in the batch
    seq_len: int
    q_len: int
    first_key: int
    grid_start: int  # first position of first_key's block
    span: int  # seq_len - grid_start: the positions of the blocks it reads

    def __init__(
        self,
        index: int,
        first_row: int,
        seq_len: int,
        q_len: int,
        block_size: int,
        sliding_window: int | None,
    ) -> None:
        self.index, self.first_row, self.seq_len, self.q_len = index, first_row, seq_len, q_len
        first_q = seq_len - q_len
        self.first_key = max(0, first_q - sliding_window + 1) if sliding_window else 0
        self.grid_start = self.first_key // block_size * block_size
        self.span = seq_len - self.grid_start


def _build_group(
    table: torch.Tensor,
    slots: torch.Tensor,
    seqs: list[_Seq],
    block_size: int,
    sliding_window: int | None,
    whole_spans: bool = False,
) -> AttentionGroup:
    """The chunks of ``seqs``: one prefill, or decodes sorted by span descending."""
    is_one_chunk = whole_spans or seqs[0].span <= ONE_CHUNK_BLOCKS * block_size
    if is_one_chunk:  # as wide as the longest span (whole_spans: however long)
        chunk_len = max(ONE_CHUNK_BLOCKS * block_size, seqs[0].span)
    else:
        chunk_len = CHUNK_BLOCKS * block_size
    q_len, num_chunks = seqs[0].q_len, -(-seqs[0].span // chunk_len)
    # One chunk is as wide as the longest span (the first: a prefill, or decodes by span).
    grid_len = num_chunks * chunk_len if num_chunks > 1 else seqs[0].span
    grid = _key_grid(table, slots, seqs, grid_len, block_size, sliding_window)
    chunks = [
        _key_chunk(seqs, c * chunk_len, chunk_len, grid, sliding_window) for c in range(num_chunks)
    ]
    rows: torch.Tensor | slice
    first_rows = [s.first_row for s in seqs]
    if first_rows == list(range(first_rows[0], first_rows[0] + len(seqs) * q_len, q_len)):
        rows = slice(first_rows[0], first_rows[0] + len(seqs) * q_len)
    else:
        rows = torch.tensor(first_rows, device=table.device)  # decodes: one row each
    only = chunks[0]
    is_causal = num_chunks == 1 and seqs[0].grid_start == 0 and seqs[0].seq_len == q_len
    is_causal = is_causal and not (sliding_window and q_len > sliding_window)
    return AttentionGroup(
        rows=rows,
        num_seqs=len(seqs),
        q_len=q_len,
        chunks=chunks,
        is_causal=is_causal,
        allowed=(
            ~only.hidden[:, :, :, 0]
            if num_chunks == 1 and only.hidden is not None and not is_causal
            else None
        ),
    )


class _KeyGrid(NamedTuple):
    """Per sequence and grid position: the key's block and offset (a padding position reads
    the sequence's last written slot), and per query row whether the key is hidden from it."""

    blocks: torch.Tensor  # [S, grid]
    offsets: torch.Tensor  # [S, grid]
    hidden: torch.Tensor  # [S, q_len, grid]


def _key_grid(
    table: torch.Tensor,
    slots: torch.Tensor,
    seqs: list[_Seq],
    grid_len: int,
    block_size: int,
    sliding_window: int | None,
) -> _KeyGrid:
    """The keys of ``seqs`` over ``grid_len`` positions from each one's ``grid_start``."""
    device = table.device
    q_len = seqs[0].q_len
    seq_idx, grid_start, first_key, seq_len, last_row = torch.tensor(
        [[s.index, s.grid_start, s.first_key, s.seq_len, s.first_row + q_len - 1] for s in seqs],
        device=device,
    ).T[:, :, None]  # each [S, 1]
    pos = grid_start + torch.arange(grid_len, device=device)  # [S, grid]
    is_read = (pos >= first_key) & (pos < seq_len)
    cols = torch.div(pos, block_size, rounding_mode="floor").clamp(max=table.shape[1] - 1)
    last_slot = slots[last_row]  # [S, 1]
    blocks = torch.where(is_read, table[seq_idx, cols], last_slot // block_size)
    offsets = torch.where(is_read, pos % block_size, last_slot % block_size)
    if q_len == 1:  # one query sees exactly the keys it reads: none after it, none before
        # its window (first_key is where its window starts)
        return _KeyGrid(blocks, offsets, ~is_read[:, None, :])
    q_pos = seq_len - q_len + torch.arange(q_len, device=device)  # [S, q_len]
    hidden = ~is_read[:, None, :] | (pos[:, None, :] > q_pos[:, :, None])  # [S, q_len, grid]
    if sliding_window:
        hidden |= pos[:, None, :] <= q_pos[:, :, None] - sliding_window
    return _KeyGrid(blocks, offsets, hidden)


def _key_chunk(
    seqs: list[_Seq], start: int, chunk_len: int, grid: _KeyGrid, sliding_window: int | None
) -> KeyChunk:
    """The chunk of the grid from ``start``: the sequences that reach it, the query rows that
    see a key in it, and its mask unless every key is visible to every row."""
    q_len = seqs[0].q_len
    inside = [s for s in seqs if s.span > start]
    lens = [min(chunk_len, s.seq_len - s.grid_start - start) for s in inside]
    width = max(lens)
    # The query rows that see a key here, q_pos in [first key, last key + window): all of
    # a prefill's rows only when it is short; the one row of each decode always.
    first_pos, first_q = seqs[0].grid_start + start, seqs[0].seq_len - q_len
    first_row = max(0, first_pos - first_q)
    end_row = q_len
    if sliding_window:
        end_row = min(q_len, first_pos + lens[0] - 1 + sliding_window - first_q)
    is_masked = any(
        n < width  # padding at the end
        or s.grid_start + start < s.first_key  # start of the window's first block
        or s.grid_start + start + n - 1 > s.seq_len - q_len  # causal within the chunk
        or (sliding_window and s.grid_start + start <= s.seq_len - 1 - sliding_window)
        for s, n in zip(inside, lens, strict=True)
    )
    keys = (slice(0, len(inside)), slice(start, start + width))
    chunk_hidden = grid.hidden[keys[0], first_row:end_row, keys[1]]  # [n, rows, width]
    return KeyChunk(
        num_seqs=len(inside),
        first_row=first_row,
        end_row=end_row,
        blocks=grid.blocks[keys],
        offsets=grid.offsets[keys],
        hidden=chunk_hidden[:, None, :, None, :] if is_masked else None,
    )
