"""One request as the engine sees it: its tokens, its block hashes, its progress.

Token regions of a running request::

    |<------------------- num_tokens ------------------------>|
    |<---- prompt_token_ids ---->|<--- output_token_ids ----->|
    |<-- num_computed_tokens -->|                             |
    |<- cached ->|                 KV exists for the computed tokens; the rest is computed next
    |<- block_hashes: one per full block of all tokens ->|

``num_cached_tokens`` is fixed at the first admission: the prompt tokens found in the prefix
cache. After a preemption ``num_computed_tokens`` drops to zero and the request is recomputed
(with whatever the cache still holds); its outputs are kept.
"""

import enum
import time

from replicas.cache_hints import CacheHints
from replicas.kv.hashing import BlockHash, extend_block_hashes, parent_key
from replicas.resume import ResumeState
from replicas.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        block_size: int,
        *,
        cache_salt: str | None = None,
        num_shared_blocks: int = 0,
        batch: bool = False,
        lifetime_s: float | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
        cache_hints: CacheHints | None = None,
        resumed: ResumeState | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.cache_salt = cache_salt
        self.num_shared_blocks = num_shared_blocks  # hashed without the salt (kv.shared_prefixes)
        self.block_size = block_size
        # Leading prompt blocks the KV cache keeps ahead of ordinary ones, and for how long.
        hints = cache_hints or CacheHints()
        self.cache_key = hints.key  # the routing key it came with (for the simulator's router)
        self.batch = batch  # its priority class: batch blocks are evicted first
        self.lifetime_s = lifetime_s  # an interactive use protects blocks this long (None: pool's)
        self.tenant = 0  # its salt's tenant in the replica's cache (replicas.kv.tenants)
        self.num_retained_blocks = hints.retained_blocks(block_size, len(self.prompt_token_ids))
        self.retention_ttl_s = hints.ttl_s if self.num_retained_blocks else 0.0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time

        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.block_hashes: list[BlockHash] = []
        self._extend_hashes()

        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None
        self.num_npu_cached_tokens = 0
        self.num_host_cached_tokens = 0
        # cache type -> (NPU, host) tokens of cached KV adopted at admission
        self.cached_tokens_by_cache_type: dict[str, tuple[int, int]] = {}

        self.first_token_time: float | None = None
        self.finish_time: float | None = None

        # Set when the sampling parameters ask for them (``replicas.outputs.TokenLogprob``):
        # one per output token, and one per prompt position scored so far (position 0: None).
        self.logprobs: list | None = [] if sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list | None = (
            [None] if sampling_params.prompt_logprobs is not None else None
        )
        if resumed is not None:  # output generated elsewhere counts as this request's own
            logprobs = resumed.logprobs or (None,) * resumed.num_output_tokens
            for token_id, logprob in zip(resumed.output_token_ids, logprobs, strict=True):
                self.append_output_token(token_id, logprob)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

    @property
    def num_scored_prompt_tokens(self) -> int:
        """Prompt positions whose log-probabilities are known (position 0 counts: it has none)."""
        return len(self.prompt_logprobs) if self.prompt_logprobs is not None else 0

    def append_output_token(self, token_id: int, logprob=None) -> None:
        if logprob is not None:
            self.cumulative_logprob += logprob.logprob
            if self.logprobs is not None:
                self.logprobs.append(logprob)
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._extend_hashes()

    def _extend_hashes(self) -> None:
        extend_block_hashes(
            self.block_hashes,
            self.all_token_ids,
            self.block_size,
            self.cache_salt,
            self.num_shared_blocks,
        )

    def parent_key(self, index: int) -> bytes:
        """What names the tokens before block ``index`` (``replicas.kv.hashing.parent_key``)."""
        return parent_key(self.block_hashes, index, self.cache_salt, self.num_shared_blocks)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
