"""What ``auto`` means on this machine: the dtype and the way of keeping linear weights that
run this model fastest here, chosen by timing them at start-up, never by a CPU-flag rule.

Machines differ: the packed int4 and int8 kernels are the fastest decode on one CPU and the
slowest prefill on another; bfloat16 speeds one CPU's prefill up and slows another's down
(figures: docs/design.md section 12). So each candidate is built and timed on this CPU, with
this process's threads, for a fraction of a second; a checkpoint's candidate as a probe of a few
of its layers, whose timings are priced at the model's depth (``at_depth``, ``time_rest``;
``replicas.model.streamed``; a probe's forwards skip the LM head, timed once per form of it):

* prefill: one forward of ``PREFILL_TOKENS`` fresh tokens, per token;
* decode: one forward of a single token after ``DECODE_CONTEXT_TOKENS`` of context.

Both run over a block KV cache in the configured ``kv_cache_dtype`` (``replicas.model.kv_format``):
8-bit K/V attend in float32 whatever the engine dtype, so the KV format can move the choice.

Each figure is the fastest of its runs (the one least disturbed by other processes):
``REPEATS`` prefills, ``DECODE_REPEATS`` decode steps (a step is short, so a burst of another
process's work could otherwise decide between two candidates whose steps differ well beyond
noise). The runs are spread over ``REPEATS`` rounds, each a prefill then a third of the decode
steps, so that one slow stretch of a shared VM (its host's other guests) cannot hold all of a
candidate's runs. A round's decode steps stop early once they have taken ``DECODE_ROUND_S`` (at
least ``MIN_DECODE_STEPS`` of them): a small model's candidates take a
fraction of a second each as before, and a large model's slow candidates (a dense float32 decode
step reads every weight: 4 GB for a billion parameters) take a few of their steps, not thirty.
A candidate whose rounds so far price its request at more than ``OUT_OF_THE_RUNNING`` times
the best one timed before it is timed no further (a dense float32 build of a quantized file,
say: it can be neither the choice nor a finalist). The first pass times each build (dtype,
quantization and int4 kernel) with the native stack only, where it has one. The finalists'
builds are then timed again in the reverse order, each with every stack, each figure the
faster of its timings: the first pass's choice, the twins it
was weighed against below, and every candidate within ``FINALIST_MARGIN`` of its request: a
shared VM's slow stretch can last longer than a candidate's rounds. The eager stack runs the
native loop's ops with Python between them, so it matters only between builds close enough
to be finalists; timing it for every build took a large share of a measured start-up
(benchmarks/README.md). (What each of these rules was seen to prevent is in docs/design.md
section 12.)
The candidates are priced by the time of one representative request (``PROMPT_TOKENS`` of
prefill and ``OUTPUT_TOKENS`` of decode) and the cheapest wins, with one more rule: a candidate
in a narrower dtype than float32 is eligible only where it measured faster than float32 with the
same weights and stack in prefill and in decode both (a narrower dtype costs precision, so it
must pay in both phases); and a candidate with Strata's int4 kernel is eligible only where it
measured faster than the same candidate with torch's kernel in prefill and in decode both (its
activations pass through int8 twice, and a prefill chunk's many rows stand for a batch of
decodes too, which one request's price leaves out; how the two kernels compare differs between
CPUs). A weighted sum of the two times never picks a candidate that another eligible one
beat in both.

The candidates: both dtypes (``CANDIDATE_DTYPES``) where ``dtype`` is ``auto``; ``none``,
``int8`` and ``int4`` where ``quantization`` is ``auto`` and the checkpoint is stored quantized
(a GGUF file of 4- to 8-bit tensors), else ``none`` (a float checkpoint is never quantized
unasked, and on CUDA, where there are no packed kernels, neither is a quantized one: there
``replicas.model.device_defaults`` fixes the dtype and quantization before any timing); and both
ways of running the layers where ``decoder_stack`` is ``auto`` and the model can run natively
here (``eager``, module by module in Python, and ``native``, one C++ loop over the same ops:
``replicas.model.native_stack``; the same outputs bitwise, so only their speed is chosen
between), an int4 one natively with each int4 kernel where ``int4_kernel`` is ``auto``. Each
dtype, quantization and kernel is built once and timed each way. An explicit ``dtype``,
``quantization``, ``decoder_stack`` or ``int4_kernel`` fixes that part of the choice.

On CUDA every timed forward is synchronized before and after, and the CPU share below is not
taken (a process timing a GPU waits on it). A measurement taken while another process competed
for the CPU is a guess about a quieter machine: while the candidates are timed, ``CPUShare``
compares this process's CPU time with the wall time its threads had. Below ``MIN_CPU_SHARE``
(another process took the cores) the choice is logged as measured on a busy machine and kept
only for this start's scope (``SCOPE_ENV``: the replica actor sets it to its deployment's Ray
job unless the environment names a scope already, so the other replicas of the deployment and
their restarts take the same choice, even after a quieter start elsewhere measured another); any
other start measures again.

Every replica of a deployment must run the same choice: a greedy request must give the same
tokens whichever replica serves it (or resumes it). So the measurement is taken under an
exclusive lock on the cache file (``<cache>.lock``): replicas starting together on one node
measure one at a time, and each reads the cache again once it holds the lock, so the first
one's choice is every other's. Replicas on other nodes measure their own CPU.

The choice is kept in a small JSON file per machine (``cache_path``), keyed by the CPU's model
name and flags, torch's version and CPU capability, the thread count, the device, the model's
files and the candidates, so a restart does not measure again; ``STRATA_AUTOTUNE_CACHE`` names
another file, or ``off`` for none. ``benchmarks/engine_vs_llamacpp.py`` reports the choice and the
timings it was made from beside every configuration measured.
"""

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from replicas.dtypes import torch_dtype
from replicas.model.autotune_cache import CACHE_ENV as CACHE_ENV
from replicas.model.autotune_cache import CHOICE_RULES as CHOICE_RULES
from replicas.model.autotune_cache import ISA_LIMITS as ISA_LIMITS
from replicas.model.autotune_cache import cache_key as cache_key
from replicas.model.autotune_cache import cache_path as cache_path
from replicas.model.autotune_cache import cpu_facts as cpu_facts
from replicas.model.autotune_cache import locked, read_cache, write_cache
from replicas.model.autotune_timing import DECODE_CONTEXT_TOKENS as DECODE_CONTEXT_TOKENS
from replicas.model.autotune_timing import DECODE_REPEATS as DECODE_REPEATS
from replicas.model.autotune_timing import DECODE_ROUND_S as DECODE_ROUND_S
from replicas.model.autotune_timing import MIN_DECODE_STEPS as MIN_DECODE_STEPS
from replicas.model.autotune_timing import PREFILL_TOKENS as PREFILL_TOKENS
from replicas.model.autotune_timing import REPEATS as REPEATS
from replicas.model.autotune_timing import at_depth as at_depth
from replicas.model.autotune_timing import synchronize as synchronize
from replicas.model.autotune_timing import time_model as time_model
from replicas.model.autotune_timing import time_rest as time_rest
from replicas.model.transformer import Transformer

