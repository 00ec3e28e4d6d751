"""Attention over the block KV cache, read in place chunk by chunk, in plain torch (CPU and CUDA).

Each layer first writes its new tokens' k/v into the cache at their slots, then every
sequence's queries attend over its context, read through its block table. For sequence ``i``
with ``q_len`` new tokens and ``seq_len`` tokens of context, query ``j`` sits at position
``q_pos = seq_len - q_len + j`` and sees keys at positions ``p`` with::

    p <= q_pos                        (causal)
    p >  q_pos - sliding_window       (sliding layers only: itself and window-1 keys back)

A sequence reads the blocks covering ``[first_key, seq_len)``, ``first_key`` being the window
start of its first query (0 without a window), in chunks of ``CHUNK_BLOCKS`` blocks::

    block table:  | stale ... | b3 b9 .. b1 | b7 b2 .. b5 | b4 b8 |
                           first_key ^        chunk 1     chunk 2, ends at seq_len
                    never read      chunk 0

Each chunk is gathered from the cache into one small tensor, whose K/V stays in a core's L2
cache; no tensor holds a long context. It is attended with a block-wise online softmax
(flash-decoding): per query row, chunk ``c`` yields its score maximum ``m_c``,
``l_c = sum 2^(s - m_c)`` and ``o_c = sum 2^(s - m_c) v`` (scores in base 2: exp2 is as exact
as exp and, unlike exp on CPU, fast on the -inf of masked keys). The chunks combine exactly::

    M = max_c m_c,   out = sum_c 2^(m_c - M) o_c / sum_c 2^(m_c - M) l_c

Scores, softmax and the combine run in float32 whatever the cache dtype; the output has q's
dtype. The cache holds rows of a KV format (``replicas.model.kv_format``: values, or 8-bit codes
and a scale): new tokens' K/V are quantized as they are written, and only the rows gathered for
a chunk are dequantized, never a whole context. A group whose spans all fit in
``ONE_CHUNK_BLOCKS`` blocks reads one chunk and needs no combine: it runs one fused
``F.scaled_dot_product_attention`` call over exactly its keys. On CPU the fused call beats the
unfused float32 online softmax, by most in bfloat16, since torch has neither an SDPA that
returns the log-sum-exp nor a bfloat16 GEMM with float32 output; so chunks are used for long
contexts only.

On a CPU (head size a multiple of 16, the native library built: ``strata_attends``), every
group reads its keys as one chunk however long (``AttentionMetadata.
build(whole_spans=True)``), and skips the gather and SDPA: ``strata_native::decode_attention``
(one query per sequence) and ``rows_attention`` (a prefill chunk) in ``decode_attention.cpp``,
used by the eager model and the native stack alike, read each sequence's keys and values in
place through the same row indices, in float32 with the softmax in base 2. At one query SDPA's
set-up and the gather are most of the time; at a prefill's many rows it runs about as fast as
SDPA. A row's result is its own whatever the batch, on every instruction path, and the same
bits whether its position is computed in a prefill, in a chunk after cached keys or as a
decode: prefix caching on and off give the same outputs. An 8-bit cache's rows are first
dequantized into float32 (``code * scale``, exact), a few sequences' at a time, so a position's
keys are the same numbers whichever forward reads them and the same holds. Elsewhere (CUDA)
chunks and SDPA run as above.

All decodes (one new token each) attend as one group, each prefill chunk (several new tokens)
as its own, and so does each of the batch's last ``num_solo_seqs`` sequences (draft tokens being
verified: a row padded to a longer row's keys rounds differently from the same row alone, so a
draft token attends alone, exactly as the decode it stands for would, and pads no other row).
Decodes are sorted by span, so chunk ``c`` holds only the leading sequences that still have
keys there, padded to the longest. A prefill's chunk ``c`` is computed only for the
query rows that see one of its keys (causal: the later rows; window: the earlier ones). So
every row a chunk computes sees a key and its ``m_c`` is finite; the partials a chunk does
not compute stay neutral (``m = -inf``, ``l = o = 0``).

A position a sequence does not read (padding, the start of a window's first block, the tail of
its last block) is redirected to the slot of the sequence's last new token, just written and
so finite, and masked out with -inf. Block table entries outside the keys read (stale blocks
of a sliding group, padding such as -1) are never used as indices: unused blocks and
positions may hold anything, NaN and inf included.

``AttentionMetadata.build`` does the host work of a forward once (positions, blocks, masks,
chunk lists); the cache row indices, which also depend on the cache's strides and head counts,
are computed at the first layer and reused by the others, so a layer runs only tensor ops.
The cache must be contiguous (the model runner allocates it so).
"""

