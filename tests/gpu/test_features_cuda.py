"""Every request feature on a GPU against a CPU run (``tests/fake_cuda_mix.py``, the mix the
fake-CUDA CI tests send), float32: greedy requests give the CPU's tokens with close logprobs
through the host tier, n-gram drafts, 8-bit KV and hybrid attention; sampled requests draw from
CUDA generators (another stream than the CPU's), so they are checked by what must hold on any
device: a seed gives the same tokens whatever else is in the batch, each token's logprob is the
CPU model's score of the sequence, and structured outputs follow their grammar."""

import pytest
import torch

from cluster import LLM
from replicas.engine.structured_output import GrammarCompiler
from replicas.model.perplexity import sequence_logits
from tests.fake_cuda_mix import assert_same_outputs, feature_mix, host_tier_llm, run_mix
from tests.gpu.devices import CUDA_ONLY

LOGPROB_TOL = 1e-3  # float32 on two devices: other kernels, other rounding
GREEDY = ("greedy", "spec", "prompt_logprobs", "greedy_penalties", "min_tokens", "greedy_logprobs")
SAMPLED = ("top_p_k", "top_p", "top_k", "logprobs", "penalties", "logit_bias", "n")
STRUCTURED = ("json", "regex", "choice", "tool_call")


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize(
    "model, kv_cache_dtype",
    [("tiny", "auto"), ("tiny", "int8"), ("tiny-hybrid", "fp8_e4m3")],
    ids=str,
)
def test_greedy_features_on_cuda_equal_the_cpu(device, model, kv_cache_dtype):
    want = run_mix(host_tier_llm(model, "cpu", kv_cache_dtype=kv_cache_dtype), GREEDY)
    got = run_mix(host_tier_llm(model, device, kv_cache_dtype=kv_cache_dtype), GREEDY)
    assert_same_outputs(got.first, want.first, LOGPROB_TOL)
    assert_same_outputs(got.reloaded, want.reloaded, LOGPROB_TOL)
    assert got.num_host_hits == want.num_host_hits > 0
    assert got.num_accepted_drafts == want.num_accepted_drafts  # the same greedy tokens
    assert got.num_accepted_drafts > 0 or model != "tiny"


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_sampled_features_on_cuda_are_seeded_scored_and_structured(device):
    llm = host_tier_llm("tiny", device)
    mix = [m for m in feature_mix() if m[0] in SAMPLED + STRUCTURED]
    first = llm.generate([p for _, p, _ in mix], [s for _, _, s in mix])
    alone = [llm.generate(p, s) for _, p, s in mix]  # another batch: the seeds decide alone
    reference = LLM("tiny", device="cpu", dtype="float32").engine.loaded.model
    compiler = GrammarCompiler(llm.tokenizer, llm.tokenizer.vocab_size)
    for (name, prompt, params), out, again in zip(mix, first, alone, strict=True):
        choices, repeats = (out, again) if isinstance(out, list) else ([out], [again])
        assert len(choices) == params.n
        for choice, repeat in zip(choices, repeats, strict=True):
            assert choice.token_ids == repeat.token_ids, name
            if params.logprobs is not None:
                assert_scored_as_on_the_cpu(reference, llm.tokenizer.vocab_size, prompt, choice)
            if params.structured_outputs is not None:
                matcher = compiler.matcher(params.structured_outputs)
                for token in choice.token_ids:
                    matcher.accept(token)  # raises on a token the grammar forbids
    llm.check_integrity()


def assert_scored_as_on_the_cpu(model, vocab_size: int, prompt: list[int], output) -> None:
    """Each generated token's logprob is the CPU model's log-softmax score of it after the
    tokens before it (sampling never changes the logprobs reported)."""
    tokens = prompt + output.token_ids
    logits = sequence_logits(model, tokens)[len(prompt) - 1 : -1, :vocab_size]
    scores = torch.log_softmax(logits, dim=-1)
    for i, logprob in enumerate(output.logprobs):
        assert logprob.logprob == pytest.approx(scores[i, logprob.token_id].item(), abs=1e-3)
