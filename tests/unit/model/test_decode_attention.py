"""Strata's decode attention (``strata_native::decode_attention``) against float64 attention:
every cache dtype, grouped queries, masked keys never read, the same bits on every instruction
path and in any batch; and the attention module takes it exactly where it should."""

import math

import pytest
import torch

from replicas.model import attention, native_stack
from replicas.model.kv_format import float_format, kv_format

pytestmark = pytest.mark.skipif(
    native_stack.load_error() is not None, reason="the native library does not build here"
)


def op():
    return torch.ops.strata_native.decode_attention


def problem(seed, num_seqs, heads, kv_heads, head_dim, width, dtype):
    """Random queries and cache rows; each sequence's keys and values at random rows, a few of
    its keys masked, and every masked key's row NaN (so reading one would show)."""
    gen = torch.Generator().manual_seed(seed)
    num_rows = 4 * num_seqs * kv_heads * width + 64
    cache = torch.randn(num_rows, head_dim, generator=gen).to(dtype)
    rows = torch.randperm(num_rows - 1, generator=gen)[: 2 * num_seqs * kv_heads * width]
    allowed = torch.rand(num_seqs, 1, 1, width, generator=gen) < 0.8
    allowed[..., 0] = True
    hidden = ~allowed.view(num_seqs, 1, width).expand(num_seqs, kv_heads, width)
    cache[rows.view(2, num_seqs, kv_heads, width)[:, hidden]] = float("nan")
    q = torch.randn(num_seqs, heads, head_dim, generator=gen).to(dtype)
    return q, cache, rows.contiguous(), allowed


def reference(q, cache, rows, allowed, kv_heads):
    num_seqs, heads, head_dim = q.shape
    k, v = cache.double()[rows].view(2, num_seqs, kv_heads, -1, head_dim)
    scores = q.double().view(num_seqs, kv_heads, heads // kv_heads, head_dim) @ k.transpose(-1, -2)
    hidden = ~allowed.view(num_seqs, 1, 1, -1)
    scores = (scores / math.sqrt(head_dim)).masked_fill(hidden, -math.inf)
    p = scores.softmax(-1).nan_to_num()  # 0 * NaN of a masked value is 0 here
    return torch.einsum("sgqk,sgkd->sgqd", p, v.nan_to_num()).reshape(num_seqs, heads, head_dim)


CASES = [  # (sequences, heads, kv heads, head size, keys)
    (1, 9, 3, 64, 200),
    (4, 8, 2, 128, 77),
    (3, 4, 4, 80, 301),
    (2, 4, 1, 16, 1),
    (2, 6, 2, 64, 1500),  # more keys than a split: attended in splits, then combined
]
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_matches_float64_attention_and_never_reads_a_masked_key(dtype, case):
    num_seqs, heads, kv_heads, head_dim, width = case
    q, cache, rows, allowed = problem(0, num_seqs, heads, kv_heads, head_dim, width, dtype)
    out = op()(q, cache, rows, allowed, kv_heads)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    expected = reference(q, cache, rows, allowed, kv_heads)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [123, 1300])  # 1300: some sequences' keys split, some not
def test_every_instruction_path_and_any_batch_give_the_same_bits(dtype, width):
    num_seqs, heads, kv_heads, head_dim = 5, 6, 2, 64
    q, cache, rows, allowed = problem(1, num_seqs, heads, kv_heads, head_dim, width, dtype)
    best = torch.ops.strata_native.decode_attention_path()
    outputs = [op()(q, cache, rows, allowed, kv_heads, path) for path in range(best + 1)]
    for other in outputs[1:]:
        assert torch.equal(other, outputs[0])
    # Each sequence alone, its keys unpadded: the same bits as in the padded batch.
    per_seq = rows.view(2, num_seqs, kv_heads, width)
    for s in range(num_seqs):
        seen = allowed[s].flatten().nonzero().flatten()
        alone = op()(
            q[s : s + 1],
            cache,
            per_seq[:, s : s + 1, :, seen].contiguous().flatten(),
            None,
            kv_heads,
        )
        assert torch.equal(alone[0], outputs[0][s])


def test_bad_arguments_are_refused_naming_the_problem():
    q, cache, rows, allowed = problem(2, 1, 4, 2, 16, 8, torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op()(q[..., :8], cache[:, :8].contiguous(), rows, allowed, 2)
    with pytest.raises(RuntimeError, match="do not share"):
        op()(q, cache, rows, allowed, 3)
    with pytest.raises(RuntimeError, match="int64"):
        op()(q, cache, rows.int(), allowed, 2)
    with pytest.raises(RuntimeError, match="allowed"):
        op()(q, cache, rows, allowed.float(), 2)


def test_the_attention_module_takes_it_for_cpu_decodes_of_a_cache_of_values_or_8_bit_codes():
    q = torch.zeros(2, 4, 64)
    assert attention.strata_attends(q.device, float_format(torch.bfloat16), 64)
    assert not attention.strata_attends(q.device, float_format(torch.bfloat16), 40)
    assert attention.strata_attends(q.device, kv_format("int8", torch.float32), 64)
    assert not attention.strata_attends(torch.device("meta"), float_format(torch.float32), 64)