import math

import torch
import torch.nn.functional as F

from replicas.model.attention_metadata import (
    DEQUANTIZED_ROWS,
    AttentionGroup,
    AttentionMetadata,
    GroupReads,
)
from replicas.model.kv_format import KVFormat

__all__ = ["AttentionMetadata", "cached_attention", "strata_attends"]


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Writes k/v of the new tokens into ``kv_cache[:, layer]`` and attends over the context.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim];
    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, row_width], rows of
    ``meta.kv_format`` (quantized as written; only the rows a chunk reads are dequantized).
    Returns [T, num_heads, head_dim].
    """
    num_kv_heads, row_width = kv_cache.shape[-2:]
    head_dim = q.shape[-1]
    layout = meta.layout_for(kv_cache, q.shape[1] // num_kv_heads, head_dim)
    fmt = layout.kv_format
    # One row per (block, layer, k|v, offset, kv head), from this layer's first.
    rows = kv_cache.view(-1, row_width)[layer * (kv_cache.stride(1) // row_width) :]
    rows.index_copy_(0, layout.write_rows, fmt.quantize(torch.cat([k, v]).view(-1, head_dim)))
    if meta.is_one_group:
        return _attend(q, rows, fmt, num_kv_heads, meta.groups[0], layout.reads[0])
    out = torch.empty_like(q)
    for group, reads in zip(meta.groups, layout.reads, strict=True):
        out[group.rows] = _attend(q[group.rows], rows, fmt, num_kv_heads, group, reads)
    return out


def _attend(
    q: torch.Tensor,
    cache_rows: torch.Tensor,
    fmt: KVFormat,
    num_kv_heads: int,
    group: AttentionGroup,
    reads: GroupReads,
) -> torch.Tensor:
    """q: [S * Q, H, D] of one group -> its attention output, [S * Q, H, D] in q's dtype."""
    num_seqs, q_len = group.num_seqs, group.q_len
    num_heads, head_dim = q.shape[1:]
    heads_per_kv = num_heads // num_kv_heads
    if len(group.chunks) == 1 and strata_attends(q.device, fmt, head_dim):
        if fmt.is_quantized:
            return _strata_attends_dequantized(q, cache_rows, fmt, num_kv_heads, group, reads)
        if q_len == 1:
            return torch.ops.strata_native.decode_attention(
                q, cache_rows, reads.rows[0], group.allowed, num_kv_heads
            )
        return torch.ops.strata_native.rows_attention(
            q, cache_rows, reads.rows[0], group.allowed, group.is_causal, q_len, num_kv_heads
        )
    if len(group.chunks) == 1:  # no combine: one fused SDPA over exactly the chunk's keys
        return _sdpa_one_chunk(q, cache_rows, fmt, num_kv_heads, group, reads)

    # [S * Q, H, D] -> [S * kv_heads, Q * heads_per_kv, D]: the query rows of each kv head,
    # query-major so that a range of queries is a range of rows; float32, scaled so that the
    # scores are in base 2 (exp2 is as exact as exp and, unlike exp on CPU, fast on -inf).
    qg = q.reshape(num_seqs, q_len, num_kv_heads, heads_per_kv, head_dim).transpose(1, 2)
    qg = qg.reshape(num_seqs * num_kv_heads, q_len * heads_per_kv, head_dim)
    qg = qg.to(torch.float32) * (math.log2(math.e) / math.sqrt(head_dim))
    for chunk, rows, queries, bias, (max_score, sum_exp, acc) in zip(
        group.chunks, reads.rows, reads.queries, reads.biases, reads.partials, strict=True
    ):
        n = chunk.num_seqs * num_kv_heads
        codes, scales = fmt.split(cache_rows.index_select(0, rows), torch.float32)
        k, v = codes.view(2, n, -1, head_dim)
        s = torch.bmm(qg[:n, queries], k.transpose(1, 2))  # [n, rows, width]
        if scales is not None:  # q . (codes * scale) = (q . codes) * scale, per key
            scale_k, scale_v = scales.view(2, n, 1, -1)
            s.mul_(scale_k)
        if bias is not None:
            s.view(chunk.num_seqs, num_kv_heads, -1, s.shape[-1]).add_(bias)
        torch.amax(s, -1, keepdim=True, out=max_score)  # finite: every row here sees a key
        p = s.sub_(max_score).exp2_()
        torch.sum(p, -1, keepdim=True, out=sum_exp)
        if scales is not None:  # p @ (codes * scale) = (p * scale) @ codes, per key
            p.mul_(scale_v)
        torch.bmm(p, v, out=acc)
    weights = (reads.m_all - reads.m_all.amax(0)).exp2_()  # 2^(m_c - M)
    out = (reads.o_all * weights).sum(0) / (reads.l_all * weights).sum(0)
    out = out.view(num_seqs, num_kv_heads, q_len, heads_per_kv, head_dim).transpose(1, 2)
    return out.reshape(num_seqs * q_len, num_heads, head_dim).to(q.dtype)


