"""How chat outputs become a Responses answer or stream (``Serving.respond`` drives it).

The chat renderer of the translated request does the chat work (text, tool-call parsing);
this one turns its answer into output items, and its stream chunks into Responses events::

    response.created, response.in_progress                        (first_chunks)
    per chat chunk:  text      -> [output_item.added, content_part.added] output_text.delta
                     tool call -> [output_item.added] function_call_arguments.delta
    at the end:      output_text.done, content_part.done, output_item.done        (per item)
                     function_call_arguments.done, output_item.done
                     response.completed (or response.incomplete at max_output_tokens)

Every event is framed ``event: <type>`` + ``data: <json>`` with a ``sequence_number`` counted
from 0; the stream ends with its last event (no ``[DONE]``), as OpenAI's does.
"""

import time
from collections.abc import Callable, Sequence

from cluster.api.errors import APIError
from cluster.api.protocol import Usage
from cluster.api.renderers import ChatRenderer, Renderer
from cluster.api.responses.protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    EventBatch,
    FunctionCall,
    IncompleteDetails,
    InputTokensDetails,
    LifecycleEvent,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseUsage,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from cluster.api.responses.translate import new_id, output_items
from replicas.outputs import RequestOutput

# Called with the finished response and the engine's final output of it.
OnFinish = Callable[[ResponseObject, RequestOutput], None]


def response_usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=usage.prompt_tokens_details.cached_tokens
        ),
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )


class ResponsesRenderer(Renderer):
    id_prefix = "resp"
    stream_end = b""  # OpenAI's Responses stream ends with its last event

    def __init__(
        self,
        chat: ChatRenderer,
        draft: ResponseObject,
        on_finish: OnFinish | None = None,
    ) -> None:
        """``draft``: the response with every request field set and no output yet."""
        super().__init__(chat.model, chat.tokenizer, draft.id)
        self.chat = chat
        self.draft = draft
        self.on_finish = on_finish
        self._sequence_number = 0
        self._items: list[OutputItem] = []  # streamed items, in output order
        self._open: list[OutputItem] = []  # streamed items not yet done
        self._message: OutputMessage | None = None  # the open message taking text
        self._calls: dict[int, FunctionCall] = {}  # chat tool call index -> its item
        self._last: RequestOutput | None = None

    # ---- framing -----------------------------------------------------------------------------
    def encode(self, payload: EventBatch | StreamEvent) -> bytes:
        events = payload.events if isinstance(payload, EventBatch) else [payload]
        return b"".join(self._frame(event) for event in events)

    def _frame(self, event: StreamEvent) -> bytes:
        event.sequence_number = self._sequence_number
        self._sequence_number += 1
        return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n".encode()

    def error_payload(self, error: APIError) -> ErrorEvent:
        return ErrorEvent(code=error.code or error.type, message=error.message, param=error.param)

    # ---- stream ------------------------------------------------------------------------------
    def first_chunks(self, num_prompts: int = 1) -> list[EventBatch]:
        snapshot = self.draft.model_copy(deep=True)
        events = [
            LifecycleEvent(type="response.created", response=snapshot),
            LifecycleEvent(type="response.in_progress", response=snapshot),
        ]
        return [EventBatch(events=events)]

    def chunk(self, index: int, output: RequestOutput) -> EventBatch | None:
        self._last = output
        chat_chunk = self.chat.chunk(index, output)
        if chat_chunk is None or not chat_chunk.choices:
            return None
        delta = chat_chunk.choices[0].delta.model_dump()
        events: list[StreamEvent] = []
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return EventBatch(events=events) if events else None

    def _open_message(self) -> list[StreamEvent]:
        message = self._message = OutputMessage(id=new_id("msg"))
        events = self._add(message)
        message.content.append(OutputText())
        part_added = ContentPartEvent(
            type="response.content_part.added",
            item_id=message.id,
            output_index=self._items.index(message),
            part=OutputText(),
        )
        return [*events, part_added]

    def _text(self, text: str) -> list[StreamEvent]:
        events = self._open_message() if self._message is None else []
        message = self._message
        message.content[0].text += text
        events.append(
            TextDeltaEvent(item_id=message.id, output_index=self._items.index(message), delta=text)
        )
        return events

    def _call(self, delta: dict) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        function = delta.get("function") or {}
        index = delta.get("index", 0)
        call = self._calls.get(index)
        limit = self.draft.max_tool_calls
        if call is None and limit is not None and len(self._calls) >= limit:
            return events  # past max_tool_calls: not part of the response
        if call is None:
            if self._message is not None:  # the text came first; function calls follow it
                events += self._done(self._message, "completed")
                self._message = None
            call = FunctionCall(
                id=new_id("fc"),
                call_id=delta.get("id") or new_id("call"),
                name=function.get("name") or "",
            )
            self._calls[index] = call
            events += self._add(call)
        elif function.get("name") and not call.name:
            call.name = function["name"]
        if function.get("arguments"):
            call.arguments += function["arguments"]
            events.append(
                ArgumentsDeltaEvent(
                    item_id=call.id,
                    output_index=self._items.index(call),
                    delta=function["arguments"],
                )
            )
        return events

    def _add(self, item: OutputItem) -> list[StreamEvent]:
        self._items.append(item)
        self._open.append(item)
        added = OutputItemEvent(
            type="response.output_item.added",
            output_index=len(self._items) - 1,
            item=item.model_copy(deep=True),
        )
        return [added]

    def _done(self, item: OutputItem, status: str) -> list[StreamEvent]:
        self._open.remove(item)
        item.status = status
        output_index = self._items.index(item)
        events: list[StreamEvent] = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events.append(TextDoneEvent(item_id=item.id, output_index=output_index, text=part.text))
            events.append(
                ContentPartEvent(
                    type="response.content_part.done",
                    item_id=item.id,
                    output_index=output_index,
                    part=part.model_copy(),
                )
            )
        else:
            events.append(
                ArgumentsDoneEvent(
                    item_id=item.id,
                    output_index=output_index,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        events.append(
            OutputItemEvent(
                type="response.output_item.done",
                output_index=output_index,
                item=item.model_copy(deep=True),
            )
        )
        return events

    def usage_chunk(self, usage: Usage) -> EventBatch:
        """The stream's end: every open item done, then the finished response."""
        assert self._last is not None and self._last.finished
        is_incomplete = self._last.finish_reason == "length"
        events: list[StreamEvent] = []
        if not self._items:  # nothing was said: the answer is one empty message
            events += self._open_message()
        for item in list(self._open):
            events += self._done(item, "incomplete" if is_incomplete else "completed")
        final = self._finish(list(self._items), usage, is_incomplete, self._last)
        kind = "response.incomplete" if is_incomplete else "response.completed"
        events.append(LifecycleEvent(type=kind, response=final))
        return EventBatch(events=events)

    # ---- whole answer ------------------------------------------------------------------------
    def response(
        self, choices: Sequence[tuple[int, RequestOutput]], usage: Usage
    ) -> ResponseObject:
        chat_answer = self.chat.response(choices, usage)
        message = chat_answer.choices[0].message.model_dump()
        final = choices[0][1]
        is_incomplete = final.finish_reason == "length"
        items = output_items(message.get("content"), message.get("tool_calls") or [], is_incomplete)
        return self._finish(items, usage, is_incomplete, final)

    def _finish(
        self,
        items: list[OutputItem],
        usage: Usage,
        is_incomplete: bool,
        final: RequestOutput,
    ) -> ResponseObject:
        limit = self.draft.max_tool_calls
        if limit is not None:
            calls = [item for item in items if isinstance(item, FunctionCall)]
            items = [item for item in items if item not in calls[limit:]]
        response = self.draft.model_copy(
            update={
                "status": "incomplete" if is_incomplete else "completed",
                "incomplete_details": IncompleteDetails() if is_incomplete else None,
                "completed_at": None if is_incomplete else int(time.time()),
                "output": items,
                "usage": response_usage(usage),
            }
        )
        if self.on_finish is not None:
            self.on_finish(response, final)
        return response
