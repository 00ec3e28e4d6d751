"""A replica's batched output stream (``submit`` + ``outputs``): one message per engine step
carries what the step added to every request of a subscriber; added up, the same tokens and
text as one stream per request."""

import asyncio
import warnings

import pytest

from replicas.actor import ReplicaActor
from replicas.config import EngineConfig
from replicas.engine.async_engine import OverloadedError
from replicas.kv.events import Tier
from replicas.outputs import OutputAccumulator, OutputDelta, RequestOutput
from replicas.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = {f"r{i}": [(11 * i + j) % 250 + 1 for j in range(40 + 7 * i)] for i in range(4)}


def make_actor() -> ReplicaActor:
    return ReplicaActor(0, EngineConfig(model="tiny", num_npu_blocks=128, max_model_len=256))


async def read_stream(actor: ReplicaActor, subscriber: str, messages: list, done: set) -> None:
    async for batch in actor.outputs(subscriber):
        messages.append(batch)
        done.update(rid for rid, item in batch if OutputDelta._make(item).finished)
        if done >= set(PROMPTS):
            return


def test_one_message_per_step_carries_every_request_and_the_same_tokens():
    async def scenario():
        actor = make_actor()
        # Reference: one stream per request, each request alone.
        reference = {}
        for rid, prompt in PROMPTS.items():
            outputs = [o async for o in actor.generate(f"ref-{rid}", prompt, PARAMS)]
            reference[rid] = (outputs[-1].token_ids, outputs[-1].text)
        actor.engine.reset_prefix_cache()
        steps_before = actor.engine.stats().steps.num_steps
        messages, done = [], set()
        reader = asyncio.ensure_future(read_stream(actor, "front:1", messages, done))
        for rid, prompt in PROMPTS.items():
            await actor.submit("front:1", rid, prompt, PARAMS)
        await asyncio.wait_for(reader, 60)
        return actor, reference, messages, actor.engine.stats().steps.num_steps - steps_before

    actor, reference, messages, steps = asyncio.run(scenario())
    items = [item for batch in messages for item in batch]
    rebuilt = {rid: OutputAccumulator(PROMPTS[rid]) for rid in PROMPTS}
    finals = {}
    for rid, delta in items:
        output = rebuilt[rid].add(OutputDelta._make(delta))
        assert output.prompt_token_ids == PROMPTS[rid]
        if output.finished:
            finals[rid] = (output.token_ids, output.text)
    assert finals == reference
    assert len(messages) <= steps  # never more than one message per engine step
    assert len(messages) < len(items)  # and steps of several requests shared one
    assert all(OutputDelta._make(item).replica_index == 0 for _, item in items)
    assert actor.engine.num_unfinished == 0
    actor.engine.check_integrity()


def test_a_newer_stream_of_the_same_owner_ends_the_old_one_and_aborts_its_requests():
    async def scenario():
        actor = make_actor()
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        old = actor.outputs("front:1")
        await actor.submit("front:1", "a", PROMPTS["r0"], long)
        first = await anext(old)  # the request runs
        assert first[0][0] == "a"
        newer = asyncio.ensure_future(anext(actor.outputs("front:2")))
        rest = [batch async for batch in old]  # ends: the owner opened a newer stream
        for _ in range(100):  # the abort lands between steps
            if actor.engine.num_unfinished == 0:
                break
            await asyncio.sleep(0.01)
        newer.cancel()
        return actor, rest

    actor, rest = asyncio.run(scenario())
    assert all(not OutputDelta._make(item).finished for batch in rest for _, item in batch)
    assert actor.engine.num_unfinished == 0
    assert actor.engine.kv_cache.npu.num_used == 0
    actor.engine.check_integrity()


def test_submit_turns_away_what_it_cannot_queue():
    async def scenario():
        actor = ReplicaActor(
            0,
            EngineConfig(model="tiny", num_npu_blocks=128, max_model_len=256),
            max_waiting_requests=2,
        )
        errors = []
        for rid, prompt in [("a", PROMPTS["r0"]), ("b", []), ("c", PROMPTS["r1"]), ("d", [1])]:
            try:
                await actor.submit("front:1", rid, prompt, PARAMS)
            except (ValueError, OverloadedError) as error:
                errors.append((rid, type(error)))
        queued = set(actor._subscribers["front:1"].request_ids)
        for rid in queued:
            await actor.abort(rid)
        return errors, queued

    errors, queued = asyncio.run(scenario())
    assert errors == [("b", ValueError), ("d", OverloadedError)]
    assert queued == {"a", "c"}


