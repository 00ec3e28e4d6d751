"""The model's own scores of a whole sequence, the reference of the sampling tests."""

import torch

from cluster import LLM
from replicas.model.batch import ForwardBatch

BS = 16


@torch.inference_mode()
def reference_logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """The logits [len(tokens) - 1, vocab] of one pass over ``tokens``: row i predicts
    token i + 1."""
    model = llm.engine.loaded.model
    vocab_size = llm.engine.tokenizer.vocab_size
    n = len(tokens)
    num_blocks = -(-n // BS)
    specs = model.kv_cache_specs(torch.float32)
    caches = {g: torch.zeros(s.shape(num_blocks, BS)) for g, s in specs.items()}
    positions = torch.arange(n)
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens),
        positions=positions,
        query_start_loc=[0, n],
        seq_lens=[n],
        block_tables={g: torch.arange(num_blocks)[None, :] for g in specs},
        slot_mapping={g: positions for g in specs},
        logits_indices=positions,
    )
    return model.compute_logits(model(batch, caches)[: n - 1])[:, :vocab_size]


def reference_scores(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """log_softmax of ``reference_logits``: row i scores token i + 1."""
    return torch.log_softmax(reference_logits(llm, tokens), dim=-1)