logger = logging.getLogger(__name__)

CANDIDATE_DTYPES = ("float32", "bfloat16")
QUANTIZED_CANDIDATES = ("none", "int8", "int4")
PROMPT_TOKENS = 256
"""Prompt tokens computed by the representative request (what prefix caching leaves to do)."""
OUTPUT_TOKENS = 128
MIN_CPU_SHARE = 0.8
"""Below this share of its threads' wall time on a CPU, a measurement is not cached."""
SCOPE_ENV = "STRATA_AUTOTUNE_SCOPE"
"""Names the deployment a start belongs to; a busy machine's choice is reused within it only."""


class Candidate(NamedTuple):
    dtype: str  # a name of replicas.dtypes.TORCH_DTYPES
    quantization: str  # none, int8 or int4 (replicas.model.quant)
    stack: str = "eager"  # how the layers run: eager or native (replicas.model.native_stack)
    kernel: str = "torch"  # int4's product: torch's packed kernel or Strata's (quant.py)

    def __str__(self) -> str:
        kernel = "-strata" if self.kernel == "strata" else ""
        return f"{self.dtype}/{self.quantization}{kernel}/{self.stack}"


class Timing(NamedTuple):
    candidate: Candidate
    prefill_s_per_token: float
    decode_s: float  # one decode step of one sequence

    @property
    def request_s(self) -> float:
        """The time of the representative request: what candidates are priced by."""
        return PROMPT_TOKENS * self.prefill_s_per_token + OUTPUT_TOKENS * self.decode_s


