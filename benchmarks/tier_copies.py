"""Host-tier copy rates and the delay a store adds to the next step, measured beside an engine.

Part of ``reload-vs-recompute``. Both measure a ``KVTransfer`` of their own, shaped like the
engine's KV (its cache types, block shape and dtype, on its device) with its own NPU blocks and
host slab, so the engine's cache is never touched:

* ``copy_rates``: one plan of ``num_blocks`` loads (host -> NPU) and one of stores, with host
  ids in order (one copy per cache type) and shuffled (one copy per block), timed to the end of
  the copies; against plain copies of the same bytes between a pinned tensor and the device
  (the bus's rate as torch measures it). On a CPU the "pinned" tensor is ordinary memory.
* ``store_delay``: the engine decodes one request step by step; every other step a store of
  ``num_blocks`` blocks is submitted on the side transfer just before it, as the engine submits
  a write-through store before its forward pass. The delay is the median step with a store over
  the median step without, minus one; each store lands after its step, outside the timing.
"""

import random
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.workload import random_tokens
from cluster import LLM, SamplingParams
from replicas.kv.records import BlockCopy, TransferPlan
from replicas.kv.transfer import KVTransfer


def _side_transfer(llm: LLM, num_blocks: int) -> KVTransfer:
    caches = llm.engine.runner.kv_caches
    npu = {
        name: torch.randn((num_blocks, *t.shape[1:])).to(dtype=t.dtype, device=t.device)
        for name, t in caches.items()
    }
    return KVTransfer(npu, dict.fromkeys(npu, num_blocks))


def _timed(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` to the end of its device work (one unrecorded warm-up)."""
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - begin)
    return statistics.median(times[1:])


def copy_rates(llm: LLM, num_blocks: int, repeats: int) -> dict[str, float]:
    """GiB/s of ``num_blocks``-block loads and stores through ``KVTransfer`` and of plain
    pinned copies of the same bytes."""
    transfer = _side_transfer(llm, num_blocks)
    device = transfer.device
    num_bytes = num_blocks * sum(transfer.block_bytes.values())
    shuffled = list(range(num_blocks))
    random.Random(0).shuffle(shuffled)
    rates = {"num_blocks": num_blocks, "bytes": num_bytes}
    for order, host_ids in (("in_order", list(range(num_blocks))), ("shuffled", shuffled)):
        for kind in ("load", "store"):
            copies = [
                BlockCopy(h, n, name) if kind == "load" else BlockCopy(n, h, name)
                for name in transfer.npu_caches
                for n, h in enumerate(host_ids)
            ]
            plan = TransferPlan([], copies) if kind == "load" else TransferPlan(copies, [])

            def run(plan: TransferPlan = plan) -> None:
                transfer.submit(plan)
                transfer.poll(wait=True)

            rates[f"{kind}_{order}_gib_per_s"] = num_bytes / _timed(run, device, repeats) / 2**30
    transfer.close()
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    on_device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    h2d = _timed(lambda: on_device.copy_(host, non_blocking=True), device, repeats)
    d2h = _timed(lambda: host.copy_(on_device, non_blocking=True), device, repeats)
    rates["pinned_h2d_gib_per_s"] = num_bytes / h2d / 2**30
    rates["pinned_d2h_gib_per_s"] = num_bytes / d2h / 2**30
    rates["load_over_pinned"] = rates["load_in_order_gib_per_s"] / rates["pinned_h2d_gib_per_s"]
    rates["store_over_pinned"] = rates["store_in_order_gib_per_s"] / rates["pinned_d2h_gib_per_s"]
    return rates


def store_delay(llm: LLM, num_blocks: int, num_steps: int) -> dict[str, float]:
    """The next decode step's time with and without a store of ``num_blocks`` blocks."""
    engine = llm.engine
    side = _side_transfer(llm, num_blocks)
    names = list(side.npu_caches)
    store = TransferPlan([BlockCopy(i, i, name) for name in names for i in range(num_blocks)], [])
    prompt = random_tokens(random.Random(1), 64)
    params = SamplingParams(max_tokens=2 * num_steps + 4, ignore_eos=True)
    request = engine.add_request("store-delay", prompt, params)
    while request.first_token_time is None:
        engine.step()
    plain, with_store = [], []
    for i in range(2 * num_steps):
        storing = i % 2 == 1
        if storing:
            side.submit(store)
        begin = time.perf_counter()
        engine.step()
        (with_store if storing else plain).append(time.perf_counter() - begin)
        side.poll(wait=True)  # lands outside the timing: the next plain step runs alone
    while engine.has_unfinished_requests():
        engine.step()
    side.close()
    plain_s, store_s = statistics.median(plain), statistics.median(with_store)
    return {
        "num_blocks": num_blocks,
        "bytes": num_blocks * sum(side.block_bytes.values()),
        "step_s": plain_s,
        "step_with_store_s": store_s,
        "delay": store_s / plain_s - 1,
    }
