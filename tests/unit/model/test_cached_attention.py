"""Attention over the block KV cache against dense attention over whole histories."""

import math

import pytest
import torch

from replicas.model.attention import AttentionMetadata, cached_attention

BLOCK_SIZE = 4
NUM_BLOCKS = 32
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
LAYERS, LAYER = 3, 1


def dense_attention(q, k, v, q_positions, window):
    """q: [q_len, H, D]; k, v: [seq_len, Hkv, D]; float64 softmax over allowed keys."""
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1).double()
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(HEAD_DIM)
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_positions[:, None]
    if window:
        allowed &= k_pos > q_positions[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def run_case(seqs, window, make_batch, chunk):
    """seqs: (seq_len, q_len, block table) per sequence; context already in the cache."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(NUM_BLOCKS, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    histories, chunks = [], []
    for seq_len, q_len, table in seqs:
        k = torch.randn(seq_len, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(seq_len, KV_HEADS, HEAD_DIM, generator=gen)
        for p in range(seq_len - q_len):
            cache[table[p // BLOCK_SIZE], LAYER, 0, p % BLOCK_SIZE] = k[p]
            cache[table[p // BLOCK_SIZE], LAYER, 1, p % BLOCK_SIZE] = v[p]
        first_kept = max(0, seq_len - q_len - window + 1) // BLOCK_SIZE if window else 0
        stale_table = [-7] * first_kept + table[first_kept:]
        for block in table[:first_kept]:
            cache[block] = float("nan")
        histories.append((k, v, torch.randn(q_len, HEADS, HEAD_DIM, generator=gen)))
        chunks.append(chunk(list(range(seq_len)), seq_len - q_len, q_len, {"g": stale_table}))
    batch = make_batch(chunks, BLOCK_SIZE)
    # Slots of new tokens are computed from the real table, as the model runner would.
    for i, (seq_len, q_len, table) in enumerate(seqs):
        rows = range(batch.query_start_loc[i], batch.query_start_loc[i + 1])
        for row, p in zip(rows, range(seq_len - q_len, seq_len), strict=True):
            batch.slot_mapping["g"][row] = table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
    meta = AttentionMetadata.build(batch, "g", BLOCK_SIZE, window)
    q = torch.cat([q_i for _, _, q_i in histories])
    k_new = torch.cat([k[len(k) - len(q_i) :] for k, _, q_i in histories])
    v_new = torch.cat([v[len(v) - len(q_i) :] for _, v, q_i in histories])
    out = cached_attention(q, k_new, v_new, cache, LAYER, meta)
    for i, ((k, v, q_i), (seq_len, q_len, table)) in enumerate(zip(histories, seqs, strict=True)):
        rows = slice(batch.query_start_loc[i], batch.query_start_loc[i + 1])
        q_positions = torch.arange(seq_len - q_len, seq_len)
        expected = dense_attention(q_i, k, v, q_positions, window)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
        p = seq_len - 1
        torch.testing.assert_close(cache[table[p // BLOCK_SIZE], LAYER, 0, p % BLOCK_SIZE], k[p])
        torch.testing.assert_close(cache[table[p // BLOCK_SIZE], LAYER, 1, p % BLOCK_SIZE], v[p])


MIXED = [(11, 11, [5, 0, 30]), (9, 1, [7, 12, 3]), (14, 6, [2, 9, 31, 4]), (1, 1, [8])]
DECODES = [(17, 1, [1, 6, 11, 16, 21]), (3, 1, [13]), (8, 1, [25, 19])]


@pytest.mark.parametrize("window", [None, 3, 6], ids=["full", "window3", "window6"])
@pytest.mark.parametrize("seqs", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_matches_dense_attention(seqs, window, make_batch, chunk):
    run_case(seqs, window, make_batch, chunk)


def test_writes_land_in_the_cache_and_nowhere_else(make_batch, chunk):
    cache = torch.zeros(NUM_BLOCKS, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    batch = make_batch([chunk([0] * 6, 0, 6, {"g": [3, 17]})], BLOCK_SIZE)
    meta = AttentionMetadata.build(batch, "g", BLOCK_SIZE, None)
    k = torch.arange(1, 7).float()[:, None, None].expand(6, KV_HEADS, HEAD_DIM)
    cached_attention(torch.ones(6, HEADS, HEAD_DIM), k, -k, cache, LAYER, meta)
    assert cache[3, LAYER, 0, :, 0, 0].tolist() == [1, 2, 3, 4]
    assert cache[17, LAYER, 1, :2, 0, 0].tolist() == [-5, -6]
    assert cache.count_nonzero() == 2 * 6 * KV_HEADS * HEAD_DIM
