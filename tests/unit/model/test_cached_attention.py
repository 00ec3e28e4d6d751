"""Attention over the block KV cache against dense attention over whole histories."""

import math

import pytest
import torch

from replicas.model import attention_metadata
from replicas.model.attention import AttentionMetadata, cached_attention

BLOCK_SIZE = 4
NUM_BLOCKS = 32
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
LAYERS, LAYER = 3, 1


def dense_attention(q, k, v, q_positions, window):
    """q: [q_len, H, D]; k, v: [seq_len, Hkv, D]; float64 softmax over allowed keys."""
    heads_per_kv = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(heads_per_kv, dim=1)
    v = v.double().repeat_interleave(heads_per_kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_positions[:, None]
    if window:
        allowed &= k_pos > q_positions[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(
    seqs,
    window,
    make_batch,
    chunk,
    *,
    dtype=torch.float32,
    heads=HEADS,
    kv_heads=KV_HEADS,
    num_blocks=NUM_BLOCKS,
    stale_block=-7,
    pad_block=-1,
    poison=False,
    layers=(LAYER,),
    tolerance=1e-5,
    head_dim=HEAD_DIM,
):
    """seqs: (seq_len, q_len, block table) per sequence; context already in the cache.

    Blocks that fall wholly before a sliding window are freed: their table entries become
    ``stale_block`` and their contents NaN. ``poison`` fills everything else no sequence
    holds (unused blocks, the tail of last blocks) with NaN and inf instead of noise.
    """
    gen = torch.Generator().manual_seed(0)
    shape = (num_blocks, LAYERS, 2, BLOCK_SIZE, kv_heads, head_dim)
    if poison:
        cache = torch.full(shape, float("nan"))
        cache[1::2] = float("inf")
    else:
        cache = torch.randn(shape, generator=gen)
    cache = cache.to(dtype)
    histories = {}  # layer -> [(k, v, q)] per sequence, in the cache dtype
    for layer in layers:
        histories[layer] = []
        for seq_len, q_len, table in seqs:
            k = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
            for p in range(seq_len - q_len):
                cache[table[p // BLOCK_SIZE], layer, 0, p % BLOCK_SIZE] = k[p]
                cache[table[p // BLOCK_SIZE], layer, 1, p % BLOCK_SIZE] = v[p]
            q = torch.randn(q_len, heads, head_dim, generator=gen).to(dtype)
            histories[layer].append((k, v, q))
    chunks = []
    for seq_len, q_len, table in seqs:
        first_kept = max(0, seq_len - q_len - window + 1) // BLOCK_SIZE if window else 0
        stale_table = [stale_block] * first_kept + table[first_kept:]
        for block in table[:first_kept]:
            cache[block] = float("nan")
        chunks.append(chunk(list(range(seq_len)), seq_len - q_len, q_len, {"g": stale_table}))
    batch = make_batch(chunks, BLOCK_SIZE, pad_block=pad_block)
    # Slots of new tokens are computed from the real table, as the model runner would.
    for i, (seq_len, q_len, table) in enumerate(seqs):
        rows = range(batch.query_start_loc[i], batch.query_start_loc[i + 1])
        for row, p in zip(rows, range(seq_len - q_len, seq_len), strict=True):
            batch.slot_mapping["g"][row] = table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
    meta = AttentionMetadata.build(batch, "g", BLOCK_SIZE, window)
    for layer in layers:  # every layer reuses the one metadata
        q = torch.cat([q_i for _, _, q_i in histories[layer]])
        k_new = torch.cat([k[len(k) - len(q_i) :] for k, _, q_i in histories[layer]])
        v_new = torch.cat([v[len(v) - len(q_i) :] for _, v, q_i in histories[layer]])
        out = cached_attention(q, k_new, v_new, cache, layer, meta)
        assert out.dtype == dtype
        for i, ((k, v, q_i), (seq_len, q_len, table)) in enumerate(
            zip(histories[layer], seqs, strict=True)
        ):
            rows = slice(batch.query_start_loc[i], batch.query_start_loc[i + 1])
            q_positions = torch.arange(seq_len - q_len, seq_len)
            expected = dense_attention(q_i, k, v, q_positions, window)
            torch.testing.assert_close(out[rows].double(), expected, atol=tolerance, rtol=tolerance)
            p = seq_len - 1
            block, offset = table[p // BLOCK_SIZE], p % BLOCK_SIZE
            torch.testing.assert_close(cache[block, layer, 0, offset], k[p])
            torch.testing.assert_close(cache[block, layer, 1, offset], v[p])


def shuffled_tables(seq_lens, num_blocks, seed):
    """Distinct random blocks for each sequence, never block 0."""
    ids = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    tables, used = [], 0
    for seq_len in seq_lens:
        n = -(-seq_len // BLOCK_SIZE)
        tables.append(ids[used : used + n].tolist())
        used += n
    return tables


MIXED = [(11, 11, [5, 0, 30]), (9, 1, [7, 12, 3]), (14, 6, [2, 9, 31, 4]), (1, 1, [8])]
DECODES = [(17, 1, [1, 6, 11, 16, 21]), (3, 1, [13]), (8, 1, [25, 19])]
# Decodes of ragged lengths and prefills after short and long cached contexts: with chunks of
# 1-3 blocks each spans many chunks, and decodes drop out of the later chunks one by one.
LONG_LENS = [(37, 1), (29, 1), (6, 1), (33, 9), (41, 16), (13, 13), (21, 1), (40, 2)]
LONG_BLOCKS = 64
LONG = [
    (seq_len, q_len, table)
    for (seq_len, q_len), table in zip(
        LONG_LENS, shuffled_tables([n for n, _ in LONG_LENS], LONG_BLOCKS, seed=3), strict=True
    )
]


@pytest.fixture(params=[8, 16], ids=["d8", "d16"])
def head_dim(request):
    """Head sizes: 8 decodes through SDPA, 16 (a multiple of 16) through Strata's decode
    attention wherever the native library builds."""
    return request.param


@pytest.fixture(
    params=[(32, 96), (1, 0), (2, 0), (3, 3)],
    ids=["one_chunk", "chunks_of_1", "chunks_of_2", "chunks_of_3"],
)
def chunking(request, monkeypatch):
    """Chunk sizes small enough that these short contexts span many chunks.

    (chunk blocks, one-chunk blocks): ``chunks_of_3`` reads spans of at most 3 blocks in one
    chunk and longer ones in chunks of 3, so one batch mixes both kinds of group.
    """
    chunk_blocks, one_chunk_blocks = request.param
    monkeypatch.setattr(attention_metadata, "CHUNK_BLOCKS", chunk_blocks)
    monkeypatch.setattr(attention_metadata, "ONE_CHUNK_BLOCKS", one_chunk_blocks)
    return request.param


@pytest.mark.parametrize("window", [None, 3, 6], ids=["full", "window3", "window6"])
@pytest.mark.parametrize("seqs", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_matches_dense_attention(seqs, window, make_batch, chunk, chunking, head_dim):
    run_case(seqs, window, make_batch, chunk, head_dim=head_dim)


@pytest.mark.parametrize("window", [None, 5, 7, 12], ids=["full", "w5", "w7", "w12"])
def test_long_contexts_ignore_nan_and_inf_outside_their_keys(
    window, make_batch, chunk, chunking, head_dim
):
    """Shuffled tables, freed sliding blocks named 0 and tables padded with 0: block 0, every
    unused block and every unused position hold NaN or inf, and none reaches the output."""
    run_case(
        LONG,
        window,
        make_batch,
        chunk,
        num_blocks=LONG_BLOCKS,
        stale_block=0,
        pad_block=0,
        poison=True,
        head_dim=head_dim,
    )


@pytest.mark.parametrize("window", [None, 6], ids=["full", "w6"])
def test_bfloat16_cache_and_queries(window, make_batch, chunk, chunking, head_dim):
    """Scores and softmax run in float32: only the bfloat16 output rounding is left."""
    run_case(
        LONG,
        window,
        make_batch,
        chunk,
        dtype=torch.bfloat16,
        num_blocks=LONG_BLOCKS,
        poison=True,
        tolerance=1e-2,
        head_dim=head_dim,
    )


@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (9, 3), (3, 3), (4, 1)])
def test_grouped_query_attention(heads, kv_heads, make_batch, chunk, chunking, head_dim):
    run_case(
        LONG,
        7,
        make_batch,
        chunk,
        heads=heads,
        kv_heads=kv_heads,
        num_blocks=LONG_BLOCKS,
        poison=True,
        head_dim=head_dim,
    )


def test_every_layer_reuses_the_metadata(make_batch, chunk, chunking):
    run_case(LONG, 6, make_batch, chunk, num_blocks=LONG_BLOCKS, poison=True, layers=(0, 2, 1))


def test_chunks_are_at_most_chunk_blocks_long(make_batch, chunk, monkeypatch):
    monkeypatch.setattr(attention_metadata, "CHUNK_BLOCKS", 2)
    monkeypatch.setattr(attention_metadata, "ONE_CHUNK_BLOCKS", 3)
    tables = [table for _, _, table in LONG]
    chunks = [
        chunk([0] * seq_len, seq_len - q_len, q_len, {"g": table})
        for (seq_len, q_len), table in zip(LONG_LENS, tables, strict=True)
    ]
    meta = AttentionMetadata.build(make_batch(chunks, BLOCK_SIZE), "g", BLOCK_SIZE, None)
    # Prefills first, in batch order, then the decodes, longest first; a (6, 1) decode alone
    # would fit in one chunk, but it attends with the longer decodes in chunks of 2 blocks.
    assert [(g.num_seqs, g.q_len) for g in meta.groups] == [
        (1, 9),
        (1, 16),
        (1, 13),
        (1, 2),
        (4, 1),
    ]
    assert [len(g.chunks) for g in meta.groups] == [5, 6, 2, 5, 5]
    decodes = meta.groups[-1]
    assert [c.num_seqs for c in decodes.chunks] == [4, 3, 3, 2, 1]  # 37, 29, 21, 6 tokens
    for group in meta.groups:
        for c in group.chunks:
            assert c.blocks.shape[1] <= 2 * BLOCK_SIZE
    # The 13-token prefill from position 0: only its rows from 8 on see the second chunk.
    assert [(c.first_row, c.end_row) for c in meta.groups[2].chunks] == [(0, 13), (8, 13)]


def test_writes_land_in_the_cache_and_nowhere_else(make_batch, chunk):
    cache = torch.zeros(NUM_BLOCKS, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    batch = make_batch([chunk([0] * 6, 0, 6, {"g": [3, 17]})], BLOCK_SIZE)
    meta = AttentionMetadata.build(batch, "g", BLOCK_SIZE, None)
    k = torch.arange(1, 7).float()[:, None, None].expand(6, KV_HEADS, HEAD_DIM)
    cached_attention(torch.ones(6, HEADS, HEAD_DIM), k, -k, cache, LAYER, meta)
    assert cache[3, LAYER, 0, :, 0, 0].tolist() == [1, 2, 3, 4]
    assert cache[17, LAYER, 1, :2, 0, 0].tolist() == [-5, -6]
    assert cache.count_nonzero() == 2 * 6 * KV_HEADS * HEAD_DIM


def test_solo_sequences_attend_alone_and_bitwise_as_if_decoded_alone(make_batch, chunk):
    """Draft tokens (the batch's last ``num_solo_seqs`` sequences) get a group each, and the
    decode before them attends exactly as it does alone: no row of it is padded by theirs."""
    gen = torch.Generator().manual_seed(3)
    shape = (NUM_BLOCKS, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    cache = torch.randn(shape, generator=gen)
    lens = (40, 41, 42)  # a decode at position 39 and its two drafts after it
    table = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - -(-max(lens) // BLOCK_SIZE), -1))
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(len(lens), KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))

    def attend(seq_lens: tuple[int, ...], num_solo: int) -> tuple[torch.Tensor, int]:
        chunks = [chunk(list(range(n)), n - 1, 1, {"g": table}) for n in seq_lens]
        batch = make_batch(chunks, BLOCK_SIZE)
        batch.num_solo_seqs = num_solo
        meta = AttentionMetadata.build(batch, "g", BLOCK_SIZE, None)
        rows = len(seq_lens)
        out = cached_attention(q[:rows], k[:rows], v[:rows], cache.clone(), LAYER, meta)
        return out, len(meta.groups)

    alone, _ = attend(lens[:1], 0)
    with_drafts, num_groups = attend(lens, 2)
    assert num_groups == 3
    assert torch.equal(with_drafts[0], alone[0])
    padded, num_groups = attend(lens, 0)
    assert num_groups == 1 and padded.shape == with_drafts.shape
