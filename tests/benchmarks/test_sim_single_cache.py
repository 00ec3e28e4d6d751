"""The single-cache ideal (``benchmarks.sim.single_cache``) and the generated agentic trace
(``benchmarks.sim.agentic_trace``)."""

import statistics

import pytest

from benchmarks.sim.agentic_trace import AgenticShape, generate
from benchmarks.sim.cost_model import CostModel, HardwareProfile
from benchmarks.sim.single_cache import single_cache
from benchmarks.sim.trace import TraceRecord, expand

COST = CostModel(HardwareProfile.load("h200-llama8b"), 16, 32.0)


def _requests(*hash_ids: tuple[int, ...]) -> list:
    records = [TraceRecord(i, len(ids) * 512, 32, ids) for i, ids in enumerate(hash_ids)]
    return expand(records, 16)


def test_hits_are_leading_blocks_but_the_last_token() -> None:
    # 4 blocks cold, then 4 cached of 6 (the 6-block prompt may reuse up to 5), then 3 of 3
    # cached but only 2 usable (its last token is computed).
    requests = _requests((1, 2, 3, 4), (1, 2, 3, 4, 5, 6), (1, 2, 3))
    figures = single_cache(requests, 100, 16, COST)
    assert figures["hit_rate"] == pytest.approx((4 + 2) * 16 / ((4 + 6 + 3) * 16))
    assert figures["ttft_mean_s"] > 0 and figures["ttft_p90_s"] >= figures["ttft_p50_s"]


def test_a_full_cache_evicts_the_deepest_blocks_first() -> None:
    # Capacity 4: after (1,2,3,4) and (7,8), blocks 3 and 4 went, 1 and 2 stay.
    requests = _requests((1, 2, 3, 4), (7, 8), (1, 2, 3, 4, 5))
    figures = single_cache(requests, 4, 16, COST)
    assert figures["hit_rate"] == pytest.approx(2 * 16 / ((4 + 2 + 5) * 16))


def test_the_agentic_trace_is_deterministic_and_shaped_as_said() -> None:
    shape = AgenticShape(num_requests=2000)
    records = generate(shape)
    assert records == generate(shape)
    assert len(records) == 2000
    assert [r.timestamp_ms for r in records] == sorted(r.timestamp_ms for r in records)
    assert 6000 < statistics.fmean(r.input_length for r in records) < 11000
    assert 150 < statistics.fmean(r.output_length for r in records) < 210
    for record in records:  # 512 tokens a hash id, the last one possibly partial
        assert len(record.hash_ids) == -(-record.input_length // 512)
