"""What the engine reports about a request."""

from dataclasses import dataclass


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step. ``text`` and ``token_ids`` are cumulative;
    ``new_token_ids`` and ``new_text`` are what this step added (for streaming).

    ``num_cached_tokens`` prompt tokens were served from the prefix cache at admission, split by
    the tier they came from (``num_npu_cached_tokens + num_host_cached_tokens``).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_cached_tokens: int
    num_npu_cached_tokens: int
    num_host_cached_tokens: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    prompt: str | None = None
    replica_index: int | None = None  # set by the replica actor that served it
    # cache type -> (NPU, host) tokens of cached KV reused; a sliding type holds only the window
    cached_tokens_by_cache_type: dict[str, tuple[int, int]] | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token in seconds, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time
