"""How engine outputs become OpenAI bodies: one renderer per endpoint.

A stream is ``first_chunks``, then one ``chunk`` per output that added text or tokens (the last
of a choice carries its ``finish_reason``), then ``usage_chunk`` when the client asked for usage,
then ``data: [DONE]``. A non-streaming answer is one ``response`` built from every choice's final
output. Choice ``i`` of prompt ``p`` has index ``p * n + i``. A renderer frames its own stream
(``encode``, ``error_payload``, ``stream_end``): the Responses renderer
(``cluster.api.responses``) sends named events and no ``[DONE]``.

Logprobs are rendered with each token's text (``Tokenizer.decode`` of that token alone) in
OpenAI's shapes: completions' parallel lists (with ``echo``, the prompt's tokens first, the first
of them without a logprob), chat's ``content`` list of ``{token, logprob, bytes, top_logprobs}``.
"""

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence

from pydantic import BaseModel

from cluster.api.errors import APIError
from cluster.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)
from cluster.api.streaming import DONE, sse
from replicas.model import Tokenizer
from replicas.outputs import RequestOutput, TokenLogprob


def usage_of(outputs: Sequence[RequestOutput], num_choices_per_prompt: int = 1) -> Usage:
    """Usage of a request: each prompt counted once (its choices share it), every choice's
    output; cached tokens as the prompt's first sequence found them."""
    return _usage(outputs[::num_choices_per_prompt], outputs)


def running_usage(
    num_prompt_tokens: int,
    latest: dict[int, RequestOutput],
    num_choices_per_prompt: int = 1,
    num_cached_tokens: int = 0,
) -> Usage:
    """Usage so far of a streamed request (vLLM's ``continuous_usage_stats``): every prompt's
    tokens, known before any output, and each choice's latest output (choice ``i`` of prompt
    ``p`` at index ``p * n + i``), its prompt's cached tokens counted from its first choice.
    ``num_cached_tokens``: cached tokens known besides ``latest`` (the role chunks, sent
    before any output's tokens, count those of the first output)."""
    prompts = [o for index, o in latest.items() if index % num_choices_per_prompt == 0]
    num_completion = sum(len(o.token_ids) for o in latest.values())
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion,
        total_tokens=num_prompt_tokens + num_completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=num_cached_tokens + sum(o.num_cached_tokens for o in prompts)
        ),
    )


def _usage(prompts: Sequence[RequestOutput], outputs: Sequence[RequestOutput]) -> Usage:
    """``prompts``: one output of each prompt (its first choice's)."""
    num_prompt = sum(len(o.prompt_token_ids) for o in prompts)
    num_completion = sum(len(o.token_ids) for o in outputs)
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(o.num_cached_tokens for o in prompts)
        ),
    )


