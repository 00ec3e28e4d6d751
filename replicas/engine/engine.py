"""One replica's engine: requests in, tokens out, one step at a time. No Ray here."""

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from replicas import fake_cuda
from replicas.cache_hints import CacheHints
from replicas.config import EngineConfig, dtype_name_of
from replicas.engine.core import EngineCore, SpecDecodeStats
from replicas.engine.executor import ModelExecutor
from replicas.kv.capacity import CachePlan, plan_cache
from replicas.kv.handover import HANDOVER_BATCH_BLOCKS
from replicas.kv.hashing import BlockHash
from replicas.kv.host_memory import check_host_capacity, host_tier_bytes
from replicas.kv.manager import KVCacheManager, ReloadCosts, ReservationPolicy
from replicas.kv.records import CacheStats, CacheTypeSpec, CacheTypeUsage
from replicas.kv.sizing import PoolSize, device_memory, module_bytes, size_npu_pool

if TYPE_CHECKING:
    from replicas.kv.disk import DiskStats, DiskStore
from replicas.engine.model_runner import ModelRunner
from replicas.engine.output_processor import OutputProcessor
from replicas.engine.prompt_logprobs import PromptLogprobsCache
from replicas.engine.request import Request
from replicas.engine.sampler import Sampler
from replicas.kv.retention import ADAPTIVE, OFF, ON, BlockCosts, RetentionStats, tuning_hint
from replicas.kv.transfer import KVTransfer, TransferStats
from replicas.model import KVCacheSpec, LoadedModel, load_model
from replicas.outputs import RequestOutput
from replicas.prompt import check_prompt_length
from replicas.resume import ResumeState
from replicas.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepTimes:
    """Where a busy engine's time goes: ``step_seconds`` inside its steps, ``gap_seconds``
    between a step and the next one while requests were unfinished (the serving layer's share:
    dispatching outputs, taking requests in, waiting for the event loop)."""

    num_steps: int = 0
    step_seconds: float = 0.0
    gap_seconds: float = 0.0


@dataclass(slots=True)
class EngineStats:
    """A snapshot of one engine's counters and gauges; block usage per cache type."""

    cache: CacheStats
    transfer: TransferStats | None
    num_running: int
    num_waiting: int
    num_preemptions: int
    cache_types: dict[str, CacheTypeUsage] = field(default_factory=dict)
    steps: StepTimes = field(default_factory=StepTimes)
    retention: dict[str, RetentionStats] = field(default_factory=dict)  # with a host tier
    disk: "dict[str, DiskStats]" = field(default_factory=dict)  # with a disk tier
    reload_costs: "ReloadCosts | None" = None  # the disk cost rule's inputs (with a disk tier)
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """The stats of several engines as one: every counter and gauge summed, per cache type
    where they are per cache type."""
    if not stats:
        raise ValueError("no engine stats to sum")
    return functools.reduce(_add, stats)


def _add(a: Any, b: Any) -> Any:
    if a is None or b is None:
        return b if a is None else a
    if dataclasses.is_dataclass(a):
        return type(a)(**{f.name: _add(getattr(a, f.name), getattr(b, f.name)) for f in fields(a)})
    if isinstance(a, tuple):  # a NamedTuple of numbers
        return type(a)(*(x + y for x, y in zip(a, b)))
    if isinstance(a, dict):
        return {k: _add(a.get(k), b.get(k)) for k in {**a, **b}}
    return a + b


