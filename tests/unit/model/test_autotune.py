"""What ``auto`` resolves to: the rule over measured timings, the measurement (with a stub
timer), the per-machine cache, and a real quantized file loaded with ``auto``."""

import itertools
import json
import threading
import time

import pytest
import torch

from replicas.model import autotune, load_model
from replicas.model.autotune import Candidate, Timing, choose, tune

F32_NONE, F32_INT4 = Candidate("float32", "none"), Candidate("float32", "int4")
BF16_NONE, BF16_INT4 = Candidate("bfloat16", "none"), Candidate("bfloat16", "int4")


class FixedShare:
    """A ``CPUShare`` that reports ``fraction``: the stub-clock tests must not depend on what
    else the test machine runs."""

    fraction_value = 1.0

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type

    def fraction(self) -> float:
        return self.fraction_value


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    monkeypatch.setattr(autotune, "CPUShare", FixedShare)
    monkeypatch.setattr(FixedShare, "fraction_value", 1.0)
    monkeypatch.delenv(autotune.SCOPE_ENV, raising=False)


def timing(candidate: Candidate, prefill_ms: float, decode_ms: float) -> Timing:
    return Timing(candidate, prefill_ms / 1e3, decode_ms / 1e3)


def test_the_cheapest_request_wins():
    timings = [timing(F32_NONE, 2.0, 60), timing(F32_INT4, 5.0, 20)]
    # 256 x 2 + 128 x 60 = 8.2 s against 256 x 5 + 128 x 20 = 3.8 s
    assert choose(timings) == F32_INT4
    timings = [timing(F32_NONE, 1.0, 30), timing(F32_INT4, 5.0, 25)]
    assert choose(timings) == F32_NONE


def test_bfloat16_only_where_it_is_faster_in_prefill_and_decode_both():
    # Cheaper overall (prefill 6x faster) but slower to decode than float32: not eligible.
    timings = [timing(F32_NONE, 6.0, 20), timing(BF16_NONE, 1.0, 21)]
    assert choose(timings) == F32_NONE
    timings = [timing(F32_NONE, 6.0, 20), timing(BF16_NONE, 5.9, 19.9)]
    assert choose(timings) == BF16_NONE
    # Its twin is the float32 candidate with the same weights, not any float32 candidate.
    timings = [
        timing(F32_NONE, 2.0, 60),
        timing(F32_INT4, 5.0, 20),
        timing(BF16_NONE, 1.0, 55),
        timing(BF16_INT4, 4.0, 21),
    ]
    assert choose(timings) == F32_INT4


def test_strata_int4_only_where_it_is_faster_than_torchs_in_prefill_and_decode_both():
    torch4 = Candidate("float32", "int4", "native")
    strata4 = Candidate("float32", "int4", "native", "strata")
    # Cheaper overall (decode 1 ms faster) but slower to prefill: not eligible.
    assert choose([timing(torch4, 1.1, 6.0), timing(strata4, 1.4, 5.0)]) == torch4
    assert choose([timing(torch4, 1.1, 6.0), timing(strata4, 1.0, 5.9)]) == strata4
    # A bfloat16 one must beat its float32 twin with the same kernel too.
    bf16_strata = Candidate("bfloat16", "int4", "native", "strata")
    timings = [timing(torch4, 1.1, 6.0), timing(strata4, 1.0, 5.5), timing(bf16_strata, 0.9, 5.6)]
    assert choose(timings) == strata4


@pytest.mark.parametrize("seed", range(20))
def test_never_a_candidate_another_eligible_one_beat_in_both(seed):
    gen = torch.Generator().manual_seed(seed)
    options = autotune.candidates(
        "auto", "auto", True, torch.device("cpu"), ("eager", "native"), ("torch", "strata")
    )
    timings = [
        timing(c, *(float(v) for v in torch.rand(2, generator=gen) * 50 + 1)) for c in options
    ]
    chosen = next(t for t in timings if t.candidate == choose(timings))
    for other in timings:
        beats = (
            other.prefill_s_per_token < chosen.prefill_s_per_token
            and other.decode_s < chosen.decode_s
        )
        twins = [Candidate("float32", *other.candidate[1:])]
        if other.candidate.kernel == "strata":
            twins.append(other.candidate._replace(kernel="torch"))
        eligible = all(
            other.prefill_s_per_token < twin.prefill_s_per_token and other.decode_s < twin.decode_s
            for twin in (next(t for t in timings if t.candidate == c) for c in twins)
            if twin.candidate != other.candidate
        )
        assert not (beats and eligible), (other, chosen)


