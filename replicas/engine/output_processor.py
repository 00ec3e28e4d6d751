"""From output tokens to text: incremental detokenization, stop strings, streaming hold-back.

The engine step works in token ids; this class owns everything about text. Per request it keeps
the decoded text and two token offsets::

    output_token_ids  |..........|<-- prefix -->|<---- unread ---->|
                                 prefix_offset  read_offset        num_output_tokens

Each update decodes only ``output_token_ids[prefix_offset:]`` and appends what it adds to the
decode of ``[prefix_offset:read_offset]``; ``read_offset`` advances only when the new text ends in
a complete character (not U+FFFD), so ``text`` always equals the decode of
``output_token_ids[:read_offset]`` and, once the request finishes, of all of them. A window that
starts at ``prefix_offset`` (not at ``read_offset``) lets tokenizers that strip or merge at the
start of a decode (sentencepiece spaces) decode the new token in context.

Streamed text is held back by ``max(len(stop)) - 1`` characters while a stop string may still be
forming, and by any trailing U+FFFD; a finished request's text is final.
"""

from dataclasses import dataclass

from replicas.engine.request import Request
from replicas.kv.events import Tier, per_tier
from replicas.model import Tokenizer
from replicas.outputs import RequestOutput


@dataclass(slots=True)
class _TextState:
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    num_searched_chars: int = 0  # text before this holds no stop string
    num_emitted_chars: int = 0  # text already reported (streaming cursor)
    num_emitted_tokens: int = 0
    is_cut: bool = False  # a stop string cut the text: it is final
    prompt_logprobs: list | None = None  # trimmed to the request's count, once complete


class OutputProcessor:
    """Turns a request's output tokens into ``RequestOutput``s; one state per live request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}

    def add(self, request: Request, num_emitted_chars: int = 0) -> None:
        """Start a request's text. A resumed request (``replicas.resume``) comes with output
        tokens: their text is decoded now, all of it searched for stop strings already, and
        its first ``num_emitted_chars`` characters received by the client; the rest (held
        back) goes out with the next output."""
        state = self._states[request.request_id] = _TextState()
        if request.output_token_ids:
            self._decode(state, request.output_token_ids, final=False)
            state.num_searched_chars = len(state.text)
            state.num_emitted_chars = num_emitted_chars
            state.num_emitted_tokens = request.num_output_tokens

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def update(self, request: Request) -> None:
        """Decode the request's new output tokens into its text (complete characters only)."""
        state = self._states[request.request_id]
        self._decode(state, request.output_token_ids, final=False)

    def find_stop(self, request: Request) -> bool:
        """True if the text now contains one of the request's stop strings; the text is cut
        before the earliest one. Only text that arrived since the last call is searched (with
        the overlap a stop string straddling the boundary needs)."""
        stop = request.sampling_params.stop
        state = self._states[request.request_id]
        start = max(0, state.num_searched_chars - max(len(s) for s in stop) + 1)
        state.num_searched_chars = len(state.text)
        positions = [p for s in stop if (p := state.text.find(s, start)) >= 0]
        if not positions:
            return False
        state.text = state.text[: min(positions)]
        state.is_cut = True
        return True

    def output(self, request: Request) -> RequestOutput:
        """The request's output now: cumulative text and tokens, and what is new since the
        last output (held back while streaming, see the module docstring)."""
        state = self._states[request.request_id]
        if request.is_finished and not state.is_cut:
            self._decode(state, request.output_token_ids, final=True)
        text = state.text
        end = len(text)
        if not request.is_finished:
            stop = request.sampling_params.stop
            end -= max((len(s) for s in stop), default=1) - 1 if stop else 0
            while end > state.num_emitted_chars and text[end - 1] == "\ufffd":
                end -= 1
        end = max(end, state.num_emitted_chars)
        new_text = text[state.num_emitted_chars : end]
        new_token_ids = request.output_token_ids[state.num_emitted_tokens :]
        logprobs = new_logprobs = new_prompt_logprobs = None
        params = request.sampling_params
        if request.logprobs is not None:
            logprobs = list(request.logprobs)  # the sampler keeps the asked-for alternatives
            new_logprobs = logprobs[state.num_emitted_tokens :]
        if state.prompt_logprobs is None and request.prompt_logprobs is not None:
            if len(request.prompt_logprobs) == request.num_prompt_tokens:
                state.prompt_logprobs = _trimmed(request.prompt_logprobs, params.prompt_logprobs)
                new_prompt_logprobs = state.prompt_logprobs
        state.num_emitted_chars = end
        state.num_emitted_tokens = request.num_output_tokens
        return RequestOutput(
            logprobs=logprobs,
            new_logprobs=new_logprobs,
            prompt_logprobs=state.prompt_logprobs,
            new_prompt_logprobs=new_prompt_logprobs,
            cumulative_logprob=request.cumulative_logprob if logprobs is not None else None,
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=text[:end],
            new_token_ids=new_token_ids,
            new_text=new_text,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_cached_tokens_by_tier=per_tier(
                {Tier.NPU: request.num_npu_cached_tokens, Tier.HOST: request.num_host_cached_tokens}
            ),
            cached_tokens_by_cache_type=dict(request.cached_tokens_by_cache_type),
            arrival_time=request.arrival_time,
            first_token_time=request.first_token_time,
            finish_time=request.finish_time,
        )

    def _decode(self, state: _TextState, token_ids: list[int], final: bool) -> None:
        if state.read_offset == len(token_ids):
            return
        decode = self.tokenizer.decode
        window = decode(token_ids[state.prefix_offset :])
        known = decode(token_ids[state.prefix_offset : state.read_offset])
        if final or (len(window) > len(known) and not window.endswith("\ufffd")):
            state.text += window[len(known) :]
            state.prefix_offset = state.read_offset
            state.read_offset = len(token_ids)


def _trimmed(scores: list, num_top: int) -> list:
    """Scores with at most ``num_top`` alternatives each (the engine keeps more for prompts)."""
    return [
        s if s is None or len(s.top) <= num_top else s._replace(top=s.top[:num_top]) for s in scores
    ]
