"""Quantized KV (``kv_cache_dtype`` int8 and fp8_e4m3) on the GPU: the same bytes as on the CPU,
attention over a quantized cache as on the CPU (one chunk and many), and an engine whose
host reloads give the cold output."""

import random

import pytest
import torch

from cluster import LLM, KVOffloadConfig, PrefixCacheConfig, SamplingParams, SchedulerConfig
from replicas.kv.events import Tier
from replicas.model.attention import AttentionMetadata, cached_attention
from replicas.model.kv_format import KV_FORMATS
from tests.gpu.devices import CUDA_ONLY, DEVICES
from tests.gpu.test_model_cuda import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, _batch, _to

SCALED = ["int8", "fp8_e4m3"]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("name", SCALED)
def test_quantize_on_cuda_gives_the_cpu_bytes(device, name):
    fmt = KV_FORMATS[name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, HEAD_DIM, generator=gen) * torch.logspace(-4, 3, 4096)[:, None]
    x[0] = 0
    on_cpu = fmt.quantize(x)
    on_gpu = fmt.quantize(x.to(device))
    assert on_gpu.dtype == torch.uint8
    assert torch.equal(on_gpu.cpu(), on_cpu)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(fmt.dequantize(on_gpu, dtype).cpu(), fmt.dequantize(on_cpu, dtype))


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("name", SCALED)
def test_attention_over_a_quantized_cache_on_cuda_equals_the_cpu(device, name):
    """Contexts of 3000 tokens read in chunks, shorter ones in one; decodes and prefills."""
    fmt = KV_FORMATS[name]
    gen = torch.Generator().manual_seed(0)
    num_blocks = 400
    values = torch.randn(num_blocks * 2 * 2 * BLOCK_SIZE * KV_HEADS, HEAD_DIM, generator=gen)
    cache = fmt.quantize(values).view(num_blocks, 2, 2, BLOCK_SIZE, KV_HEADS, -1)
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
    outs, caches = [], []
    for where in ("cpu", device):
        b = _to(batch, where)
        meta = AttentionMetadata.build(b, "full", BLOCK_SIZE, None, kv_format=fmt)
        c = cache.clone().to(where)
        outs.append(cached_attention(q.to(where), k.to(where), v.to(where), c, 1, meta).cpu())
        caches.append(c.cpu())
    assert torch.equal(caches[1], caches[0])  # the new tokens' rows: the same bytes
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", SCALED)
def test_host_reloads_of_quantized_blocks_give_the_cold_output(device, name):
    rng = random.Random(1)
    prefix = [rng.randrange(256) for _ in range(200)]
    prompt = [*prefix, 1, 2, 3]
    cold = SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False))
    options = {"device": device, "dtype": "float32", "kv_cache_dtype": name}
    reference = LLM("tiny", scheduler_config=cold, **options).generate(prompt, GREEDY)
    offload = KVOffloadConfig(enabled=True, host_memory_ratio=2.0, write_through_threshold=1)
    llm = LLM(
        "tiny",
        num_npu_blocks=40,
        scheduler_config=SchedulerConfig(kv_offload_config=offload),
        **options,
    )
    assert llm.engine.runner.kv_caches["full"].dtype == torch.uint8
    llm.generate([*prefix, 9], GREEDY)
    llm.generate([*prefix, 8], GREEDY)  # first later hit: promoted to host
    for i in range(5):  # unrelated traffic pushes the prefix out of the NPU tier
        llm.generate([rng.randrange(256) for _ in range(180)] + [i], GREEDY)
    output = llm.generate(prompt, GREEDY)
    assert output.num_cached_tokens_in(Tier.HOST) == 192
    assert output.token_ids == reference.token_ids
    llm.check_integrity()