class Choice(NamedTuple):
    """What ``auto`` resolved to, and why: ``source`` is ``measured``, ``measured on a busy
    machine`` (cached for this scope only), ``cached`` (measured by an earlier start on this
    machine, or by another replica of this deployment) or ``fixed`` (nothing to choose)."""

    candidate: Candidate
    timings: tuple[Timing, ...]
    source: str

    def describe(self) -> str:
        """One log line: the choice, where it came from and every candidate's timings."""
        if not self.timings:
            return f"{self.candidate} ({self.source})"
        rows = ", ".join(
            f"{t.candidate} prefill {1e3 * t.prefill_s_per_token:.2f} ms/token decode "
            f"{1e3 * t.decode_s:.1f} ms/step request {t.request_s:.2f} s"
            for t in self.timings
        )
        return f"{self.candidate} ({self.source}; {rows})"


def candidates(
    dtype: str,
    quantization: str,
    is_quantized_checkpoint: bool,
    device: torch.device,
    stacks: Sequence[str] = ("eager",),
    int4_kernels: Sequence[str] = ("torch",),
) -> list[Candidate]:
    """The configurations ``auto`` chooses among (see the module docstring); ``stacks``: the
    ways of running the layers that this model can take here; ``int4_kernels``: the int4
    products the native stack can take (the eager stack runs torch's own kernels)."""
    dtypes = CANDIDATE_DTYPES if dtype == "auto" else (dtype,)
    if quantization != "auto":
        quantizations: Sequence[str] = (quantization,)
    elif is_quantized_checkpoint and device.type == "cpu":
        quantizations = QUANTIZED_CANDIDATES
    else:
        quantizations = ("none",)
    return [
        Candidate(d, q, s, k)
        for d in dtypes
        for q in quantizations
        for s in stacks
        for k in (int4_kernels if q == "int4" and s == "native" else ("torch",))
    ]


def choose(timings: Sequence[Timing]) -> Candidate:
    """The cheapest eligible candidate by ``Timing.request_s`` (see the module docstring)."""
    float32 = {t.candidate[1:]: t for t in timings if t.candidate.dtype == "float32"}
    torch_kernel = {t.candidate[:3]: t for t in timings if t.candidate.kernel == "torch"}

    def faster(t: Timing, twin: Timing | None) -> bool:
        """Faster than ``twin`` in both phases, or nothing to beat."""
        if twin is None:
            return True
        return t.prefill_s_per_token < twin.prefill_s_per_token and t.decode_s < twin.decode_s

    def eligible(t: Timing) -> bool:
        if t.candidate.kernel != "torch" and not faster(t, torch_kernel.get(t.candidate[:3])):
            return False
        return t.candidate.dtype == "float32" or faster(t, float32.get(t.candidate[1:]))

    return min(filter(eligible, timings), key=lambda t: t.request_s).candidate


class CPUShare:
    """From its creation on: the CPU time this process used, as a share of the wall time its
    ``torch.get_num_threads()`` threads had (1: nothing else ran on their cores). A process
    timing a GPU waits on the device, so its CPU share says nothing of other processes: there
    it is 1."""

    def __init__(self, device_type: str = "cpu") -> None:
        self._device_type = device_type
        self._wall = time.perf_counter()
        self._cpu = time.process_time()

    def fraction(self) -> float:
        if self._device_type != "cpu":
            return 1.0
        wall = (time.perf_counter() - self._wall) * torch.get_num_threads()
        return (time.process_time() - self._cpu) / wall if wall > 0 else 1.0