class Engine:
    """One replica's model, KV cache and step loop, with text in and text out.

    ``step`` runs ``EngineCore.step`` (schedule -> transfer -> forward -> sample -> update) with
    the model executor, then turns the requests that got a token into ``RequestOutput``s through
    the output processor (detokenization, stop strings, hold-back).
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.device = resolve_device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.loaded = loaded or load_model(
            config.model,
            self.device,
            config.dtype,
            seed=config.seed,
            revision=config.revision,
            quantization=config.quantization,
            kv_cache_dtype=config.kv_cache_dtype,
            decoder_stack="eager" if config.torch_compile else config.decoder_stack,
            int4_kernel=config.int4_kernel,
        )
        if config.torch_compile and self.loaded.model.compiled is None:
            self.loaded.model.compile_layers()
        dtype = self.loaded.dtype
        specs = self.loaded.model.kv_cache_specs(dtype, config.kv_cache_dtype)
        # What ``auto`` resolved to, so that everything after reads the dtypes the engine runs.
        self.config = config = config.model_copy(
            update={
                "dtype": dtype_name_of(dtype),
                "quantization": self.loaded.quantization,
                "decoder_stack": self.loaded.decoder_stack,
                "int4_kernel": self.loaded.int4_kernel,
                "kv_cache_dtype": next(iter(specs.values())).kv_format.name,
            }
        )
        self.tokenizer = self.loaded.tokenizer
        self.block_size = config.block_size
        pool = self._size_npu_pool(specs)
        plan = plan_cache(specs, config, self.loaded.args.max_position_embeddings, pool.num_blocks)
        self.num_npu_blocks = plan.num_npu_blocks[next(iter(specs))]
        self.max_model_len = pool.max_model_len
        if plan.num_host_blocks:  # fail before any bookkeeping is built
            pools = [n * plan.block_bytes[g] for g, n in plan.num_host_blocks.items()]
            check_host_capacity(host_tier_bytes(pools, pinned=self.device.type == "cuda"))
        self.runner = ModelRunner(
            self.loaded,
            plan.num_npu_blocks,
            self.block_size,
            self.device,
            dtype,
            config.kv_cache_dtype,
            max_num_seqs=config.scheduler_config.max_num_seqs,
            max_model_len=self.max_model_len,
            cuda_graphs=config.cuda_graphs,
        )
        self.disk = self._open_disk(plan.num_disk_blocks) if plan.num_disk_blocks else None
        self.kv_cache = self._kv_cache_manager(specs, plan)
        self.transfer = (
            KVTransfer(self.runner.kv_caches, plan.num_host_blocks, disk=self.disk)
            if plan.num_host_blocks
            else None
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._grammar = None  # a GrammarCompiler, built for the first structured request
        self.sampler = Sampler(
            config.seed, self.device, self.tokenizer.eos_token_ids, grammar=self._compiler
        )
        self.core = self._engine_core()
        self._step_times = StepTimes()
        self._busy_since: float | None = None  # end of the last step, while work remained
        self._compute = _ComputeTime()  # per token, from steps with a prefill's worth of tokens
        self.tuning_hint_interval_s = (
            config.scheduler_config.kv_offload_config.tuning_hint_interval_s
            if plan.num_host_blocks
            else None
        )
        self._last_hint = time.monotonic()
        logger.info(
            "engine: model %s on %s (%s, weights: %s, KV: %s, layers: %s), block size %d, "
            "max_model_len %d",
            self.loaded.name,
            self.device,
            config.dtype,
            self.loaded.quantization + ("/strata" if config.int4_kernel == "strata" else ""),
            config.kv_cache_dtype,
            "torch.compile" if config.torch_compile else config.decoder_stack,
            self.block_size,
            self.max_model_len,
        )

    def _kv_cache_manager(self, specs: dict[str, KVCacheSpec], plan: CachePlan) -> KVCacheManager:
        """The replica's KV cache: one cache type per KV spec, sized by ``plan``, with the
        configured prefix-cache and host-tier policies."""
        sched = self.config.scheduler_config
        offload = sched.kv_offload_config
        return KVCacheManager(
            block_size=self.block_size,
            cache_types=[
                CacheTypeSpec(
                    g, plan.num_npu_blocks[g], plan.num_host_blocks.get(g, 0), spec.sliding_window
                )
                for g, spec in specs.items()
            ],
            enable_prefix_caching=sched.prefix_cache_config.enabled,
            reservations=ReservationPolicy(sched.prefix_cache_config.reservation_share),
            write_through_threshold=offload.promotion_threshold,
            write_back=offload.write_back,
            retention=offload.retention,
            curve_sample_rate=offload.miss_ratio_curve_sample_rate,
            disk=self.disk,
            retained_share=offload.retained_share,
            reuse_partial_blocks=True,
        )

    def _engine_core(self) -> EngineCore:
        """The step loop over this engine's scheduler config, cache, executor and transfer."""
        return EngineCore(
            self.config.scheduler_config,
            self.kv_cache,
            ModelExecutor(self.runner, self.sampler, self.tokenizer.vocab_size),
            max_model_len=self.max_model_len,
            eos_token_ids=frozenset(self.tokenizer.eos_token_ids),
            transfer=self.transfer,
            text=self.output_processor,
            prompt_scores=PromptLogprobsCache(self.block_size),
        )

    def _open_disk(self, num_disk_blocks: dict[str, int]) -> "dict[str, DiskStore]":
        """One disk store per cache type under the configured path, keyed by this model's
        fingerprint (a store that cannot open its files is off, with a warning)."""
        from replicas.kv.disk import DiskStore, model_fingerprint

        loaded = self.loaded
        architecture = f"{type(loaded.model).__name__}|{loaded.args!r}|{loaded.quantization}"
        # The KV dtype (format) is the layout of the blocks' bytes: another one, another directory.
        fingerprint = model_fingerprint(
            loaded.model, architecture, self.config.kv_cache_dtype, self.block_size
        )
        path = self.config.scheduler_config.kv_offload_config.disk_path
        return {
            cache_type: DiskStore(
                path,
                fingerprint,
                cache_type,
                tuple(self.runner.kv_caches[cache_type].shape[1:]),
                self.runner.kv_caches[cache_type].dtype,
                num_slots,
                max_retained=int(
                    self.config.scheduler_config.kv_offload_config.retained_share * num_slots
                ),
            )
            for cache_type, num_slots in num_disk_blocks.items()
        }

    def close(self) -> None:
        """Hand the planned disk writes to the disk stores, land every copy still in flight
        (the cache manager unlocks their host blocks) and unpin the host slab, then finish the
        disk writes and release the disk slabs (no-op without a host tier)."""
        if self.disk:
            for _ in range(2):  # a landed host store plans its disk store at threshold 0
                self.core.run_transfers(self.kv_cache.take_transfer_plan(), wait=True)
        if self.transfer is not None:
            for landed in self.transfer.close():
                self.kv_cache.complete_transfer(landed)
        for store in (self.disk or {}).values():
            store.close()

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        cache_hints: CacheHints | None = None,
        resumed: ResumeState | None = None,
    ) -> Request:
        """Queue a request. Raises ``ValueError`` for a prompt the engine can never serve.
        ``cache_hints``: the prefix to retain in the host and disk tiers, and for how long.
        ``resumed``: the output a lost replica generated for it (``replicas.resume``)."""
        params = sampling_params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.validate_prompt(prompt)
        self.validate_params(params)
        if resumed is not None:
            self.validate_resumed(len(token_ids), params, resumed)
        request = Request(
            request_id,
            token_ids,
            params,
            self.block_size,
            cache_salt=cache_salt,
            prompt=text,
            arrival_time=arrival_time,
            cache_hints=cache_hints,
            resumed=resumed,
        )
        self.core.add(request)
        self.output_processor.add(request, resumed.num_emitted_chars if resumed else 0)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; None if it is unknown or already finished."""
        request = self.core.abort(request_id)
        if not self.core.has_unfinished_requests():
            self._busy_since = None  # idle from here on: not a gap between steps
        return self._outputs([request])[0] if request is not None else None

    def shed_waiting(self) -> list[str]:
        """Drop every waiting request that has produced no output here, freeing its blocks,
        for the caller to route elsewhere; returns their ids. Running requests continue."""
        shed = self.core.shed_waiting()
        for request in shed:
            self.output_processor.release(request.request_id)
        if not self.core.has_unfinished_requests():
            self._busy_since = None
        return [request.request_id for request in shed]

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (not yet running, or preempted)."""
        return self.core.num_waiting

    @property
    def num_unfinished(self) -> int:
        return self.core.num_unfinished

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the requests that produced a token or finished."""
        start = time.perf_counter()
        times = self._step_times
        if self._busy_since is not None:
            times.gap_seconds += start - self._busy_since
        tokens_before = self.core.num_scheduled_tokens
        outputs = self._outputs(self.core.step())
        end = time.perf_counter()
        times.num_steps += 1
        times.step_seconds += end - start
        self._busy_since = end if self.core.has_unfinished_requests() else None
        if self.transfer is not None:
            self._after_step(end - start, self.core.num_scheduled_tokens - tokens_before)
        return outputs

    def _after_step(self, seconds: float, num_tokens: int) -> None:
        """With a host tier: measure what a block costs to compute and to copy, for the
        adaptive policy; log the tuning hint every ``tuning_hint_interval_s``."""
        if num_tokens >= self.block_size:
            self._compute.add(seconds, num_tokens)
        if self._step_times.num_steps % COST_UPDATE_STEPS == 0:
            costs = self.block_costs()
            if costs is not None:
                self.kv_cache.set_block_costs(costs)
        interval = self.tuning_hint_interval_s
        now = time.monotonic()
        if interval is not None and now - self._last_hint >= interval:
            self._last_hint = now
            for line in self.tuning_hints():
                logger.info("%s", line)

    def block_costs(self) -> BlockCosts | None:
        """Measured seconds per block: recompute (from steps that computed at least a block),
        reload and store (the transfers' time per block moved; both share it); None until both
        have been measured."""
        per_token = self._compute.per_token()
        stats = self.transfer.stats if self.transfer else None
        moved = stats.blocks_loaded + stats.blocks_stored if stats else 0
        if per_token is None or not moved:
            return None
        per_copy = stats.seconds / moved
        return BlockCosts(per_token * self.block_size, per_copy, per_copy)

    def tuning_hints(self) -> list[str]:
        """One line per cache type with a host tier (see ``kv_retention.tuning_hint``)."""
        cache = self.kv_cache
        policy = ADAPTIVE if cache.retention == "adaptive" else (ON if cache.write_back else OFF)
        lines = []
        for cache_type, stats in cache.retention_stats().items():
            line = tuning_hint(cache_type, stats, cache.stats.queries, policy)
            if line is not None:
                lines.append(line)
        return lines

    def _outputs(self, requests: list[Request]) -> list[RequestOutput]:
        outputs = [self.output_processor.output(r) for r in requests]
        for request in requests:
            if request.is_finished:
                self.output_processor.release(request.request_id)
        return outputs

    # ---- checks ------------------------------------------------------------------------------
    def _size_npu_pool(self, specs: dict[str, KVCacheSpec]) -> PoolSize:
        """The NPU pool from the memory the device has left now that the weights are loaded
        (``replicas.kv.sizing``), logged in one line with how it was sized."""
        pool = size_npu_pool(
            device_memory(self.device),
            self.loaded.args,
            specs,
            self.config,
            weights_bytes=module_bytes(self.loaded.model),
        )
        logger.info("engine: NPU KV pool from %s", pool.reason)
        return pool

    def validate_prompt(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids; ``ValueError`` if the engine can never serve it."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        check_prompt_length(len(token_ids), self.max_model_len)
        vocab_size = self.loaded.args.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"prompt token id {bad} is outside the vocabulary (0..{vocab_size - 1})"
            )
        sched = self.config.scheduler_config
        if not sched.enable_chunked_prefill and len(token_ids) > sched.max_num_batched_tokens:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than max_num_batched_tokens="
                f"{sched.max_num_batched_tokens}, and chunked prefill is disabled"
            )
        return token_ids

    def validate_resumed(
        self, num_prompt_tokens: int, params: SamplingParams, resumed: ResumeState
    ) -> None:
        """Raise ``ValueError`` unless ``resumed`` can continue: fewer output tokens than
        ``max_tokens`` and, with the prompt, than ``max_model_len``, all in the vocabulary, one
        logprob each when the request asks for them, and no prompt to score."""
        num_output = resumed.num_output_tokens
        if num_output >= params.max_tokens or num_prompt_tokens + num_output >= self.max_model_len:
            raise ValueError(f"a resumed request with {num_output} output tokens is complete")
        vocab_size = self.loaded.args.vocab_size
        if any(not 0 <= t < vocab_size for t in resumed.output_token_ids):
            raise ValueError("a resumed output token is outside the vocabulary")
        num_logprobs = len(resumed.logprobs) if resumed.logprobs is not None else None
        if params.logprobs is not None and num_logprobs != num_output:
            raise ValueError("a resumed request asking for logprobs needs one per output token")
        if params.prompt_logprobs is not None:
            raise ValueError("a resumed request cannot score its prompt again")

    # ---- introspection -----------------------------------------------------------------------
    def validate_params(self, params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the field for what this engine cannot honour: an ``n``
        above one (``cluster.choices`` fans those out), a token id outside the vocabulary, a
        schema the grammar library rejects."""
        if params.num_sequences > 1:
            raise ValueError("the engine serves one sequence per request: use n=1 here")
        vocab_size = self.tokenizer.vocab_size
        for token_id in params.logit_bias or ():
            if token_id >= vocab_size:
                raise ValueError(f"logit_bias: token id {token_id} is not below {vocab_size}")
        if params.structured_outputs is not None:
            self._compiler(params.structured_outputs)

    def _compiler(self, spec=None):
        """The grammar compiler (``replicas.engine.structured_output``), built on first use; with a
        ``spec``, that spec is compiled (cached) or rejected."""
        if self._grammar is None:
            from replicas.engine.structured_output import GrammarCompiler

            self._grammar = GrammarCompiler(self.tokenizer, self.tokenizer.vocab_size)
        if spec is not None:
            self._grammar.validate(spec)
        return self._grammar

    def stats(self) -> EngineStats:
        return EngineStats(
            cache=self.kv_cache.stats,
            transfer=self.transfer.stats if self.transfer else None,
            num_running=self.core.num_running,
            num_waiting=self.core.num_waiting,
            num_preemptions=self.core.num_preemptions,
            cache_types=self.kv_cache.usage(),
            steps=dataclasses.replace(self._step_times),
            retention=self.kv_cache.retention_stats(),
            disk={c: store.stats() for c, store in (self.disk or {}).items()},
            reload_costs=self.kv_cache.reload_costs(),
            spec_decode=dataclasses.replace(self.core.spec_decode),
        )

    def reset_counters(self) -> None:
        """Zero the prefix cache's counters and the step times (the engine must be idle): after
        the start-up measurement, so that a replica's stats count the traffic it served."""
        if self.has_unfinished_requests():
            raise RuntimeError("reset_counters needs an idle engine")
        self.kv_cache.stats = CacheStats()
        self.core.spec_decode = SpecDecodeStats()
        self._step_times = StepTimes()
        self._busy_since = None

    def reset_prefix_cache(self, tier: str = "all") -> None:
        """Forget cached blocks nobody uses, in ``tier`` ("all", "npu", "host", "disk")."""
        self.core.reset_prefix_cache(tier)

    def check_integrity(self) -> None:
        self.kv_cache.check_integrity()

    # ---- scaling: the hand-over through the disk tier (``replicas.kv.handover``) --------------
    def hot_blocks(self) -> dict[BlockHash, float]:
        """Every block hash of the primary cache type in the NPU or host tier, with its hit
        weight (``replicas.kv.hotness``; 0.0: no recent hit)."""
        return self.kv_cache.hot_blocks()

    def write_hot_blocks_to_disk(self, time_budget_s: float) -> int:
        """Write the NPU and host blocks the node's disk tier lacks to this replica's slab,
        hottest first, in rounds until done or ``time_budget_s`` has passed (checked between
        rounds), never replacing a hotter disk block by a colder one; returns the blocks whose
        writes landed (0 without a disk tier). The engine must not step meanwhile."""
        if not self.disk:
            return 0
        deadline = time.monotonic() + time_budget_s
        self.core.run_transfers(self.kv_cache.take_transfer_plan(), wait=True)
        write_out = self.kv_cache.start_write_out()
        num_written = 0
        while not write_out.is_done and time.monotonic() < deadline:
            num_stores = write_out.plan_round(HANDOVER_BATCH_BLOCKS)
            self.core.run_transfers(self.kv_cache.take_transfer_plan(), wait=True)
            left_s = max(0.0, deadline - time.monotonic())
            if all([store.flush(left_s) for store in self.disk.values()]):
                num_written += num_stores
        write_out.end()
        return num_written

    def warm_from_disk(self, time_budget_s: float) -> int:
        """Read the node's disk blocks (every replica's slab) into empty host blocks, hottest
        first, in rounds until the host tier or the disk has no more or ``time_budget_s`` has
        passed; they are host blocks then (announced as such). Returns the blocks loaded by
        then (0 without a disk or host tier); reads still in flight land later. Call it
        before the engine serves."""
        if not self.disk or self.transfer is None:
            return 0
        deadline = time.monotonic() + time_budget_s
        warm = self.kv_cache.start_warm()
        loaded_before = self.kv_cache.stats.disk_blocks_loaded
        while not warm.is_done and time.monotonic() < deadline:
            if not warm.plan_round(HANDOVER_BATCH_BLOCKS):
                break
            self.core.run_transfers(self.kv_cache.take_transfer_plan())
            self.core.complete_disk_loads(max(0.0, deadline - time.monotonic()))
        return self.kv_cache.stats.disk_blocks_loaded - loaded_before


COST_UPDATE_STEPS = 16
"""Steps between updates of the measured block costs the adaptive policy reads."""


class _ComputeTime:
    """Seconds per computed token, an exponential average over steps."""

    __slots__ = ("_per_token",)

    def __init__(self) -> None:
        self._per_token: float | None = None

    def add(self, seconds: float, num_tokens: int) -> None:
        sample = seconds / num_tokens
        previous = self._per_token
        self._per_token = sample if previous is None else 0.9 * previous + 0.1 * sample

    def per_token(self) -> float | None:
        return self._per_token


def resolve_device(device: str) -> torch.device:
    if device.startswith("cuda") and fake_cuda.is_requested():
        fake_cuda.activate()  # the CUDA path on the CPU, with a GPU's device checks
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine")
    return torch.device(device)
