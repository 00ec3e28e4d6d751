"""One replica's engine: requests in, tokens out, one step at a time. No Ray here."""

import logging
import time
from dataclasses import dataclass, field

import torch

from replicas.config import EngineConfig
from replicas.host_memory import check_host_capacity
from replicas.kv_cache_manager import KVCacheManager
from replicas.kv_cache_types import CacheGroupSpec, CacheStats, TransferPlan
from replicas.kv_capacity import plan_cache
from replicas.kv_transfer import KVTransfer, TransferStats
from replicas.model import LoadedModel, load_model
from replicas.model_runner import ModelRunner
from replicas.outputs import RequestOutput
from replicas.request import Request, RequestStatus
from replicas.sampler import Sampler
from replicas.sampling_params import SamplingParams
from replicas.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class PoolUsage:
    """Blocks of one cache type: capacity, in use (held), cached (holding a reusable prefix)."""

    npu_blocks: int
    npu_used: int
    npu_cached: int
    host_blocks: int
    host_used: int
    host_cached: int


@dataclass(slots=True)
class EngineStats:
    """A snapshot of one engine's counters and gauges."""

    cache: CacheStats
    transfer: TransferStats | None
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_npu_blocks: int
    num_npu_blocks_used: int
    num_host_blocks: int
    num_host_blocks_used: int
    num_npu_blocks_cached: int = 0  # holding a reusable prefix (in use or evictable)
    num_host_blocks_cached: int = 0
    cache_types: dict[str, PoolUsage] = field(default_factory=dict)


