"""The CUDA engine's own path on a GPU: the paged attention kernels compiled (against the
float64 reference, at contexts long enough to split), and the engine with decode CUDA graphs
and without them giving the CPU's greedy outputs, prefix hits included."""

import random

import pytest
import torch

from cluster import LLM, PrefixCacheConfig, SamplingParams, SchedulerConfig
from replicas.model.paged_attention import paged_attention
from tests.gpu.devices import CUDA_ONLY
from tests.unit.model.test_paged_attention import _case, _meta, _reference

pytest.importorskip("triton")

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize(
    ("fmt_name", "dtype", "window", "splits", "tolerance"),
    [
        ("auto", torch.bfloat16, None, 1, 2e-2),
        ("auto", torch.bfloat16, None, 8, 2e-2),
        ("auto", torch.float32, None, 4, 1e-4),
        ("int8", torch.bfloat16, None, 4, 2e-2),
        ("fp8_e4m3", torch.bfloat16, 300, 2, 2e-2),
    ],
)
def test_kernels_match_the_float64_reference(device, fmt_name, dtype, window, splits, tolerance):
    seq_lens, q_lens = [3000, 70, 1100, 400], [1, 1, 130, 400]
    fmt, cache, table, keys, q, k, v, slots = _case(
        seq_lens, q_lens, 32, 8, 128, fmt_name, dtype, seed=1
    )
    meta = _meta(fmt, table, seq_lens, q_lens, slots, window, splits, q, 8)
    for name in ("slot_mapping", "block_table", "seq_lens", "query_start"):
        setattr(meta, name, getattr(meta, name).to(device))
    meta.decode_seqs = meta.decode_seqs.to(device)
    meta.prefill_tiles = meta.prefill_tiles.to(device)
    out = paged_attention(q.to(device), k.to(device), v.to(device), cache.to(device), 1, meta)
    expected = _reference(q, keys, seq_lens, q_lens, window)
    torch.testing.assert_close(out.cpu().double(), expected, atol=tolerance, rtol=tolerance)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(150)]
    return [[*shared, *(rng.randrange(256) for _ in range(n))] for n in (3, 40, 90, 7, 200)]


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize(
    ("model", "kv_cache_dtype"),
    [("tiny", "auto"), ("tiny", "int8"), ("tiny-hybrid", "auto"), ("tiny-hybrid", "fp8_e4m3")],
)
def test_engine_on_cuda_gives_the_cpu_greedy_outputs(device, model, kv_cache_dtype):
    """float32 weights: graphs, eager launches and the CPU agree token for token; the second
    pass over the prompts hits the prefix cache on the GPU."""
    prompts = _prompts(3)
    cold = SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False))
    cpu = LLM(model, device="cpu", kv_cache_dtype=kv_cache_dtype, scheduler_config=cold)
    expected = [o.token_ids for o in cpu.generate(prompts, GREEDY)]
    for cuda_graphs in (True, False):
        llm = LLM(model, device=device, kv_cache_dtype=kv_cache_dtype, cuda_graphs=cuda_graphs)
        assert (llm.engine.runner.graphs is not None) == cuda_graphs
        for _ in range(2):
            outputs = llm.generate(prompts, GREEDY)
            assert [o.token_ids for o in outputs] == expected
        assert sum(o.num_cached_tokens for o in outputs) > 0
        llm.check_integrity()
