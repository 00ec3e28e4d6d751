"""Speculative decoding by n-gram lookup.

First on the real scheduler, cache and update loop with a scripted model (each request's next
token at each position is fixed, served as one-hot logits through the real sampler): exact
drafts, acceptances and block counts. Then on the built-in model against decoding without
drafts, with the prefix cache and the host tier on.
"""

import math
import random
from typing import NamedTuple

import pytest
import torch

from cluster import LLM, KVOffloadConfig, PrefixCacheConfig, SamplingParams, SchedulerConfig
from replicas.engine.core import EngineCore, StepResult
from replicas.engine.ngram_proposer import BACKOFF_DRAFT_LEN, MAX_DRAFT_INTERVAL
from replicas.engine.request import Request
from replicas.engine.sampler import Sampler
from replicas.engine.scheduler import SchedulerOutput
from replicas.kv.events import Tier
from replicas.kv.manager import KVCacheManager

BS = 4
VOCAB = 64
CYCLE = list(range(10, 19))  # 9 tokens, repeated: every draft after the first lap is right


class Seen(NamedTuple):
    """A scheduled request as the executor saw it (before the step's update)."""

    request_id: str
    num_tokens: int
    num_new_tokens: int
    draft_token_ids: tuple[int, ...]


class ScriptedExecutor:
    """A model whose choice after position ``p`` of a request is ``scripts[id][p + 1]``,
    whatever the tokens before (the sampler verifies drafts against it as against logits).
    Logit rows are laid out as the model runner lays them out: one per sampled request, then
    one per draft token. Records every step's scheduled requests."""

    def __init__(self, scripts: dict[str, list[int]]) -> None:
        self.scripts = scripts
        self.sampler = Sampler(0, torch.device("cpu"))
        self.steps: list[list[Seen]] = []

    def execute(self, output: SchedulerOutput) -> StepResult:
        self.steps.append(
            [
                Seen(
                    s.request.request_id, s.request.num_tokens, s.num_new_tokens, s.draft_token_ids
                )
                for s in output.scheduled
            ]
        )
        sampled = [s for s in output.scheduled if s.is_sampled]
        rows = [self.scripts[s.request.request_id][s.request.num_tokens] for s in sampled]
        for s in sampled:
            script, first = self.scripts[s.request.request_id], s.request.num_tokens
            rows += script[first + 1 : first + 1 + len(s.draft_token_ids)]
        logits = torch.nn.functional.one_hot(torch.tensor(rows, dtype=torch.long), VOCAB).float()
        requests = [s.request for s in sampled]
        token_ids, _ = self.sampler.sample(logits[: len(sampled)], requests)
        drafts = [s.draft_token_ids for s in sampled]
        extra = self.sampler.verify_drafts(logits[len(sampled) :], token_ids, drafts)
        return StepResult(requests, token_ids, None, (), extra)

    def release(self, request_id: str) -> None:
        return


def make_core(
    scripts: dict[str, list[int]],
    num_blocks: int = 64,
    k: int = 4,
    max_model_len: int = 200,
    budget: int = 64,
) -> tuple[EngineCore, ScriptedExecutor]:
    config = SchedulerConfig(speculative_ngram=k, max_num_batched_tokens=budget)
    executor = ScriptedExecutor(scripts)
    core = EngineCore(config, KVCacheManager(num_blocks, BS), executor, max_model_len=max_model_len)
    return core, executor


