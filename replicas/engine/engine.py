"""One replica's engine: requests in, tokens out, one step at a time. No Ray here."""

import dataclasses
import functools
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from replicas import fake_cuda
from replicas.cache_hints import CacheHints, PeerSource
from replicas.config import EngineConfig
from replicas.dtypes import dtype_name_of
from replicas.engine import assembly, handover
from replicas.engine.core import EngineCore, SpecDecodeStats
from replicas.engine.executor import ModelExecutor
from replicas.engine.export_window import copy_block
from replicas.engine.model_runner import ModelRunner
from replicas.engine.output_processor import OutputProcessor
from replicas.engine.prompt_logprobs import PromptLogprobsCache
from replicas.engine.request import Request
from replicas.engine.request_checks import CheckedPrompt, RequestChecks
from replicas.engine.sampler import Sampler
from replicas.engine.step_meter import StepMeter, StepTimes
from replicas.kv.capacity import plan_cache
from replicas.kv.events import Tier
from replicas.kv.hashing import BlockHash
from replicas.kv.host_memory import check_host_capacity, host_tier_bytes
from replicas.kv.manager import KVCacheManager
from replicas.kv.onboarding import ReloadCosts
from replicas.kv.records import CacheStats, CacheTypeUsage
from replicas.kv.retention import RetentionStats
from replicas.kv.session_gaps import SessionGaps
from replicas.kv.shared_prefixes import SharedPrefixes
from replicas.kv.tenants import TenantStats, tenant_stats
from replicas.kv.tiers import peer
from replicas.kv.transfer import KVTransfer, TransferStats
from replicas.model import LoadedModel
from replicas.outputs import RequestOutput
from replicas.resume import ResumeState
from replicas.sampling_params import SamplingParams

if TYPE_CHECKING:
    from replicas.kv.tiers import BackingStore

__all__ = ["Engine", "EngineStats", "StepTimes", "resolve_device", "sum_stats"]

