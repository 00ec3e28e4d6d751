"""Turn each sequence's last-token logits into its next token (and, when asked, its logprobs)."""

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from replicas.engine.logits_processor import LogitsProcessor
from replicas.engine.request import Request
from replicas.outputs import TokenLogprob
from replicas.sampling_params import MIN_TOP_P

if TYPE_CHECKING:
    from replicas.engine.structured_output import GrammarCompiler, GrammarMatcher


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # per row: set when the request asked for logprobs


class Sampler:
    """Samples a batch's next tokens on the logits' device, all rows together.

    Greedy rows take the argmax. Sampled rows go through temperature, top-k and top-p as one
    batch and draw by the exponential race (``argmax(probs / q)`` with ``q ~ Exp(1)`` per token,
    which is what ``torch.multinomial`` draws one token by): the noise of a request with a
    ``seed`` comes from its own generator, so its tokens do not depend on what else is in the
    batch; unseeded rows draw theirs together from the engine's generator, in batch order. The
    host waits once per step, for the tokens (and once more for logprobs when asked).

    Rows whose parameters process logits (``SamplingParams.processes_logits``) are processed on a
    copy (``replicas.engine.logits_processor``); logprobs are always those of the model's
    logits. A request with structured outputs has a grammar matcher here (from ``grammar()``,
    which returns the ``replicas.engine.structured_output.GrammarCompiler`` of the tokenizer),
    advanced by every token it is given.
    """

    def __init__(
        self,
        seed: int,
        device: torch.device,
        eos_token_ids: tuple[int, ...] = (),
        grammar: "Callable[[], GrammarCompiler] | None" = None,
    ) -> None:
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.grammar = grammar
        self.processor = LogitsProcessor(eos_token_ids)
        self._shared = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._matchers: dict[str, GrammarMatcher] = {}

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        """``logits``: [B, vocab] float32, row i for ``requests[i]``."""
        processed = logits
        if any(r.sampling_params.processes_logits for r in requests):
            processed = logits.clone()
            biases = {
                i: self._matcher(r).bias()
                for i, r in enumerate(requests)
                if r.sampling_params.structured_outputs is not None
            }
            self.processor.process(processed, requests, biases)
        chosen = processed.argmax(dim=-1)
        sampled = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if sampled:
            # Unseeded rows first: their noise is one draw from the shared generator.
            sampled.sort(key=lambda i: requests[i].sampling_params.seed is not None)
            rows = torch.tensor(sampled, dtype=torch.long, device=logits.device)
            chosen[rows] = self._draw(processed[rows], [requests[i] for i in sampled])
        tokens = chosen.tolist()
        for row, request in enumerate(requests):
            matcher = self._matchers.get(request.request_id)
            if matcher is not None:
                matcher.accept(tokens[row])
        return SampleResult(tokens, self._logprobs(logits, requests, chosen, tokens))

    def _draw(self, scores: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One token per row of ``scores`` [S, vocab] (row j for ``requests[j]``, the unseeded
        ones first), as a tensor on the device."""
        params = [r.sampling_params for r in requests]
        temperature = torch.tensor(
            [p.temperature for p in params], dtype=scores.dtype, device=scores.device
        )
        scores = scores / temperature[:, None]
        scores = _min_p_filter(scores, [p.min_p for p in params])
        scores = _top_k_filter(scores, [p.top_k for p in params])
        scores = _top_p_filter(scores, [max(p.top_p, MIN_TOP_P) for p in params])
        probs = torch.softmax(scores, dim=-1)
        noise = torch.empty_like(probs)
        num_unseeded = sum(p.seed is None for p in params)
        if num_unseeded:
            noise[:num_unseeded].exponential_(generator=self._shared)
        for j in range(num_unseeded, len(requests)):
            noise[j].exponential_(generator=self._generator(requests[j]))
        return (probs / noise).argmax(dim=-1)

    def verify_drafts(
        self,
        logits: torch.Tensor,
        token_ids: list[int],
        draft_token_ids: list[tuple[int, ...]],
    ) -> list[list[int]]:
        """Greedy verification of draft tokens (requests that ``can_speculate`` only).

        ``token_ids[i]`` is request i's sampled token, ``draft_token_ids[i]`` the draft that
        followed its last token in the batch, and ``logits`` [D, vocab] has one row per draft
        token, in order (the model's scores after that token). A draft token is accepted while
        it equals the model's choice at its position; each accepted one yields the model's
        choice after it. Returns, per request, the tokens after ``token_ids[i]``: one per
        accepted draft token, the last being the model's own token after the accepted prefix::

            drafts    d1  d2  d3          model's argmax after: last token g0, d1 g1, d2 g2, ...
            accepted  d1 = g0, d2 = g1, d3 != g2   ->  tokens g0 (token_ids[i]), g1, g2
        """
        choices = logits.argmax(dim=-1).tolist() if logits.shape[0] else []
        out: list[list[int]] = []
        row = 0
        for token_id, drafts in zip(token_ids, draft_token_ids, strict=True):
            tokens: list[int] = []
            previous = token_id
            for j, draft in enumerate(drafts):
                if draft != previous:
                    break
                previous = choices[row + j]
                tokens.append(previous)
            out.append(tokens)
            row += len(drafts)
        return out

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self.processor.release(request_id)

    def _matcher(self, request: Request) -> "GrammarMatcher":
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            if self.grammar is None:
                raise ValueError("structured outputs need a grammar compiler for this tokenizer")
            matcher = self.grammar().matcher(request.sampling_params.structured_outputs)
            for token_id in request.output_token_ids:  # resumed after a restart of its state
                matcher.accept(token_id)
            self._matchers[request.request_id] = matcher
        return matcher

    def _logprobs(
        self, logits: torch.Tensor, requests: list[Request], chosen: torch.Tensor, tokens: list[int]
    ) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not rows:
            return out
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        scores = torch.log_softmax(logits[index], dim=-1)
        chosen_scores = scores.gather(1, chosen[index, None]).squeeze(1).tolist()
        num_top = max(requests[i].sampling_params.logprobs for i in rows)
        top_ids: list[list[int]] = [[] for _ in rows]
        top_values: list[list[float]] = [[] for _ in rows]
        if num_top:
            values, ids = scores.topk(num_top, dim=-1)
            top_ids, top_values = ids.tolist(), values.tolist()
        for j, row in enumerate(rows):
            k = requests[row].sampling_params.logprobs
            top = tuple(zip(top_ids[j][:k], top_values[j][:k]))
            out[row] = TokenLogprob(tokens[row], chosen_scores[j], top)
        return out

    def _generator(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self._shared
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[request.request_id] = generator
        return generator


def _min_p_filter(scores: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Keep, in row j, the tokens whose probability is at least ``min_p[j]`` times the likeliest
    one's (0: all of them): scores at least the top score plus ``log(min_p[j])``."""
    if not any(p > 0 for p in min_p):
        return scores
    offsets = [math.log(p) if p > 0 else -math.inf for p in min_p]
    floor = (
        scores.amax(dim=-1, keepdim=True)
        + torch.tensor(offsets, dtype=scores.dtype, device=scores.device)[:, None]
    )
    return scores.masked_fill(scores < floor, float("-inf"))


def _top_k_filter(scores: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep, in row j, the tokens scoring at least its ``top_k[j]``-th best (0, -1 or the
    whole vocabulary: all of them)."""
    width = scores.shape[-1]
    if not any(0 < k < width for k in top_k):
        return scores
    ranks = [k - 1 if 0 < k < width else width - 1 for k in top_k]
    ranks_t = torch.tensor(ranks, dtype=torch.long, device=scores.device)[:, None]
    kth = scores.sort(dim=-1, descending=True).values.gather(1, ranks_t)
    has_k = torch.tensor([0 < k < width for k in top_k], device=scores.device)[:, None]
    return scores.masked_fill((scores < kth) & has_k, float("-inf"))


def _top_p_filter(scores: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep, in row j, the smallest set of most likely tokens whose probability reaches
    ``top_p[j]`` (1: all of them)."""
    if all(p >= 1.0 for p in top_p):
        return scores
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    # Drop a token when the tokens before it already reach top_p; the top token always stays.
    limit = torch.tensor(top_p, dtype=scores.dtype, device=scores.device)[:, None]
    has_p = torch.tensor([p < 1.0 for p in top_p], device=scores.device)[:, None]
    drop = ((probs.cumsum(dim=-1) - probs) >= limit) & has_p
    sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
    return torch.empty_like(scores).scatter_(-1, order, sorted_scores)
