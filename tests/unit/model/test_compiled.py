"""The decoder stack through torch.compile (``replicas.model.compiled``) against eager: the same
greedy tokens in float32, batched and alone (bfloat16 is not promised: fused ops round once
where eager rounds after each); prefix caching changes nothing under compile either; a model
that fails to compile runs eager."""

import logging

import pytest
import torch
import torch._dynamo.utils

from cluster import LLM, SamplingParams
from replicas.model import compiled

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PREFIX = "The lighthouse keeper climbed the stairs at dusk and lit the lamp. "
PROMPTS = [PREFIX + "Then", PREFIX + "A ship appeared on the horizon and", "Hello"]


def tokens(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def eager_and_compiled():
    eager = LLM("tiny", dtype="float32", seed=3)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    fast = LLM("tiny", dtype="float32", seed=3, torch_compile=True)
    yield eager, fast, graphs_before
    eager.shutdown()
    fast.shutdown()


def test_compiled_gives_the_eager_tokens_batched_and_alone(eager_and_compiled):
    eager, fast, graphs_before = eager_and_compiled
    assert tokens(fast, PROMPTS) == tokens(eager, PROMPTS)  # one batch, three token counts
    for prompt in PROMPTS:  # alone: a decode step of one token
        assert tokens(fast, [prompt]) == tokens(eager, [prompt])
    model = fast.engine.loaded.model
    assert model.compiled is not None and model.compiled.failed is None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before


def test_prefix_caching_changes_nothing_under_compile(eager_and_compiled):
    _, fast, _ = eager_and_compiled
    fast.reset_prefix_cache("all")
    cold = fast.generate(PROMPTS[1], GREEDY)
    assert cold.num_cached_tokens == 0
    warm = fast.generate(PROMPTS[1], GREEDY)  # the prefix from the cache, the rest computed
    assert warm.num_cached_tokens > 0
    assert list(warm.token_ids) == list(cold.token_ids)


def test_a_model_that_fails_to_compile_runs_eager(monkeypatch, caplog):
    def broken(fn, **options):
        def run(*args):
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(compiled.torch, "compile", broken)
    eager = LLM("tiny", dtype="float32", seed=5)
    with caplog.at_level(logging.WARNING, logger=compiled.__name__):
        fallback = LLM("tiny", dtype="float32", seed=5, torch_compile=True)
        assert tokens(fallback, PROMPTS) == tokens(eager, PROMPTS)
    assert "no C++ compiler" in fallback.engine.loaded.model.compiled.failed
    assert "runs eager" in caplog.text
    eager.shutdown()
    fallback.shutdown()


def test_inductors_cache_is_kept_per_cpu_capability_unless_the_user_names_one(monkeypatch):
    """Inductor's cache keys omit the vector ISA: kernels built under one CPU capability must
    not be loaded under another (they gave every token 0 under ATEN_CPU_CAPABILITY=avx2)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = default_cache_dir()
    capability = torch.backends.cpu.get_cpu_capability().lower()
    for before in (None, default):
        if before is None:
            monkeypatch.delenv(compiled.CACHE_DIR_ENV, raising=False)
        else:
            monkeypatch.setenv(compiled.CACHE_DIR_ENV, before)
        compiled._cache_dir_per_cpu_capability()
        assert compiled.os.environ[compiled.CACHE_DIR_ENV].endswith(f"strata-{capability}")
    monkeypatch.setenv(compiled.CACHE_DIR_ENV, "/somewhere/mine")
    compiled._cache_dir_per_cpu_capability()
    assert compiled.os.environ[compiled.CACHE_DIR_ENV] == "/somewhere/mine"
