"""How engine outputs become OpenAI bodies: one renderer per endpoint.

A stream is ``first_chunks``, then one ``chunk`` per output that added text (the last one
carries ``finish_reason``), then ``usage_chunk`` when the client asked for usage, then
``data: [DONE]``. A non-streaming answer is one ``response`` built from the final output.
"""

import time
import uuid
from abc import ABC, abstractmethod

from pydantic import BaseModel

from cluster.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    Usage,
)
from replicas.outputs import RequestOutput


def usage_of(output: RequestOutput) -> Usage:
    num_prompt = len(output.prompt_token_ids)
    num_completion = len(output.token_ids)
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens),
    )


class Renderer(ABC):
    id_prefix: str

    def __init__(self, model: str, request_id: str | None = None) -> None:
        self.model = model
        self.request_id = request_id or f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def first_chunks(self) -> list[BaseModel]:
        return []

    @abstractmethod
    def chunk(self, output: RequestOutput) -> BaseModel | None:
        """This output's delta as a chunk; None when it adds nothing to send."""

    @abstractmethod
    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    @abstractmethod
    def response(self, final: RequestOutput) -> BaseModel: ...


class CompletionRenderer(Renderer):
    id_prefix = "cmpl"

    def _body(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def chunk(self, output: RequestOutput) -> CompletionResponse | None:
        if not output.new_text and not output.finished:
            return None
        choice = CompletionChoice(text=output.new_text, finish_reason=output.finish_reason)
        return self._body([choice], None)

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return self._body([], usage)

    def response(self, final: RequestOutput) -> CompletionResponse:
        choice = CompletionChoice(text=final.text, finish_reason=final.finish_reason)
        return self._body([choice], usage_of(final))


class ChatRenderer(Renderer):
    id_prefix = "chatcmpl"

    def _chunk(self, choices: list[ChatStreamChoice], usage: Usage | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def first_chunks(self) -> list[BaseModel]:
        delta = DeltaMessage(role="assistant", content="")
        return [self._chunk([ChatStreamChoice(delta=delta)], None)]

    def chunk(self, output: RequestOutput) -> ChatCompletionChunk | None:
        if not output.new_text and not output.finished:
            return None
        delta = DeltaMessage(content=output.new_text or None)
        choice = ChatStreamChoice(delta=delta, finish_reason=output.finish_reason)
        return self._chunk([choice], None)

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def response(self, final: RequestOutput) -> ChatCompletionResponse:
        choice = ChatChoice(
            message=AssistantMessage(content=final.text), finish_reason=final.finish_reason
        )
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=usage_of(final),
        )