def test_candidates_follow_what_is_fixed_and_what_the_checkpoint_stores():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert autotune.candidates("auto", "auto", True, cpu) == [
        Candidate(d, q) for d in ("float32", "bfloat16") for q in ("none", "int8", "int4")
    ]
    assert autotune.candidates("auto", "auto", False, cpu) == [F32_NONE, BF16_NONE]
    assert autotune.candidates("auto", "auto", True, cuda) == [F32_NONE, BF16_NONE]
    assert autotune.candidates("float32", "auto", True, cpu) == [
        F32_NONE,
        Candidate("float32", "int8"),
        F32_INT4,
    ]
    assert autotune.candidates("bfloat16", "int4", True, cpu) == [BF16_INT4]
    # Both ways of running the layers, where the model can run natively here.
    assert autotune.candidates("bfloat16", "int4", True, cpu, ("eager", "native")) == [
        BF16_INT4,
        Candidate("bfloat16", "int4", "native"),
    ]
    # Both int4 kernels, for int4 on the native stack only.
    both = ("torch", "strata")
    assert autotune.candidates("bfloat16", "auto", True, cpu, ("eager", "native"), both) == [
        Candidate("bfloat16", q, s, k)
        for q in ("none", "int8", "int4")
        for s in ("eager", "native")
        for k in (both if (q, s) == ("int4", "native") else ("torch",))
    ]


def test_a_narrower_dtypes_twin_runs_the_same_stack():
    f32_native, bf16_native = (
        Candidate("float32", "none", "native"),
        BF16_NONE._replace(stack="native"),
    )
    timings = [
        timing(F32_NONE, 6.0, 30),
        timing(f32_native, 5.0, 20),
        timing(BF16_NONE, 4.0, 25),  # faster than float32 eager, slower than float32 native
        timing(bf16_native, 4.5, 21),  # slower to decode than its twin (float32 native)
    ]
    assert choose(timings) == f32_native
    timings[-1] = timing(bf16_native, 4.5, 19)
    assert choose(timings) == bf16_native


class StubClock:
    """A clock that advances ``cost[candidate]`` seconds per forward timed: two reads of the
    clock bracket one forward."""

    def __init__(self, cost: dict[Candidate, float]) -> None:
        self.cost = cost
        self.current: Candidate | None = None
        self.now = 0.0
        self._reads = itertools.count()

    def __call__(self) -> float:
        if next(self._reads) % 2:  # the end of a forward
            self.now += self.cost[self.current]
        return self.now


def tiny_builder(clock: StubClock):
    def build(candidate: Candidate):
        clock.current = candidate
        return load_model("tiny", torch.device("cpu"), candidate.dtype).model

    return build


def test_tune_measures_each_candidate_and_picks_the_stub_clocks_fastest(tmp_path):
    options = [F32_NONE, BF16_NONE]
    clock = StubClock({F32_NONE: 0.010, BF16_NONE: 0.004})
    choice = tune(options, tiny_builder(clock), "key", tmp_path / "c.json", timer=clock)
    assert choice.source == "measured" and choice.candidate == BF16_NONE
    by_candidate = {t.candidate: t for t in choice.timings}
    # Every forward costs the stub's time: decode one step, prefill per token.
    assert by_candidate[F32_NONE].decode_s == pytest.approx(0.010)
    assert by_candidate[F32_NONE].prefill_s_per_token == pytest.approx(
        0.010 / autotune.PREFILL_TOKENS
    )
    # Slower bfloat16 (in both phases) is never chosen, whatever the price.
    clock = StubClock({F32_NONE: 0.004, BF16_NONE: 0.005})
    assert tune(options, tiny_builder(clock), "other", None, timer=clock).candidate == F32_NONE


def test_a_candidate_out_of_the_running_is_timed_for_one_round_only():
    """After float32's rounds, bfloat16's first round prices it at more than
    ``OUT_OF_THE_RUNNING`` times float32's request: it gets no second round, and the choice
    and its figure (every forward costs the same) are what all its rounds would have given."""
    options = [F32_NONE, BF16_NONE]
    clock = StubClock({F32_NONE: 0.002, BF16_NONE: 0.010})
    forwards = {F32_NONE: 0, BF16_NONE: 0}

    def timer() -> float:
        forwards[clock.current] += 0.5  # two reads of the clock bracket a forward
        return clock()

    choice = tune(options, tiny_builder(clock), "k", None, timer=timer)
    assert choice.candidate == F32_NONE
    by_candidate = {t.candidate: t for t in choice.timings}
    assert by_candidate[BF16_NONE].decode_s == pytest.approx(0.010)
    one_round = 1 + autotune.DECODE_REPEATS // autotune.REPEATS  # a prefill and a burst
    assert forwards[BF16_NONE] == one_round
    assert forwards[F32_NONE] == autotune.REPEATS * one_round  # every round (no finalist else)


