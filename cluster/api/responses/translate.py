"""Responses <-> chat completions: a Responses request becomes a chat request, the chat
answer becomes Responses output items, and a stored turn continues token for token.

    input items                          chat messages
    -----------                          -------------
    instructions                    -->  {"role": "system"}              (first)
    "text" / message (user, system)  -->  {"role": "user" | "system", "content": text}
    message (developer)              -->  {"role": "system"}
    message (assistant)              -->  {"role": "assistant", "content": text}
    function_call                    -->  {"role": "assistant", "tool_calls": [...]}  (joins the
                                          assistant message right before it)
    function_call_output             -->  {"role": "tool", "tool_call_id", "content"}

    chat answer                          output items
    -----------                          ------------
    message.content                  -->  message with one output_text part
    message.tool_calls[i]            -->  function_call {call_id, name, arguments}
"""

import re
import uuid
from collections.abc import Callable
from typing import Any

from jinja2.exceptions import TemplateError

from cluster.api.errors import APIError
from cluster.api.responses.protocol import (
    FunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponsesRequest,
)
from cluster.api.responses.store import StoredResponse
from replicas.model import Tokenizer

# A chat request field -> the Responses field a client set it with, for 400s.
CHAT_TO_RESPONSES_PARAM = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
}
# Fields a Responses request passes on to chat completions unchanged.
PASSED_ON = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "cache_salt",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "ignore_eos",
    "user",
    "parallel_tool_calls",
    "prompt_cache_key",
    "service_tier",
    "prompt_cache_options",
    "prompt_cache_retention",
)
# Chat field names in error messages -> the Responses names.
_RESPONSES_WORDS = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}
_CHAT_WORDS = re.compile(r"\b(" + "|".join(_RESPONSES_WORDS) + r")\b")
_NESTED_TOOL = re.compile(r"(tools\[\d+\])\.function\.")
TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text", "refusal"})
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# Where the previous output goes when a stored turn is rendered again (private-use characters,
# which no text of a conversation holds by accident).
OUTPUT_MARK = "\ue000strata:previous-output\ue001"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    """A message's (or a tool output's) text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError.bad_request(f"{where} must be a string or a list of parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES:
            raise APIError.bad_request(
                f"{where}[{j}]: content parts of type {kind!r} are not supported by this "
                "server; only input_text and output_text are",
                "input",
            )
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise APIError.bad_request(f"{where}[{j}] has no text", "input")
        texts.append(text)
    return "".join(texts)


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError.bad_request(f"{where}.{name} must be a string", "input")
    return value


def input_messages(input_: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input``; a 400 naming the item that cannot be one."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(input_):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise APIError.bad_request(
                    f"{where}.role must be one of {sorted(ROLES)}, got {item.get('role')!r}",
                    "input",
                )
            content = _text_of(item.get("content"), f"{where}.content")
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _field(item, "name", where),
                    "arguments": _field(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _field(item, "call_id", where),
                    "content": _text_of(item.get("output"), f"{where}.output"),
                }
            )
        else:
            raise APIError.bad_request(
                f"{where}: input items of type {kind!r} are not supported by this server; "
                "send message, function_call and function_call_output items",
                "input",
            )
    return messages


def system_messages(instructions: str | None) -> list[dict[str, Any]]:
    return [] if instructions is None else [{"role": "system", "content": instructions}]


def chat_body(body: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions request of ``body`` over ``messages`` (instructions included)."""
    chat: dict[str, Any] = {"messages": messages, "stream": body.stream}
    for name in PASSED_ON:
        value = getattr(body, name)
        if value is not None:
            chat[name] = value
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.text is not None and body.text.format.type != "text":
        text_format = body.text.format
        if text_format.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        else:
            if text_format.schema_ is None:
                raise APIError.bad_request(
                    "text.format of type json_schema needs a schema", "text.format.schema"
                )
            json_schema = {
                "schema": text_format.schema_,
                "name": text_format.name,
                "description": text_format.description,
                "strict": text_format.strict,
            }
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {k: v for k, v in json_schema.items() if v is not None},
            }
    if body.tools:
        chat["tools"] = chat_tools([tool.model_dump(exclude_none=True) for tool in body.tools])
    if body.tool_choice is not None:
        chat["tool_choice"] = chat_tool_choice(body.tool_choice)
    return chat


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise APIError.bad_request(
                f'tool_choice must be "auto", "none", "required" or a function, got {choice!r}',
                "tool_choice",
            )
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError.bad_request(
            'tool_choice must name a function: {"type": "function", "name": ...}; other '
            "tool choices are not supported by this server",
            "tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def responses_message(chat_message: str) -> str:
    """A chat completions error message in the words of the Responses request."""
    message = _CHAT_WORDS.sub(lambda m: _RESPONSES_WORDS[m.group(0)], chat_message)
    return _NESTED_TOOL.sub(r"\1.", message)


def responses_param(chat_param: str | None) -> str | None:
    if chat_param is None:
        return None
    head, dot, rest = chat_param.partition(".")
    if head.startswith("tools[") and rest.startswith("function."):
        rest = rest.removeprefix("function.")  # Responses' tools are flat
    return CHAT_TO_RESPONSES_PARAM.get(head, head) + dot + rest


def output_items(
    content: str | None, tool_calls: list[dict[str, Any]], is_incomplete: bool
) -> list[OutputItem]:
    """The output items of a chat answer's message: its text (if any, or if there is nothing
    else), then one function call per tool call."""
    status = "incomplete" if is_incomplete else "completed"
    items: list[OutputItem] = []
    if content or not tool_calls:
        part = OutputText(text=content or "")
        items.append(OutputMessage(id=new_id("msg"), status=status, content=[part]))
    for call in tool_calls:
        function = call.get("function") or {}
        items.append(
            FunctionCall(
                id=new_id("fc"),
                call_id=call.get("id") or new_id("call"),
                name=function.get("name") or "",
                arguments=function.get("arguments") or "",
                status=status,
            )
        )
    return items


def chat_message_of(items: list[OutputItem]) -> list[dict[str, Any]]:
    """The output items as the chat history's assistant message."""
    text = "".join(
        part.text for item in items if isinstance(item, OutputMessage) for part in item.content
    )
    calls = [
        {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": item.arguments},
        }
        for item in items
        if isinstance(item, FunctionCall)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]


def continuation_ids(
    tokenizer: Tokenizer,
    render: Callable[[list[dict[str, Any]], list[dict[str, Any]]], str],
    previous: StoredResponse,
    previous_tools: list[dict[str, Any]],
    instructions: str | None,
    new_messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
) -> list[int] | None:
    """The next turn's prompt as the previous turn's exact tokens (prompt, then output) and
    the rendering of what follows them, so that the whole previous turn's cached KV is reused::

        [previous prompt][previous output (its EOS dropped)][end of turn, new messages, prompt]
         '--------- token ids as the model read and wrote them ---------''-- rendered -----'

    ``render(messages, tools)`` is the chat prompt text of messages offering chat tools. None
    when the previous turn is not rendered the same way again (other instructions or tools, a
    template that rewrites history): the caller renders the whole conversation instead."""
    earlier = previous.messages[: previous.num_input_messages]
    mark = {"role": "assistant", "content": OUTPUT_MARK}
    try:
        before = render(system_messages(previous.instructions) + earlier, previous_tools)
        text = render(system_messages(instructions) + earlier + [mark] + new_messages, tools)
    except (ValueError, TemplateError):
        return None
    head, found, after = text.partition(OUTPUT_MARK)
    if not found or head != before or OUTPUT_MARK in after:
        return None
    output = list(previous.output_token_ids)
    # An EOS ended the output; the template writes its own end of turn (often that token).
    if output and output[-1] in tokenizer.eos_token_ids:
        output.pop()
    return [*previous.prompt_token_ids, *output, *tokenizer.encode(after, add_special_tokens=False)]


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses' flat function tools in chat's shape (``function`` nested)."""
    return [
        {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
        for tool in tools
    ]