logger = logging.getLogger(__name__)


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
    # Per backing tier (disk, ...), its stores' own counters per cache type:
    backing: dict[str, dict[str, object]] = field(default_factory=dict)
    reload_costs: "ReloadCosts | None" = None  # the backing cost rule's inputs (with one)
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    tenants: dict[str, TenantStats] = field(default_factory=dict)  # by label (kv.tenants)

    @property
    def disk(self) -> dict[str, object]:
        """Deprecated: ``backing["disk"]``."""
        warnings.warn(
            "EngineStats.disk is deprecated; read EngineStats.backing['disk']",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.backing.get("disk", {})


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
    if isinstance(a, tuple):  # of numbers (or of dicts of them), a NamedTuple or not
        summed = [_add(x, y) for x, y in zip(a, b)]
        return type(a)(*summed) if hasattr(a, "_fields") else tuple(summed)
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
        self.loaded = loaded or assembly.load(config, self.device)
        specs = self.loaded.model.kv_cache_specs(self.loaded.dtype, config.kv_cache_dtype)
        self.config = config = _resolved(config, self.loaded, specs)
        self.tokenizer = self.loaded.tokenizer
        self.block_size = config.block_size
        prefix_config = config.scheduler_config.prefix_cache_config
        self.shared_prefixes = SharedPrefixes.from_config(
            prefix_config.shared_prefixes, self.tokenizer
        )
        self.sessions = SessionGaps(prefix_config.interactive_lifetime_s)  # learned lifetimes
        pool = assembly.npu_pool(self.device, self.loaded, specs, config)
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
            self.loaded.dtype,
            config.kv_cache_dtype,
            max_num_seqs=config.scheduler_config.max_num_seqs,
            max_model_len=self.max_model_len,
            cuda_graphs=config.cuda_graphs,
        )
        kv_caches = self.runner.kv_caches
        self._fingerprint: str | None = None
        self.backing: dict[str, dict[str, BackingStore]] = {}
        if plan.num_backing_blocks:
            self.backing = assembly.open_backing(
                config, self.fingerprint, kv_caches, plan.num_backing_blocks
            )
        self.kv_cache = assembly.kv_cache_manager(config, specs, plan, self.backing)
        self.kv_cache.set_tenant_quotas(prefix_config.tenant_quotas, prefix_config.tenant_min_share)
        self.transfer = (
            KVTransfer(kv_caches, plan.num_host_blocks, backing=self.backing)
            if plan.num_host_blocks
            else None
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.checks = RequestChecks(
            self.tokenizer, self.loaded.args.vocab_size, self.max_model_len, config.scheduler_config
        )
        self.sampler = Sampler(
            config.seed, self.device, self.tokenizer.eos_token_ids, grammar=self.checks.compiler
        )
        self.core = self._engine_core()
        self.exports_in_steps = _exports_in_steps(self.device, self.transfer)
        offload = config.scheduler_config.kv_offload_config
        self.meter = StepMeter(
            self.kv_cache, self.transfer, self.block_size, offload.tuning_hint_interval_s
        )
        _log_start(self)

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

    def close(self) -> None:
        """Hand the planned backing writes to their stores, land every copy still in flight
        (the cache manager unlocks their host blocks) and unpin the host slab, then finish the
        backing writes and close the stores (no-op without a host tier)."""
        if self.backing:
            for _ in range(2):  # a landed host store plans its backing store at threshold 0
                self.core.flush_transfers(wait=True)
        if self.transfer is not None:
            for landed in self.transfer.close():
                self.kv_cache.complete_transfer(landed)
        for stores in self.backing.values():
            for store in stores.values():
                store.close()

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | CheckedPrompt,
        sampling_params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        cache_hints: CacheHints | None = None,
        resumed: ResumeState | None = None,
    ) -> Request:
        """Queue a request. Raises ``ValueError`` for a prompt the engine can never serve (a
        ``CheckedPrompt``, from ``check_prompt``, is not checked again) and for parameters it
        cannot honour. ``cache_hints``: the prefix to retain in the host and disk tiers, and
        for how long. ``resumed``: the output a lost replica generated for it
        (``replicas.resume``)."""
        params = sampling_params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        if not isinstance(prompt, CheckedPrompt):
            prompt = self.checks.prompt(prompt)
        token_ids = prompt.token_ids
        self.checks.params(params)
        if resumed is not None:
            self.checks.resumed(len(token_ids), params, resumed)
        prefix_config = self.config.scheduler_config.prefix_cache_config
        batch = prefix_config.is_batch(cache_salt, cache_hints and cache_hints.batch)
        lifetime_s = None if batch else self.sessions.turn(cache_hints and cache_hints.key)
        if cache_hints is not None:  # retained no longer than the session's own turns call for
            cache_hints = cache_hints.bounded(self.sessions.learned_s(cache_hints.key))
        request = Request(
            request_id,
            token_ids,
            params,
            self.block_size,
            cache_salt=cache_salt,
            num_shared_blocks=(
                self.shared_prefixes.num_blocks(token_ids, self.block_size)
                if cache_salt is not None
                else 0
            ),
            batch=batch,
            lifetime_s=lifetime_s,
            prompt=text,
            arrival_time=arrival_time,
            cache_hints=cache_hints,
            resumed=resumed,
        )
        request.tenant = self.kv_cache.tenants.index(cache_salt)
        self._offer_peer_blocks(request, cache_hints)
        self.core.add(request)
        self.output_processor.add(request, resumed.num_emitted_chars if resumed else 0)
        return request

    def _offer_peer_blocks(self, request: Request, hints: CacheHints | None) -> None:
        """The router named a source holding a longer prefix: its blocks are the peer tier's
        to read for this request (``replicas.kv.tiers.peer``; ignored without that tier)."""
        stores = self.backing.get("peer")
        if hints is None or hints.peer is None or not stores:
            return
        num_blocks = min(hints.peer.num_tokens // self.block_size, len(request.block_hashes))
        for store in stores.values():
            store.offer(request.block_hashes[:num_blocks], hints.peer)

    def export_blocks(
        self, cache_type: str, hashes: list[BlockHash], in_step: bool = False
    ) -> tuple:
        """The blocks of ``cache_type`` this replica holds in its NPU or host tier, by hash,
        for a replica that pulls them (``replicas.kv.tiers.peer.export``: each with its
        checksum, None for one it does not hold), after every copy in flight has landed;
        ``in_step``: called from another thread in a forward pass's window
        (``replicas.engine.export_window``, only where ``exports_in_steps``)."""
        if not in_step:
            self.core.flush_transfers(wait=True)
        blocks = []
        for block_hash in hashes:
            found = self.kv_cache.views.locate(cache_type, block_hash)
            if found is None:
                blocks.append(None)
                continue
            tier, block_id = found
            if tier == Tier.NPU:
                tensor = self.runner.kv_caches[cache_type][block_id]
            else:
                tensor = self.transfer.host_caches[cache_type][block_id]
            blocks.append(copy_block(tensor) if in_step else tensor.to("cpu", copy=True))
        return peer.export(self.fingerprint, blocks, hashes)

    @property
    def fingerprint(self) -> str:
        """This model's KV fingerprint (``assembly.model_fingerprint``), computed once."""
        if self._fingerprint is None:
            self._fingerprint = assembly.model_fingerprint(self.config, self.loaded)
        return self._fingerprint

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; None if it is unknown or already finished."""
        request = self.core.abort(request_id)
        if not self.core.has_unfinished_requests():
            self.meter.idle()
        return self._outputs([request])[0] if request is not None else None

    def shed_waiting(self) -> list[str]:
        """Drop every waiting request that has produced no output here, freeing its blocks,
        for the caller to route elsewhere; returns their ids. Running requests continue."""
        shed = self.core.shed_waiting()
        for request in shed:
            self.output_processor.release(request.request_id)
        if not self.core.has_unfinished_requests():
            self.meter.idle()
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
        start = self.meter.start()
        tokens_before = self.core.num_scheduled_tokens
        outputs = self._outputs(self.core.step())
        num_tokens = self.core.num_scheduled_tokens - tokens_before
        self.meter.stop(start, num_tokens, busy=self.core.has_unfinished_requests())
        return outputs

    def _outputs(self, requests: list[Request]) -> list[RequestOutput]:
        outputs = [self.output_processor.output(r) for r in requests]
        for request in requests:
            if request.is_finished:
                self.output_processor.release(request.request_id)
        return outputs

    # ---- checks ------------------------------------------------------------------------------
    def check_prompt(self, prompt: str | list[int]) -> CheckedPrompt:
        """The prompt's token ids, for ``add_request`` to queue as they are; ``ValueError`` if
        the engine can never serve it."""
        return self.checks.prompt(prompt)

    def validate_prompt(self, prompt: str | list[int]) -> list[int]:
        """``check_prompt``'s token ids; deprecated until the next release."""
        warnings.warn(
            "Engine.validate_prompt is deprecated; use Engine.check_prompt, whose result "
            "add_request queues without checking it again",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.check_prompt(prompt).token_ids

    # ---- introspection -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            cache=self.kv_cache.stats,
            transfer=self.transfer.stats if self.transfer else None,
            num_running=self.core.num_running,
            num_waiting=self.core.num_waiting,
            num_preemptions=self.core.num_preemptions,
            cache_types=self.kv_cache.views.usage(),
            steps=dataclasses.replace(self.meter.times),
            retention=self.kv_cache.views.retention_stats(),
            backing={
                tier: {c: store.stats() for c, store in stores.items()}
                for tier, stores in self.backing.items()
            },
            reload_costs=self.kv_cache.onboarding.reload_costs(),
            spec_decode=dataclasses.replace(self.core.spec_decode),
            tenants=_tenant_stats(self.kv_cache, self.config),
        )

    def reset_counters(self) -> None:
        """Zero the prefix cache's counters and the step times (the engine must be idle): after
        the start-up measurement, so that a replica's stats count the traffic it served."""
        if self.has_unfinished_requests():
            raise RuntimeError("reset_counters needs an idle engine")
        self.kv_cache.stats = CacheStats()
        self.core.spec_decode = SpecDecodeStats()
        self.meter.reset()

    def reset_prefix_cache(self, tier: str = "all") -> None:
        """Forget cached blocks nobody uses, in ``tier`` ("all" or a tier's name)."""
        self.core.reset_prefix_cache(tier)

    def check_integrity(self) -> None:
        self.kv_cache.check_integrity()

    # ---- scaling: the hand-over through the node's disk tier (``replicas.kv.handover``) -------
    def hot_blocks(self) -> dict[BlockHash, float]:
        """Every block hash of the primary cache type in the NPU or host tier, with its hit
        weight (``replicas.kv.hotness``; 0.0: no recent hit)."""
        return self.kv_cache.hot_blocks()

    def write_hot_blocks_to_disk(self, time_budget_s: float) -> int:
        """Write the NPU and host blocks the node's disk tier lacks to this replica's slab,
        hottest first, until done or ``time_budget_s`` has passed; returns the blocks whose
        writes landed (0 without a disk tier). The engine must not step meanwhile."""
        return handover.write_out(self, time_budget_s)

    def warm_from_disk(self, time_budget_s: float) -> int:
        """Read the node's disk blocks (every replica's slab) into empty host blocks, hottest
        first, until the host tier or the disk has no more or ``time_budget_s`` has passed;
        they are host blocks then (announced as such). Returns the blocks loaded by then (0
        without a disk or host tier); reads still in flight land later. Call it before the
        engine serves."""
        return handover.warm_from_disk(self, time_budget_s)

    def warm_from_peers(
        self,
        sources: "list[tuple[PeerSource, dict[BlockHash, float]]]",
        time_budget_s: float,
        max_share: float = 0.0,
    ) -> int:
        """Read other replicas' blocks (each source with hashes and hit weights) into host
        blocks through the peer tier, hottest first, into empty ones and up to ``max_share`` of
        the host tier (``replicas.engine.handover.warm_from_peers``); returns the blocks loaded
        within ``time_budget_s``. The engine must not step meanwhile."""
        return handover.warm_from_peers(self, sources, time_budget_s, max_share)

    @property
    def disk(self) -> "dict[str, BackingStore] | None":
        """Deprecated: ``backing["disk"]`` (None without a disk tier)."""
        warnings.warn(
            "Engine.disk is deprecated; read Engine.backing['disk']",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.backing.get("disk")


def _exports_in_steps(device: torch.device, transfer: KVTransfer | None) -> bool:
    """Whether a peer's pull may read blocks while a forward pass runs: where the step's copies
    between tiers ran before it, at once (``replicas.engine.export_window``)."""
    return device.type == "cpu" and not (transfer is not None and transfer.streamed)


def resolve_device(device: str) -> torch.device:
    if device.startswith("cuda") and fake_cuda.is_requested():
        fake_cuda.activate()  # the CUDA path on the CPU, with a GPU's device checks
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine")
    return torch.device(device)


def _resolved(config: EngineConfig, loaded: LoadedModel, specs: dict) -> EngineConfig:
    """``config`` with what ``auto`` resolved to, so that everything after reads the dtypes and
    ways the engine runs."""
    return config.model_copy(
        update={
            "dtype": dtype_name_of(loaded.dtype),
            "quantization": loaded.quantization,
            "decoder_stack": loaded.decoder_stack,
            "int4_kernel": loaded.int4_kernel,
            "kv_cache_dtype": next(iter(specs.values())).kv_format.name,
        }
    )


def _log_start(engine: Engine) -> None:
    config = engine.config
    logger.info(
        "engine: model %s on %s (%s, weights: %s, KV: %s, layers: %s), block size %d, "
        "max_model_len %d",
        engine.loaded.name,
        engine.device,
        config.dtype,
        engine.loaded.quantization + ("/strata" if config.int4_kernel == "strata" else ""),
        config.kv_cache_dtype,
        "torch.compile" if config.torch_compile else config.decoder_stack,
        engine.block_size,
        engine.max_model_len,
    )


def _tenant_stats(kv: KVCacheManager, config: EngineConfig) -> dict[str, TenantStats]:
    """Per tenant: its hits and blocks; named as the config names it, else by a digest."""
    named = config.scheduler_config.prefix_cache_config.named_tenants
    return tenant_stats(kv.tenants, kv.views.tenant_holders(), kv.stats.by_tenant, named)
