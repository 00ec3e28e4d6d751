"""Attention over the block KV cache, in plain torch (CPU and CUDA).

Each layer first writes its new tokens' k/v into the cache at ``slot_mapping``, then every
sequence's queries attend over the context read back through its block table. For sequence
``i`` with ``q_len`` new tokens and ``seq_len`` tokens of context, query ``j`` sits at position
``seq_len - q_len + j`` and sees keys at positions ``p`` with::

    p <= q_pos                        (causal)
    p >  q_pos - sliding_window       (sliding layers only: itself and window-1 keys back)

A sliding group reads only the blocks covering ``[max(0, first_q_pos - window + 1), seq_len)``;
earlier block table entries may name freed blocks and are never touched.

Sequences with one new token (decode) are batched into one padded attention call; padding keys
are masked, so the cache must hold finite values everywhere (allocate it with zeros). Sequences
with several new tokens (prefill chunks) run one attention call each over exactly their keys.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replicas.model.batch import ForwardBatch


@dataclass(slots=True)
class PrefillAttention:
    """One prefill chunk: its query rows and the exact key range it reads."""

    rows: slice  # rows of this sequence's new tokens in the batch
    blocks: torch.Tensor  # [num_blocks] cache blocks holding keys first_key_pos .. seq_len-1
    skip: int  # keys to drop at the start of the first block
    num_keys: int
    mask: torch.Tensor | None  # [q_len, num_keys] bool, None when plainly causal from 0


@dataclass(slots=True)
class DecodeAttention:
    """All single-token sequences, padded to the same number of blocks and read in one call."""

    rows: torch.Tensor  # [Bd] rows of the decode tokens in the batch
    blocks: torch.Tensor  # [Bd, nb] blocks to read, padded with block 0
    mask: torch.Tensor  # [Bd, 1, 1, nb * block_size] bool, False on padding and old keys


@dataclass(slots=True)
class AttentionMetadata:
    """What every layer of one cache group needs for one forward; built once per group."""

    write_blocks: torch.Tensor  # [T] block of each new token
    write_offsets: torch.Tensor  # [T] offset of each new token in its block
    decode: DecodeAttention | None
    prefills: list[PrefillAttention]

    @classmethod
    def build(
        cls, batch: ForwardBatch, group: str, block_size: int, sliding_window: int | None
    ) -> "AttentionMetadata":
        table = batch.block_tables[group]  # [B, max_blocks]
        slots = batch.slot_mapping[group]  # [T]
        device = table.device
        decodes: list[tuple[int, int, int, int]] = []  # (seq, row, first block, seq_len)
        prefills = []
        for i, seq_len in enumerate(batch.seq_lens):
            start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            q_len = end - start
            if q_len == 0:
                continue
            first_q_pos = seq_len - q_len
            first_key_pos = max(0, first_q_pos - sliding_window + 1) if sliding_window else 0
            first_block = first_key_pos // block_size
            if q_len == 1:
                decodes.append((i, start, first_block, seq_len))
                continue
            mask = None
            if first_q_pos > 0 or (sliding_window and q_len > sliding_window):
                q_pos = torch.arange(first_q_pos, seq_len, device=device)[:, None]
                k_pos = torch.arange(first_key_pos, seq_len, device=device)[None, :]
                mask = k_pos <= q_pos
                if sliding_window:
                    mask &= k_pos > q_pos - sliding_window
            last_block = (seq_len + block_size - 1) // block_size
            prefills.append(
                PrefillAttention(
                    rows=slice(start, end),
                    blocks=table[i, first_block:last_block],
                    skip=first_key_pos - first_block * block_size,
                    num_keys=seq_len - first_key_pos,
                    mask=mask,
                )
            )
        decode = _decode_attention(table, decodes, block_size, sliding_window) if decodes else None
        return cls(
            write_blocks=torch.div(slots, block_size, rounding_mode="floor"),
            write_offsets=slots % block_size,
            decode=decode,
            prefills=prefills,
        )


def _decode_attention(
    table: torch.Tensor,
    decodes: list[tuple[int, int, int, int]],
    block_size: int,
    sliding_window: int | None,
) -> DecodeAttention:
    device = table.device
    seqs, rows, first_blocks, seq_lens = zip(*decodes, strict=True)
    num_read = [
        (n + block_size - 1) // block_size - f for n, f in zip(seq_lens, first_blocks, strict=True)
    ]
    steps = torch.arange(max(num_read), device=device)[None, :]  # [1, nb]
    cols = torch.tensor(first_blocks, device=device)[:, None] + steps  # [Bd, nb] table columns
    blocks = table[torch.tensor(seqs, device=device)].gather(
        1, cols.clamp(max=table.shape[1] - 1)
    )  # [Bd, nb]
    is_read = steps < torch.tensor(num_read, device=device)[:, None]
    blocks = torch.where(is_read, blocks, torch.zeros_like(blocks))
    offsets = torch.arange(block_size, device=device)
    k_pos = (cols[:, :, None] * block_size + offsets).flatten(1)  # [Bd, nb * block_size]
    q_pos = torch.tensor(seq_lens, device=device)[:, None] - 1  # [Bd, 1]
    mask = k_pos <= q_pos
    if sliding_window:
        mask &= k_pos > q_pos - sliding_window
    return DecodeAttention(
        rows=torch.tensor(rows, device=device), blocks=blocks, mask=mask[:, None, None, :]
    )


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
    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim].
    Returns [T, num_heads, head_dim].
    """
    k_cache = kv_cache[:, layer, 0]  # [num_blocks, block_size, kv_heads, head_dim], a view
    v_cache = kv_cache[:, layer, 1]
    k_cache[meta.write_blocks, meta.write_offsets] = k.to(k_cache.dtype)
    v_cache[meta.write_blocks, meta.write_offsets] = v.to(v_cache.dtype)
    out = torch.empty_like(q)

    if (d := meta.decode) is not None:
        k_ctx = k_cache[d.blocks].flatten(1, 2).transpose(1, 2)  # [Bd, kv_heads, L, head_dim]
        v_ctx = v_cache[d.blocks].flatten(1, 2).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[d.rows].unsqueeze(2),  # [Bd, heads, 1, head_dim]
            k_ctx.to(q.dtype),
            v_ctx.to(q.dtype),
            attn_mask=d.mask,
            enable_gqa=True,
        )
        out[d.rows] = o.squeeze(2)

    for p in meta.prefills:
        keys = slice(p.skip, p.skip + p.num_keys)
        k_ctx = k_cache[p.blocks].flatten(0, 1)[keys].transpose(0, 1)  # [kv_heads, L, d]
        v_ctx = v_cache[p.blocks].flatten(0, 1)[keys].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[p.rows].transpose(0, 1).unsqueeze(0),  # [1, heads, q_len, head_dim]
            k_ctx.to(q.dtype).unsqueeze(0),
            v_ctx.to(q.dtype).unsqueeze(0),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            enable_gqa=True,
        )
        out[p.rows] = o.squeeze(0).transpose(0, 1)
    return out