def tune(
    options: Sequence[Candidate],
    build: Callable[[Candidate], Transformer],
    key: str,
    cache_file: Path | None,
    timer: Callable[[], float] = time.perf_counter,
    kv_cache_dtype: str = "auto",
    device_type: str = "cpu",
    layers: int | None = None,
) -> Choice:
    """The choice among ``options``: from ``cache_file`` under ``key`` when an earlier start
    measured it, else by timing the model ``build`` makes of each (built and dropped one at a
    time, over a KV cache of ``kv_cache_dtype``) and stored there; a busy machine's choice
    (``CPUShare``) is stored for this start's scope only. Measuring holds the cache's lock, so
    starts on one machine measure in turn. ``layers``: the model's depth, where ``build``
    makes a probe of fewer layers (its timings are priced at this depth: ``at_depth``)."""
    if len(options) == 1:
        return Choice(options[0], (), "fixed")
    scope = os.environ.get(SCOPE_ENV) or None
    how = _How(timer, kv_cache_dtype, device_type, layers, {})
    if cache_file is None:
        return _measure(options, build, how)
    cached = _cached_choice(cache_file, key, options, scope)
    if cached is not None:
        return cached
    with locked(cache_file):
        cached = _cached_choice(cache_file, key, options, scope)  # measured while we waited
        if cached is not None:
            return cached
        choice = _measure(options, build, how)
        if choice.source == "measured":
            write_cache(cache_file, key, choice)
        elif scope is not None:
            write_cache(cache_file, _scoped(key, scope), choice)
    return choice


def _cached_choice(
    cache_file: Path, key: str, options: Sequence[Candidate], scope: str | None
) -> Choice | None:
    """This scope's own choice first (a busy machine's, which its replicas keep even after a
    quieter start measured), then the machine's."""
    data = read_cache(cache_file)
    for name in ([_scoped(key, scope)] if scope else []) + [key]:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            return _choice_from_json(data[name], options)
    return None


def _scoped(key: str, scope: str) -> str:
    return f"{key}@{scope}"


class _How(NamedTuple):
    """How candidates are timed (see ``tune``)."""

    timer: Callable[[], float]
    kv_cache_dtype: str
    device_type: str
    layers: int | None  # the model's depth, where the built models are probes
    rests: dict  # time_rest's timings by the form of the probe's embedding and LM head


def _measure(
    options: Sequence[Candidate], build: Callable[[Candidate], Transformer], how: _How
) -> Choice:
    share = CPUShare(how.device_type)
    builds = list(dict.fromkeys(_build_of(c) for c in options))  # each built once a pass
    timings = _timed(builds, _first_pass(options), build, how)
    # The finalists' builds again, in the reverse order and with every stack: a slow stretch
    # of a shared VM that held one finalist's first runs must not decide between it and its
    # rival.
    again_builds = {_build_of(c) for c in _finalists(list(timings.values()))}
    again_options = [c for c in options if _build_of(c) in again_builds]
    if len(again_options) > 1:
        order = [b for b in reversed(builds) if b in again_builds]
        for candidate, t in _timed(order, again_options, build, how).items():
            first = timings.get(candidate, t)
            timings[candidate] = Timing(
                candidate,
                min(first.prefill_s_per_token, t.prefill_s_per_token),
                min(first.decode_s, t.decode_s),
            )
    measured = tuple(timings.values())
    fraction = share.fraction()
    if fraction < MIN_CPU_SHARE:
        logger.warning(
            "auto: this process had %.0f%% of its threads' CPU time while timing the "
            "candidates (another process was busy); the choice serves this deployment only and "
            "is measured again by the next",
            100 * fraction,
        )
        return Choice(choose(measured), measured, "measured on a busy machine")
    return Choice(choose(measured), measured, "measured")


FINALIST_MARGIN = 1.2
"""A candidate whose request costs at most this much more than the choice's is timed again."""
OUT_OF_THE_RUNNING = 2.0
"""A candidate whose rounds so far price its request at more than this many times the best one
timed before it is timed no further: it can be neither the choice nor a finalist
(``FINALIST_MARGIN``) unless its remaining rounds ran more than this much faster."""


def _finalists(timings: Sequence[Timing]) -> list[Candidate]:
    """The first pass's choice, the twins ``choose`` weighed it against (float32, torch's
    int4 kernel) and every candidate within ``FINALIST_MARGIN`` of its request: what a second
    timing could change the choice among."""
    chosen = choose(timings)
    by_candidate = {t.candidate: t for t in timings}
    twins = {chosen._replace(dtype="float32"), chosen._replace(kernel="torch")}
    limit = FINALIST_MARGIN * by_candidate[chosen].request_s
    return [
        t.candidate
        for t in timings
        if t.candidate == chosen or t.candidate in twins or t.request_s <= limit
    ]


