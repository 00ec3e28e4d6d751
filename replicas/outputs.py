"""What the engine reports about a request."""

import operator
import warnings
from dataclasses import dataclass
from typing import NamedTuple

from replicas.kv.events import Tier, tier_count


class TokenLogprob(NamedTuple):
    """A token's log-probability under the model, and the likeliest tokens at its position
    (best first, as many as the request asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step. ``text`` and ``token_ids`` are cumulative;
    ``new_token_ids`` and ``new_text`` are what this step added (for streaming).

    ``num_cached_tokens`` prompt tokens were served from the prefix cache at admission;
    ``num_cached_tokens_by_tier`` splits them by the tier they came from (a per-tier tuple in
    ``replicas.kv.events.tiers()`` order; a disk block reaches the NPU through the host tier and
    counts as host).

    ``logprobs`` (one per token of ``token_ids``) and ``prompt_logprobs`` (one per prompt token,
    ``None`` for the first) are set when the sampling parameters asked for them; ``new_logprobs``
    are this step's. ``index`` is the choice's place among a request's ``n``.
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
    num_cached_tokens_by_tier: tuple[int, ...]
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    prompt: str | None = None
    replica_index: int | None = None  # set by the replica actor that served it
    # cache type -> (NPU, host) tokens of cached KV reused; a sliding type holds only the window
    cached_tokens_by_cache_type: dict[str, tuple[int, int]] | None = None
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    new_prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first output only
    cumulative_logprob: float | None = None
    index: int = 0

    def num_cached_tokens_in(self, tier: Tier) -> int:
        return tier_count(self.num_cached_tokens_by_tier, tier)

    # Renamed in 0.1: kept, with a DeprecationWarning, until the next release removes them.
    @property
    def num_npu_cached_tokens(self) -> int:
        """Deprecated: ``num_cached_tokens_in("npu")``."""
        _warn_renamed("num_npu_cached_tokens", 'num_cached_tokens_in("npu")')
        return self.num_cached_tokens_in(Tier.NPU)

    @property
    def num_host_cached_tokens(self) -> int:
        """Deprecated: ``num_cached_tokens_in("host")`` (and ``("disk")``, which it counted
        too: a disk block reaches the NPU through the host tier)."""
        _warn_renamed("num_host_cached_tokens", 'num_cached_tokens_in("host")')
        return self.num_cached_tokens_in(Tier.HOST) + self.num_cached_tokens_in(Tier.DISK)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token in seconds, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


def _warn_renamed(old: str, new: str) -> None:
    warnings.warn(
        f"RequestOutput.{old} is deprecated and will be removed in the next release; "
        f"use RequestOutput.{new}",
        DeprecationWarning,
        stacklevel=3,  # the caller reading the attribute
    )


class OutputDelta(NamedTuple):
    """What one step added to a request's output: a ``RequestOutput`` less what the receiver
    has already (the prompt) or adds up itself (cumulative tokens and text). A replica's output
    stream carries these as plain tuples (``OutputDelta.values_of``; they pickle several times
    faster than named tuples or dataclasses), so a step's message does not grow with prompt or
    output length. Every field is the ``RequestOutput`` field of the same name."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    num_cached_tokens_by_tier: tuple[int, ...]
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    replica_index: int | None
    cached_tokens_by_cache_type: dict[str, tuple[int, int]] | None
    new_logprobs: list[TokenLogprob] | None
    new_prompt_logprobs: list[TokenLogprob | None] | None  # sent once, with the first token
    cumulative_logprob: float | None

    @staticmethod
    def values_of(output: RequestOutput) -> tuple:
        """The delta of ``output`` as a plain tuple, in field order (``OutputDelta._make``
        turns it back)."""
        return _DELTA_VALUES(output)


_DELTA_VALUES = operator.attrgetter(*OutputDelta._fields)


_PROGRESS_FIELDS = frozenset(
    ("request_id", "new_token_ids", "new_text", "finished", "finish_reason", "finish_time")
    + ("replica_index", "new_logprobs", "new_prompt_logprobs", "cumulative_logprob")
)
"""The fields of an ``OutputDelta`` a resumed request takes from its new replica."""


class OutputAccumulator:
    """One request's ``RequestOutput``s rebuilt from its ``OutputDelta``s, in order: the tokens
    and text so far are the sum of every delta's new ones. A request resumed on another
    replica (``replicas.resume``) continues from its last output before the loss, ``resumed``,
    and keeps that output's arrival, first token and prompt cache figures: the client's."""

    def __init__(self, prompt_token_ids: list[int], resumed: RequestOutput | None = None) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = list(resumed.token_ids) if resumed else []
        self.text = resumed.text if resumed else ""
        self.logprobs = list(resumed.logprobs) if resumed and resumed.logprobs else None
        self.prompt_logprobs = resumed.prompt_logprobs if resumed else None
        self._kept = (
            {f: getattr(resumed, f) for f in OutputDelta._fields if f not in _PROGRESS_FIELDS}
            if resumed
            else {}
        )

    def add(self, delta: OutputDelta) -> RequestOutput:
        self.token_ids += delta.new_token_ids
        self.text += delta.new_text
        if delta.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.new_logprobs
        if delta.new_prompt_logprobs is not None:
            self.prompt_logprobs = delta.new_prompt_logprobs
        fields = delta._asdict() | self._kept
        return RequestOutput(
            prompt_logprobs=self.prompt_logprobs,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.token_ids),
            text=self.text,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            **fields,
        )
