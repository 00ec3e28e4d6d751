"""Strata's attention for several query rows per sequence (``strata_native::rows_attention``,
prefill chunks) against float64 attention: causal, masked (a chunk after cached keys, a sliding
window) and unmasked rows, every cache dtype, grouped queries; and each row bitwise the same as
``decode_attention`` gives that row alone, over just the keys it sees, on every instruction path:
a position's attention does not depend on whether it was computed in a prefill, in a chunk after
a cached prefix, or as a decode."""

import math

import pytest
import torch

from replicas.model import native_stack

pytestmark = pytest.mark.skipif(
    native_stack.load_error() is not None, reason="the native library does not build here"
)

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def ops():
    return torch.ops.strata_native


def problem(seed, num_seqs, q_len, heads, kv_heads, head_dim, width, dtype, mask):
    """Random queries and cache rows, each sequence's keys and values at random rows. ``mask``:
    "causal" (keys 0 .. width - q_len + l for row l, no mask tensor), "window" (that, less the
    keys more than 5 back), "holes" (causal, less every third key: hidden between a row's first
    and last) or "none". The rows no query sees hold NaN, so reading one would show."""
    gen = torch.Generator().manual_seed(seed)
    num_rows = 2 * num_seqs * kv_heads * width + 16
    cache = torch.randn(num_rows, head_dim, generator=gen).to(dtype)
    rows = torch.randperm(num_rows, generator=gen)[: 2 * num_seqs * kv_heads * width].contiguous()
    q = torch.randn(num_seqs * q_len, heads, head_dim, generator=gen).to(dtype)
    key = torch.arange(width)
    pos = width - q_len + torch.arange(q_len)
    seen = key[None, :] <= pos[:, None]  # [q_len, width]
    if mask == "window":
        seen &= key[None, :] > pos[:, None] - 5
    if mask == "holes":
        seen &= key[None, :] % 3 != 1
    if mask in ("window", "holes"):
        per_head = rows.view(2, num_seqs, kv_heads, width)
        cache[per_head[:, :, :, ~seen.any(0)]] = float("nan")
    if mask == "none":
        seen = torch.ones(q_len, width, dtype=torch.bool)
    masked = mask in ("window", "holes")
    allowed = seen.expand(num_seqs, 1, q_len, width).contiguous() if masked else None
    return q, cache, rows, allowed, mask == "causal", seen


