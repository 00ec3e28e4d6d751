"""``RayBackend`` resuming requests whose replica is lost mid-stream, over two in-process replica
actors (no Ray): replica 0's output stream breaks once a request has received a chosen number
of tokens, and the request continues on replica 1 with no gap, duplicate or error; the resume
limit and a cluster with no survivor end it with the clear error of a lost replica."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from cluster.backend import NoLiveReplicaError, ReplicaFailedError
from cluster.choices import generate_choices, generate_sequences
from cluster.deploy import RayBackend
from cluster.dispatch import Dispatcher
from cluster.membership import Membership
from replicas.engine.structured_output import StructuredOutputs
from replicas.outputs import OutputDelta
from replicas.sampling_params import SamplingParams
from tests.unit.test_replica_link import InProcessReplica, _ready

PROMPT = [(7 * j) % 200 + 30 for j in range(21)]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}},
    "required": ["city", "ok"],
}


class CutReplica(InProcessReplica):
    """An in-process replica whose output stream breaks right after the output that brings
    any request to ``cut_at`` tokens (outputs after it in the same message are lost too)."""

    def __init__(self, cut_at: int | None = None) -> None:
        super().__init__()
        self.cut_at = cut_at
        self.num_tokens: dict[str, int] = {}
        self.abort = SimpleNamespace(
            remote=lambda rid: asyncio.ensure_future(self.actor.abort(rid))
        )

    def number(self, index: int) -> "CutReplica":
        self.actor.replica_index = self.actor.async_engine.replica_index = index
        return self

    async def _stream(self, subscriber: str):
        async for batch in self.actor.outputs(subscriber):
            for position, (request_id, item) in enumerate(batch):
                if isinstance(item, BaseException):
                    continue
                count = self.num_tokens.get(request_id, 0) + len(OutputDelta._make(item)[1])
                self.num_tokens[request_id] = count
                if self.cut_at is not None and count >= self.cut_at:
                    yield _ready(batch[: position + 1])
                    raise RuntimeError("object lost")
            yield _ready(batch)


class Health:
    def __init__(self, num_replicas: int) -> None:
        self.live = set(range(num_replicas))

    def ensure_running(self) -> None:
        pass

    def is_alive(self, index: int) -> bool:
        return index in self.live

    def mark_lost(self, index: int) -> None:
        self.live.discard(index)


class RouterCalls:
    """The lowest live replica not excluded; ``NoLiveReplicaError`` when there is none."""

    def __init__(self, health: Health) -> None:
        self.health = health
        self.routed: list[tuple[str, int]] = []  # (request, prompt and output tokens)

    def route(self, request_id, num_prompt_tokens, hashes, exclude=(), cache_key=None):
        future = asyncio.get_running_loop().create_future()
        live = sorted(self.health.live - set(exclude))
        self.routed.append((request_id, num_prompt_tokens))
        if live:
            future.set_result(SimpleNamespace(replica_index=live[0], peer_source=None))
        else:
            future.set_exception(NoLiveReplicaError("no live replica"))
        return future

    def release(self, request_id):
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


def in_process_backend(replicas: list[InProcessReplica], max_resumes: int = 2) -> RayBackend:
    """A ``RayBackend``'s serving half over in-process replicas, a scripted router and
    health monitor."""
    backend = RayBackend.__new__(RayBackend)
    health = Health(len(replicas))
    backend.health = health
    backend.router_calls = RouterCalls(health)
    numbered = [replica.number(i) for i, replica in enumerate(replicas)]
    backend.membership = Membership(numbered, [{"node_id": "node"} for _ in replicas])
    backend.max_model_len = 512
    backend.block_size = 16
    backend.dispatcher = Dispatcher(
        backend.membership, health, backend.router_calls, 16, max_resumes
    )
    return backend


async def collect(backend, request_id: str, params: SamplingParams) -> list:
    return [o async for o in backend.generate(request_id, PROMPT, params)]


def reference(params: SamplingParams) -> list:
    """The uninterrupted run's outputs, on a replica nothing happens to."""
    return asyncio.run(collect(in_process_backend([CutReplica()]), "reference", params))


def resumed(params: SamplingParams, cut_at: int, max_resumes: int = 2):
    backend = in_process_backend([CutReplica(cut_at), CutReplica()], max_resumes)
    return asyncio.run(asyncio.wait_for(collect(backend, "r", params), 120)), backend


def assert_continuous(outputs: list, want) -> None:
    """The client's view: every token and character once, in order, equal to ``want``."""
    final = outputs[-1]
    assert [t for o in outputs for t in o.new_token_ids] == final.token_ids == want.token_ids
    assert "".join(o.new_text for o in outputs) == final.text == want.text
    assert final.finish_reason == want.finish_reason
    assert final.prompt_token_ids == PROMPT


