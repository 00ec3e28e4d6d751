"""``ReplicaLink`` over an in-process replica actor: outputs reach their requests, and a stream
that breaks, however it breaks, ends every request it carried."""

import asyncio
from types import SimpleNamespace

import pytest

from cluster.replica_link import ReplicaLink, StreamLostError
from replicas.actor import ReplicaActor
from replicas.config import EngineConfig
from replicas.sampling_params import SamplingParams

PROMPTS = [[(5 * i + j) % 250 + 1 for j in range(30 + 9 * i)] for i in range(3)]


async def _ready(value):
    return value


class InProcessReplica:
    """A ``ReplicaActor`` behind the calls a Ray actor handle offers (``x.remote``,
    ``outputs.options(num_returns="streaming").remote``); ``break_after`` messages, its output
    stream raises a plain error."""

    def __init__(self, break_after: int | None = None) -> None:
        self.actor = ReplicaActor(0, EngineConfig(model="tiny", num_npu_blocks=128))
        self.break_after = break_after
        self.submit = SimpleNamespace(remote=self.actor.submit)
        self.abort = SimpleNamespace(remote=self.actor.abort)
        self.outputs = SimpleNamespace(options=lambda **_: SimpleNamespace(remote=self._stream))

    async def _stream(self, subscriber: str):
        sent = 0
        async for batch in self.actor.outputs(subscriber):
            if self.break_after is not None and sent == self.break_after:
                raise RuntimeError("object lost")
            sent += 1
            yield _ready(batch)  # a reference to await, as Ray's stream yields


async def collect(link: ReplicaLink, index: int, params: SamplingParams):
    return [o async for o in link.generate(f"r{index}", PROMPTS[index], params, None)]


def test_outputs_reach_their_requests_and_match_one_stream_per_request():
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    async def scenario():
        replica = InProcessReplica()
        link = ReplicaLink(replica)
        linked = await asyncio.wait_for(
            asyncio.gather(*(collect(link, i, params) for i in range(3))), 60
        )
        alone = []
        for i, prompt in enumerate(PROMPTS):
            outputs = [o async for o in replica.actor.generate(f"alone-{i}", prompt, params)]
            alone.append(outputs[-1])
        return link, linked, alone

    link, linked, alone = asyncio.run(scenario())
    for outputs, reference in zip(linked, alone):
        final = outputs[-1]
        assert (final.token_ids, final.text, final.finish_reason) == (
            reference.token_ids,
            reference.text,
            reference.finish_reason,
        )
        assert final.prompt_token_ids == reference.prompt_token_ids
        assert [t for o in outputs for t in o.new_token_ids] == final.token_ids
    assert link.num_messages < link.num_items


def test_a_stream_that_breaks_ends_every_request_it_carried():
    params = SamplingParams(max_tokens=100, ignore_eos=True)

    async def scenario():
        replica = InProcessReplica(break_after=2)
        link = ReplicaLink(replica)
        results = await asyncio.wait_for(
            asyncio.gather(*(collect(link, i, params) for i in range(3)), return_exceptions=True),
            60,
        )
        for _ in range(200):  # the replica aborts what the broken stream carried
            if replica.actor.engine.num_unfinished == 0:
                break
            await asyncio.sleep(0.01)
        return replica, results

    replica, results = asyncio.run(scenario())
    assert all(isinstance(r, StreamLostError) for r in results), results
    with pytest.raises(StreamLostError, match="object lost"):
        raise results[0]
    assert replica.actor.engine.num_unfinished == 0
    replica.actor.engine.check_integrity()
