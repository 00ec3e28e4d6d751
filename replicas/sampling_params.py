"""How to pick each next token, and when to stop."""

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replicas.engine.structured_output import StructuredOutputs

GREEDY_BELOW_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6  # smaller values keep only the likeliest token anyway; they underflow float32
MAX_TOP_LOGPROBS = 20  # OpenAI's bound; prompt scores are kept at this many alternatives
MAX_LOGIT_BIAS = 100.0


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings. Invalid values raise ``ValueError`` naming the field.

    ``temperature == 0`` is greedy decoding. ``top_k == 0`` (or -1), ``top_p == 1`` and
    ``min_p == 0`` disable those filters (``min_p`` keeps the tokens at least that share of the
    likeliest one's probability, after temperature; applied before top-k and top-p). ``seed``
    makes a sampled request reproducible on its own. ``stop`` strings end the output before the
    matched string; ``stop_token_ids`` end it after the matched token.

    Logits processing, in this order, before temperature and the filters (greedy rows too):
    the structured-output mask; ``min_tokens`` forbids EOS and ``stop_token_ids`` until that
    many tokens are out (unless the mask allows nothing else);
    ``logit_bias`` adds to a token's logit (in [-100, 100]); ``repetition_penalty`` divides a
    positive logit (multiplies a negative one) of every token seen in the prompt or output;
    ``frequency_penalty`` subtracts per occurrence in the output, ``presence_penalty`` once per
    token present in the output.

    ``logprobs = k`` reports each generated token's log-probability and the ``k`` likeliest
    alternatives; ``prompt_logprobs = k`` the same for every prompt token after the first. Both are
    the model's log-softmax, before any of the processing above. ``max_tokens = 0`` (with
    ``prompt_logprobs`` only) scores the prompt and generates nothing.

    ``n`` sequences are generated from the prompt (``best_of`` of them when set, returning the
    ``n`` with the highest cumulative log-probability); the engine serves one sequence per
    request, and ``cluster.choices`` fans a request out into its choices.

    ``structured_outputs`` constrains the output to a JSON schema, any JSON object, a regular
    expression or one of several strings (``replicas.engine.structured_output``).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    structured_outputs: "StructuredOutputs | None" = None

    def _check_filters(self) -> None:
        """top_p, top_k and min_p in range."""
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}"
            )
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError(
                f"max_tokens must be at least 1 (0 only to score a prompt: with "
                f"prompt_logprobs), got {self.max_tokens}"
            )
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        self._check_filters()
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not all(isinstance(s, str) for s in self.stop):
                raise ValueError("stop must be a string or a list of strings")
            if any(s == "" for s in self.stop):
                raise ValueError("stop strings must not be empty")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        _check_int("n", self.n, 1)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, 1)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be at least n ({self.n}), got {self.best_of}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, MAX_TOP_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.structured_outputs is not None:
            from replicas.engine.structured_output import StructuredOutputs

            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise ValueError("structured_outputs must be a StructuredOutputs")

    @property
    def is_greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy: the limit of sampling as the temperature falls,
        and dividing logits by them would overflow float32."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def num_sequences(self) -> int:
        """Sequences generated for one request: ``best_of`` or ``n``."""
        return self.best_of or self.n

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def can_speculate(self) -> bool:
        """Whether this request may decode with draft tokens (speculative decoding): greedy,
        without logprobs and with nothing processing the logits, so that each of its tokens is
        the model's argmax after the tokens before it, which is what a draft is checked
        against."""
        return self.is_greedy and self.logprobs is None and not self.processes_logits

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the logits before sampling (see the class docstring)."""
        return (
            self.has_penalties
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.structured_outputs is not None
        )


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f"at least {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_float(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _check_logit_bias(bias: object) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must map token ids to biases")
    checked = {}
    for token, value in bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {token!r}") from None
        if token_id < 0 or isinstance(token, bool):
            raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
        _check_float(f"logit_bias[{token_id}]", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        checked[token_id] = float(value)
    return checked