def _build_of(candidate: Candidate) -> tuple[str, str, str]:
    """What a model is built for: the candidate but for its stack."""
    return candidate.dtype, candidate.quantization, candidate.kernel


def _first_pass(options: Sequence[Candidate]) -> list[Candidate]:
    """The candidates the first pass times: each build's native ones where it has them."""
    native = {_build_of(c) for c in options if c.stack == "native"}
    return [c for c in options if c.stack == "native" or _build_of(c) not in native]


def _timed(
    builds: Sequence[tuple[str, str, str]],
    options: Sequence[Candidate],
    build: Callable[[Candidate], Transformer],
    how: _How,
) -> dict[Candidate, Timing]:
    """Each of ``options`` timed, its model built once per (dtype, quantization, kernel) in
    the order of ``builds`` (none that no option needs) and dropped before the next; a probe's
    timings priced at the model's depth (what is not its layers timed by ``time_rest`` once
    per form of the embedding and LM head: int8 and torch's int4 builds keep a Q8_0 head
    alike)."""
    timings = {}
    for dtype_name, quantization, kernel in builds:
        if not any(_build_of(c) == (dtype_name, quantization, kernel) for c in options):
            continue
        model = build(Candidate(dtype_name, quantization, kernel=kernel))
        dtype = torch_dtype(dtype_name)
        depth = model.args.num_layers
        rests = None
        if how.layers is not None and depth < how.layers:
            head = (dtype_name, type(model.output).__name__, model.output.extra_repr())
            if head not in how.rests:
                how.rests[head] = rest_and_head(model, dtype, how.timer, how.kv_cache_dtype)
            rests = how.rests[head]
        for candidate in options:
            if candidate[:2] + candidate[3:] != (dtype_name, quantization, kernel):
                continue
            model.use_native_stack(candidate.stack == "native")
            price = _Priced(candidate, rests, depth, how.layers)
            best = min((t.request_s for t in timings.values()), default=math.inf)

            def out(prefill: float, decode: float) -> bool:
                return price(prefill, decode).request_s > OUT_OF_THE_RUNNING * best  # noqa: B023

            # a probe without the LM head, which its rests time once per form
            timed = time_model(model, dtype, how.timer, how.kv_cache_dtype, rests is None, out)
            timings[candidate] = price(*timed)
        del model
    return timings


class _Priced(NamedTuple):
    """A candidate's timing from a model's figures: a probe's priced at the model's depth."""

    candidate: Candidate
    rests: tuple | None  # rest_and_head's figures where the model is a probe
    depth: int
    layers: int | None

    def __call__(self, prefill: float, decode: float) -> Timing:
        if self.rests is None:
            return Timing(self.candidate, prefill, decode)
        priced = at_depth((prefill, decode), self.rests[0], self.depth, self.layers, self.rests[1])
        return Timing(self.candidate, *priced)


def rest_and_head(
    model: Transformer,
    dtype: torch.dtype,
    timer: Callable[[], float] = time.perf_counter,
    kv_cache_dtype: str = "auto",
) -> tuple[tuple[float, float], tuple[float, float]]:
    """What is not a probe's layers (``time_rest``) without the LM head, and the head's own
    times (the rest with it, less the rest without it): a probe's forwards skip the head, which
    at a large vocabulary costs as much as several of its layers."""
    body = time_rest(model, dtype, timer, kv_cache_dtype, logits=False)
    whole = time_rest(model, dtype, timer, kv_cache_dtype)
    return body, tuple(max(0.0, w - b) for w, b in zip(whole, body, strict=True))


def _choice_from_json(entry: dict, options: Sequence[Candidate]) -> Choice:
    candidate = Candidate(*entry["choice"])
    timings = tuple(Timing(Candidate(*c), float(p), float(s)) for *c, p, s in entry["timings"])
    if candidate not in options:
        raise ValueError(f"cached choice {candidate} is not a candidate")
    return Choice(candidate, timings, "cached")
