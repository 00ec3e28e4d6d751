"""Turn each sequence's last-token logits into its next token (and, when asked, its logprobs)."""

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from replicas.engine.request import Request
from replicas.outputs import TokenLogprob
from replicas.sampling_params import MIN_TOP_P

if TYPE_CHECKING:
    from replicas.engine.structured_output import GrammarCompiler, GrammarMatcher


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # per row: set when the request asked for logprobs


class Sampler:
    """Greedy rows are decided together; sampled rows one by one with their own filters.

    A request with a ``seed`` draws from its own generator, so its tokens do not depend on what
    else is in the batch; unseeded requests share the engine's generator.

    Rows whose parameters process logits (``SamplingParams.processes_logits``) are processed on a
    copy, in the order ``SamplingParams`` documents; logprobs are always those of the model's
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
        self._shared = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._matchers: dict[str, GrammarMatcher] = {}
        self._seen_in_prompt: dict[str, torch.Tensor] = {}

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        """``logits``: [B, vocab] float32, row i for ``requests[i]``."""
        processed = logits
        rows = [i for i, r in enumerate(requests) if r.sampling_params.processes_logits]
        if rows:
            processed = logits.clone()
            for row in rows:
                self._process(processed[row], requests[row])
        tokens = processed.argmax(dim=-1).tolist()
        for row, request in enumerate(requests):
            params = request.sampling_params
            if params.is_greedy:
                continue
            scores = processed[row] / params.temperature
            if params.top_k > 0 and params.top_k < scores.numel():
                kth = torch.topk(scores, params.top_k).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            if params.top_p < 1.0:
                scores = _top_p_filter(scores, max(params.top_p, MIN_TOP_P))
            probs = torch.softmax(scores, dim=-1)
            generator = self._generator(request)
            tokens[row] = int(torch.multinomial(probs, 1, generator=generator).item())
        for row, request in enumerate(requests):
            matcher = self._matchers.get(request.request_id)
            if matcher is not None:
                matcher.accept(tokens[row])
        return SampleResult(tokens, self._logprobs(logits, requests, tokens))

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
        self._seen_in_prompt.pop(request_id, None)

    def _process(self, row: torch.Tensor, request: Request) -> None:
        """Apply the grammar, min_tokens, logit_bias and the penalties to one row, in place."""
        params = request.sampling_params
        if params.structured_outputs is not None:
            self._matcher(request).apply_mask(row)  # masks commute with the rest: -inf stays
        if request.num_output_tokens < params.min_tokens:
            banned = [t for t in (*self.eos_token_ids, *params.stop_token_ids) if t < row.numel()]
            kept = row.clone() if params.structured_outputs is not None else None
            row[banned] = float("-inf")
            if kept is not None and not torch.isfinite(row).any():
                row.copy_(kept)  # a complete structured output may end before min_tokens
        if params.logit_bias:
            ids = [t for t in params.logit_bias if t < row.numel()]
            row[ids] += torch.tensor([params.logit_bias[t] for t in ids], dtype=row.dtype)
        if params.repetition_penalty != 1.0:
            seen = self._seen(request, row.numel())
            values = row[seen]
            penalty = params.repetition_penalty
            row[seen] = torch.where(values > 0, values / penalty, values * penalty)
        if (params.presence_penalty or params.frequency_penalty) and request.output_token_ids:
            output = torch.tensor(request.output_token_ids, dtype=torch.long)
            counts = torch.bincount(output, minlength=row.numel())[: row.numel()].to(row.dtype)
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)

    def _seen(self, request: Request, vocab_size: int) -> torch.Tensor:
        """Token ids in the prompt or the output so far (the repetition penalty's set)."""
        prompt = self._seen_in_prompt.get(request.request_id)
        if prompt is None:
            prompt = torch.tensor(request.prompt_token_ids, dtype=torch.long).unique()
            self._seen_in_prompt[request.request_id] = prompt
        output = torch.tensor(request.output_token_ids, dtype=torch.long)
        seen = torch.cat([prompt, output]).unique()
        return seen[seen < vocab_size]

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
        self, logits: torch.Tensor, requests: list[Request], tokens: list[int]
    ) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not rows:
            return out
        scores = torch.log_softmax(logits[rows], dim=-1)
        chosen = scores.gather(1, torch.tensor([[tokens[i]] for i in rows])).squeeze(1).tolist()
        num_top = max(requests[i].sampling_params.logprobs for i in rows)
        top_values, top_ids = scores.topk(num_top, dim=-1) if num_top else (None, None)
        for j, row in enumerate(rows):
            k = requests[row].sampling_params.logprobs
            top = tuple(zip(top_ids[j, :k].tolist(), top_values[j, :k].tolist())) if k else ()
            out[row] = TokenLogprob(tokens[row], chosen[j], top)
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


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``."""
    sorted_scores, order = torch.sort(scores, descending=True)
    cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
    # Drop a token when the tokens before it already reach top_p; the top token always stays.
    drop = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= top_p
    sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
    return torch.empty_like(scores).scatter_(0, order, sorted_scores)
