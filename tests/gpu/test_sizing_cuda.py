"""GPU defaults: the NPU pool sized from the HBM left after the weights (replicas.kv.sizing),
dtype auto as bfloat16 with no float32 copy, quantized GGUF weights dequantized at load, and
autotune timings synchronized and kept across restarts on the device."""

import pytest
import torch

from replicas.config import EngineConfig, SchedulerConfig
from replicas.engine.engine import Engine
from replicas.kv.capacity import kv_cache_specs
from replicas.kv.sizing import device_memory, size_npu_pool
from replicas.model import load_model
from replicas.model.autotune import Candidate, time_model, tune
from replicas.model.builtin import BUILTIN_MODEL_ARGS, build_builtin_model
from replicas.model.resolve import packaged_model_path
from tests.gpu.devices import CUDA_ONLY


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_the_engine_sizes_its_pool_from_the_gpus_free_memory(device):
    config = EngineConfig(
        model="tiny", device=device, scheduler_config=SchedulerConfig(max_num_seqs=4)
    )
    engine = Engine(config)
    # The tiny model's pool is capped at max_num_seqs full contexts of 16384 tokens.
    assert engine.num_npu_blocks == 4 * 16384 // 16 and engine.max_model_len == 16384
    args = BUILTIN_MODEL_ARGS["tiny"]()
    memory = device_memory(torch.device(device))
    assert memory.kind == "cuda" and 0 < memory.free_bytes <= memory.total_bytes
    # Without the cap, what the rule gives for an 8B model's weights on this device.
    config = EngineConfig(dtype="bfloat16", max_model_len=16384)
    specs = kv_cache_specs(args, "bfloat16")
    pool = size_npu_pool(memory, args, specs, config, weights_bytes=16 * 10**9)
    assert pool.num_blocks >= 1 and "cuda memory" in pool.reason


def _smollm2_path():
    try:
        return packaged_model_path("smollm2-135m")
    except ValueError as error:
        pytest.skip(str(error))


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_a_quantized_gguf_file_loads_as_bfloat16_with_auto_on_cuda(device):
    loaded = load_model(str(_smollm2_path()), torch.device(device), "auto", quantization="auto")
    assert loaded.dtype == torch.bfloat16 and loaded.quantization == "none"
    assert loaded.auto is None  # nothing timed: the device decided
    weights = loaded.model.tok_embeddings.weight
    assert weights.device.type == "cuda" and weights.dtype == torch.bfloat16


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_autotune_on_cuda_measures_synchronized_and_keeps_its_choice(device, tmp_path):
    def build(candidate: Candidate):
        dtype = getattr(torch, candidate.dtype)
        return build_builtin_model("tiny", 0).to(device=device, dtype=dtype).eval()

    prefill, decode = time_model(build(Candidate("bfloat16", "none")), torch.bfloat16)
    assert 0 < prefill < 1 and 0 < decode < 1
    options = [Candidate("float32", "none"), Candidate("bfloat16", "none")]
    cache = tmp_path / "choices.json"
    first = tune(options, build, "key", cache, device_type="cuda")
    assert first.source == "measured"  # a GPU process's CPU share never counts as busy
    again = tune(options, build, "key", cache, device_type="cuda")
    assert again.source == "cached" and again.candidate == first.candidate