def _sdpa_one_chunk(
    q: torch.Tensor,
    cache_rows: torch.Tensor,
    fmt: KVFormat,
    num_kv_heads: int,
    group: AttentionGroup,
    reads: GroupReads,
) -> torch.Tensor:
    """A group of one chunk: one fused SDPA call over exactly its keys, no combine."""
    num_seqs, q_len = group.num_seqs, group.q_len
    num_heads, head_dim = q.shape[1:]
    heads_per_kv = num_heads // num_kv_heads
    # 8-bit rows dequantize exactly into float32 (code * scale); narrowing them to
    # bfloat16 would cost a pass more than SDPA saves over float32 keys.
    dtype = torch.float32 if fmt.is_quantized else q.dtype
    k, v = fmt.dequantize(cache_rows.index_select(0, reads.rows[0]), dtype).view(
        2, num_seqs, num_kv_heads, -1, head_dim
    )
    if q_len == 1:  # decodes: the query rows of each kv head side by side, no GQA expand
        o = F.scaled_dot_product_attention(
            q.reshape(num_seqs, num_kv_heads, heads_per_kv, head_dim).to(dtype),
            k,
            v,
            attn_mask=group.allowed,
        )
        return o.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
    o = F.scaled_dot_product_attention(
        q.reshape(num_seqs, q_len, num_heads, head_dim).transpose(1, 2).to(dtype),
        k,
        v,
        attn_mask=group.allowed,
        is_causal=group.is_causal,
        enable_gqa=True,
    )
    return o.transpose(1, 2).reshape(num_seqs * q_len, num_heads, head_dim).to(q.dtype)


def _strata_attends_dequantized(
    q: torch.Tensor,
    cache_rows: torch.Tensor,
    fmt: KVFormat,
    num_kv_heads: int,
    group: AttentionGroup,
    reads: GroupReads,
) -> torch.Tensor:
    """Strata's attention over an 8-bit cache: the rows a group reads, dequantized into float32
    (``code * scale``, exact) a few sequences at a time (``DEQUANTIZED_ROWS`` rows, or one
    sequence's). A key is the same float32 numbers whichever forward reads it, so a position
    gets the same bits in a prefill, after cached keys or as a decode."""
    rows = reads.rows[0].view(2, group.num_seqs, num_kv_heads, -1)
    per_call = max(1, DEQUANTIZED_ROWS // rows[:, 0].numel())
    outs = []
    for first in range(0, group.num_seqs, per_call):
        seqs = slice(first, first + per_call)
        part = rows[:, seqs].flatten()
        values = fmt.dequantize(cache_rows.index_select(0, part), torch.float32)
        index = torch.arange(part.numel(), device=part.device)
        allowed = None if group.allowed is None else group.allowed[seqs]
        q_part = q[first * group.q_len : (first + per_call) * group.q_len]
        if group.q_len == 1:
            op = torch.ops.strata_native.decode_attention
            outs.append(op(q_part, values, index, allowed, num_kv_heads))
        else:
            op = torch.ops.strata_native.rows_attention
            args = (allowed, group.is_causal, group.q_len, num_kv_heads)
            outs.append(op(q_part, values, index, *args))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def strata_attends(device: torch.device, fmt: KVFormat | None, head_dim: int) -> bool:
    """Whether a group of one chunk takes Strata's attention (see the module docstring): on a
    CPU, a head size of a multiple of 16, and the native library built. An 8-bit cache (``fmt``
    quantized) is read through a float32 copy of the rows of a few sequences at a time."""
    if device.type != "cpu" or head_dim % 16:
        return False
    from replicas.model import native_stack  # it imports this module

    return native_stack.load_error() is None
