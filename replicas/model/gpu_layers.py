"""The decoder stack on a GPU: the layers' products, paged attention and fused elementwise steps.

A decode step of an 8B model is bandwidth-bound in its products; what else runs is launches.
Eager, a layer is about twenty kernels (norms, rotary's five ops, K/V's stack and write, the
SwiGLU's two, residual adds); here it is ten, every elementwise step fused into the kernel
beside it (``replicas.model.fused_kernels``)::

    residual, x = add_rms_norm(previous output, residual, attention_norm)   (1 kernel)
    q, k, v     = wqkv(x)                                                   (1 product)
    q           = rope_write(q, k, v -> cache)                              (1 kernel)
    o           = attend over the block cache (+ combine of its shares)     (1-2 kernels)
    residual, x = add_rms_norm(wo(o), residual, ffn_norm)                   (1 product + 1)
    out         = w2(silu_mul(w13(x)))                                      (2 products + 1)

The kernels round as the eager ops do, so the values are eager's but for the order of a sum.
8-bit KV formats, and a head size whose half is no power of two, write K/V through the
format's torch quantization instead (``paged_attention``).
"""

import torch
from torch import nn

from replicas.model.kv_format import KVFormat
from replicas.model.paged_attention import (
    PagedAttentionMetadata,
    attend_written,
    jit_kernels,
    paged_attention,
    triton_next_power_of_2,
)

FUSED = "replicas.model.fused_kernels"


def run_paged_layers(
    layers: nn.ModuleList,
    norm: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_caches: dict[str, torch.Tensor],
    metas: dict[str, PagedAttentionMetadata],
) -> torch.Tensor:
    """The layers then the final norm over ``x`` [T, hidden]; returns the normed output."""
    residual = x
    hidden = add_rms_norm(x, None, layers[0].attention_norm)[1]
    for i, layer in enumerate(layers):
        group = layer.attention.group
        out = _attention(layer.attention, hidden, cos, sin, kv_caches[group], metas[group])
        residual, hidden = add_rms_norm(out, residual, layer.ffn_norm)
        out = _feed_forward(layer.feed_forward, hidden)
        after = layers[i + 1].attention_norm if i + 1 < len(layers) else norm
        residual, hidden = add_rms_norm(out, residual, after)
    return hidden


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, norm(x + residual)); without a residual, (x, norm(x))."""
    rows, width = x.shape
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else x
    if rows:
        _kernel("add_rms_norm", x)[(rows,)](
            x,
            residual if residual is not None else x,
            norm.weight,
            out,
            total,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            norm.eps,
            WIDTH=width,
            WIDTH_P2=triton_next_power_of_2(width),
            HAS_RESIDUAL=residual is not None,
            num_warps=8 if width >= 2048 else 4,
        )
    return total, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] ``gate | up`` -> [T, I] ``silu(gate) * up``."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton_next_power_of_2(width))
    if rows:
        _kernel("silu_mul", gate_up)[(rows, -(-width // block))](
            gate_up, out, gate_up.stride(0), WIDTH=width, BLOCK=block
        )
    return out


def rope_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k, v [T, Hkv, D] (any row strides); cos, sin [T, 1, D]; ``cache`` one
    layer's ``[blocks, 2, block_size, Hkv, D]`` of values. Returns q and k rotated; k rotated
    and v are also in their slots."""
    tokens, heads, head_dim = q.shape
    q_out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, k.shape[1], head_dim), dtype=k.dtype, device=k.device)
    if tokens:
        _kernel("rope_write", q)[(tokens, heads + k.shape[1])](
            q, k, v, cos, sin, q_out, k_out, cache, slots,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0),
            cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
            NUM_HEADS=heads,
            NUM_KV_HEADS=k.shape[1],
            HALF=head_dim // 2,
            BLOCK_SIZE=cache.shape[2],
        )  # fmt: skip
    return q_out, k_out


def fuses_rope(fmt: KVFormat, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``rope_write`` can write K/V: a float cache in the model's dtype, and a head
    size whose half is a power of two."""
    half = head_dim // 2
    return not fmt.is_quantized and fmt.storage_dtype == dtype and half & (half - 1) == 0


def _attention(
    attention: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
) -> torch.Tensor:
    tokens = x.shape[0]
    if attention.wqkv is not None:
        q, k, v = attention.wqkv(x).split(attention.qkv_sizes, dim=-1)
    else:
        q, k, v = attention.wq(x), attention.wk(x), attention.wv(x)
    q = q.view(tokens, attention.num_heads, attention.head_dim)
    k = k.view(tokens, attention.num_kv_heads, attention.head_dim)
    v = v.view(tokens, attention.num_kv_heads, attention.head_dim)
    if attention.q_norm is not None:
        q, k = attention.q_norm(q), attention.k_norm(k)
    layer = attention.layer_in_group
    if fuses_rope(meta.kv_format, q.dtype, attention.head_dim):
        q, k = rope_write(q, k, v, cos, sin, kv_cache[:, layer], meta.slot_mapping)
        out = attend_written(q, k, v, kv_cache, layer, meta)
    else:
        from replicas.model.transformer import apply_rope

        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, layer, meta)
    return attention.wo(out.reshape(tokens, -1))


def _feed_forward(ffn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate_up = ffn.w13(x) if ffn.w13 is not None else torch.cat([ffn.w1(x), ffn.w3(x)], dim=-1)
    return ffn.w2(silu_mul(gate_up))


def _kernel(name: str, like: torch.Tensor):
    return jit_kernels(FUSED, like.device.type == "cuda")[name]
