"""Turn each sequence's last-token logits into its next token."""

import torch

from replicas.request import Request
from replicas.sampling_params import MIN_TOP_P


class Sampler:
    """Greedy rows are decided together; sampled rows one by one with their own filters.

    A request with a ``seed`` draws from its own generator, so its tokens do not depend on what
    else is in the batch; unseeded requests share the engine's generator.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self._shared = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """``logits``: [B, vocab] float32, row i for ``requests[i]``."""
        tokens = logits.argmax(dim=-1).tolist()
        for row, request in enumerate(requests):
            params = request.sampling_params
            if params.is_greedy:
                continue
            scores = logits[row] / params.temperature
            if params.top_k > 0 and params.top_k < scores.numel():
                kth = torch.topk(scores, params.top_k).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            if params.top_p < 1.0:
                scores = _top_p_filter(scores, max(params.top_p, MIN_TOP_P))
            probs = torch.softmax(scores, dim=-1)
            generator = self._generator(request)
            tokens[row] = int(torch.multinomial(probs, 1, generator=generator).item())
        return tokens

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

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
