"""Attention that reads the block KV cache in place, as Triton kernels (CUDA).

On a GPU the torch path of ``replicas.model.attention`` gathers every sequence's keys into a
new tensor each step and runs SDPA over it: three passes over the KV bytes, and host-side
metadata that a CUDA graph cannot replay. Here each program of one kernel reads a sequence's
keys and values straight from their blocks through its block table::

    grid (tile, kv head, split):  tile = a sequence's query rows (one for a decode),
                                  split = a contiguous share of its keys (flash-decoding)
    rows of a tile:  m = query q * G + g   (the G query heads of the kv head side by side,
                                            so one key read serves every head of the group)

A tile's keys ``[lo, hi)`` are its causal range (and window), cut into ``num_splits``
contiguous shares of ``BLOCK_N`` keys; a share's partial (row maximum ``m``, ``l = sum 2^(s -
m)`` and ``o = sum 2^(s - m) v``) is combined exactly by ``_combine`` when there is more than one.
Scores are in base 2 and float32; the products run on the cache's dtype (8-bit rows: their
codes, exact in bfloat16, with the row's scale folded into the score or probability, as
``replicas.model.attention`` folds it).

The new tokens' K/V are quantized by the KV format in torch and written by ``_write_rows``; a
slot of -1 writes nothing (the padding rows of a CUDA graph's batch). Everything a launch
reads is a device tensor, so a decode step replays as a graph (``replicas.engine.cuda_graphs``).
A prefill chunk with no cached keys and a float cache in the model's dtype runs
``scaled_dot_product_attention`` over its own K/V (flash attention), which is faster.

Without a GPU the same kernels run in Triton's interpreter on CPU tensors (the tests).
"""

import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replicas.model.kv_format import KVFormat

FP8_E4M3_IN_FLOAT16 = 2.0**8  # see replicas.model.kv_format
DECODE_ROWS = 16  # a decode tile's rows: the smallest a tensor-core product takes
PREFILL_ROWS = 64  # a prefill tile's rows (query positions x heads of a kv head)
KEYS_PER_STEP = 64  # keys a program reads per loop step


@dataclass(slots=True)
class PagedAttentionMetadata:
    """Device tensors (int32) that every layer of one cache group reads in one forward.

    ``decode_seqs``: the sequences with one new token, one tile each; ``prefill_tiles`` [2, n]:
    (sequence, first query of the tile) of the other sequences' tiles, except ``dense`` ones:
    (first token row, number of tokens) of prefills with no cached keys, attended by SDPA.
    """

    slot_mapping: torch.Tensor  # [T] flat slot of each new token, -1: not written
    block_table: torch.Tensor  # [B, max_blocks]
    seq_lens: torch.Tensor  # [B] keys of each sequence after this step
    query_start: torch.Tensor  # [B + 1] first token row of each sequence
    decode_seqs: torch.Tensor | None
    num_decode_splits: int
    prefill_tiles: torch.Tensor | None
    dense: tuple[tuple[int, int], ...]
    sliding_window: int  # 0: none
    kv_format: KVFormat


def uses_gpu_kernels(device: torch.device) -> bool:
    """Whether a model on ``device`` attends through these kernels: a real GPU (the CPU-only
    device-checking mode, ``STRATA_FAKE_CUDA=1``, runs the CUDA path's torch code instead)."""
    from replicas import fake_cuda

    return device.type == "cuda" and not fake_cuda.is_active()


def decode_splits(num_seqs: int, num_kv_heads: int, max_keys: int, num_sms: int) -> int:
    """Shares of each decode's keys: enough programs to fill the device twice over, none
    shorter than ``4 * KEYS_PER_STEP`` keys."""
    wanted = -(-2 * num_sms // max(1, num_seqs * num_kv_heads))
    splits = max(1, min(wanted, max_keys // (4 * KEYS_PER_STEP), 64))
    return 1 << (splits.bit_length() - 1)  # a power of two: the combine reads them as a range


def tile_queries(heads_per_kv: int) -> int:
    """Query positions in one prefill tile (its rows hold each one's ``heads_per_kv`` heads)."""
    return max(PREFILL_ROWS, triton_next_power_of_2(heads_per_kv)) // heads_per_kv


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: PagedAttentionMetadata,
) -> torch.Tensor:
    """Writes the new tokens' k/v into ``kv_cache[:, layer]`` and attends over each context.

    q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [blocks, layers, 2, block_size, Hkv, row_width].
    Returns [T, H, D] in q's dtype.
    """
    num_tokens, _, head_dim = q.shape
    cache = kv_cache[:, layer]  # [blocks, 2, block_size, Hkv, row_width]
    rows = meta.kv_format.quantize(torch.stack([k, v]).view(-1, head_dim))
    _write(rows.view(2, num_tokens, -1), cache, meta.slot_mapping)
    return attend_written(q, k, v, kv_cache, layer, meta)


def attend_written(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: PagedAttentionMetadata,
) -> torch.Tensor:
    """``paged_attention`` once the new tokens' K/V are in the cache (``k``, ``v``: their
    values, which a prefill with no cached keys attends directly)."""
    cache = kv_cache[:, layer]
    out = torch.empty_like(q)
    if meta.decode_seqs is not None:
        _attend(q, cache, out, meta, meta.decode_seqs, None, meta.num_decode_splits)
    if meta.prefill_tiles is not None:
        _attend(q, cache, out, meta, meta.prefill_tiles[0], meta.prefill_tiles[1], 1)
    group = q.shape[1] // k.shape[1]
    for start, length in meta.dense:  # heads expanded: flash attention takes no GQA
        window = slice(start, start + length)
        o = F.scaled_dot_product_attention(
            q[window].transpose(0, 1).unsqueeze(0),
            k[window].repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0),
            v[window].repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0),
            is_causal=True,
        )
        out[window] = o[0].transpose(0, 1)
    return out