class Renderer(ABC):
    id_prefix: str

    def __init__(
        self,
        model: str,
        tokenizer: Tokenizer | None = None,
        request_id: str | None = None,
        *,
        num_choices: int = 1,
        logprobs: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.request_id = request_id or f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.num_choices = num_choices  # per prompt
        self.logprobs = logprobs  # alternatives per token; None: no logprobs
        self._token_text: dict[int, str] = {}

    def choice_index(self, prompt_index: int, sequence_index: int) -> int:
        return prompt_index * self.num_choices + sequence_index

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def first_chunks(self, num_prompts: int) -> list[BaseModel]:
        return []

    # A stream's framing: each chunk as ``data: <json>``, then ``data: [DONE]``.
    stream_end: bytes = DONE

    def encode(self, chunk: BaseModel | dict) -> bytes:
        """The bytes of one chunk (or of the error payload) in this endpoint's stream."""
        return sse(chunk)

    def error_payload(self, error: APIError) -> BaseModel | dict:
        """What a stream sends when it fails after it started."""
        return error.body()

    @abstractmethod
    def chunk(self, index: int, output: RequestOutput) -> BaseModel | None:
        """This output's delta as a chunk of choice ``index``; None when it adds nothing."""

    @abstractmethod
    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    @abstractmethod
    def response(self, choices: Sequence[tuple[int, RequestOutput]], usage: Usage) -> BaseModel:
        """``choices``: (index, final output) in index order."""


class CompletionRenderer(Renderer):
    id_prefix = "cmpl"

    def __init__(self, *args, echo: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo
        self._echoed: set[int] = set()
        self._offsets: dict[int, int] = {}  # choice -> text offset of its next token
        self._prompt_logprobs: dict[int, list] = {}  # prompt index -> its scores

    def _body(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids)

    def chunk(self, index: int, output: RequestOutput) -> CompletionResponse | None:
        text = output.new_text
        scores: list[TokenLogprob] = []
        if self.echo and index not in self._echoed:
            self._echoed.add(index)
            text = self._prompt_text(output) + text
            scores = self._prompt_scores(index, output)
        scores += output.new_logprobs or []
        if not text and not scores and not output.finished:
            return None
        logprobs = self._logprobs(index, scores) if self.logprobs is not None else None
        choice = CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=output.finish_reason
        )
        return self._body([choice], None)

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return self._body([], usage)

    def response(
        self, choices: Sequence[tuple[int, RequestOutput]], usage: Usage
    ) -> CompletionResponse:
        rendered = []
        for index, final in choices:
            text = final.text
            scores: list[TokenLogprob] = list(final.logprobs or [])
            if self.echo:
                text = self._prompt_text(final) + text
                scores = self._prompt_scores(index, final) + scores
            logprobs = self._logprobs(index, scores) if self.logprobs is not None else None
            rendered.append(
                CompletionChoice(
                    index=index, text=text, logprobs=logprobs, finish_reason=final.finish_reason
                )
            )
        return self._body(rendered, usage)

    def _prompt_scores(self, index: int, output: RequestOutput) -> list[TokenLogprob]:
        """The prompt's scores (only each prompt's first sequence scores it; its output comes
        before any other of that prompt's), the first token without a logprob."""
        prompt_index = index // self.num_choices
        scores = output.prompt_logprobs or self._prompt_logprobs.get(prompt_index)
        if output.prompt_logprobs is not None:
            self._prompt_logprobs[prompt_index] = output.prompt_logprobs
        if scores is None:
            scores = [None] * len(output.prompt_token_ids)
        return [
            s if s is not None else TokenLogprob(t, None, ())
            for s, t in zip(scores, output.prompt_token_ids)
        ]

    def _logprobs(self, index: int, scores: list[TokenLogprob]) -> CompletionLogprobs:
        logprobs = CompletionLogprobs()
        offset = self._offsets.get(index, 0)
        for score in scores:
            text = self.token_text(score.token_id)
            logprobs.tokens.append(text)
            logprobs.token_logprobs.append(score.logprob)
            logprobs.top_logprobs.append(None if score.logprob is None else self._top(score))
            logprobs.text_offset.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return logprobs

    def _top(self, score: TokenLogprob) -> dict[str, float]:
        top = {self.token_text(t): v for t, v in score.top[: self.logprobs]}
        top.setdefault(self.token_text(score.token_id), score.logprob)
        return top


class ChatRenderer(Renderer):
    id_prefix = "chatcmpl"

    def _chunk(self, choices: list[ChatStreamChoice], usage: Usage | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def first_chunks(self, num_prompts: int = 1) -> list[BaseModel]:
        delta = DeltaMessage(role="assistant", content="")
        return [
            self._chunk([ChatStreamChoice(index=i, delta=delta)], None)
            for i in range(num_prompts * self.num_choices)
        ]

    def chunk(self, index: int, output: RequestOutput) -> ChatCompletionChunk | None:
        if not output.new_text and not output.new_logprobs and not output.finished:
            return None
        delta = DeltaMessage(content=output.new_text or None)
        choice = ChatStreamChoice(
            index=index,
            delta=delta,
            logprobs=self._logprobs(output.new_logprobs or []),
            finish_reason=output.finish_reason,
        )
        return self._chunk([choice], None)

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def response(
        self, choices: Sequence[tuple[int, RequestOutput]], usage: Usage
    ) -> ChatCompletionResponse:
        rendered = [
            ChatChoice(
                index=index,
                message=AssistantMessage(content=final.text),
                logprobs=self._logprobs(final.logprobs or []),
                finish_reason=final.finish_reason,
            )
            for index, final in choices
        ]
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=rendered,
            usage=usage,
        )

    def _logprobs(self, scores: list[TokenLogprob]) -> ChatLogprobs | None:
        if self.logprobs is None:
            return None
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    **self._entry(score.token_id, score.logprob),
                    top_logprobs=[
                        TopLogprob(**self._entry(t, v)) for t, v in score.top[: self.logprobs]
                    ],
                )
                for score in scores
            ]
        )

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
