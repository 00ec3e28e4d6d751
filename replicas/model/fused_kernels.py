"""Triton kernels that fuse a decoder layer's elementwise steps on a GPU (``gpu_layers``).

Each rounds where the eager ops it replaces round (to the model's dtype after every op), so a
layer gives eager's values up to the order of one row's sum of squares: ``add_rms_norm`` is
``h = x + residual``, then ``weight * rms_norm(h)`` with the norm in float32 rounded once;
``silu_mul`` is ``silu(gate) * up``; ``rope_write`` rotates each head as ``apply_rope`` does
(``x * cos + rotate(x) * sin``, three roundings) and writes K and V rows to their cache slots.
Plain functions: ``paged_attention.jit_kernels`` wraps them for the GPU or the interpreter;
their private helpers (``_*``) are ``triton.jit`` functions, inlined on the GPU (see
``replicas.model.paged_kernels``).
"""

import triton
import triton.language as tl


def add_rms_norm(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_r,
    eps,
    WIDTH: tl.constexpr,
    WIDTH_P2: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """Program: one row. ``sum = x + residual`` (when given), ``out = weight * norm(sum)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, WIDTH_P2)
    mask = cols < WIDTH
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
        tl.store(sum_ptr + row * WIDTH + cols, h, mask=mask)
    wide = h.to(tl.float32)
    rms = tl.math.rsqrt(tl.sum(wide * wide, 0) / WIDTH + eps)
    normed = (wide * rms).to(h.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * WIDTH + cols, (normed * weight).to(h.dtype), mask=mask)


def silu_mul(
    gate_up_ptr,
    out_ptr,
    stride_in,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row, block of columns): ``silu(gate) * up`` of a ``[gate | up]`` row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + WIDTH + cols, mask=mask, other=0.0)
    wide = gate.to(tl.float32)
    silu = (wide / (1.0 + tl.math.exp(-wide))).to(gate.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * WIDTH + cols, out, mask=mask)


def rope_write(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    cache_ptr,
    slots_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_cb,
    stride_ck,
    stride_co,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program (token, head of q then of k): the head rotated, to ``q_out`` or ``k_out``
    ([T, H or Hkv, D], contiguous); k's and the same kv head's v also to the token's slot (-1:
    none)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, HALF)
    if head < NUM_HEADS:
        src = q_ptr + token * stride_qt + head * stride_qh
    else:
        src = k_ptr + token * stride_kt + (head - NUM_HEADS) * stride_kh
    y1, y2 = _rotated(src, cos_ptr, sin_ptr, token, stride_cos, dims, HALF)
    if head < NUM_HEADS:
        target = q_out_ptr + (token * NUM_HEADS + head) * (2 * HALF)
        tl.store(target + dims, y1)
        tl.store(target + HALF + dims, y2)
    else:
        kv_head = head - NUM_HEADS
        target = k_out_ptr + (token * NUM_KV_HEADS + kv_head) * (2 * HALF)
        tl.store(target + dims, y1)
        tl.store(target + HALF + dims, y2)
        _write_slot(
            y1, y2, v_ptr, cache_ptr, slots_ptr, token, kv_head, dims, stride_vt, stride_vh,
            stride_cb, stride_ck, stride_co, stride_ch, HALF, BLOCK_SIZE,
        )  # fmt: skip


@triton.jit
def _rotated(src, cos_ptr, sin_ptr, token, stride_cos, dims, HALF: tl.constexpr):
    """The head at ``src`` rotated by the token's ``cos`` and ``sin`` rows as ``apply_rope``
    does (``x * cos + rotate(x) * sin``, rounded to its dtype after each op), as two halves."""
    x1 = tl.load(src + dims)
    x2 = tl.load(src + HALF + dims)
    dtype = x1.dtype
    c1 = tl.load(cos_ptr + token * stride_cos + dims).to(tl.float32)
    c2 = tl.load(cos_ptr + token * stride_cos + HALF + dims).to(tl.float32)
    s1 = tl.load(sin_ptr + token * stride_cos + dims).to(tl.float32)
    s2 = tl.load(sin_ptr + token * stride_cos + HALF + dims).to(tl.float32)
    a1 = (x1.to(tl.float32) * c1).to(dtype).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(dtype).to(tl.float32)
    b1 = (-x2.to(tl.float32) * s1).to(dtype).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2).to(dtype).to(tl.float32)
    y1 = (a1 + b1).to(dtype)
    y2 = (a2 + b2).to(dtype)
    return y1, y2


@triton.jit
def _write_slot(
    y1,
    y2,
    v_ptr,
    cache_ptr,
    slots_ptr,
    token,
    kv_head,
    dims,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ck,
    stride_co,
    stride_ch,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """The rotated k (halves ``y1``, ``y2``) and the kv head's v row to the token's slot in
    ``cache``, as the cache's dtype; nothing for slot -1."""
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co
        row += kv_head * stride_ch
        tl.store(cache_ptr + row + dims, y1.to(cache_ptr.dtype.element_ty))
        tl.store(cache_ptr + row + HALF + dims, y2.to(cache_ptr.dtype.element_ty))
        v_src = v_ptr + token * stride_vt + kv_head * stride_vh
        v1 = tl.load(v_src + dims)
        v2 = tl.load(v_src + HALF + dims)
        tl.store(cache_ptr + row + stride_ck + dims, v1.to(cache_ptr.dtype.element_ty))
        tl.store(cache_ptr + row + stride_ck + HALF + dims, v2.to(cache_ptr.dtype.element_ty))
