"""A prompt that no replica can serve, sent through ``RayBackend``'s dispatcher to an in-process
replica actor (no Ray): the replica it is routed to checks it where it enters, and the caller
gets that ``ValueError``, with the rule's text, without the request being routed again."""

import asyncio

import pytest
from ray.exceptions import RayTaskError

from replicas.sampling_params import SamplingParams
from tests.unit.test_resume_backend import CutReplica, in_process_backend


class RayErrorsReplica(CutReplica):
    """What a Ray actor handle raises for an error in ``submit``: a ``RayTaskError`` whose
    ``cause`` is the actor's own error."""

    def __init__(self) -> None:
        super().__init__()
        self.submit.remote = self._submit

    async def _submit(self, *args):
        try:
            await self.actor.submit(*args)
        except ValueError as error:
            raise RayTaskError("submit", "", error) from None


def test_a_prompt_too_long_is_refused_by_the_replica_once():
    replica = RayErrorsReplica()
    max_model_len = replica.actor.engine.max_model_len
    backend = in_process_backend([replica, RayErrorsReplica()])
    prompt = [5] * max_model_len

    def run(request_id: str, token_ids: list[int]) -> list:
        async def scenario():
            params = SamplingParams(max_tokens=1)
            return [o async for o in backend.generate(request_id, token_ids, params)]

        return asyncio.run(asyncio.wait_for(scenario(), 60))

    with pytest.raises(ValueError, match=f"but max_model_len is {max_model_len}: it must be"):
        run("long", prompt)
    assert backend.router_calls.routed == [("long", max_model_len)]  # not routed again
    assert replica.actor.engine.num_unfinished == 0
    assert run("fits", prompt[:-1])[-1].finish_reason == "length"  # one token shorter fits