def reference(q, cache, rows, seen, num_seqs, kv_heads):
    rows_total, heads, head_dim = q.shape
    q_len = rows_total // num_seqs
    k, v = cache.double()[rows].view(2, num_seqs, kv_heads, 1, -1, head_dim)
    qs = q.double().view(num_seqs, q_len, kv_heads, heads // kv_heads, head_dim).transpose(1, 2)
    scores = (qs @ k.transpose(-1, -2)) / math.sqrt(head_dim)  # [S, kv, q_len, hpk, W]
    scores = scores.masked_fill(~seen[None, None, :, None, :], -math.inf)
    p = scores.softmax(-1)
    out = p @ v.nan_to_num()  # a hidden key's weight is 0
    return out.transpose(1, 2).reshape(rows_total, heads, head_dim)


CASES = [  # (sequences, rows, heads, kv heads, head size, keys)
    (1, 40, 9, 3, 64, 40),  # a prefill from position 0
    (2, 13, 8, 2, 128, 90),  # chunks after cached keys
    (1, 33, 4, 4, 80, 33),  # one head per kv head, a head size of five lanes
    (1, 70, 7, 1, 16, 300),  # seven heads to a kv head (four, then three, at once)
    (1, 30, 6, 2, 64, 1200),  # rows seeing more keys than a split: in splits, then combined
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", ["causal", "window", "holes", "none"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_matches_float64_attention_and_never_reads_a_hidden_value(dtype, mask, case):
    num_seqs, q_len, heads, kv_heads, head_dim, width = case
    q, cache, rows, allowed, causal, seen = problem(
        0, num_seqs, q_len, heads, kv_heads, head_dim, width, dtype, mask
    )
    out = ops().rows_attention(q, cache, rows, allowed, causal, q_len, kv_heads)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    expected = reference(q, cache, rows, seen, num_seqs, kv_heads)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["causal", "window", "holes"])
@pytest.mark.parametrize("width", [100, 1060])  # 1060: the last rows' keys in splits
def test_each_row_is_its_decode_bitwise_on_every_instruction_path(dtype, mask, width):
    num_seqs, q_len, heads, kv_heads, head_dim = 2, 37, 6, 2, 64
    q, cache, rows, allowed, causal, seen = problem(
        1, num_seqs, q_len, heads, kv_heads, head_dim, width, dtype, mask
    )
    best = ops().decode_attention_path()
    outputs = [
        ops().rows_attention(q, cache, rows, allowed, causal, q_len, kv_heads, path)
        for path in range(best + 1)
    ]
    for other in outputs[1:]:
        assert torch.equal(other, outputs[0])
    per_seq = rows.view(2, num_seqs, kv_heads, width)
    for s in range(num_seqs):
        for row in (0, 1, q_len // 2, q_len - 1):
            keys = seen[row].nonzero().flatten()  # just the keys it sees: no padding, no mask
            alone = ops().decode_attention(
                q[s * q_len + row : s * q_len + row + 1],
                cache,
                per_seq[:, s : s + 1, :, keys].contiguous().flatten(),
                None,
                kv_heads,
            )
            assert torch.equal(alone[0], outputs[0][s * q_len + row])
    # The same rows as a chunk of their own after the others (a cached prefix): the same bits.
    tail = q.view(num_seqs, q_len, heads, head_dim)[:, 20:].reshape(-1, heads, head_dim)
    tail_allowed = seen[20:].expand(num_seqs, 1, q_len - 20, width).contiguous()
    chunk = ops().rows_attention(tail, cache, rows, tail_allowed, False, q_len - 20, kv_heads)
    whole = outputs[0].view(num_seqs, q_len, heads, head_dim)[:, 20:].reshape(-1, heads, head_dim)
    assert torch.equal(chunk, whole)


@pytest.mark.parametrize("mask", ["causal", "holes"])
def test_long_rows_give_the_same_bits_whatever_memory_their_splits_may_take(mask):
    num_seqs, q_len, heads, kv_heads, head_dim, width = 2, 24, 4, 2, 32, 1400
    q, cache, rows, allowed, causal, _ = problem(
        3, num_seqs, q_len, heads, kv_heads, head_dim, width, torch.float32, mask
    )
    whole = ops().rows_attention(q, cache, rows, allowed, causal, q_len, kv_heads)
    # One unit's partials at a time: many waves of splits and their combination.
    waves = ops().rows_attention(q, cache, rows, allowed, causal, q_len, kv_heads, -1, 1)
    assert torch.equal(waves, whole)


def test_bad_arguments_are_refused_naming_the_problem():
    q, cache, rows, allowed, _, _ = problem(2, 1, 4, 4, 2, 16, 8, torch.float32, "window")
    with pytest.raises(RuntimeError, match="q_len"):
        ops().rows_attention(q, cache, rows, allowed, False, 3, 2)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops().rows_attention(q[..., :8], cache[:, :8].contiguous(), rows, allowed, False, 4, 2)
    with pytest.raises(RuntimeError, match="allowed"):
        ops().rows_attention(q, cache, rows, allowed[..., :4].contiguous(), False, 4, 2)
    with pytest.raises(RuntimeError, match="sees no key"):
        ops().rows_attention(q, cache, rows, torch.zeros_like(allowed), False, 4, 2)
    with pytest.raises(RuntimeError, match="cache of Long"):
        ops().rows_attention(q, cache.long(), rows, allowed, False, 4, 2)
