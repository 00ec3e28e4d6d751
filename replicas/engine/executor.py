"""Runs a step on the model: the forward pass of the model runner, then the sampler."""

from replicas.engine.core import StepResult
from replicas.engine.model_runner import ModelRunner
from replicas.engine.sampler import Sampler
from replicas.engine.scheduler import SchedulerOutput


class ModelExecutor:
    """The ``Executor`` of a real replica. Logits beyond the tokenizer's vocabulary (padding
    rows of the embedding) are never sampled."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, vocab_size: int) -> None:
        self.runner = runner
        self.sampler = sampler
        self.vocab_size = vocab_size

    def execute(self, output: SchedulerOutput) -> StepResult:
        self.runner.copy_blocks(output.transfer.block_copies)  # before the forward reads them
        logits, sampled, prompt_scores = self.runner.execute(output.scheduled, self.vocab_size)
        logits = logits[:, : self.vocab_size]
        requests = [output.scheduled[i].request for i in sampled]
        token_ids, logprobs = self.sampler.sample(logits[: len(sampled)], requests)
        drafts = [output.scheduled[i].draft_token_ids for i in sampled]
        extra = None
        if any(drafts):
            extra = self.sampler.verify_drafts(logits[len(sampled) :], token_ids, drafts)
        return StepResult(requests, token_ids, logprobs, prompt_scores, extra)

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)
