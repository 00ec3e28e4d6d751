"""What an engine checks of a request before it queues it: the prompt, a resumed request's
output so far and the sampling parameters, each failure a ``ValueError`` naming the problem.

A prompt is checked once, where it enters a replica: ``AsyncEngine.submit``, which every request
of the HTTP server, the offline ``LLM`` and a Ray deployment passes, or ``Engine.add_request``
for a caller of the engine itself. ``RequestChecks.prompt`` gives a ``CheckedPrompt``, which the
engine then queues without checking it again."""

from dataclasses import dataclass

from replicas.config import SchedulerConfig
from replicas.model.tokenizer import Tokenizer
from replicas.prompt import check_prompt_length
from replicas.resume import ResumeState
from replicas.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class CheckedPrompt:
    """A prompt's token ids that passed ``RequestChecks.prompt``."""

    token_ids: list[int]


class RequestChecks:
    """The checks against one engine's tokenizer, vocabulary, ``max_model_len`` and scheduler
    limits; owns the grammar compiler (``replicas.engine.structured_output``), built for the
    first structured request."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        scheduler_config: SchedulerConfig,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: what an embedding row exists for
        self.max_model_len = max_model_len
        self._scheduler_config = scheduler_config
        self._grammar = None

    def prompt(self, prompt: str | list[int]) -> CheckedPrompt:
        """The prompt's token ids; ``ValueError`` if the engine can never serve it."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        check_prompt_length(len(token_ids), self.max_model_len)
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"prompt token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        sched = self._scheduler_config
        if not sched.enable_chunked_prefill and len(token_ids) > sched.max_num_batched_tokens:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than max_num_batched_tokens="
                f"{sched.max_num_batched_tokens}, and chunked prefill is disabled"
            )
        return CheckedPrompt(token_ids)

    def resumed(self, num_prompt_tokens: int, params: SamplingParams, resumed: ResumeState) -> None:
        """Raise ``ValueError`` unless ``resumed`` can continue: fewer output tokens than
        ``max_tokens`` and, with the prompt, than ``max_model_len``, all in the vocabulary, one
        logprob each when the request asks for them, and no prompt to score."""
        num_output = resumed.num_output_tokens
        if num_output >= params.max_tokens or num_prompt_tokens + num_output >= self.max_model_len:
            raise ValueError(f"a resumed request with {num_output} output tokens is complete")
        if any(not 0 <= t < self.vocab_size for t in resumed.output_token_ids):
            raise ValueError("a resumed output token is outside the vocabulary")
        num_logprobs = len(resumed.logprobs) if resumed.logprobs is not None else None
        if params.logprobs is not None and num_logprobs != num_output:
            raise ValueError("a resumed request asking for logprobs needs one per output token")
        if params.prompt_logprobs is not None:
            raise ValueError("a resumed request cannot score its prompt again")

    def params(self, params: SamplingParams) -> None:
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
            self.compiler(params.structured_outputs)

    def compiler(self, spec=None):
        """The grammar compiler, built on first use; with a ``spec``, that spec is compiled
        (cached) or rejected."""
        if self._grammar is None:
            from replicas.engine.structured_output import GrammarCompiler

            self._grammar = GrammarCompiler(self.tokenizer, self.tokenizer.vocab_size)
        if spec is not None:
            self._grammar.validate(spec)
        return self._grammar
