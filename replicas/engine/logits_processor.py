"""What ``SamplingParams`` does to a batch's logits before sampling, on the logits' device.

Stages, in the order ``SamplingParams`` documents, each one batched operation over the rows that
use it (their indices and values uploaded once per stage, never a tensor per row)::

    grammar mask       row = min(row, bias)          bias: +inf allowed, -inf not, per token
    min_tokens         row[EOS, stop ids] = -inf     undone where a grammar then allows nothing
    logit_bias         row[ids] += bias
    repetition         row[seen] = row / p if row > 0 else row * p    seen: prompt or output
    presence/frequency row -= frequency * count + presence * (count > 0)    counts: output only

Token ids at or past the logits' width (the model's vocabulary) are ignored. The values equal
those of processing each row on its own (the same elementwise operations).
"""

from collections.abc import Sequence

import numpy as np
import torch

from replicas.engine.request import Request


class LogitsProcessor:
    """Applies the stages above in place. Keeps, per request, the mask of its prompt's tokens
    on the device (the repetition penalty's prompt part), until ``release``."""

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self._prompt_masks: dict[str, torch.Tensor] = {}

    def process(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        grammar_biases: dict[int, np.ndarray],
    ) -> None:
        """Process ``logits`` [B, vocab] in place; ``grammar_biases`` maps a row with structured
        outputs to its grammar state's bias (``GrammarMatcher.bias``)."""
        if grammar_biases:
            _mask(logits, grammar_biases)
        self._min_tokens(logits, requests)
        _logit_bias(logits, requests)
        self._repetition(logits, requests)
        _presence_frequency(logits, requests)

    def release(self, request_id: str) -> None:
        self._prompt_masks.pop(request_id, None)

    def _min_tokens(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        width = logits.shape[1]
        rows: list[int] = []
        cols: list[int] = []
        structured: list[int] = []  # rows whose grammar may end before min_tokens
        for i, request in enumerate(requests):
            params = request.sampling_params
            if request.num_output_tokens >= params.min_tokens:
                continue
            banned = [t for t in (*self.eos_token_ids, *params.stop_token_ids) if t < width]
            rows += [i] * len(banned)
            cols += banned
            if params.structured_outputs is not None:
                structured.append(i)
        if not rows:
            return
        kept_rows = _index(structured, logits.device)
        kept = logits[kept_rows] if structured else None
        logits[_index(rows, logits.device), _index(cols, logits.device)] = float("-inf")
        if kept is not None:  # a complete structured output may end before min_tokens
            now = logits[kept_rows]
            allows_nothing = ~torch.isfinite(now).any(dim=-1, keepdim=True)
            logits[kept_rows] = torch.where(allows_nothing, kept, now)

    def _repetition(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        rows = [i for i, r in enumerate(requests) if r.sampling_params.repetition_penalty != 1.0]
        if not rows:
            return
        width, device = logits.shape[1], logits.device
        seen = torch.stack([self._prompt_mask(requests[i], width, device) for i in rows])
        out_rows, out_cols = _output_tokens([requests[i] for i in rows], width)
        if out_cols:
            seen[_index(out_rows, device), _index(out_cols, device)] = True
        penalty = _column([requests[i].sampling_params.repetition_penalty for i in rows], logits)
        index = _index(rows, device)
        x = logits[index]
        logits[index] = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)

    def _prompt_mask(self, request: Request, width: int, device: torch.device) -> torch.Tensor:
        mask = self._prompt_masks.get(request.request_id)
        if mask is None:
            mask = torch.zeros(width, dtype=torch.bool, device=device)
            ids = [t for t in request.prompt_token_ids if t < width]
            if ids:
                mask[_index(ids, device)] = True
            self._prompt_masks[request.request_id] = mask
        return mask


def _mask(logits: torch.Tensor, biases: dict[int, np.ndarray]) -> None:
    rows = _index(list(biases), logits.device)
    bias = torch.from_numpy(np.stack(list(biases.values())))
    bias = bias.to(device=logits.device, dtype=logits.dtype)
    logits[rows] = torch.minimum(logits[rows], bias)


def _logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    width = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, request in enumerate(requests):
        for token_id, value in (request.sampling_params.logit_bias or {}).items():
            if token_id < width:
                rows.append(i)
                cols.append(token_id)
                values.append(value)
    if rows:
        index = (_index(rows, logits.device), _index(cols, logits.device))
        added = torch.tensor(values, dtype=logits.dtype, device=logits.device)
        logits.index_put_(index, added, accumulate=True)


def _presence_frequency(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    rows = [
        i
        for i, r in enumerate(requests)
        if (r.sampling_params.presence_penalty or r.sampling_params.frequency_penalty)
        and r.output_token_ids
    ]
    if not rows:
        return
    width, device = logits.shape[1], logits.device
    out_rows, out_cols = _output_tokens([requests[i] for i in rows], width)
    counts = torch.zeros((len(rows), width), dtype=logits.dtype, device=device)
    if out_cols:
        ones = torch.ones(len(out_cols), dtype=logits.dtype, device=device)
        counts.index_put_((_index(out_rows, device), _index(out_cols, device)), ones, True)
    params = [requests[i].sampling_params for i in rows]
    frequency = _column([p.frequency_penalty for p in params], logits)
    presence = _column([p.presence_penalty for p in params], logits)
    index = _index(rows, device)
    logits[index] = logits[index] - (frequency * counts + presence * (counts > 0))


def _output_tokens(requests: Sequence[Request], width: int) -> tuple[list[int], list[int]]:
    """(row, token id) of every output token of ``requests`` (row j: ``requests[j]``)."""
    rows: list[int] = []
    cols: list[int] = []
    for j, request in enumerate(requests):
        ids = [t for t in request.output_token_ids if t < width]
        rows += [j] * len(ids)
        cols += ids
    return rows, cols


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]
