"""SIGHUP's config reload (``cluster.reload``): what changes, and what is only logged."""

import asyncio
import logging
import os
import signal

import pytest

from cluster.backend import ScaleResult
from cluster.config import ClusterConfig
from cluster.reload import plan_reload, reload_config, watch_sighup


def config(**data) -> ClusterConfig:
    return ClusterConfig.model_validate({"model": {"model": "tiny"}, **data})


class Backend:
    def __init__(self) -> None:
        self.calls: list[int] = []

    async def scale(self, data_parallel_size: int) -> ScaleResult:
        self.calls.append(data_parallel_size)
        if data_parallel_size > 8:
            raise ValueError(f"data_parallel_size {data_parallel_size} is more than fits")
        return ScaleResult(2, data_parallel_size)


def test_the_plan_separates_the_size_from_fields_that_need_a_restart():
    current = config(data_parallel_size=2)
    assert plan_reload(current, config(data_parallel_size=2)).is_empty
    plan = plan_reload(
        current,
        config(data_parallel_size=3, server={"port": 9000}, routing={"ramp_s": 5.0}),
    )
    assert plan.data_parallel_size == 3
    assert plan.needs_restart == ["routing.ramp_s", "server.port"]


def test_an_unchanged_config_changes_nothing(caplog):
    backend = Backend()
    current = config(data_parallel_size=2)
    with caplog.at_level(logging.INFO, "cluster.reload"):
        after = asyncio.run(reload_config(backend, current, lambda: config(data_parallel_size=2)))
    assert after is current and backend.calls == []
    assert "unchanged" in caplog.text


def test_a_changed_size_resizes_and_other_fields_are_named(caplog):
    backend = Backend()
    new = config(data_parallel_size=4, server={"port": 9000})
    with caplog.at_level(logging.INFO, "cluster.reload"):
        after = asyncio.run(reload_config(backend, config(data_parallel_size=2), lambda: new))
    assert backend.calls == [4] and after.data_parallel_size == 4
    assert after.server.port == 8000  # the rest waits for a restart
    assert "after a restart: server.port" in caplog.text


@pytest.mark.parametrize("bad", ["file", "size"])
def test_a_bad_file_or_size_is_logged_and_changes_nothing(caplog, bad):
    backend = Backend()
    current = config(data_parallel_size=2)

    def read() -> ClusterConfig:
        if bad == "file":
            return config(data_parallel_size=0)
        return config(data_parallel_size=99)

    with caplog.at_level(logging.INFO, "cluster.reload"):
        after = asyncio.run(reload_config(backend, current, read))
    assert after is current
    assert "data_parallel_size" in caplog.text and "nothing changed" in caplog.text
    assert backend.calls == ([] if bad == "file" else [99])


def test_a_sighup_to_this_process_reloads():
    backend = Backend()
    reads: list[int] = []

    def read() -> ClusterConfig:
        reads.append(1)
        return config(data_parallel_size=3)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        watch_sighup(loop, backend, config(data_parallel_size=2), read)
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(200):
                if backend.calls:
                    break
                await asyncio.sleep(0.01)
        finally:
            loop.remove_signal_handler(signal.SIGHUP)

    asyncio.run(main())
    assert reads == [1] and backend.calls == [3]
