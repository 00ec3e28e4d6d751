"""Every request feature through ``device="cuda"`` on the fake CUDA device (STRATA_FAKE_CUDA)
gives what the CPU gives: the CUDA code path (direct host-tier copies on side streams, SDPA
attention, device-side sampling) runs with a GPU's device checks, so a CPU tensor that reaches
a CUDA op fails here as it would on a GPU."""

import json

import pytest
import torch

from replicas import fake_cuda
from replicas.config import EngineConfig
from replicas.engine.engine import Engine
from replicas.engine.structured_output import StructuredOutputs
from replicas.fake_cuda import FakeCudaTensor
from replicas.resume import ResumeState
from replicas.sampling_params import SamplingParams
from tests.fake_cuda_mix import SCHEMA, assert_same_outputs, host_tier_llm, run_mix

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a real CUDA device is here")
LOGPROB_TOL = 1e-4  # the CUDA path attends with SDPA, the CPU one with its own kernel


@pytest.fixture
def fake_env(monkeypatch):
    """STRATA_FAKE_CUDA=1 for the test, the fake device off after it; one torch thread (the
    tiny model's ops are too small to share, and a busy machine's spinning threads would
    multiply the test's time)."""
    monkeypatch.setenv(fake_cuda.ENV, "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    fake_cuda.deactivate()


def assert_on_fake_cuda(engine: Engine) -> None:
    assert fake_cuda.is_active() and engine.device.type == "cuda"
    assert all(isinstance(c, FakeCudaTensor) for c in engine.runner.kv_caches.values())
    assert engine.transfer is not None and engine.transfer.is_cuda and engine.transfer.streamed


def test_every_feature_on_cuda_equals_the_cpu(fake_env):
    want = run_mix(host_tier_llm("tiny", "cpu"))
    llm = host_tier_llm("tiny", "cuda")
    assert_on_fake_cuda(llm.engine)
    got = run_mix(llm)
    assert_same_outputs(got.first, want.first, LOGPROB_TOL)
    assert_same_outputs(got.reloaded, want.reloaded, LOGPROB_TOL)
    assert got.num_host_hits == want.num_host_hits > 0
    assert got.num_accepted_drafts == want.num_accepted_drafts > 0


@pytest.mark.parametrize(
    "model, kv_cache_dtype", [("tiny", "int8"), ("tiny-hybrid", "fp8_e4m3")], ids=str
)
def test_quantized_kv_and_hybrid_attention_on_cuda_equal_the_cpu(fake_env, model, kv_cache_dtype):
    names = ("greedy", "spec", "top_p_k", "logprobs", "penalties")
    want = run_mix(host_tier_llm(model, "cpu", kv_cache_dtype=kv_cache_dtype), names)
    llm = host_tier_llm(model, "cuda", kv_cache_dtype=kv_cache_dtype)
    assert_on_fake_cuda(llm.engine)
    got = run_mix(llm, names)
    assert_same_outputs(got.first, want.first, LOGPROB_TOL)
    assert_same_outputs(got.reloaded, want.reloaded, LOGPROB_TOL)
    assert got.num_host_hits == want.num_host_hits > 0


def _run(engine: Engine, params: SamplingParams, resumed: ResumeState | None = None) -> list:
    engine.add_request("r", list(range(5, 25)), params, resumed=resumed)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == "r"]
    engine.check_integrity()
    return outputs


def test_a_resumed_request_on_cuda_continues_as_on_the_cpu(fake_env):
    """Resumed after 5 tokens with a grammar, penalties and logprobs, a greedy request ends as
    its uninterrupted CPU run does (a sampled one would draw anew from its seed)."""
    params = SamplingParams(
        max_tokens=12,
        logprobs=2,
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA)),
    )
    engines = {
        device: Engine(EngineConfig(model="tiny", device=device, num_npu_blocks=32))
        for device in ("cpu", "cuda")
    }
    whole = _run(engines["cpu"], params)
    cut = next(o for o in whole if len(o.token_ids) == 5)
    resumed = _run(engines["cuda"], params, ResumeState.of(cut))
    assert engines["cuda"].device.type == "cuda"
    assert all(isinstance(c, FakeCudaTensor) for c in engines["cuda"].runner.kv_caches.values())
    assert resumed[-1].token_ids[:5] == cut.token_ids and len(resumed[-1].token_ids) > 5
    assert_same_outputs([resumed[-1]], [whole[-1]], LOGPROB_TOL)
