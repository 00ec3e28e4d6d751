"""The Triton kernels of ``replicas.model.paged_attention``, as plain functions.

``paged_attention.kernels`` wraps them with ``triton.jit`` on a GPU or with Triton's interpreter
on a CPU. Their private helpers (``_*``) are ``triton.jit`` functions, which Triton inlines into
a compiled kernel and the interpreter calls: which of the two ``triton.jit`` makes is decided at
import, so ``TRITON_INTERPRET`` must be set before this module is imported (as it must be before
triton is).

Cache strides are in elements of the cache's dtype; ``cache`` is one layer's
``[blocks, 2 (k|v), block_size, Hkv, row_width]`` and ``scales`` the same memory read as
float16 (8-bit formats: a row's scale is the float16 after its ``HEAD_DIM`` codes).
"""

import triton
import triton.language as tl


def write_rows(
    rows_ptr,
    cache_ptr,
    slots_ptr,
    stride_rk,
    stride_rt,
    stride_cb,
    stride_ck,
    stride_co,
    WIDTH: tl.constexpr,
    WIDTH_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program (token, k|v): that token's rows of every kv head into its slot."""
    token = tl.program_id(0)
    kv = tl.program_id(1)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    cols = tl.arange(0, WIDTH_P2)
    mask = (cols < WIDTH) & (cols * 0 + slot >= 0)  # a block mask (the interpreter needs one)
    values = tl.load(rows_ptr + kv * stride_rk + token * stride_rt + cols, mask=mask)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    target = cache_ptr + block * stride_cb + kv * stride_ck + offset * stride_co
    tl.store(target + cols, values, mask=mask)


def attend(
    q_ptr,
    cache_ptr,
    scales_ptr,
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
    table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    tile_seq_ptr,
    tile_q0_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ck,
    stride_co,
    stride_ch,
    stride_tb,
    qk_scale,
    window,
    num_tokens,
    num_splits,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    QUANT: tl.constexpr,
    SPLIT: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """Program (tile, kv head, split): the tile's query rows of the kv head's G query heads
    over the split's share of the tile's keys (see the module docstring of paged_attention)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, q0, seq_len, q_len, token, head, q_pos, row_ok = _query_rows(
        tile, kv_head, tile_seq_ptr, tile_q0_ptr, seq_lens_ptr, query_start_ptr, G, BLOCK_M, BLOCK_Q
    )
    dims = tl.arange(0, D_P2)
    dim_ok = dims < HEAD_DIM
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(_head_rows(q_ptr, token, head, dims, stride_qt, stride_qh), mask=q_mask, other=0.0)
    acc, m_i, l_i = _attend_keys(
        q, q_pos, dims, dim_ok, seq, kv_head, split, seq_len, q_len, q0, window, num_splits,
        qk_scale, cache_ptr, scales_ptr, table_ptr, stride_tb, stride_cb, stride_ck, stride_co,
        stride_ch, BLOCK_M, BLOCK_Q, BLOCK_N, BLOCK_SIZE, HEAD_DIM, D_P2, QUANT, F32_DOT,
    )  # fmt: skip
    _store_tile(
        acc, m_i, l_i, out_ptr, part_o_ptr, part_ml_ptr, token, head, dims, q_mask, row_ok, split,
        stride_ot, stride_oh, num_tokens, NUM_HEADS, HEAD_DIM, SPLIT,
    )  # fmt: skip


@triton.jit
def _query_rows(
    tile,
    kv_head,
    tile_seq_ptr,
    tile_q0_ptr,
    seq_lens_ptr,
    query_start_ptr,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """The tile's sequence (its index, first query ``q0``, keys ``seq_len``, new tokens
    ``q_len``) and, per row (query ``q0 + r // G``, query head ``kv_head * G + r % G``), its
    token, query head, position, and whether the row is a query of the tile."""
    seq = tl.load(tile_seq_ptr + tile)
    q0 = 0
    if BLOCK_Q > 1:
        q0 = tl.load(tile_q0_ptr + tile)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start

    m_rows = tl.arange(0, BLOCK_M)
    qi = m_rows // G
    head = kv_head * G + m_rows % G
    row_ok = (qi < BLOCK_Q) & (q0 + qi < q_len)
    token = (q_start + q0 + qi).to(tl.int64)
    q_pos = seq_len - q_len + q0 + qi
    return seq, q0, seq_len, q_len, token, head, q_pos, row_ok


@triton.jit
def _head_rows(ptr, token, head, dims, stride_t, stride_h):
    """Pointers to the ``[token, head]`` rows of a ``[T, H, D]`` tensor, one per tile row."""
    return ptr + token[:, None] * stride_t + head[:, None] * stride_h + dims[None, :]


@triton.jit
def _attend_keys(
    q,
    q_pos,
    dims,
    dim_ok,
    seq,
    kv_head,
    split,
    seq_len,
    q_len,
    q0,
    window,
    num_splits,
    qk_scale,
    cache_ptr,
    scales_ptr,
    table_ptr,
    stride_tb,
    stride_cb,
    stride_ck,
    stride_co,
    stride_ch,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    QUANT: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """The split's share of the tile's keys ``[lo, hi)``, ``BLOCK_N`` per step: each row's
    output ``acc`` (not yet divided by its sum), running maximum ``m_i`` and sum ``l_i``."""
    last_q = tl.minimum(q_len - 1, q0 + BLOCK_Q - 1)
    hi = seq_len - q_len + last_q + 1  # keys after the tile's last query are never seen
    lo = tl.where(window > 0, tl.maximum(seq_len - q_len + q0 - window + 1, 0), 0)
    lo = lo // BLOCK_N * BLOCK_N
    num_steps = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    per_split = tl.cdiv(num_steps, num_splits)
    first = split * per_split
    last = tl.minimum(first + per_split, num_steps)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_P2], dtype=tl.float32)
    for step in range(first, last):
        keys = lo + step * BLOCK_N + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = _attend_step(
            q, q_pos, dims, dim_ok, keys, hi, window, qk_scale, acc, m_i, l_i, seq, kv_head,
            cache_ptr, scales_ptr, table_ptr, stride_tb, stride_cb, stride_ck, stride_co,
            stride_ch, BLOCK_SIZE, HEAD_DIM, QUANT, F32_DOT,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _attend_step(
    q,
    q_pos,
    dims,
    dim_ok,
    keys,
    hi,
    window,
    qk_scale,
    acc,
    m_i,
    l_i,
    seq,
    kv_head,
    cache_ptr,
    scales_ptr,
    table_ptr,
    stride_tb,
    stride_cb,
    stride_ck,
    stride_co,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """One step of ``BLOCK_N`` keys: their scores (causal, in the window) folded into each
    row's ``acc``, maximum ``m_i`` and sum ``l_i``, which it returns."""
    key_ok = keys < hi
    block = tl.load(table_ptr + seq * stride_tb + keys // BLOCK_SIZE, mask=key_ok, other=0)
    base = block.to(tl.int64) * stride_cb + (keys % BLOCK_SIZE) * stride_co
    base += kv_head * stride_ch
    kv_mask = key_ok[:, None] & dim_ok[None, :]
    k = _load_rows(cache_ptr, base, dims, kv_mask, q.dtype, QUANT)
    if F32_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = _times_row_scales(s * qk_scale, scales_ptr, base, key_ok, HEAD_DIM, QUANT)
    seen = (keys[None, :] <= q_pos[:, None]) & key_ok[None, :]
    seen = seen & ((window == 0) | (keys[None, :] > q_pos[:, None] - window))
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_base = base + stride_ck
    v = _load_rows(cache_ptr, v_base, dims, kv_mask, q.dtype, QUANT)
    p = _times_row_scales(p, scales_ptr, v_base, key_ok, HEAD_DIM, QUANT)
    if F32_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _load_rows(cache_ptr, base, dims, mask, dtype: tl.constexpr, QUANT: tl.constexpr):
    """The K or V rows starting at ``base`` as ``dtype``: a float cache's values, or an 8-bit
    row's codes (int8 as integers, fp8_e4m3 as float16 ``code / 2^8``), before its scale."""
    rows = tl.load(cache_ptr + base[:, None] + dims[None, :], mask=mask, other=0)
    if QUANT == 0:
        rows = rows.to(dtype)
    elif QUANT == 1:
        # Through float32 (exact): Triton's interpreter casts int8 to bfloat16 as raw bits.
        rows = rows.to(tl.int8, bitcast=True).to(tl.float32).to(dtype)
    elif QUANT == 2:
        bits = (rows.to(tl.int8, bitcast=True).to(tl.int16) << 7) & -0x4080
        rows = bits.to(tl.float16, bitcast=True).to(dtype)
    return rows


@triton.jit
def _times_row_scales(x, scales_ptr, base, key_ok, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
    """``x`` [rows, keys] (scores, or probabilities) times each key's row scale for an 8-bit
    format (the float16 after the row's codes; fp8_e4m3 also times the 2^8 its codes lack)."""
    if QUANT > 0:
        scale = tl.load(scales_ptr + (base + HEAD_DIM) // 2, mask=key_ok, other=0.0)
        x = x * scale.to(tl.float32)[None, :]
        if QUANT == 2:
            x = x * 256.0
    return x


@triton.jit
def _store_tile(
    acc,
    m_i,
    l_i,
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
    token,
    head,
    dims,
    q_mask,
    row_ok,
    split,
    stride_ot,
    stride_oh,
    num_tokens,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """The tile's rows: normalised into ``out``, or with ``SPLIT`` the share's partial
    (``acc``, ``m_i``, ``l_i``) for ``combine``."""
    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        target = _head_rows(out_ptr, token, head, dims, stride_ot, stride_oh)
        tl.store(target, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        at = (split * num_tokens + token) * NUM_HEADS + head  # [BLOCK_M]
        tl.store(part_o_ptr + at[:, None] * HEAD_DIM + dims[None, :], acc, mask=q_mask)
        ml = split * 2 * num_tokens * NUM_HEADS + token * NUM_HEADS + head
        tl.store(part_ml_ptr + ml, m_i, mask=row_ok)
        tl.store(part_ml_ptr + ml + num_tokens * NUM_HEADS, l_i, mask=row_ok)


def combine(
    part_o_ptr,
    part_ml_ptr,
    out_ptr,
    tile_seq_ptr,
    query_start_ptr,
    stride_ot,
    stride_oh,
    num_tokens,
    NUM_SPLITS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
):
    """Program (decode tile, head): ``out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s``."""
    seq = tl.load(tile_seq_ptr + tl.program_id(0))
    token = tl.load(query_start_ptr + seq).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, D_P2)
    ml = splits * 2 * num_tokens * NUM_HEADS + token * NUM_HEADS + head
    m = tl.load(part_ml_ptr + ml)
    l_s = tl.load(part_ml_ptr + ml + num_tokens * NUM_HEADS)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.math.exp2(m - m_max)  # 0 for a share with no key
    at = (splits * num_tokens + token) * NUM_HEADS + head
    o = tl.load(
        part_o_ptr + at[:, None] * HEAD_DIM + dims[None, :],
        mask=(dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(weight * l_s, 0)
    out = tl.sum(o * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    target = out_ptr + token * stride_ot + head * stride_oh + dims
    tl.store(target, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