def test_the_finalists_are_timed_again_in_reverse_order():
    """A slow stretch of the machine over the first candidate's runs (float32's, 10x) makes
    bfloat16 look faster in both phases; the finalists (bfloat16 and the float32 twin it was
    weighed against) are timed again, bfloat16 first, and float32, faster in both, is chosen."""
    options = [F32_NONE, BF16_NONE, F32_INT4]
    clock = StubClock({F32_NONE: 0.003, BF16_NONE: 0.004, F32_INT4: 0.030})
    built = []

    def build(candidate: Candidate):
        built.append(candidate)
        clock.current = candidate
        return load_model("tiny", torch.device("cpu"), candidate.dtype).model

    first_timing = iter(range(10**6))

    def timer() -> float:
        now = clock()
        # float32's first timing (its first build) runs in the slow stretch
        if built.count(F32_NONE) == 1 and clock.current == F32_NONE and next(first_timing) % 2:
            clock.now += 9 * clock.cost[F32_NONE]
            now = clock.now
        return now

    choice = tune(options, build, "k", None, timer=timer)
    assert built == [F32_NONE, BF16_NONE, F32_INT4, BF16_NONE, F32_NONE]  # F32_INT4 not again
    assert choice.candidate == F32_NONE
    by_candidate = {t.candidate: t for t in choice.timings}
    assert by_candidate[F32_NONE].decode_s == pytest.approx(0.003)
    assert [t.candidate for t in choice.timings] == options


def test_a_restart_takes_the_cached_choice_and_a_new_key_measures_again(tmp_path):
    options = [F32_NONE, BF16_NONE]
    path = tmp_path / "choices.json"
    clock = StubClock({F32_NONE: 0.003, BF16_NONE: 0.008})
    first = tune(options, tiny_builder(clock), "machine-a", path, timer=clock)

    def never(candidate):
        raise AssertionError("a cached choice is not measured again")

    again = tune(options, never, "machine-a", path)
    assert again.source == "cached" and again.candidate == first.candidate == F32_NONE
    assert again.timings == first.timings
    # Another machine, torch or model (another key) measures, and both entries are kept.
    clock = StubClock({F32_NONE: 0.008, BF16_NONE: 0.003})
    other = tune(options, tiny_builder(clock), "machine-b", path, timer=clock)
    assert other.source == "measured" and other.candidate == BF16_NONE
    assert set(json.loads(path.read_text())) == {"machine-a", "machine-b"}
    # A damaged file is measured over, not trusted.
    path.write_text("{not json")
    clock = StubClock({F32_NONE: 0.003, BF16_NONE: 0.008})
    assert tune(options, tiny_builder(clock), "machine-a", path, timer=clock).source == "measured"


def test_a_measurement_on_a_busy_machine_serves_one_start_and_is_not_cached(
    tmp_path, monkeypatch, caplog
):
    options = [F32_NONE, BF16_NONE]
    path = tmp_path / "choices.json"
    monkeypatch.setattr(FixedShare, "fraction_value", 0.45)
    clock = StubClock({F32_NONE: 0.003, BF16_NONE: 0.008})
    with caplog.at_level("WARNING", logger="replicas.model.autotune"):
        busy = tune(options, tiny_builder(clock), "machine-a", path, timer=clock)
    assert busy.source == "measured on a busy machine" and busy.candidate == F32_NONE
    assert not path.exists()  # nothing cached: the next start measures again
    assert "45% of its threads' CPU time" in caplog.text
    monkeypatch.setattr(FixedShare, "fraction_value", 0.95)
    clock = StubClock({F32_NONE: 0.003, BF16_NONE: 0.008})
    quiet = tune(options, tiny_builder(clock), "machine-a", path, timer=clock)
    assert quiet.source == "measured" and set(json.loads(path.read_text())) == {"machine-a"}


