"""Attention over a quantized block KV cache: against float64 attention over exactly the K/V the
cache stores (dequantized), and, loosely, over the K/V before quantization."""

import pytest
import torch

from replicas.model.attention import AttentionMetadata, cached_attention
from replicas.model.kv_format import KV_FORMATS, KVFormat
from tests.unit.model.test_cached_attention import (  # noqa: F401  (chunking: a fixture)
    BLOCK_SIZE,
    DECODES,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYER,
    LAYERS,
    LONG,
    LONG_BLOCKS,
    MIXED,
    chunking,
    dense_attention,
)

# Output error against attention over the unquantized K/V, for unit-variance K, V and q.
LOOSE = {"int8": 0.03, "fp8_e4m3": 0.15, "float16": 2e-3}


def stored(fmt: KVFormat, x: torch.Tensor) -> torch.Tensor:
    """What the cache holds of x [n, kv_heads, D], read back in float64."""
    return fmt.dequantize(fmt.quantize(x.reshape(-1, HEAD_DIM)), torch.float64).view(x.shape)


def run_quantized_case(
    fmt: KVFormat,
    seqs,
    window,
    make_batch,
    chunk,
    *,
    dtype=torch.float32,
    num_blocks=32,
    layers=(LAYER,),
    tolerance=1e-5,
):
    """seqs: (seq_len, q_len, block table); context already in the cache, quantized. Every
    byte no sequence reads (unused blocks, freed sliding blocks, tails) is random, NaN and
    inf scales included; freed sliding blocks and padding are named block 0."""
    gen = torch.Generator().manual_seed(0)
    width = fmt.row_bytes(HEAD_DIM)
    noise = torch.randint(
        0, 256, (num_blocks, LAYERS, 2, BLOCK_SIZE, KV_HEADS, width), generator=gen
    )
    cache = noise.to(torch.uint8).view(fmt.storage_dtype)
    histories = {}
    for layer in layers:
        histories[layer] = []
        for seq_len, q_len, table in seqs:
            k, v = (
                torch.randn(seq_len, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2)
            )
            for p in range(seq_len - q_len):
                cache[table[p // BLOCK_SIZE], layer, 0, p % BLOCK_SIZE] = fmt.quantize(k[p])
                cache[table[p // BLOCK_SIZE], layer, 1, p % BLOCK_SIZE] = fmt.quantize(v[p])
            q = torch.randn(q_len, HEADS, HEAD_DIM, generator=gen).to(dtype)
            histories[layer].append((k, v, q))
    chunks = []
    for seq_len, q_len, table in seqs:
        first_kept = max(0, seq_len - q_len - window + 1) // BLOCK_SIZE if window else 0
        chunks.append(
            chunk(
                list(range(seq_len)),
                seq_len - q_len,
                q_len,
                {"g": [0] * first_kept + table[first_kept:]},
            )
        )
    batch = make_batch(chunks, BLOCK_SIZE, pad_block=0)
    for i, (seq_len, q_len, table) in enumerate(seqs):
        rows = range(batch.query_start_loc[i], batch.query_start_loc[i + 1])
        for row, p in zip(rows, range(seq_len - q_len, seq_len), strict=True):
            batch.slot_mapping["g"][row] = table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
    meta = AttentionMetadata.build(batch, "g", BLOCK_SIZE, window, kv_format=fmt)
    for layer in layers:
        q = torch.cat([q_i for _, _, q_i in histories[layer]])
        k_new = torch.cat([k[len(k) - len(q_i) :] for k, _, q_i in histories[layer]])
        v_new = torch.cat([v[len(v) - len(q_i) :] for _, v, q_i in histories[layer]])
        out = cached_attention(q, k_new, v_new, cache, layer, meta)
        assert out.dtype == dtype
        for i, ((k, v, q_i), (seq_len, q_len, table)) in enumerate(
            zip(histories[layer], seqs, strict=True)
        ):
            rows = slice(batch.query_start_loc[i], batch.query_start_loc[i + 1])
            q_pos = torch.arange(seq_len - q_len, seq_len)
            as_stored = dense_attention(q_i, stored(fmt, k), stored(fmt, v), q_pos, window)
            got = out[rows].double()
            torch.testing.assert_close(got, as_stored, atol=tolerance, rtol=tolerance)
            exact = dense_attention(q_i, k, v, q_pos, window)
            assert (got - exact).abs().max() <= LOOSE[fmt.name]
            # The new tokens' rows are their quantized bytes, as a store would copy them.
            p = seq_len - 1
            block, offset = table[p // BLOCK_SIZE], p % BLOCK_SIZE
            assert torch.equal(cache[block, layer, 0, offset], fmt.quantize(k[p]))
            assert torch.equal(cache[block, layer, 1, offset], fmt.quantize(v[p]))


@pytest.mark.usefixtures("chunking")
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
@pytest.mark.parametrize("seqs", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_matches_attention_over_the_stored_kv(name, seqs, window, make_batch, chunk):
    if seqs is MIXED:  # block 0 is in use there: freed blocks keep their numbers
        seqs = [(n, q, [b + 1 for b in table]) for n, q, table in seqs]
    run_quantized_case(KV_FORMATS[name], seqs, window, make_batch, chunk, num_blocks=LONG_BLOCKS)


@pytest.mark.usefixtures("chunking")
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "float16"])
@pytest.mark.parametrize("window", [None, 5, 12], ids=["full", "w5", "w12"])
def test_long_contexts_in_chunks(name, window, make_batch, chunk):
    """Decodes of ragged lengths and prefills after cached contexts, over many chunks (the
    online softmax) and in one (SDPA), every layer reusing the metadata."""
    run_quantized_case(
        KV_FORMATS[name],
        LONG,
        window,
        make_batch,
        chunk,
        num_blocks=LONG_BLOCKS,
        layers=(0, 2, 1),
    )


@pytest.mark.usefixtures("chunking")
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_bfloat16_queries(name, make_batch, chunk):
    """bfloat16 queries over 8-bit rows: both paths dequantize into float32 (code * scale is
    exact there), so the output's rounding to bfloat16 (2^-9 relative) is the only error
    beyond float32's."""
    run_quantized_case(
        KV_FORMATS[name],
        LONG,
        6,
        make_batch,
        chunk,
        dtype=torch.bfloat16,
        num_blocks=LONG_BLOCKS,
        tolerance=2**-8,
    )


def test_a_cache_of_another_format_is_refused(make_batch, chunk):
    batch = make_batch([chunk([0] * 4, 0, 4, {"g": [1]})], BLOCK_SIZE)
    meta = AttentionMetadata.build(batch, "g", BLOCK_SIZE, None, kv_format=KV_FORMATS["int8"])
    cache = torch.zeros(4, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)  # float32 rows
    x = torch.zeros(4, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="int8 KV cache holds rows of 10"):
        cached_attention(torch.zeros(4, HEADS, HEAD_DIM), x, x, cache, LAYER, meta)