def add(core: EngineCore, request_id: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = Request(request_id, prompt, params, BS)
    core.add(request)
    return request


def run(core: EngineCore) -> list[list[int]]:
    """Step until done, checking the pools after every step and that each decoding request
    has all but its last token computed. Returns each step's new tokens per request."""
    chunks = []
    while core.has_unfinished_requests():
        before = {r.request_id: r.num_output_tokens for r in core.scheduler.running}
        for request in core.step():
            chunks.append(request.output_token_ids[before.get(request.request_id, 0) :])
        for request in core.scheduler.running:
            if request.num_output_tokens:
                assert request.num_computed_tokens == request.num_tokens - 1
        core.kv_cache.check_integrity()
    return chunks


def test_a_cycle_is_drafted_and_accepted_to_max_tokens():
    script = CYCLE * 6
    core, executor = make_core({"a": script})
    request = add(core, "a", script[:11], max_tokens=13)
    chunks = run(core)
    assert request.output_token_ids == script[11:24]
    # prefill: 1 token; then 4 drafts + 1 each step; the last step drafts only what
    # max_tokens leaves room for (13 - 11 - 1 = 1)
    assert chunks == [script[11:12], script[12:17], script[17:22], script[22:24]]
    assert [s.draft_token_ids for [s] in executor.steps] == [
        (),
        tuple(script[12:16]),
        tuple(script[17:21]),
        tuple(script[22:23]),
    ]
    assert core.spec_decode.num_draft_tokens == core.spec_decode.num_accepted_tokens == 9
    assert request.finish_reason == "length"
    # Freed; every full block of computed tokens (all but the last token) stays cached.
    manager = core.kv_cache
    assert manager.npu.num_used == 0
    assert manager.npu.num_cached == (request.num_tokens - 1) // BS == 5


def test_a_rejected_draft_keeps_the_models_token_and_caches_only_accepted_blocks():
    script = CYCLE * 6
    script[20] = 60  # the model leaves the cycle once, inside a draft
    core, executor = make_core({"a": script})
    request = add(core, "a", script[:11], max_tokens=20)
    chunks = run(core)
    assert request.output_token_ids == script[11:31]
    assert chunks[:3] == [script[11:12], script[12:17], script[17:21]]
    # step 3 drafted 18 10 11 12 (positions 17..20): 18 10 11 accepted, 12 rejected (the
    # model says 60 there), and 60 is the step's last token
    assert executor.steps[2][0].draft_token_ids == (18, 10, 11, 12)
    assert executor.steps[2][0].num_new_tokens == 5
    stats = core.spec_decode
    assert stats.num_draft_tokens - stats.num_accepted_tokens == 2
    # Later, a draft copies the 60 (the model says 12): rejected, and max_tokens leaves room
    # for 2 drafts there.
    assert [s.draft_token_ids for [s] in executor.steps] == [
        (),
        (13, 14, 15, 16),
        (18, 10, 11, 12),
        (),
        (),
        (15, 16, 17, 18),
        (11, 60),
        (),
    ]
    assert core.kv_cache.npu.num_used == 0 and core.kv_cache.npu.num_cached == 30 // BS
    # The cached blocks are those of the right tokens: a request with the same 28 tokens
    # finds 7 blocks (the last token always left to compute).
    again = add(core, "b", script[:29], max_tokens=1)
    core.executor.scripts["b"] = script
    run(core)
    assert again.num_cached_tokens == 28 and again.output_token_ids == [script[29]]


def test_drafts_stop_at_max_model_len_and_never_compute_past_it():
    script = CYCLE * 6
    core, executor = make_core({"a": script}, max_model_len=20)
    request = add(core, "a", script[:11], max_tokens=50)
    run(core)
    assert request.num_tokens == 20 and request.finish_reason == "length"
    assert request.output_token_ids == script[11:20]
    for [s] in executor.steps:
        assert s.num_tokens + len(s.draft_token_ids) <= 19  # the last position computed: 18
    assert executor.steps[-1][0].draft_token_ids  # bounded, not dropped


def test_drafts_leave_one_token_of_budget_to_each_running_request():
    a, b = CYCLE * 6, [40 + i for i in range(20)] * 3
    core, executor = make_core({"a": a, "b": b}, k=3, budget=4)
    add(core, "a", a[:11], max_tokens=6)
    add(core, "b", b[:3], max_tokens=6)
    run(core)
    for step in executor.steps:
        assert sum(s.num_new_tokens for s in step) <= 4
    # Once both decode, "a" drafts 2 (4 - its token - b's token), "b" nothing (no repeat).
    decoding = [step for step in executor.steps if len(step) == 2]
    assert decoding and all(
        len(sa.draft_token_ids) <= 2 and sb.draft_token_ids == () for sa, sb in decoding
    )
    assert any(len(sa.draft_token_ids) == 2 for sa, _ in decoding)


def test_no_block_for_the_drafts_means_a_plain_decode_not_a_preemption():
    a, b = CYCLE * 6, [40, 41, 42, 43, 44, 45, 46]
    core, executor = make_core({"a": a, "b": b}, num_blocks=5)
    add(core, "b", b[:4], max_tokens=2)  # admitted first: 1 block, then a second for its decode
    add(core, "a", a[:11], max_tokens=3)  # 3 blocks; position 11 ends its third
    run(core)
    second = executor.steps[1]
    assert [s.request_id for s in second] == ["b", "a"]
    assert second[1].draft_token_ids == () and second[1].num_new_tokens == 1
    assert core.num_preemptions == 0


def test_only_greedy_requests_without_logprobs_or_processing_are_drafted():
    script = CYCLE * 6
    core, executor = make_core({n: script for n in "abcd"})
    params = {
        "a": SamplingParams(max_tokens=8, ignore_eos=True),
        "b": SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1),
        "c": SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.1),
        "d": SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.5, seed=1),
    }
    for name, p in params.items():
        core.add(Request(name, script[:11], p, BS))
    run(core)
    drafted = {s.request_id for step in executor.steps for s in step if s.draft_token_ids}
    assert drafted == {"a"}