class Engine:
    """Schedule, transfer, forward, sample, update: see ``step``."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        dtype = _DTYPES[config.dtype]
        self.loaded = loaded or load_model(
            config.model, self.device, dtype, seed=config.seed, revision=config.revision
        )
        self.tokenizer = self.loaded.tokenizer
        self.block_size = config.block_size
        specs = self.loaded.model.kv_cache_specs(dtype)
        plan = plan_cache(specs, config, self.loaded.args.max_position_embeddings)
        self.num_npu_blocks = plan.num_npu_blocks[next(iter(specs))]
        self.max_model_len = self._resolve_max_model_len()
        if plan.num_host_blocks:  # fail before any bookkeeping is built
            check_host_capacity(
                sum(n * plan.block_bytes[g] for g, n in plan.num_host_blocks.items())
            )
        self.runner = ModelRunner(
            self.loaded, plan.num_npu_blocks, self.block_size, self.device, dtype
        )
        sched = config.scheduler_config
        offload = sched.kv_offload_config
        self.kv_cache = KVCacheManager(
            block_size=self.block_size,
            groups=[
                CacheGroupSpec(
                    g, plan.num_npu_blocks[g], plan.num_host_blocks.get(g, 0), spec.sliding_window
                )
                for g, spec in specs.items()
            ],
            enable_prefix_caching=sched.prefix_cache_config.enabled,
            write_through_threshold=offload.write_through_threshold,
            write_back=offload.write_back,
        )
        self.transfer = (
            KVTransfer(self.runner.kv_caches, plan.num_host_blocks)
            if plan.num_host_blocks
            else None
        )
        self.scheduler = Scheduler(sched, self.kv_cache)
        self.sampler = Sampler(config.seed, self.device)
        self._requests: dict[str, Request] = {}
        self._eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        logger.info(
            "engine: model %s on %s, block size %d, max_model_len %d",
            self.loaded.name,
            self.device,
            self.block_size,
            self.max_model_len,
        )

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Queue a request. Raises ``ValueError`` for a prompt the engine can never serve."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = sampling_params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.validate_prompt(prompt)
        request = Request(
            request_id,
            token_ids,
            params,
            self.block_size,
            cache_salt=cache_salt,
            prompt=text,
            arrival_time=arrival_time,
        )
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; None if it is unknown or already finished."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self.sampler.release(request_id)
        request.finish_time = time.monotonic()
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the requests that produced a token or finished."""
        scheduler_output = self.scheduler.schedule()
        self._transfer(scheduler_output.transfer)
        if not scheduler_output.scheduled:
            self._check_progress()
            return []
        logits, sampled = self.runner.execute(scheduler_output.scheduled)
        logits = logits[:, : self.tokenizer.vocab_size]  # never sample padding rows
        requests = [scheduler_output.scheduled[i].request for i in sampled]
        token_ids = self.sampler.sample(logits, requests)
        outputs = self._update(scheduler_output, requests, token_ids)
        self._transfer(self.kv_cache.take_transfer_plan())  # stores of blocks written just now
        return outputs

    def _transfer(self, plan: TransferPlan, wait: bool = False) -> None:
        if self.transfer is None:
            return
        self.transfer.submit(plan)
        for landed in self.transfer.poll(wait=wait):
            self.kv_cache.complete_transfer(landed)

    def _update(
        self, scheduler_output: SchedulerOutput, sampled: list[Request], token_ids: list[int]
    ) -> list[RequestOutput]:
        for request, num_new, *_ in scheduler_output.scheduled:
            request.num_computed_tokens += num_new
            self.kv_cache.cache_blocks(request)
        now = time.monotonic()
        outputs = []
        for request, token_id in zip(sampled, token_ids):
            request.append_output_token(token_id)
            if request.first_token_time is None:
                request.first_token_time = now
            status = self._check_stop(request, token_id)
            if status is not None:
                self.scheduler.finish(request, status)
                self.sampler.release(request.request_id)
                self._requests.pop(request.request_id, None)
                request.finish_time = now
            outputs.append(self._output(request))
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self._eos_token_ids
        ):
            request.output_text = self.tokenizer.decode(request.output_token_ids)
            return RequestStatus.FINISHED_STOPPED
        request.output_text = self.tokenizer.decode(request.output_token_ids)
        if params.stop:
            positions = [request.output_text.find(s) for s in params.stop]
            found = [p for p in positions if p >= 0]
            if found:
                request.output_text = request.output_text[: min(found)]
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, request: Request) -> RequestOutput:
        text = request.output_text
        end = len(text)
        if not request.is_finished:
            # Hold back what may still become a stop string or a multi-byte character.
            stop = request.sampling_params.stop
            end -= max((len(s) for s in stop), default=1) - 1 if stop else 0
            while end > request.num_emitted_chars and text[end - 1] == "\ufffd":
                end -= 1
        end = max(end, request.num_emitted_chars)
        new_text = text[request.num_emitted_chars : end]
        new_token_ids = request.output_token_ids[request.num_emitted_tokens :]
        request.num_emitted_chars = end
        request.num_emitted_tokens = request.num_output_tokens
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=text[:end],
            new_token_ids=new_token_ids,
            new_text=new_text,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_npu_cached_tokens=request.num_npu_cached_tokens,
            num_host_cached_tokens=request.num_host_cached_tokens,
            cached_tokens_by_cache_type=dict(request.cached_tokens_by_cache_type),
            arrival_time=request.arrival_time,
            first_token_time=request.first_token_time,
            finish_time=request.finish_time,
        )

    # ---- checks ------------------------------------------------------------------------------
    def _resolve_max_model_len(self) -> int:
        pool_tokens = self.num_npu_blocks * self.block_size
        model_limit = self.loaded.args.max_position_embeddings
        if self.config.max_model_len is None:
            return min(model_limit, pool_tokens)
        if self.config.max_model_len > pool_tokens:
            raise ValueError(
                f"max_model_len={self.config.max_model_len} exceeds the NPU KV pool "
                f"({self.num_npu_blocks} blocks of {self.block_size} tokens = {pool_tokens} "
                "tokens); raise num_npu_blocks or lower max_model_len"
            )
        if self.config.max_model_len > model_limit:
            raise ValueError(
                f"max_model_len={self.config.max_model_len} exceeds the model's "
                f"max_position_embeddings ({model_limit})"
            )
        return self.config.max_model_len

    def validate_prompt(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids; ``ValueError`` if the engine can never serve it."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is "
                f"{self.max_model_len}: it must be shorter, leaving room for one output token"
            )
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

    def _check_progress(self) -> None:
        if self.scheduler.running or not self.scheduler.waiting:
            return
        request = self.scheduler.waiting[0]
        raise RuntimeError(
            f"request {request.request_id} cannot be scheduled with nothing running: it needs "
            f"{self.kv_cache.num_blocks_needed(request, request.num_tokens)} NPU blocks per cache "
            f"type, {[g.npu.num_free for g in self.kv_cache.groups]} are free"
        )

    # ---- introspection -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        host = self.kv_cache.host
        return EngineStats(
            cache=self.kv_cache.stats,
            transfer=self.transfer.stats if self.transfer else None,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            num_npu_blocks=self.num_npu_blocks,
            num_npu_blocks_used=self.kv_cache.npu.num_used,
            num_host_blocks=host.num_blocks if host else 0,
            num_host_blocks_used=host.num_used if host else 0,
            num_npu_blocks_cached=self.kv_cache.npu.num_cached,
            num_host_blocks_cached=host.num_cached if host else 0,
            cache_types={
                g.name: PoolUsage(
                    g.npu.num_blocks,
                    g.npu.num_used,
                    g.npu.num_cached,
                    g.host.num_blocks if g.host else 0,
                    g.host.num_used if g.host else 0,
                    g.host.num_cached if g.host else 0,
                )
                for g in self.kv_cache.groups
            },
        )

    def reset_prefix_cache(self, tier: str = "all") -> None:
        """Forget cached blocks nobody uses, in ``tier`` ("all", "npu", "host")."""
        self._transfer(self.kv_cache.take_transfer_plan(), wait=True)
        self.kv_cache.reset_prefix_cache(tier)

    def check_integrity(self) -> None:
        self.kv_cache.check_integrity()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine")
    return torch.device(device)