def _write(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """rows [2, T, Hkv * row_width] -> the cache rows of each token's slot (-1: none)."""
    num_tokens = rows.shape[1]
    if num_tokens == 0:
        return
    block_size = cache.shape[2]
    width = rows.shape[2]
    kernels(cache.device.type == "cuda").write[(num_tokens, 2)](
        rows,
        cache,
        slots,
        rows.stride(0),
        rows.stride(1),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        WIDTH=width,
        WIDTH_P2=triton_next_power_of_2(width),
        BLOCK_SIZE=block_size,
    )


def _attend(
    q: torch.Tensor,
    cache: torch.Tensor,
    out: torch.Tensor,
    meta: PagedAttentionMetadata,
    tile_seqs: torch.Tensor,
    tile_starts: torch.Tensor | None,
    num_splits: int,
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = cache.shape[3]
    group = num_heads // num_kv_heads
    is_decode = tile_starts is None
    rows = DECODE_ROWS if is_decode else PREFILL_ROWS
    rows = max(rows, triton_next_power_of_2(group))
    fmt = meta.kv_format
    quant = 0 if not fmt.is_quantized else (1 if fmt.name == "int8" else 2)
    scales = cache.view(torch.float16) if quant else cache
    num_tiles = tile_seqs.shape[0]
    split = num_splits > 1
    partial_o, partial_ml = _partials(q, num_splits) if split else (out, out)
    on_gpu = q.device.type == "cuda"
    kernels(on_gpu).attend[(num_tiles, num_kv_heads, num_splits)](
        q,
        cache,
        scales,
        out,
        partial_o,
        partial_ml,
        meta.block_table,
        meta.seq_lens,
        meta.query_start,
        tile_seqs,
        tile_starts if tile_starts is not None else tile_seqs,
        *q.stride()[:2],
        *out.stride()[:2],
        *cache.stride()[:4],
        meta.block_table.stride(0),
        math.log2(math.e) / math.sqrt(head_dim),
        meta.sliding_window,
        num_tokens,
        num_splits,
        G=group,
        BLOCK_M=rows,
        BLOCK_Q=1 if is_decode else tile_queries(group),
        BLOCK_N=KEYS_PER_STEP,
        BLOCK_SIZE=cache.shape[2],
        HEAD_DIM=head_dim,
        D_P2=triton_next_power_of_2(head_dim),
        QUANT=quant,
        SPLIT=split,
        NUM_HEADS=num_heads,
        F32_DOT=q.dtype == torch.float32 or not on_gpu,
        num_warps=4 if is_decode else 8,
        **({"num_stages": 2} if on_gpu else {}),
    )
    if split:
        _combine(partial_o, partial_ml, out, tile_seqs, meta.query_start, num_splits)


def _partials(q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each share's float32 ``o`` [splits, T, H, D] and ``m``, ``l`` [splits, 2, T, H]."""
    num_tokens, num_heads, head_dim = q.shape
    shape = (num_splits, num_tokens, num_heads)
    return (
        torch.empty((*shape, head_dim), device=q.device, dtype=torch.float32),
        torch.empty((num_splits, 2, num_tokens, num_heads), device=q.device, dtype=torch.float32),
    )


def _combine(partial_o, partial_ml, out, tile_seqs, query_start, num_splits: int) -> None:
    num_splits, num_tokens, num_heads, head_dim = partial_o.shape
    kernels(out.device.type == "cuda").combine[(tile_seqs.shape[0], num_heads)](
        partial_o,
        partial_ml,
        out,
        tile_seqs,
        query_start,
        out.stride(0),
        out.stride(1),
        num_tokens,
        NUM_SPLITS=num_splits,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        D_P2=triton_next_power_of_2(head_dim),
    )


def triton_next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def jit_kernels(module: str, on_gpu: bool) -> dict[str, object]:
    """The public functions of kernel module ``module`` (``replicas.model.paged_kernels``,
    ``replicas.model.fused_kernels``) compiled for the GPU, or run by Triton's interpreter on
    CPU tensors, which needs ``TRITON_INTERPRET=1`` set before triton is first imported (Triton's
    own helpers are wrapped for the interpreter only then; tests/conftest.py sets it on a
    machine without CUDA)."""
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "Strata's Triton kernels run on a CPU only in Triton's interpreter: set "
            "TRITON_INTERPRET=1 before triton is imported"
        )
    import importlib
    import inspect

    import triton

    source = importlib.import_module(module)
    return {
        name: triton.jit(function)
        for name, function in inspect.getmembers(source, inspect.isfunction)
        if function.__module__ == module and not name.startswith("_")
    }


def kernels(on_gpu: bool) -> "_Kernels":
    found = jit_kernels("replicas.model.paged_kernels", on_gpu)
    return _Kernels(found["write_rows"], found["attend"], found["combine"])


@dataclass(frozen=True, slots=True)
class _Kernels:
    write: object
    attend: object
    combine: object
