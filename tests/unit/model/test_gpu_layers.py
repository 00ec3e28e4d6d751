"""The GPU's decoder stack (fused elementwise kernels, paged attention, the one-copy batch
builder) against the eager stack, run by Triton's interpreter on the CPU: the same hidden states
and the same cache rows, for decodes and prefill chunks, a sliding window and an 8-bit cache."""

import random

import pytest
import torch

pytest.importorskip("triton")

from replicas.engine.cuda_batch import CudaBatchBuilder, HostBatch, geometries
from replicas.model import load_model
from replicas.model.batch import ForwardBatch
from replicas.model.fusion import fuse_projections
from replicas.model.gpu_layers import add_rms_norm, silu_mul

BLOCK_SIZE = 16
CPU = torch.device("cpu")


def _host(seq_lens: list[int], q_lens: list[int], groups: list[str], seed: int) -> HostBatch:
    rng = random.Random(seed)
    host = HostBatch([], [], [0], [], [], {g: [] for g in groups}, [], 0)
    next_block = 1
    for seq_len, q_len in zip(seq_lens, q_lens, strict=True):
        count = -(-seq_len // BLOCK_SIZE)
        blocks = list(range(next_block, next_block + count))
        rng.shuffle(blocks)
        next_block += count
        span = range(seq_len - q_len, seq_len)
        host.input_ids += [rng.randrange(256) for _ in span]
        host.positions += list(span)
        host.query_start_loc.append(host.query_start_loc[-1] + q_len)
        host.seq_lens.append(seq_len)
        host.block_rows.append({g: blocks for g in groups})
        for g in groups:
            host.slots[g] += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in span]
        host.logits_indices.append(host.query_start_loc[-1] - 1)
    return host


def _eager_batch(host: HostBatch) -> ForwardBatch:
    width = max(len(r) for b in host.block_rows for r in b.values())
    long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    groups = list(host.slots)
    return ForwardBatch(
        input_ids=long(host.input_ids),
        positions=long(host.positions),
        query_start_loc=host.query_start_loc,
        seq_lens=host.seq_lens,
        block_tables={g: long([b[g] + [0] * (width - len(b[g])) for b in host.block_rows])
                      for g in groups},
        slot_mapping={g: long(host.slots[g]) for g in groups},
        logits_indices=long(host.logits_indices),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("model", "kv_cache_dtype", "tolerance"),
    [("tiny-hybrid", "auto", 2e-5), ("tiny", "int8", 1e-3)],
)
def test_gpu_stack_matches_eager(model, kv_cache_dtype, tolerance):
    """Two forwards (prompts, then a decode and a chunk after them) through each stack, each
    over its own cache: equal hidden states and cache rows (float32: to rounding; an 8-bit
    cache's rows are read in another order of products)."""
    loaded = load_model(model, CPU, "float32", decoder_stack="eager")
    net = loaded.model
    specs = net.kv_cache_specs(torch.float32, kv_cache_dtype)
    fmt = next(iter(specs.values())).kv_format
    caches = [{g: torch.zeros(s.shape(40, BLOCK_SIZE), dtype=s.storage_dtype)
               for g, s in specs.items()} for _ in range(2)]  # fmt: skip
    geometry = geometries(specs, net.args.num_heads // net.args.num_kv_heads)
    builder = CudaBatchBuilder(geometry, BLOCK_SIZE, CPU, num_sms=4)
    steps = [([20, 8], [20, 8], 0), ([21, 20], [1, 12], 1)]
    eager_out = []
    for seq_lens, q_lens, seed in steps:
        host = _host(seq_lens, q_lens, list(specs), seed)
        with torch.inference_mode():
            eager_out.append(net(_eager_batch(host), caches[0], fmt))
    fuse_projections(net)
    for (seq_lens, q_lens, seed), expected in zip(steps, eager_out, strict=True):
        host = _host(seq_lens, q_lens, list(specs), seed)
        with torch.inference_mode():
            hidden = net(builder.build(host), caches[1], fmt)
        torch.testing.assert_close(hidden, expected, atol=tolerance, rtol=tolerance)
    for group in specs:
        written = caches[0][group].view(torch.uint8) != 0
        assert written.any()
        if fmt.is_quantized:  # the same torch quantization of (nearly) the same values
            assert (caches[0][group] != caches[1][group]).float().mean() < 0.01
        else:
            torch.testing.assert_close(caches[1][group], caches[0][group], atol=2e-5, rtol=2e-5)


def test_fused_elementwise_kernels_round_as_eager_ops():
    """To one bfloat16 step: the interpreter narrows float32 by truncating where a GPU and
    torch round to nearest."""
    generator = torch.Generator().manual_seed(0)
    x, residual = torch.randn((2, 5, 96), generator=generator).to(torch.bfloat16)
    norm = torch.nn.Module()
    norm.weight, norm.eps = torch.randn(96, generator=generator).to(torch.bfloat16), 1e-6
    total, normed = add_rms_norm(x, residual, norm)
    expected_total = x + residual
    expected = norm.weight * torch.nn.functional.rms_norm(total, (96,), eps=1e-6)
    torch.testing.assert_close(total, expected_total, atol=0, rtol=2**-7)
    torch.testing.assert_close(normed, expected, atol=0, rtol=2**-6)  # two truncations
    gate_up = torch.randn((5, 2 * 48), generator=generator).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(
        silu_mul(gate_up), torch.nn.functional.silu(gate) * up, atol=0, rtol=2**-6
    )