def test_a_request_routed_back_after_an_abort_may_reuse_its_id():
    """A front that lost its stream aborts the request and may route it back to the same
    replica: the new submit waits for the abort instead of finding the id in use."""

    async def scenario():
        actor = make_actor()
        stream = actor.outputs("front:1")
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        await actor.submit("front:1", "x", PROMPTS["r0"], long)
        await anext(stream)  # running
        await actor.abort("x")
        await actor.submit("front:1", "x", PROMPTS["r1"], PARAMS)  # before the abort applied
        finals = []
        while len(finals) < 2:
            for rid, item in await anext(stream):
                delta = OutputDelta._make(item)
                if delta.finished:
                    finals.append((rid, delta.finish_reason))
        return actor, finals

    actor, finals = asyncio.run(scenario())
    assert finals == [("x", "abort"), ("x", "length")]
    assert actor.engine.num_unfinished == 0
    actor.engine.check_integrity()


def test_logprobs_cross_the_stream_once_each():
    """Generated logprobs arrive step by step, prompt logprobs once; rebuilt, they equal those
    of one stream read whole."""
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    prompt = PROMPTS["r1"]

    async def scenario():
        actor = make_actor()
        outputs = [o async for o in actor.generate("whole", prompt, params)]
        actor.engine.reset_prefix_cache()
        messages = []

        async def read() -> None:
            async for batch in actor.outputs("front:2"):
                messages.append(batch)
                if any(OutputDelta._make(item).finished for _, item in batch):
                    return

        reader = asyncio.ensure_future(read())
        await actor.submit("front:2", "r", prompt, params)
        await asyncio.wait_for(reader, 60)
        return outputs[-1], [OutputDelta._make(item) for batch in messages for _, item in batch]

    whole, deltas = asyncio.run(scenario())
    assert sum(d.new_prompt_logprobs is not None for d in deltas) == 1
    rebuilt = OutputAccumulator(prompt)
    for delta in deltas:
        output = rebuilt.add(delta)
    assert [s.token_id for s in output.logprobs] == output.token_ids == whole.token_ids
    assert [s.logprob for s in output.logprobs] == [s.logprob for s in whole.logprobs]
    assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
    assert [s.token_id for s in output.prompt_logprobs[1:]] == prompt[1:]
    assert output.cumulative_logprob == whole.cumulative_logprob


def test_a_delta_carries_the_cached_tokens_per_tier():
    output = RequestOutput(
        "r", [1, 2, 3], [7], "x", [7], "x", True, "stop", 48, (16, 32, 0), 0.0, 0.5, 1.0
    )
    rebuilt = OutputAccumulator([1, 2, 3]).add(OutputDelta._make(OutputDelta.values_of(output)))
    assert rebuilt == output
    assert rebuilt.num_cached_tokens_by_tier == (16, 32, 0)
    assert [rebuilt.num_cached_tokens_in(t) for t in ("npu", Tier.HOST, Tier.DISK)] == [16, 32, 0]


def test_the_renamed_cached_token_counts_still_read_with_a_deprecation_warning():
    output = RequestOutput(
        "r", [1] * 64, [2], "x", [2], "x", True, "stop", 48, (16, 24, 8), 0.0, 0.0, 0.0
    )
    with pytest.warns(DeprecationWarning, match=r'num_cached_tokens_in\("npu"\)') as caught:
        assert output.num_npu_cached_tokens == 16
    assert caught[0].filename == __file__  # points at the reader, not at replicas/outputs.py
    with pytest.warns(DeprecationWarning, match="num_host_cached_tokens is deprecated"):
        assert output.num_host_cached_tokens == 24 + 8  # disk blocks came through the host
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert output.num_cached_tokens_in(Tier.HOST) == 24  # the new name does not warn