def first_draft_token(token_ids: list[int]) -> int | None:
    """What the lookup would propose first, by brute force: the token after the latest earlier
    occurrence of the last 3 tokens, else of the last 2."""
    for n in (3, 2):
        suffix = token_ids[-n:]
        ends = [e for e in range(n, len(token_ids)) if token_ids[e - n : e] == suffix]
        if len(token_ids) > n and ends:
            return token_ids[ends[-1]]
    return None


def test_a_request_whose_drafts_are_never_accepted_backs_off():
    """Three tokens only, so the last two have nearly always occurred before, and the model
    never says what followed them: every draft is rejected at its first token."""
    rng = random.Random(3)
    script = [rng.choice((20, 21, 22)) for _ in range(12)]
    while len(script) < 120:
        guess = first_draft_token(script)
        script.append(rng.choice([t for t in (20, 21, 22) if t != guess]))
    core, executor = make_core({"a": script})
    request = add(core, "a", script[:12], max_tokens=100)
    run(core)
    assert request.output_token_ids == script[12:112]
    assert core.spec_decode.num_accepted_tokens == 0
    # Each decode step adds one token; those whose lookup finds a draft (with room for one),
    # numbered from 1: only the 1st, 2nd, 4th, 8th, ... are verified, all but the first as probes.
    decodes = executor.steps[1:]
    found = [
        i
        for i, [s] in enumerate(decodes)
        if s.num_tokens < 12 + 99 and first_draft_token(script[: s.num_tokens]) is not None
    ]
    assert len(found) > 90
    drafted = [i for i, [s] in enumerate(decodes) if s.draft_token_ids]
    assert drafted == [found[j - 1] for j in (1, 2, 4, 8, 16, 32, 64)]
    assert len(drafted) <= math.log2(len(decodes)) + 1
    assert core.spec_decode.num_draft_tokens == 4 + BACKOFF_DRAFT_LEN * (len(drafted) - 1)
    assert core.scheduler.proposer.num_requests == 0


def test_a_finished_or_aborted_request_leaves_no_proposer_state():
    script = CYCLE * 6
    core, executor = make_core({"a": script, "b": script})
    add(core, "a", script[:11], max_tokens=30)
    add(core, "b", script[:11], max_tokens=3)
    for _ in range(3):
        core.step()
    assert any(s.draft_token_ids for step in executor.steps for s in step)
    assert core.scheduler.proposer.num_requests == 1  # "b" finished
    core.abort("a")
    assert core.scheduler.proposer.num_requests == 0


# ---- the built-in model ----------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def repeated_span(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(rng.randrange(8, 40))] * 3


LOOP = repeated_span(29)
"""A prompt after which the built-in model soon loops, so that drafts are accepted."""


def mixed_prompts() -> list[list[int]]:
    """Repeated spans (the built-in model loops after some, not after others) and random
    tokens."""
    rng = random.Random(1)
    return [repeated_span(s) for s in (29, 17, 0, 12, 2)] + [
        [rng.randrange(256) for _ in range(50)] for _ in range(2)
    ]


