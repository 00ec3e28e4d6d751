"""The simulator's peer tier (``benchmarks.sim.peer_tier``): a request the router sends away from
the replica holding its prefix pulls the prefix from it, waits for the pull instead of computing
the blocks, and counts them as peer hits; without ``peer_pull`` nothing changes."""

import dataclasses

import pytest

from benchmarks.sim.agents import StrataAgent
from benchmarks.sim.cost_model import CostModel, HardwareProfile
from benchmarks.sim.peer_tier import GPU_PATH, MEASURED, fit_pull_cost, peer_tier
from benchmarks.sim.simulator import SimConfig, Simulator
from benchmarks.sim.trace import TraceRecord, expand
from replicas.kv.hashing import block_hashes

PREFIX = tuple(range(8))  # 8 blocks of 512 trace tokens
RECORDS = [
    TraceRecord(0.0, 8 * 512, 32, PREFIX),
    TraceRecord(1000.0, 10 * 512, 32, (*PREFIX, 100, 101)),
]
CONFIG = SimConfig(data_parallel_size=2, num_npu_blocks=64, host_memory_ratio=1.0)
GPU = dict(
    peer_pull=True, peer_pull_fixed_s=GPU_PATH.fixed_s, peer_pull_bytes_per_s=GPU_PATH.bytes_per_s
)


def _run(monkeypatch: pytest.MonkeyPatch, **changes) -> tuple[dict, dict[str, float], Simulator]:
    """Both requests, the second routed away from replica 0 (which turned it away: the real
    router then names replica 0 as its source); (record, TTFT by request, simulator)."""
    route = StrataAgent.route

    def away(self, request, now):
        if request.request_id == "r1":
            monkeypatch.setattr(self.router, "route", _excluding(self.router.route))
        return route(self, request, now)

    monkeypatch.setattr(StrataAgent, "route", away)
    config = dataclasses.replace(CONFIG, **changes)
    cost_model = CostModel(HardwareProfile.load("h200-llama8b"), 16, 32.0)
    simulator = Simulator(config, cost_model, expand(RECORDS, 16))
    record = simulator.run()
    ttfts = {r.request_id: r.first_token_time - r.arrival_time for r in simulator._finished}
    return record, ttfts, simulator


def _excluding(route):
    return lambda *args, **kwargs: route(*args, **{**kwargs, "exclude": {0}})


def test_the_pull_is_made_charged_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    off, off_ttft, _ = _run(monkeypatch)
    on, on_ttft, simulator = _run(monkeypatch, **GPU)
    assert on["peer_sources_named"] == 1 and on["peer_reloads"] == 1
    assert on["peer_num_pulls"] == 1 and on["peer_blocks_pulled"] == 8
    assert on["peer_pull_failures"] == 0
    # The 8 pulled blocks are hits of their own kind: 8 x 16 of the 288 prompt tokens.
    assert on["peer_hit_rate"] == pytest.approx(8 * 16 / (16 * 8 + 16 * 10))
    assert on["hit_rate"] == pytest.approx(on["local_hit_rate"] + on["peer_hit_rate"])
    assert off["hit_rate"] == 0.0 and on["local_hit_rate"] == 0.0
    # r1 waited for the pull (10 ms + 8 x 64 MiB at 25 GB/s), not for a prefill of its prefix.
    pull_s = GPU_PATH.fixed_s + 8 * simulator.cost_model.block_bytes / 25e9
    assert on_ttft["r1"] > pull_s
    assert on_ttft["r1"] < off_ttft["r1"]
    assert on_ttft["r0"] == off_ttft["r0"]
    # The replica that pulled holds the blocks in its own cache now.
    engine = simulator.engines[1]
    assert all(engine.kv_cache.views.locate("full", h) for h in _prefix_hashes(simulator))


def test_a_pull_dearer_than_recomputing_is_not_made(monkeypatch: pytest.MonkeyPatch) -> None:
    off, off_ttft, _ = _run(monkeypatch)
    on, on_ttft, _ = _run(monkeypatch, peer_pull=True)  # measured pricing: 7 ms + 575 MB/s
    assert on["peer_sources_named"] == 1 and on["peer_recomputes"] == 1
    assert on["peer_num_pulls"] == 0 and on["peer_hit_rate"] == 0.0
    assert on_ttft == off_ttft and on["hit_rate"] == off["hit_rate"]


def test_off_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off, the record has no peer field, and it is the same whether or not the peer tier was
    registered in the process (a run with pulls registers it; tests/conftest.py unregisters it
    after each test)."""
    before, _, _ = _run(monkeypatch)
    peer_tier()
    after, _, _ = _run(monkeypatch)
    assert not [key for key in before if key.startswith("peer")]
    for record in (before, after):
        del record["sim_wall_s"]
    assert after == before


def test_measured_pricing_is_the_cluster_cache_fit() -> None:
    """7 ms + 1.7 ns per byte, from pulled minus local-hit TTFT at 64, 128 and 256 blocks."""
    assert fit_pull_cost() == MEASURED
    assert MEASURED.fixed_s == pytest.approx(0.0066, abs=0.0005)
    assert 1 / MEASURED.bytes_per_s == pytest.approx(1.74e-9, rel=0.01)


def _prefix_hashes(simulator: Simulator) -> list[bytes]:
    request = expand(RECORDS, 16)[0]
    return block_hashes(request.prompt_token_ids, simulator.config.block_size)
