"""How ``auto`` times one candidate (``replicas.model.autotune``): a prefill and decode steps
over a block KV cache, in rounds, the fastest of each; a probe's timings priced at the model's
depth (``at_depth``) from what is not its layers (``time_rest``)."""

import time
from collections.abc import Callable

import torch
from torch import nn

from replicas.model.batch import ForwardBatch
from replicas.model.transformer import Transformer

PREFILL_TOKENS = 64
DECODE_CONTEXT_TOKENS = 64
REPEATS = 3
DECODE_REPEATS = 30
DECODE_ROUND_S = 0.15
"""A round's decode burst ends here (after ``MIN_DECODE_STEPS``) even short of its share of
``DECODE_REPEATS``, so that a large model's slow step does not stretch its measurement."""
MIN_DECODE_STEPS = 2
_BLOCK_SIZE = 16


@torch.inference_mode()
def time_model(
    model: Transformer,
    dtype: torch.dtype,
    timer: Callable[[], float] = time.perf_counter,
    kv_cache_dtype: str = "auto",
    logits: bool = True,
    out: Callable[[float, float], bool] | None = None,
) -> tuple[float, float]:
    """(prefill seconds per token, decode seconds per step) of ``model`` computing in
    ``dtype`` (see the module docstring), on random token ids over a block KV cache of
    ``kv_cache_dtype`` (``auto``: ``dtype``); ``logits``: each forward's last row through the
    LM head too; ``out``: given the figures after a round, whether the candidate is out of the
    running (then no more rounds are timed)."""
    device = model.tok_embeddings.weight.device
    num_tokens = max(PREFILL_TOKENS, DECODE_CONTEXT_TOKENS) + 1
    num_blocks = -(-num_tokens // _BLOCK_SIZE)
    specs = model.kv_cache_specs(dtype, kv_cache_dtype)
    kv_format = next(iter(specs.values())).kv_format
    caches = {
        g: torch.zeros(
            s.shape(num_blocks, _BLOCK_SIZE), dtype=kv_format.storage_dtype, device=device
        )
        for g, s in specs.items()
    }
    gen = torch.Generator().manual_seed(0)
    token_ids = torch.randint(0, model.args.vocab_size, (num_tokens,), generator=gen)

    def forward(start: int, end: int) -> None:
        positions = torch.arange(start, end, device=device)
        batch = ForwardBatch(
            input_ids=token_ids[start:end].to(device),
            positions=positions,
            query_start_loc=[0, end - start],
            seq_lens=[end],
            block_tables={g: torch.arange(num_blocks, device=device)[None, :] for g in caches},
            slot_mapping={g: positions for g in caches},
            logits_indices=torch.tensor([end - start - 1], device=device),
        )
        hidden = model(batch, caches, kv_format)
        if logits:
            model.compute_logits(hidden)

    def timed(start: int, end: int) -> float:
        synchronize(device)  # on CUDA, time the device's work, not the launches
        begin = timer()
        forward(start, end)
        synchronize(device)
        return timer() - begin

    forward(0, PREFILL_TOKENS)  # warm-up: first-touch of the cache and the kernels' set-up
    forward(DECODE_CONTEXT_TOKENS, DECODE_CONTEXT_TOKENS + 1)
    return _rounds(timed, out)


def _rounds(
    timed: Callable[[int, int], float], out: Callable[[float, float], bool] | None
) -> tuple[float, float]:
    """``time_model``'s rounds of ``timed`` forwards (start and end positions), each a prefill
    and a burst of decode steps, until ``REPEATS`` or ``out``: the fastest of each, per token
    and per step."""
    prefills, decodes = [], []
    for _ in range(REPEATS):
        prefills.append(timed(0, PREFILL_TOKENS))
        burst: list[float] = []
        while len(burst) < DECODE_REPEATS // REPEATS and (
            len(burst) < MIN_DECODE_STEPS or sum(burst) < DECODE_ROUND_S
        ):
            burst.append(timed(DECODE_CONTEXT_TOKENS, DECODE_CONTEXT_TOKENS + 1))
        decodes += burst
        if out is not None and out(min(prefills) / PREFILL_TOKENS, min(decodes)):
            break
    return min(prefills) / PREFILL_TOKENS, min(decodes)


def time_rest(
    model: Transformer,
    dtype: torch.dtype,
    timer: Callable[[], float] = time.perf_counter,
    kv_cache_dtype: str = "auto",
    logits: bool = True,
) -> tuple[float, float]:
    """``time_model`` of ``model`` without its decoder layers: the embedding, the final norm,
    the LM head where ``logits`` and what a forward does once whatever its depth (eager: the
    native stack runs the layers)."""
    layers, native = model.layers, model.native
    model.layers, model.native = nn.ModuleList(), None
    try:
        return time_model(model, dtype, timer, kv_cache_dtype, logits)
    finally:
        model.layers, model.native = layers, native


def at_depth(
    probe: tuple[float, float],
    rest: tuple[float, float],
    probe_layers: int,
    layers: int,
    head: tuple[float, float] = (0.0, 0.0),
) -> tuple[float, float]:
    """A probe's (prefill per token, decode step) times priced at ``layers`` decoder layers:
    what is not the layers (``rest``) once, and the probe's layers' share ``layers /
    probe_layers`` times (never below nothing); ``head``: the LM head's times, where the probe
    and ``rest`` were timed without it."""
    return tuple(
        r + layers * max(0.0, p - r) / probe_layers + h
        for p, r, h in zip(probe, rest, head, strict=True)
    )


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA runs asynchronously; a CPU has none queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
