"""How to pick each next token, and when to stop."""

import math
from dataclasses import dataclass, field

GREEDY_BELOW_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6  # smaller values keep only the likeliest token anyway; they underflow float32


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings. Invalid values raise ``ValueError`` naming the field.

    ``temperature == 0`` is greedy decoding. ``top_k == 0`` (or -1) and ``top_p == 1`` disable
    those filters. ``seed`` makes a sampled request reproducible on its own. ``stop`` strings end
    the output before the matched string; ``stop_token_ids`` end it after the matched token.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}"
            )
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

    @property
    def is_greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy: the limit of sampling as the temperature falls,
        and dividing logits by them would overflow float32."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE
