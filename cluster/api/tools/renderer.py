"""Chat answers whose outputs may call tools: the output text split into ``content`` and
``tool_calls`` by the request's tool format.

Non-streaming, each choice's message gets the parsed calls (``content`` null when there is no
text besides them). Streaming, each choice's text goes through the format's incremental parser;
a chunk holds one entry per call index (OpenAI's shape): a call's first entry carries its
``index``, ``id``, ``type``, name and the first fragment of its arguments (empty when none is
written yet), the next ones further fragments, which clients concatenate. A choice that called a
tool and stopped ends with ``finish_reason: "tool_calls"``.

An output cut at its token limit (``finish_reason: "length"``) keeps the calls it began after
their names, the last one with its arguments as far as they were written, as OpenAI's API
answers and as a stream has already sent them; a call cut before its name, and any start of a
call's markup, is dropped, never returned as ``content``.
"""

import secrets
from collections.abc import Sequence

from cluster.api.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    DeltaFunction,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    Usage,
)
from cluster.api.renderers import ChatRenderer
from cluster.api.tools.format import ParsedOutput, ToolCallStream, ToolFormat
from replicas.outputs import RequestOutput


def finish_reason(reason: str | None, num_calls: int) -> str | None:
    """OpenAI's finish reason of an output that made ``num_calls`` calls."""
    return "tool_calls" if num_calls and reason == "stop" else reason


class ToolCallIds:
    """``call_`` and 24 random hex digits; never twice in one response."""

    def __init__(self) -> None:
        self._given: set[str] = set()

    def new(self) -> str:
        while True:
            call_id = f"call_{secrets.token_hex(12)}"
            if call_id not in self._given:
                self._given.add(call_id)
                return call_id


def tool_calls_of(parsed: ParsedOutput, ids: ToolCallIds) -> list[ToolCall] | None:
    """The parsed calls in OpenAI's shape; None without calls."""
    if not parsed.calls:
        return None
    return [
        ToolCall(id=ids.new(), function=FunctionCall(name=call.name, arguments=call.arguments))
        for call in parsed.calls
    ]


class ToolChatRenderer(ChatRenderer):
    def __init__(self, *args, tool_format: ToolFormat, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tool_format = tool_format
        self._ids = ToolCallIds()
        self._streams: dict[int, ToolCallStream] = {}  # choice index -> its parser

    def chunk(self, index: int, output: RequestOutput) -> ChatCompletionChunk | None:
        chunk = super().chunk(index, output)
        if chunk is None:
            return None
        stream = self._streams.setdefault(index, self.tool_format.stream())
        piece = stream.feed(output.new_text)
        if output.finished:
            piece.extend(stream.finish(is_cut=output.finish_reason == "length"))
        calls = []
        for delta in piece.calls_by_index():
            if delta.name is not None:
                call_id = self._ids.new()
                function = DeltaFunction(name=delta.name, arguments=delta.arguments)
                calls.append(
                    DeltaToolCall(index=delta.index, id=call_id, type="function", function=function)
                )
            else:
                function = DeltaFunction(arguments=delta.arguments)
                calls.append(DeltaToolCall(index=delta.index, function=function))
        choice = chunk.choices[0]
        choice.delta.content = piece.content or None
        choice.delta.tool_calls = calls or None
        choice.finish_reason = finish_reason(output.finish_reason, stream.num_calls)
        if not piece.content and not calls and not output.finished and choice.logprobs is None:
            return None  # all held back
        return chunk

    def response(
        self, choices: Sequence[tuple[int, RequestOutput]], usage: Usage
    ) -> ChatCompletionResponse:
        answer = super().response(choices, usage)
        for choice, (_, final) in zip(answer.choices, choices):
            parsed = self.tool_format.parse(final.text, is_cut=final.finish_reason == "length")
            calls = tool_calls_of(parsed, self._ids)
            choice.message.tool_calls = calls
            choice.message.content = parsed.content if calls else (parsed.content or "")
            choice.finish_reason = finish_reason(final.finish_reason, len(parsed.calls))
        return answer