def test_a_busy_machines_choice_is_kept_for_its_deployment_only(tmp_path, monkeypatch):
    """The replicas of one deployment (one scope) run one choice, even when it was measured on
    a busy machine and a quieter start elsewhere measured another since."""
    options = [F32_NONE, BF16_NONE]
    path = tmp_path / "choices.json"
    monkeypatch.setattr(FixedShare, "fraction_value", 0.45)
    monkeypatch.setenv(autotune.SCOPE_ENV, "deployment-1")
    # Busy: bfloat16 looked faster in both phases.
    clock = StubClock({F32_NONE: 0.008, BF16_NONE: 0.003})
    busy = tune(options, tiny_builder(clock), "k", path, timer=clock)
    assert (busy.source, busy.candidate) == ("measured on a busy machine", BF16_NONE)

    def never(candidate):
        raise AssertionError("a replica of the deployment measured again")

    assert tune(options, never, "k", path) == busy._replace(source="cached")
    # Another deployment does not take a busy guess: it measures (quietly, float32 wins) ...
    monkeypatch.setattr(FixedShare, "fraction_value", 0.95)
    monkeypatch.setenv(autotune.SCOPE_ENV, "deployment-2")
    clock = StubClock({F32_NONE: 0.003, BF16_NONE: 0.008})
    quiet = tune(options, tiny_builder(clock), "k", path, timer=clock)
    assert (quiet.source, quiet.candidate) == ("measured", F32_NONE)
    # ... and deployment 1's restarted replicas keep its choice; a new one takes the quiet one.
    monkeypatch.setenv(autotune.SCOPE_ENV, "deployment-1")
    assert tune(options, never, "k", path).candidate == BF16_NONE
    monkeypatch.setenv(autotune.SCOPE_ENV, "deployment-3")
    assert tune(options, never, "k", path).candidate == F32_NONE


def test_replicas_starting_together_measure_in_turn_and_share_the_first_choice(tmp_path):
    """The second start waits on the cache's lock while the first measures, then reads its
    choice instead of measuring beside it."""
    options = [F32_NONE, BF16_NONE]
    path = tmp_path / "choices.json"
    measuring, release = threading.Event(), threading.Event()
    clock = StubClock({F32_NONE: 0.003, BF16_NONE: 0.008})
    build = tiny_builder(clock)

    def slow_build(candidate):
        measuring.set()
        assert release.wait(30)
        return build(candidate)

    def never(candidate):
        raise AssertionError("the second start measured beside the first")

    results = {}
    first = threading.Thread(
        target=lambda: results.update(a=tune(options, slow_build, "k", path, timer=clock))
    )
    first.start()
    assert measuring.wait(30)
    second = threading.Thread(target=lambda: results.update(b=tune(options, never, "k", path)))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # waiting on the lock
    release.set()
    first.join(30)
    second.join(30)
    assert results["a"].source == "measured"
    assert results["b"] == results["a"]._replace(source="cached")


def test_cpu_share_tells_a_busy_thread_from_one_that_waits(monkeypatch):
    monkeypatch.undo()  # the real CPUShare
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        share = autotune.CPUShare()
        end = time.process_time() + 0.2
        while time.process_time() < end:
            pass
        working = share.fraction()
        share = autotune.CPUShare()
        time.sleep(0.2)
        waiting = share.fraction()
    finally:
        torch.set_num_threads(threads)
    # The core was this thread's for much of the time (a busy machine shares it), and a
    # sleeping thread's share is near nothing.
    assert working > 0.25 and waiting < 0.1
    # A process timing a GPU waits on it: its CPU share does not make the machine busy.
    share = autotune.CPUShare("cuda")
    time.sleep(0.05)
    assert share.fraction() == 1.0


def test_the_cache_key_follows_the_threads_and_the_model_files(tmp_path):
    cpu = torch.device("cpu")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"1")
    key = autotune.cache_key([model], cpu, [F32_NONE, BF16_NONE])
    assert autotune.cache_key([model], cpu, [F32_NONE, BF16_NONE]) == key
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(before + 1)
        assert autotune.cache_key([model], cpu, [F32_NONE, BF16_NONE]) != key
    finally:
        torch.set_num_threads(before)
    model.write_bytes(b"22")
    assert autotune.cache_key([model], cpu, [F32_NONE, BF16_NONE]) != key
    key = autotune.cache_key([model], cpu, [F32_NONE, BF16_NONE])
    assert autotune.cache_key([model], cpu, [F32_NONE, BF16_NONE], "int8") != key


