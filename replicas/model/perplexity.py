"""Perplexity of a token sequence under a model: how its quality is stated for each way of
keeping its weights (``replicas.model.quant``).

The sequence is cut into disjoint windows of ``window_len`` tokens; each window is one prefill
from position 0 over a fresh block KV cache, and every token after a window's first is scored
against the logits of the token before it. Perplexity is ``exp`` of the mean negative
log-likelihood over all scored tokens. ``benchmarks/engine_vs_llamacpp.py`` scores llama.cpp
over the same windows.
"""

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from replicas.model.batch import ForwardBatch
from replicas.model.transformer import Transformer

BLOCK_SIZE = 16


def windows(token_ids: Sequence[int], window_len: int) -> list[list[int]]:
    """Disjoint windows of ``window_len`` tokens (the last may be shorter; one of a single
    token scores nothing and is dropped)."""
    if window_len < 2:
        raise ValueError(f"window_len must be at least 2, got {window_len}")
    cut = [list(token_ids[i : i + window_len]) for i in range(0, len(token_ids), window_len)]
    return [w for w in cut if len(w) > 1]


@torch.inference_mode()
def sequence_logits(
    model: Transformer, token_ids: Sequence[int], kv_cache_dtype: str = "auto"
) -> torch.Tensor:
    """Logits [len(token_ids), vocab] (float32) of one prefill from position 0 over a fresh
    block KV cache stored as ``kv_cache_dtype`` (``auto``: the weights' dtype), written and
    read by attention as in serving: row i predicts token i + 1. The reference of logprob and
    quantization tests (no cache reuse, no batching)."""
    device = model.tok_embeddings.weight.device
    n = len(token_ids)
    num_blocks = -(-n // BLOCK_SIZE)
    specs = model.kv_cache_specs(model.tok_embeddings.weight.dtype, kv_cache_dtype)
    caches = {
        g: torch.zeros(s.shape(num_blocks, BLOCK_SIZE), dtype=s.storage_dtype, device=device)
        for g, s in specs.items()
    }
    positions = torch.arange(n, device=device)
    batch = ForwardBatch(
        input_ids=torch.tensor(list(token_ids), dtype=torch.long, device=device),
        positions=positions,
        query_start_loc=[0, n],
        seq_lens=[n],
        block_tables={g: torch.arange(num_blocks, device=device)[None, :] for g in specs},
        slot_mapping={g: positions for g in specs},
        logits_indices=positions,
    )
    return model.compute_logits(model(batch, caches, next(iter(specs.values())).kv_format))


def token_nll(
    model: Transformer, window: Sequence[int], kv_cache_dtype: str = "auto"
) -> torch.Tensor:
    """Negative log-likelihood [len(window) - 1] (float32) of each token after the first."""
    logits = sequence_logits(model, window, kv_cache_dtype)[:-1]
    targets = torch.tensor(list(window[1:]), dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits, targets, reduction="none")


def perplexity(
    model: Transformer,
    token_ids: Sequence[int],
    window_len: int = 512,
    kv_cache_dtype: str = "auto",
) -> float:
    """``exp`` of the mean negative log-likelihood over ``windows(token_ids, window_len)``,
    with K and V stored as ``kv_cache_dtype``."""
    parts = [token_nll(model, w, kv_cache_dtype) for w in windows(token_ids, window_len)]
    if not parts:
        raise ValueError("perplexity needs at least two tokens")
    return math.exp(torch.cat(parts).double().mean().item())
