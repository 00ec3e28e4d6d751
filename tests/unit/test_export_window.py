"""A peer's read of cached blocks while the engine computes a step
(``replicas.engine.export_window``): the window is open only during the forward pass, the step
waits for a read in it, and what the read returns is what a read between steps returns."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from replicas.config import EngineConfig, KVOffloadConfig, SchedulerConfig
from replicas.engine.engine import Engine
from replicas.engine.export_window import ExportWindow, copy_block, export_in_step
from replicas.kv.hashing import block_hashes
from replicas.sampling_params import SamplingParams
from tests.unit.engine_runs import run

PROMPT = [(7 * i + 3) % 200 for i in range(16 * 6)] + [1, 2]


def test_the_window_is_open_only_in_a_forward_and_the_forward_waits_for_a_read():
    window = ExportWindow()
    assert window.run_if_open(lambda: 1) == (False, None)
    in_read, release, order = threading.Event(), threading.Event(), []

    def read():
        in_read.set()
        release.wait(5)
        order.append("read")
        return 7

    with ThreadPoolExecutor(1) as pool:
        with window.forward():
            future = pool.submit(window.run_if_open, read)
            assert in_read.wait(5)
            release.set()
        order.append("forward left")  # only once the read ended
        assert future.result(5) == (True, 7)
    assert order == ["read", "forward left"]
    assert window.run_if_open(lambda: 1) == (False, None)


def test_a_block_copy_is_bit_equal_and_owns_its_memory():
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        block = torch.arange(2 * 3 * 16, dtype=torch.float32).reshape(2, 3, 16).to(dtype)
        copy = copy_block(block)
        assert copy.dtype == dtype and copy.shape == block.shape and torch.equal(copy, block)
        block.zero_()
        assert not torch.equal(copy, block)


def slow_forward(engine: Engine, in_forward: threading.Event, go_on: threading.Event) -> None:
    """The engine's forward pass, which waits (in the window) until ``go_on``."""
    execute = engine.core.executor.execute

    def held(output):
        result = execute(output)
        in_forward.set()
        go_on.wait(10)
        return result

    engine.core.executor.execute = held


def test_a_read_in_a_forward_returns_what_a_read_between_steps_does():
    engine = Engine(
        EngineConfig(
            model="tiny",
            num_npu_blocks=48,
            scheduler_config=SchedulerConfig(
                kv_offload_config=KVOffloadConfig(enabled=True, host_memory_ratio=1.0)
            ),
        )
    )
    assert engine.exports_in_steps
    run(engine, PROMPT)  # its blocks are cached
    hashes = block_hashes(PROMPT, engine.block_size)
    between = engine.export_blocks("full", hashes)
    in_forward, go_on = threading.Event(), threading.Event()
    slow_forward(engine, in_forward, go_on)
    engine.add_request("other", [5, 6, 7] * 20, SamplingParams(max_tokens=2))
    with ThreadPoolExecutor(1) as stepper, ThreadPoolExecutor(1) as reader:
        step = stepper.submit(engine.step)
        assert in_forward.wait(10)

        async def read():
            return await export_in_step(
                lambda: not step.done(),
                engine.core.export_window,
                lambda: engine.export_blocks("full", hashes, in_step=True),
                reader,
            )

        done, during = asyncio.run(read())
        assert done and not step.done()  # read while the step computes
        go_on.set()
        step.result(10)
    assert during[0] == between[0]
    assert [(b.block_hash, b.checksum) for b in during[1]] == [
        (b.block_hash, b.checksum) for b in between[1]
    ]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(during[1], between[1]))
    engine.check_integrity()
    engine.close()


def test_no_window_opens_when_the_engine_does_not_step():
    window = ExportWindow()
    with ThreadPoolExecutor(1) as pool:
        assert asyncio.run(export_in_step(lambda: False, window, lambda: 1, pool)) == (False, None)