def host_tier(k: int, **kwargs) -> SchedulerConfig:
    offload = KVOffloadConfig(
        enabled=True, host_memory_ratio=2.0, write_through_threshold="immediate"
    )
    return SchedulerConfig(speculative_ngram=k, kv_offload_config=offload, **kwargs)


def assert_clean(llm: LLM) -> None:
    llm.check_integrity()
    stats = llm.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert llm.engine.kv_cache.npu.num_used == 0
    proposer = llm.engine.core.scheduler.proposer
    assert proposer is None or proposer.num_requests == 0


def step_chunks(llm: LLM, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """The tokens each engine step gave one request."""
    llm.engine.add_request("chunks", prompt, params)
    chunks = []
    while llm.engine.has_unfinished_requests():
        chunks += [o.new_token_ids for o in llm.engine.step() if o.new_token_ids]
    return chunks


@pytest.mark.parametrize("model", ["tiny", "tiny-hybrid"])
def test_outputs_and_cache_hits_equal_decoding_without_drafts(model):
    prompts = mixed_prompts()
    cold = LLM(
        model,
        scheduler_config=SchedulerConfig(prefix_cache_config=PrefixCacheConfig(enabled=False)),
    )
    reference = [o.token_ids for o in cold.generate(prompts, GREEDY)]
    results = {}
    for k in (0, 4):
        llm = LLM(model, num_npu_blocks=96, scheduler_config=host_tier(k))
        first = llm.generate(prompts, GREEDY)  # one batch
        # Follow-ups continue each prompt and its output: their prefix is the blocks the
        # first round computed, drafts included; loaded back from host after an NPU reset.
        llm.reset_prefix_cache("npu")
        follow = [p + o.token_ids + [7, 8, 9] for p, o in zip(prompts, first)]
        second = [llm.generate(f, GREEDY) for f in follow]
        results[k] = (first, second)
        stats = llm.stats()
        if k:
            assert stats.spec_decode.num_accepted_tokens > 0
        else:
            assert stats.spec_decode.num_draft_tokens == 0
        assert_clean(llm)
    (first0, second0), (first4, second4) = results[0], results[4]
    assert [o.token_ids for o in first4] == [o.token_ids for o in first0] == reference
    assert [o.token_ids for o in second4] == [o.token_ids for o in second0]
    assert [o.num_cached_tokens for o in second4] == [o.num_cached_tokens for o in second0]
    assert all(o.num_cached_tokens_in(Tier.HOST) == o.num_cached_tokens for o in second4)
    for prompt, out, again in zip(prompts, first4, second4):
        assert again.num_cached_tokens == (len(prompt) + len(out.token_ids) - 1) // 16 * 16


def test_drafts_are_accepted_on_a_repetitive_prompt():
    llm = LLM("tiny", scheduler_config=SchedulerConfig(speculative_ngram=4))
    chunks = step_chunks(llm, LOOP, GREEDY)
    stats = llm.stats().spec_decode
    assert stats.num_draft_tokens >= stats.num_accepted_tokens >= 10
    # every token past the first of a step is an accepted draft token
    assert sum(len(c) - 1 for c in chunks) == stats.num_accepted_tokens
    assert len(chunks) < GREEDY.max_tokens - 10
    assert_clean(llm)


def test_preemption_with_drafts_keeps_outputs():
    prompts = mixed_prompts()
    reference = [o.token_ids for o in LLM("tiny").generate(prompts, GREEDY)]
    config = SchedulerConfig(speculative_ngram=4, max_num_batched_tokens=64)
    llm = LLM("tiny", num_npu_blocks=24, scheduler_config=config)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode.num_accepted_tokens > 0
    assert_clean(llm)


def mutated_repeats(seed: int) -> list[int]:
    """A random span three times, every third token changed in each lap: drafts copied from
    an earlier lap fail now and then."""
    rng = random.Random(seed)
    span = [rng.randrange(256) for _ in range(rng.randrange(8, 24))]
    return [
        t if (i + lap) % 3 else rng.randrange(256) for lap in range(3) for i, t in enumerate(span)
    ]


def test_drafts_back_off_by_their_rule_on_the_built_in_model():
    """Step by step, a draft is verified whenever the lookup (done here by brute force) finds
    one, except after f >= 2 drafts in a row with nothing accepted, when the next 2^(f-1) - 1
    found are dropped; after a failure, a draft is a one-token probe until a token passes; the
    outputs are plain decoding's."""
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    plain = LLM("tiny")
    llm = LLM("tiny", scheduler_config=SchedulerConfig(speculative_ngram=4))
    num_skipped = num_failed = 0
    for seed in (0, 1, 6):
        prompt = mutated_repeats(seed)
        expected = plain.generate(prompt, params).token_ids
        llm.engine.add_request("r", prompt, params)
        tokens, failures, to_skip = list(prompt), 0, 0
        while llm.engine.has_unfinished_requests():
            before = llm.engine.stats().spec_decode
            new = [t for o in llm.engine.step() for t in o.new_token_ids]
            after = llm.engine.stats().spec_decode
            drafted = after.num_draft_tokens - before.num_draft_tokens
            accepted = after.num_accepted_tokens - before.num_accepted_tokens
            room = params.max_tokens - (len(tokens) - len(prompt)) - 1
            is_decode = len(tokens) > len(prompt)
            if not (is_decode and room > 0 and first_draft_token(tokens) is not None):
                assert drafted == 0
            elif to_skip:
                assert drafted == 0
                to_skip -= 1
                num_skipped += 1
            else:
                assert drafted == min(BACKOFF_DRAFT_LEN if failures else 4, room)
                failures = 0 if accepted else failures + 1
                num_failed += not accepted
                to_skip = min(2 ** (failures - 1), MAX_DRAFT_INTERVAL) - 1 if failures else 0
            assert accepted == len(new) - 1
            tokens += new
        assert tokens[len(prompt) :] == expected
    assert num_skipped > 0 and num_failed > 0  # the backoff was exercised
    assert_clean(llm)


def inside_a_step(chunks: list[list[int]]) -> list[int]:
    """Output lengths that end inside a step's tokens (an accepted draft token's position)."""
    ends, length = [], 0
    for chunk in chunks:
        ends += range(length + 1, length + len(chunk))
        length += len(chunk)
    return ends


def test_max_tokens_and_a_stop_string_inside_an_accepted_draft_stop_exactly():
    prompt = LOOP
    plain = LLM("tiny")
    spec = LLM("tiny", scheduler_config=SchedulerConfig(speculative_ngram=4))
    full = plain.generate(prompt, GREEDY)
    chunks = step_chunks(spec, prompt, GREEDY)
    assert [t for c in chunks for t in c] == full.token_ids
    inside = inside_a_step(chunks)
    assert inside
    # max_tokens: every length that a step would have run past
    for max_tokens in inside[:4]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        out = spec.generate(prompt, params)
        assert out.token_ids == full.token_ids[:max_tokens] and out.finish_reason == "length"
    # A stop string that first appears with an accepted draft token: the shortest text
    # (of whole characters) ending at that token and found nowhere earlier.
    tokens, decode = full.token_ids, spec.tokenizer.decode
    candidates = []
    for end in inside:
        text = decode(tokens[:end])
        for n in range(1, 7):
            piece = decode(tokens[end - n : end])
            if "\ufffd" in piece:
                break
            if text.find(piece) == len(text) - len(piece):
                candidates.append((end, piece))
                break
    assert candidates, "no stop string ends inside a step"
    length, stop = candidates[0]
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop])
    expected = plain.generate(prompt, params)
    out = spec.generate(prompt, params)
    assert len(expected.token_ids) == length and expected.finish_reason == "stop"
    assert out.token_ids == expected.token_ids and out.text == expected.text
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop)]
    assert_clean(spec)


def test_stats_sum_and_reset():
    llm = LLM("tiny", scheduler_config=SchedulerConfig(speculative_ngram=3))
    llm.generate(LOOP, GREEDY)
    stats = llm.stats().spec_decode
    assert stats.num_accepted_tokens > 0
    assert llm.engine.stats().spec_decode == stats
    llm.engine.reset_counters()
    assert llm.stats().spec_decode.num_draft_tokens == 0
