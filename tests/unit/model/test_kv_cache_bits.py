"""What prefix caching on and off needs of every KV cache dtype: a position's hidden state and
K/V bytes are the same bits whether its prompt ran whole, as chunks after cached keys, or token
by token as decodes, alone or padded beside a longer sequence (the built-in model, eager: the
native stack does not take an 8-bit cache). An 8-bit cache's rows are dequantized into float32
(exact) and read by Strata's attention, as a cache of values is."""

import pytest
import torch

from tests.unit.model.test_native_stack import (
    BLOCK,
    BLOCKS_PER_SEQ,
    VARIANTS,
    Sequences,
    model_of,
)

END = 1700  # past ONE_CHUNK_BLOCKS blocks: a long context
CUTS = [(0, 600), (600, 613), (613, END - 3)]  # chunks after cached keys, cut off block bounds


def run_cut(dtype: torch.dtype, quantization: str, kv_cache_dtype: str):
    """The hidden states of one prompt run whole and cut, and the KV bytes of both runs."""
    model = model_of(VARIANTS["llama"], dtype, quantization)
    seqs = Sequences(3, seed=4)
    seqs.tokens[1] = seqs.tokens[0]
    chunks = [seqs.batch([(1, a, b)]) for a, b in CUTS]
    # The last three positions as decodes, padded beside sequence 2's shorter context.
    decodes = [seqs.batch([(1, p, p + 1), (2, p - 1500, p - 1499)]) for p in range(END - 3, END)]
    spec = model.kv_cache_specs(dtype, kv_cache_dtype)["full"]
    cache = {"full": torch.zeros(spec.shape(3 * BLOCKS_PER_SEQ, BLOCK), dtype=spec.storage_dtype)}
    with torch.inference_mode():
        model(seqs.batch([(2, 0, END - 1500 - 3)]), cache, spec.kv_format)  # sequence 2's context
        hidden_whole = model(seqs.batch([(0, 0, END)]), cache, spec.kv_format)
        outputs = [model(b, cache, spec.kv_format) for b in chunks]
        outputs += [model(b, cache, spec.kv_format)[:1] for b in decodes]
    blocks = -(-END // BLOCK)
    kv = cache["full"][:blocks], cache["full"][BLOCKS_PER_SEQ : BLOCKS_PER_SEQ + blocks]
    return hidden_whole, torch.cat(outputs), kv


# float32 weights in the packed int8 product (each row alone, as serving's quantized weights);
# bfloat16 weights dense (torch's bfloat16 GEMM gives a row the same bits at any row count).
# Float KV formats of the engine dtype: test_native_stack.py. "one at a time": the decodes' 8-bit
# rows dequantized one sequence per call (DEQUANTIZED_ROWS), the same bits as all at once.
@pytest.mark.parametrize(
    "dtype, quantization, kv_cache_dtype",
    [
        ("float32", "int8", "int8"),
        ("float32", "int8", "fp8_e4m3"),
        ("bfloat16", "none", "int8"),
        ("bfloat16", "none", "int8 one at a time"),
        ("bfloat16", "none", "fp8_e4m3"),
        ("bfloat16", "none", "float16"),
    ],
)
def test_a_position_gets_the_same_bits_however_its_prompt_is_cut(
    dtype, quantization, kv_cache_dtype, monkeypatch
):
    from replicas.model import attention

    if kv_cache_dtype.endswith("one at a time"):
        monkeypatch.setattr(attention, "DEQUANTIZED_ROWS", 1)
    hidden_whole, hidden_split, (kv_whole, kv_split) = run_cut(
        getattr(torch, dtype), quantization, kv_cache_dtype.split()[0]
    )
    assert torch.equal(hidden_whole, hidden_split)
    assert not torch.equal(hidden_whole[:600], hidden_split[600:1200])  # not a vacuous check
    assert torch.equal(kv_whole, kv_split)


def test_dense_float32_weights_round_a_decode_row_differently_within_a_bound():
    """torch's float32 product of one row (a decode) is not its product inside a larger batch
    (a prefill), nor, on some CPUs (an AVX-512 Xeon), a chunk's rows their product in the whole
    prompt: they differ by float32 rounding only. Where those K/V are cached and reused,
    caching on and off differ at that level (docs/design.md, "Fidelity")."""
    hidden_whole, hidden_split, _ = run_cut(torch.float32, "none", "int8")
    bound = 1e-4 * hidden_whole.abs().max().item()
    chunked = END - 3
    in_chunks = (hidden_whole[:chunked] - hidden_split[:chunked]).abs().max().item()
    decoded = (hidden_whole[chunked:] - hidden_split[chunked:]).abs().max().item()
    assert in_chunks <= bound and decoded <= bound, (in_chunks, decoded)