def test_the_cache_key_follows_the_instruction_set_limits(tmp_path, monkeypatch):
    """Kernels capped below the CPU's instruction sets (to measure a lesser CPU on this one)
    time differently: their choice is not the uncapped one's."""
    for name in autotune.ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"1")
    cpu = torch.device("cpu")
    key = autotune.cache_key([model], cpu, [F32_NONE, BF16_NONE])
    assert autotune.cpu_facts()["isa_limits"] == ""
    monkeypatch.setenv("STRATA_NATIVE_ISA", "avx2")
    assert autotune.cpu_facts()["isa_limits"] == "STRATA_NATIVE_ISA=avx2"
    assert autotune.cache_key([model], cpu, [F32_NONE, BF16_NONE]) != key


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "bfloat16"])
def test_candidates_are_timed_over_the_configured_kv_cache_dtype(kv_cache_dtype, monkeypatch):
    """The timed forwards write and read a cache of the configured KV format: the caches the
    attention sees hold that format's storage dtype and row width."""
    seen = []
    real = autotune.Transformer.forward

    def spy(self, batch, caches, kv_format=None):
        seen.append((kv_format.name, {c.dtype for c in caches.values()}))
        return real(self, batch, caches, kv_format)

    monkeypatch.setattr(autotune.Transformer, "forward", spy)
    model = load_model("tiny", torch.device("cpu"), "float32").model
    prefill, decode = autotune.time_model(model, torch.float32, kv_cache_dtype=kv_cache_dtype)
    assert prefill > 0 and decode > 0
    fmt = model.kv_cache_specs(torch.float32, kv_cache_dtype)["full"].kv_format
    assert seen and all(s == (fmt.name, {fmt.storage_dtype}) for s in seen), seen


def test_a_slow_stretch_as_long_as_all_decode_runs_does_not_decide_the_decode_time():
    """The runs are spread over rounds: a slow stretch of the VM (10 s a run here) as long as
    all the decode runs together, from the fourth timed run on, still leaves some decode runs
    outside it (taken one after another after the prefills, it would hold every one)."""
    model = load_model("tiny", torch.device("cpu"), "float32").model
    durations = iter([0.001] * 3 + [10.0] * autotune.DECODE_REPEATS + [0.001] * 1000)
    clock = [0.0]
    calls = [0]

    def timer() -> float:  # begin, then end: the scripted duration of each timed run
        calls[0] += 1
        if calls[0] % 2 == 0:
            clock[0] += next(durations)
        return clock[0]

    prefill, decode = autotune.time_model(model, torch.float32, timer)
    assert decode == pytest.approx(0.001)
    assert prefill == pytest.approx(0.001 / autotune.PREFILL_TOKENS)


@pytest.mark.parametrize("step_s", [0.001, 1.0])
def test_a_rounds_decode_steps_stop_at_its_time_budget(step_s):
    """A step of 1 ms runs all of a round's share of ``DECODE_REPEATS``; a step of a second (a
    large model's dense candidate) stops each round at ``MIN_DECODE_STEPS``, past the budget."""
    model = load_model("tiny", torch.device("cpu"), "float32").model
    clock, calls, timed = [0.0], [0], []

    def timer() -> float:  # begin, then end: every timed run takes step_s
        calls[0] += 1
        if calls[0] % 2 == 0:
            clock[0] += step_s
            timed.append(step_s)
        return clock[0]

    _, decode = autotune.time_model(model, torch.float32, timer)
    assert decode == pytest.approx(step_s)
    decode_steps = len(timed) - autotune.REPEATS
    if step_s * autotune.DECODE_REPEATS / autotune.REPEATS < autotune.DECODE_ROUND_S:
        assert decode_steps == autotune.DECODE_REPEATS
    else:
        assert decode_steps == autotune.REPEATS * autotune.MIN_DECODE_STEPS


def test_cache_path_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(autotune.CACHE_ENV, "off")
    assert autotune.cache_path() is None
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path / "x.json"))
    assert autotune.cache_path() == tmp_path / "x.json"
    monkeypatch.delenv(autotune.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert autotune.cache_path() == tmp_path / "strata" / "autotune.json"


def test_built_in_models_resolve_auto_to_the_float32_reference():
    loaded = load_model("tiny", torch.device("cpu"), "auto", quantization="auto")
    assert loaded.dtype == torch.float32 and loaded.quantization == "none"
    assert loaded.auto is None
