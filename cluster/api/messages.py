"""Chat messages and function tools, as requests carry them (and answers carry ``ToolCall``)."""

import json
from typing import Any, Literal

from pydantic import (
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    field_validator,
    model_validator,
)

from cluster.api.body import _Body
from replicas.cache_hints import parse_ttl


class FunctionDefinition(_Body):
    name: str = Field(..., description="The function's name: letters, digits, _ and -.")
    description: str | None = Field(None, description="What it does, shown to the model.")
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON schema of its arguments (an object); omitted: none."
    )
    strict: bool | None = Field(None, description="Accepted; arguments always follow the schema.")


class ChatTool(_Body):
    type: str = Field("function", description='Only "function" tools are served.')
    function: FunctionDefinition | None = Field(None, description="The function offered.")


class NamedFunction(_Body):
    name: str = Field(..., description="The function to call.")


class NamedToolChoice(_Body):
    type: str = Field("function", description='"function".')
    function: NamedFunction = Field(..., description="The function the model must call.")


class FunctionCall(_Body):
    name: str = Field(..., description="The called function.")
    arguments: str = Field("", description="Its arguments as a JSON text.")


class ToolCall(_Body):
    """A tool call, in an assistant message of the history and in answers."""

    id: str = Field("", description="The call's id, echoed by the tool message answering it.")
    type: Literal["function"] = Field("function", description='"function".')
    function: FunctionCall = Field(..., description="What was called, with which arguments.")

    def to_template(self) -> dict[str, Any]:
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):  # templates read an object's keys; else the text
            arguments = self.function.arguments
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        "user", description="Who speaks."
    )
    content: str | None = Field(None, description="Text, or a list of text parts.")
    name: str | None = Field(None, description="Speaker name, passed to the chat template.")
    tool_calls: list[ToolCall] | None = Field(
        None, description="An assistant message's tool calls (its content may then be null)."
    )
    tool_call_id: str | None = Field(None, description="The call a tool message answers.")
    _cache_breakpoints: tuple[tuple[int, float | None], ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _find_breakpoints(cls, data: Any, handler: ModelWrapValidatorHandler) -> Any:
        """Where in ``content`` each text part marked with ``prompt_cache_breakpoint`` ends."""
        message = handler(data)
        parts = data.get("content") if isinstance(data, dict) else None
        if isinstance(message, ChatMessage) and isinstance(parts, list):
            message._cache_breakpoints = _content_breakpoints(parts)
        return message

    @property
    def cache_breakpoints(self) -> tuple[tuple[int, float | None], ...]:
        """``(end, ttl_s)`` per breakpoint: the offset in ``content`` where its part ends, and
        its own lifetime (None: the request's)."""
        return self._cache_breakpoints

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in value
        ):
            return "".join(p["text"] for p in value)
        raise ValueError(
            "message content must be a string or a list of text parts "
            '({"type": "text", "text": ...}); other content types are not supported'
        )

    @model_validator(mode="after")
    def _check_tool_fields(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls are only allowed in assistant messages, not {self.role}")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates read it; tool calls in Hugging Face's shape (their
        arguments parsed when they are a JSON object)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.to_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _content_breakpoints(parts: list[dict]) -> tuple[tuple[int, float | None], ...]:
    found: list[tuple[int, float | None]] = []
    end = 0
    for part in parts:
        text = part.get("text") if isinstance(part, dict) else None
        end += len(text) if isinstance(text, str) else 0
        marker = part.get("prompt_cache_breakpoint") if isinstance(part, dict) else None
        if marker is None:
            continue
        if not isinstance(marker, dict) or marker.get("mode", "explicit") != "explicit":
            raise ValueError(
                'prompt_cache_breakpoint must be {"mode": "explicit"} with an optional ttl'
            )
        ttl = marker.get("ttl")
        found.append((end, None if ttl is None else parse_ttl(ttl, "prompt_cache_breakpoint.ttl")))
    return tuple(found)
