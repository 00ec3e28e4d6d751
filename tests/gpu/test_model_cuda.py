"""The forward pass's pieces on the GPU: the chunked block-cache attention and quantized linear
layers give on ``cuda`` what they give on the CPU (the same code path, pure torch)."""

import pytest
import torch

from replicas.config import EngineConfig
from replicas.engine.engine import Engine
from replicas.model.attention import AttentionMetadata, cached_attention
from replicas.model.batch import ForwardBatch
from replicas.model.quant import QuantizedLinear
from tests.gpu.devices import CUDA_ONLY

BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 16, 9, 3, 64


def _batch(seq_lens: list[int], q_lens: list[int], tables: list[list[int]]) -> ForwardBatch:
    ids, positions, starts, slots = [], [], [0], []
    for seq_len, q_len, table in zip(seq_lens, q_lens, tables, strict=True):
        for p in range(seq_len - q_len, seq_len):
            ids.append(0)
            positions.append(p)
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        starts.append(starts[-1] + q_len)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(positions),
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_tables={"full": torch.tensor(padded)},
        slot_mapping={"full": torch.tensor(slots)},
        logits_indices=torch.tensor([s - 1 for s in starts[1:]]),
    )


def _to(batch: ForwardBatch, device: str) -> ForwardBatch:
    return ForwardBatch(
        input_ids=batch.input_ids.to(device),
        positions=batch.positions.to(device),
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables={g: t.to(device) for g, t in batch.block_tables.items()},
        slot_mapping={g: s.to(device) for g, s in batch.slot_mapping.items()},
        logits_indices=batch.logits_indices.to(device),
    )


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_chunked_attention_on_cuda_equals_the_cpu(device):
    gen = torch.Generator().manual_seed(0)
    num_blocks = 400
    cache = torch.randn(num_blocks, 2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    seq_lens, q_lens = [3000, 70, 1100, 40], [1, 1, 12, 40]
    tables, used = [], 0
    for n in seq_lens:
        blocks = -(-n // BLOCK_SIZE)
        tables.append(order[used : used + blocks])
        used += blocks
    batch = _batch(seq_lens, q_lens, tables)
    t = sum(q_lens)
    q = torch.randn(t, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen)
    outs = []
    for where in ("cpu", device):
        b = _to(batch, where)
        meta = AttentionMetadata.build(b, "full", BLOCK_SIZE, None)
        c = cache.clone().to(where)
        outs.append(cached_attention(q.to(where), k.to(where), v.to(where), c, 1, meta).cpu())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_linear_refuses_cuda_rather_than_unpack_on_every_call(device, scheme):
    gen = torch.Generator().manual_seed(1)
    layer = getattr(QuantizedLinear, scheme)(torch.randn(192, 256, generator=gen))
    with pytest.raises(RuntimeError, match="runs on CPUs only"):
        layer.to(device)(torch.randn(5, 256, generator=gen).to(device))


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_weights_on_cuda_are_refused_at_start_up(device, scheme):
    with pytest.raises(ValueError, match=f"quantization {scheme} has no kernel on cuda"):
        Engine(EngineConfig(model="tiny", device=device, quantization=scheme))
