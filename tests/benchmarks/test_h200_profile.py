"""The shipped H200 profile is the fit of the committed GPU run, and it reproduces that run."""

import json

import pytest

from benchmarks.sim.cost_model import CostModel, HardwareProfile
from benchmarks.sim.gpu_fit import RESULTS, STEP_FIELDS, fit_run

RUN = json.loads(RESULTS.read_text())["gpu-engine"]
H200 = HardwareProfile.load("h200-llama8b")


def test_the_profile_holds_the_fit_of_the_committed_run():
    fitted = fit_run(RUN)
    for name in (*STEP_FIELDS, "h2d_bytes_per_s", "d2h_bytes_per_s", "device_copy_bytes_per_s"):
        assert getattr(H200, name) == pytest.approx(fitted[name], rel=1e-12), name
    assert H200.fit["relative_errors"] == pytest.approx(fitted["relative_errors"])
    assert RESULTS.name in H200.fit["source"]


def test_the_profile_reproduces_the_measured_steps_and_copies():
    cost = CostModel(H200, block_size=16, token_scale=1.0)
    for d in RUN["decode"]:  # the decode steps, within 1%
        predicted = H200.step_fixed_s + cost.decode_s(d["batch"], d["batch"] * d["context"])
        assert predicted == pytest.approx(d["step_ms"] / 1e3, rel=0.01), d
    for p in RUN["prefill"]:  # chunk by chunk, as the engine schedules them; within 12%
        chunk = p["chunk"]
        starts = range(0, p["tokens"], chunk)
        predicted = sum(H200.step_fixed_s + cost.prefill_s(chunk, start) for start in starts)
        assert predicted == pytest.approx(p["ms"] / 1e3, rel=0.12), p
    ceilings = RUN["ceilings"]
    assert H200.h2d_bytes_per_s / 2**30 == pytest.approx(51.56, abs=0.01)
    assert H200.d2h_bytes_per_s / 2**30 == pytest.approx(ceilings["d2h_gib_per_s"])
    block_bytes = 16 * H200.kv_bytes_per_token
    assert cost.load_s(64) == pytest.approx(2e-5 + 64 * block_bytes / H200.h2d_bytes_per_s)


def test_an_overlapped_store_costs_its_gather_and_a_synchronous_one_its_bus_copy():
    cost = CostModel(H200, block_size=16, token_scale=1.0)
    block_bytes = 16 * H200.kv_bytes_per_token
    assert cost.store_s(128) == pytest.approx(2 * 128 * block_bytes / 4143.117882461613e9)
    assert cost.store_s(128) < 0.03 * cost.load_s(128)  # the bus copy overlaps the step
    cpu = CostModel(HardwareProfile.load("cpu-tiny"), block_size=16, token_scale=1.0)
    p = cpu.profile
    assert not p.stores_overlap_compute and p.device_copy_bytes_per_s == 0.0
    assert cpu.store_s(8) == pytest.approx(
        p.transfer_latency_s + 8 * 16 * p.kv_bytes_per_token / p.d2h_bytes_per_s
    )
