"""The paged attention kernels (CUDA's attention) against a float64 reference, run by Triton's
interpreter on the CPU: decodes in one share and in several, prefill chunks after cached keys,
GQA with a group of 3, sliding windows, every KV format, and writes that skip slot -1."""

import math

import pytest
import torch

pytest.importorskip("triton")

from replicas.model.kv_format import kv_format
from replicas.model.paged_attention import (
    PagedAttentionMetadata,
    paged_attention,
    tile_queries,
)

BLOCK_SIZE = 16


def _case(seq_lens, q_lens, heads, kv_heads, head_dim, fmt_name, dtype, seed=0):
    """A cache whose context keys are already written, the new tokens' q/k/v, block tables."""
    generator = torch.Generator().manual_seed(seed)
    fmt = kv_format(fmt_name, dtype)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 3
    cache = torch.zeros(
        (num_blocks, 2, 2, BLOCK_SIZE, kv_heads, fmt.row_width(head_dim)), dtype=fmt.storage_dtype
    )
    order = torch.randperm(num_blocks - 1, generator=generator) + 1  # block 0: padding
    tables, used = [], 0
    for n in seq_lens:
        count = -(-n // BLOCK_SIZE)
        tables.append(order[used : used + count].tolist())
        used += count
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    keys = []  # per sequence: every key and value, as stored (dequantized), float64
    for i, n in enumerate(seq_lens):
        kv = torch.randn((2, n, kv_heads, head_dim), generator=generator).to(dtype)
        rows = fmt.quantize(kv.reshape(-1, head_dim)).view(2, n, kv_heads, -1)
        for p in range(n - q_lens[i]):  # the cached context, written in advance
            block = tables[i][p // BLOCK_SIZE]
            cache[block, 1, :, p % BLOCK_SIZE] = rows[:, p]
        keys.append(fmt.dequantize(rows, torch.float64))
    new = [range(n - q, n) for n, q in zip(seq_lens, q_lens, strict=True)]
    k = torch.cat([kv[0][list(r)] for kv, r in zip(keys, new, strict=True)]).to(dtype)
    v = torch.cat([kv[1][list(r)] for kv, r in zip(keys, new, strict=True)]).to(dtype)
    q = torch.randn((sum(q_lens), heads, head_dim), generator=generator).to(dtype)
    slots = torch.tensor(
        [
            tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for i, r in enumerate(new)
            for p in r
        ],
        dtype=torch.int32,
    )
    return fmt, cache, table, keys, q, k, v, slots


def _reference(q, keys, seq_lens, q_lens, window):
    out, row = [], 0
    heads = q.shape[1]
    for kv, n, q_len in zip(keys, seq_lens, q_lens, strict=True):
        k, v = kv[0], kv[1]  # [n, Hkv, D]
        group = heads // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        for j in range(q_len):
            pos = n - q_len + j
            seen = torch.arange(n) <= pos
            if window:
                seen &= torch.arange(n) > pos - window
            s = torch.einsum("hd,nhd->hn", q[row + j].double(), k) / math.sqrt(q.shape[-1])
            p = torch.softmax(s.masked_fill(~seen, -math.inf), -1)
            out.append(torch.einsum("hn,nhd->hd", p, v))
        row += q_len
    return torch.stack(out)


def _meta(fmt, table, seq_lens, q_lens, slots, window, splits, q, kv_heads, dense=()):
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    tiles = [
        (i, q0)
        for i, n in enumerate(q_lens)
        if n > 1 and (starts[i], n) not in dense
        for q0 in range(0, n, tile_queries(q.shape[1] // kv_heads))
    ]
    as_int = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    return PagedAttentionMetadata(
        slot_mapping=slots,
        block_table=table,
        seq_lens=as_int(seq_lens),
        query_start=as_int(starts),
        decode_seqs=as_int(decodes) if decodes else None,
        num_decode_splits=splits,
        prefill_tiles=as_int(tiles).T.contiguous() if tiles else None,
        dense=tuple(dense),
        sliding_window=window or 0,
        kv_format=fmt,
    )


@pytest.mark.parametrize(
    ("fmt_name", "dtype", "window", "splits", "tolerance"),
    [
        ("auto", torch.float32, None, 1, 1e-5),
        ("auto", torch.bfloat16, None, 4, 2e-2),
        ("int8", torch.float32, 20, 2, 1e-5),
        ("int8", torch.bfloat16, None, 2, 2e-2),
        ("fp8_e4m3", torch.bfloat16, None, 2, 2e-2),
    ],
)
def test_matches_float64_reference(fmt_name, dtype, window, splits, tolerance):
    """Decodes (one of them padding: no keys), a prefill chunk after cached keys and a prefill
    from position 0, over 6 heads sharing 2 kv heads; the new tokens are written first."""
    seq_lens, q_lens = [70, 5, 45, 40], [1, 1, 20, 40]
    fmt, cache, table, keys, q, k, v, slots = _case(seq_lens, q_lens, 6, 2, 32, fmt_name, dtype)
    meta = _meta(fmt, table, seq_lens, q_lens, slots, window, splits, q, 2)
    out = paged_attention(q, k, v, cache, 1, meta)
    expected = _reference(q, keys, seq_lens, q_lens, window)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


def test_padding_slots_write_nothing():
    """A token whose slot is -1 (a CUDA graph's padding row) leaves the cache as it was."""
    seq_lens, q_lens = [20, 9], [1, 1]
    fmt, cache, table, _, q, k, v, slots = _case(seq_lens, q_lens, 4, 2, 32, "int8", torch.float32)
    slots[1] = -1
    before = cache.clone()
    paged_attention(q, k, v, cache, 1, _meta(fmt, table, seq_lens, q_lens, slots, None, 1, q, 2))
    changed = (cache != before).flatten(2).any(-1)  # [blocks, layer]
    assert changed[:, 0].sum() == 0 and changed[:, 1].sum() == 1
