"""One request mix with every sampling feature, run on a device and compared with a CPU run.

Shared by the fake-CUDA CI tests (``tests/unit/test_fake_cuda_engine.py``) and the real CUDA
tests (``tests/gpu/test_features_cuda.py``): the same requests, the same comparison.
"""

import json
import math
from typing import NamedTuple

from cluster import LLM, KVOffloadConfig, SamplingParams, SchedulerConfig
from cluster.api.tools.hermes import HermesFormat
from replicas.engine.structured_output import StructuredOutputs
from replicas.outputs import RequestOutput

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}}
TOOL_GRAMMAR = HermesFormat().grammar(
    [("get_weather", WEATHER)], is_required=True, is_parallel=False
)
STRUCTURED = {
    "json": StructuredOutputs(json=json.dumps(SCHEMA)),
    "regex": StructuredOutputs(regex="[a-c]{2,4}-[0-9]{2}"),
    "choice": StructuredOutputs(choice=("red", "green", "blue")),
    "tool_call": StructuredOutputs(grammar=TOOL_GRAMMAR),
}
LOOP = [40, 41, 42, 43, 44, 45, 46, 47] * 5  # repetitive: n-gram drafts are proposed and accepted


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 37 + i * 11) % 250 + 3 for i in range(length)]


def feature_mix(max_tokens: int = 8) -> list[tuple[str, list[int], SamplingParams]]:
    """``(name, prompt, params)`` of one batch that uses every sampling feature (``n`` and
    unseeded sampling included: two runs of the same batch draw alike)."""
    sampled = dict(temperature=0.9, max_tokens=max_tokens, ignore_eos=True)
    structured = dict(max_tokens=10, temperature=0.7, seed=5)
    return [
        ("greedy", _prompt(1, 40), SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
        ("spec", LOOP, SamplingParams(max_tokens=12, ignore_eos=True)),
        ("top_p_k", _prompt(2, 20), SamplingParams(**sampled, seed=11, top_p=0.8, top_k=40)),
        ("top_p", _prompt(3, 24), SamplingParams(**sampled, seed=12, top_p=0.5)),
        ("top_k", _prompt(4, 18), SamplingParams(**sampled, seed=13, top_k=3)),
        ("logprobs", _prompt(5, 30), SamplingParams(**sampled, seed=14, logprobs=3)),
        (
            "prompt_logprobs",
            _prompt(6, 21),
            SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2, logprobs=0),
        ),
        (
            "penalties",
            _prompt(7, 26),
            SamplingParams(
                **sampled,
                seed=15,
                presence_penalty=0.8,
                frequency_penalty=0.6,
                repetition_penalty=1.3,
            ),
        ),
        (
            "greedy_penalties",
            _prompt(8, 19),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, repetition_penalty=1.5),
        ),
        (
            "logit_bias",
            _prompt(9, 22),
            SamplingParams(**sampled, seed=16, logit_bias={65: 8.0, 66: 6.5, 67: -100.0}),
        ),
        ("min_tokens", _prompt(10, 17), SamplingParams(max_tokens=6, min_tokens=5, seed=17)),
        ("n", _prompt(15, 20), SamplingParams(**sampled, seed=18, n=2, logprobs=1)),
        ("greedy_logprobs", _prompt(16, 20), SamplingParams(max_tokens=4, logprobs=2)),
        ("unseeded", _prompt(17, 20), SamplingParams(max_tokens=4, temperature=0.8, top_k=20)),
    ] + [
        (name, _prompt(20 + j, 16), SamplingParams(structured_outputs=spec, **structured))
        for j, (name, spec) in enumerate(STRUCTURED.items())
    ]


def host_tier_llm(model: str, device: str, **options: object) -> LLM:
    """``model`` on ``device`` with a small NPU pool, the host tier on (written through at once)
    and n-gram speculative decoding."""
    return LLM(
        model,
        device=device,
        dtype="float32",
        num_npu_blocks=64,
        scheduler_config=SchedulerConfig(
            speculative_ngram=4,
            kv_offload_config=KVOffloadConfig(
                enabled=True, host_memory_ratio=4.0, write_through_threshold="immediate"
            ),
        ),
        **options,
    )


class MixRun(NamedTuple):
    first: list  # per request of ``feature_mix``: a RequestOutput (a list of them when n > 1)
    reloaded: list[RequestOutput]  # greedy follow-ups whose prefixes come back from the host
    num_host_hits: int
    num_accepted_drafts: int


def run_mix(llm: LLM, names: tuple[str, ...] | None = None) -> MixRun:
    """The mix (its requests named in ``names``, or all) as one batch, then greedy follow-ups of
    every prompt after the NPU cache is dropped (their prefixes load back from the host tier)."""
    mix = [m for m in feature_mix() if names is None or m[0] in names]
    first = llm.generate([p for _, p, _ in mix], [s for _, _, s in mix])
    llm.reset_prefix_cache("npu")
    follow = SamplingParams(max_tokens=4, ignore_eos=True)
    reloaded = llm.generate([p + [7, 8] for _, p, _ in mix], follow)
    stats = llm.stats()
    llm.check_integrity()
    return MixRun(
        first,
        reloaded,
        sum(o.num_cached_tokens for o in reloaded),
        stats.spec_decode.num_accepted_tokens,
    )


def assert_same_outputs(got: list, want: list, logprob_tol: float) -> None:
    """Same tokens, text and finish reasons; logprobs within ``logprob_tol``."""
    for g, w in zip(got, want, strict=True):
        if isinstance(w, list):
            assert_same_outputs(g, w, logprob_tol)
            continue
        assert g.token_ids == w.token_ids, (g.request_id, g.token_ids, w.token_ids)
        assert g.text == w.text and g.finish_reason == w.finish_reason
        assert _logprobs(g.logprobs) == _approx(_logprobs(w.logprobs), logprob_tol)
        assert _prompt_logprobs(g) == _approx(_prompt_logprobs(w), logprob_tol)


def _logprobs(logprobs: list | None) -> list:
    if logprobs is None:
        return []
    return [(lp.token_id, lp.logprob, *(x for pair in lp.top for x in pair)) for lp in logprobs]


def _prompt_logprobs(output: RequestOutput) -> list:
    return _logprobs([lp for lp in output.prompt_logprobs or [] if lp is not None])


class _Close:
    def __init__(self, value: float, tol: float) -> None:
        self.value, self.tol = value, tol

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (int, float)) and math.isclose(other, self.value, abs_tol=self.tol)

    def __repr__(self) -> str:
        return f"{self.value}±{self.tol}"


def _approx(rows: list, tol: float) -> list:
    """Token ids exact, floats within ``tol``."""
    return [tuple(x if isinstance(x, int) else _Close(x, tol) for x in row) for row in rows]
