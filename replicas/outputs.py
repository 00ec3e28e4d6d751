"""What the engine reports about a request."""

from dataclasses import dataclass
from typing import NamedTuple


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


class OutputDelta(NamedTuple):
    """What one step added to a request's output: a ``RequestOutput`` less what the receiver
        has already (the prompt) or adds up itself (cumulative tokens and text). A replica's output
        stream carries these (as plain tuples), so a step's message does not grow with prompt or
    output length."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    num_npu_cached_tokens: int
    num_host_cached_tokens: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    replica_index: int | None
    cached_tokens_by_cache_type: dict[str, tuple[int, int]] | None

    @classmethod
    def of(cls, output: RequestOutput) -> "OutputDelta":
        return cls(
            output.request_id,
            output.new_token_ids,
            output.new_text,
            output.finished,
            output.finish_reason,
            output.num_cached_tokens,
            output.num_npu_cached_tokens,
            output.num_host_cached_tokens,
            output.arrival_time,
            output.first_token_time,
            output.finish_time,
            output.replica_index,
            output.cached_tokens_by_cache_type,
        )


class OutputAccumulator:
    """One request's ``RequestOutput``s rebuilt from its ``OutputDelta``s, in order: the tokens
    and text so far are the sum of every delta's new ones."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []
        self.text = ""

    def add(self, delta: OutputDelta) -> RequestOutput:
        self.token_ids += delta.new_token_ids
        self.text += delta.new_text
        return RequestOutput(
            request_id=delta.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.token_ids),
            text=self.text,
            new_token_ids=delta.new_token_ids,
            new_text=delta.new_text,
            finished=delta.finished,
            finish_reason=delta.finish_reason,
            num_cached_tokens=delta.num_cached_tokens,
            num_npu_cached_tokens=delta.num_npu_cached_tokens,
            num_host_cached_tokens=delta.num_host_cached_tokens,
            arrival_time=delta.arrival_time,
            first_token_time=delta.first_token_time,
            finish_time=delta.finish_time,
            replica_index=delta.replica_index,
            cached_tokens_by_cache_type=delta.cached_tokens_by_cache_type,
        )