@pytest.mark.parametrize("cut_at", [1, 5, 17])
def test_a_request_lost_mid_stream_resumes_on_the_survivor(cut_at):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = reference(params)[-1]
    outputs, backend = resumed(params, cut_at)
    assert_continuous(outputs, want)
    assert {o.replica_index for o in outputs} == {0, 1}
    counts = backend.dispatcher.counts
    assert counts.num_resumed == 1 and counts.num_rerouted == 0
    # The survivor was asked for the prompt and the output sent so far.
    assert backend.router_calls.routed[-1] == ("r", len(PROMPT) + cut_at)
    # The client's figures are the first replica's: arrival, first token, cached prompt.
    first = outputs[0]
    assert {(o.arrival_time, o.first_token_time, o.num_cached_tokens) for o in outputs} == {
        (first.arrival_time, first.first_token_time, first.num_cached_tokens)
    }


def test_a_stop_string_straddling_the_cut_still_stops():
    """The stop string starts in text replica 0 held back and ends in tokens replica 1
    generates: the client gets the text before it, once."""
    plain = reference(SamplingParams(max_tokens=60, ignore_eos=True))[-1]
    text = plain.text
    cases = 0
    for k in range(4, 55):
        window = plain.token_ids[k - 2 : k + 2]
        stop = "".join(map(chr, window))
        if not all(32 <= t < 127 for t in window) or text.find(stop) != len(text) - len(
            "".join(chr(t) for t in plain.token_ids[k - 2 :])
        ):
            continue
        params = SamplingParams(max_tokens=60, ignore_eos=True, stop=stop)
        want = reference(params)[-1]
        outputs, backend = resumed(params, k)
        assert_continuous(outputs, want)
        assert want.finish_reason == "stop" and backend.dispatcher.counts.num_resumed == 1
        cases += 1
    if not cases:
        pytest.skip("no ASCII stretch in this model's output to cut at")


def test_logprobs_continue_across_the_cut():
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    want = reference(params)[-1]
    outputs, _ = resumed(params, 9)
    assert_continuous(outputs, want)
    got = [lp for o in outputs for lp in o.new_logprobs]
    assert [lp.token_id for lp in got] == want.token_ids
    assert [len(lp.top) for lp in got] == [2] * len(want.token_ids)
    assert [lp.logprob for lp in got] == pytest.approx(
        [lp.logprob for lp in want.logprobs], abs=1e-4
    )
    assert outputs[-1].logprobs == got


def test_a_json_schema_output_resumes_inside_the_object():
    params = SamplingParams(
        max_tokens=60, structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA))
    )
    want = reference(params)[-1]
    assert set(json.loads(want.text)) == {"city", "ok"}
    outputs, _ = resumed(params, 4)
    assert_continuous(outputs, want)


def test_n_choices_resume_each_from_its_own_output():
    params = SamplingParams(max_tokens=20, ignore_eos=True, n=3, temperature=0.0)

    async def choices(backend):
        return await generate_choices(backend, "n3", [PROMPT], params)

    want = asyncio.run(choices(in_process_backend([CutReplica()])))[0]
    backend = in_process_backend([CutReplica(6), CutReplica()])

    async def streamed():
        return [s async for s in generate_sequences(backend, "n3", [PROMPT], params)]

    sequences = asyncio.run(asyncio.wait_for(streamed(), 120))
    for index in range(3):
        outputs = [s.output for s in sequences if s.sequence_index == index]
        assert_continuous(outputs, want[index])
    assert backend.dispatcher.counts.num_resumed >= 1


def test_past_the_resume_limit_the_request_fails_as_before():
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    with pytest.raises(ReplicaFailedError, match=r"^replica 0 failed while serving the request"):
        resumed(params, 5, max_resumes=0)
    # Both replicas lose it: one resume allowed, the second loss fails it.
    backend = in_process_backend([CutReplica(5), CutReplica(9)], max_resumes=1)
    with pytest.raises(ReplicaFailedError, match=r"^replica 1 failed while serving the request"):
        asyncio.run(asyncio.wait_for(collect(backend, "r", params), 120))
    assert backend.dispatcher.counts.num_resumed == 1


def test_with_no_live_replica_to_take_it_the_request_fails_as_before():
    backend = in_process_backend([CutReplica(5)])
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    with pytest.raises(ReplicaFailedError, match=r"^replica 0 failed while serving the request"):
        asyncio.run(asyncio.wait_for(collect(backend, "r", params), 120))
    assert backend.dispatcher.counts.num_resumed == 0


def test_the_old_count_names_still_read_with_a_deprecation_warning():
    _, backend = resumed(SamplingParams(max_tokens=6, ignore_eos=True), cut_at=3)
    with pytest.warns(DeprecationWarning, match="dispatcher.counts.num_resumed"):
        assert backend.num_resumed == backend.dispatcher.counts.num_resumed == 1
    with pytest.raises(AttributeError):
        _ = backend.num_lost
