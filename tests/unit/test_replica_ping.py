"""The health monitor's ping (``ReplicaActor.ready``) answers while a step runs: only its first
call, before any traffic, waits between steps to publish the backing tiers' blocks."""

import asyncio
from types import SimpleNamespace

from replicas.actor import ReplicaActor


class StepRunning:
    """An engine loop whose step never ends: ``between_steps`` waits for ever."""

    def __init__(self) -> None:
        self.waits = 0

    async def between_steps(self) -> None:
        self.waits += 1
        if self.waits > 1:
            await asyncio.Event().wait()


def test_a_ping_answers_while_a_long_step_runs():
    loop = StepRunning()
    reports = []
    actor = SimpleNamespace(
        engine=SimpleNamespace(backing={"peer": {}}),
        async_engine=loop,
        incarnation="i1",
        _published_backing=False,
        _check_engine=lambda: None,
        _report=reports.append,
    )

    async def pings() -> list[str]:
        first = await ReplicaActor.ready(actor)  # publishes the backing tiers' blocks
        later = [await asyncio.wait_for(ReplicaActor.ready(actor), 1.0) for _ in range(3)]
        return [first, *later]

    assert asyncio.run(pings()) == ["i1"] * 4
    assert loop.waits == 1 and reports == [[]]
