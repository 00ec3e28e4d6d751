"""The model's own scores of a whole sequence, the reference of the sampling tests."""

import torch

from cluster import LLM
from replicas.model.perplexity import sequence_logits


def reference_logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """The logits [len(tokens) - 1, vocab] of one pass over ``tokens``: row i predicts
    token i + 1."""
    logits = sequence_logits(llm.engine.loaded.model, tokens, "float32")[:-1]
    return logits[:, : llm.engine.tokenizer.vocab_size]


def reference_scores(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """log_softmax of ``reference_logits``: row i scores token i + 1."""
    return torch.log_softmax(reference_logits(llm, tokens), dim=-1)
