"""The Hermes tool-call format (NousResearch Hermes 2 Pro, Qwen 2.5 and 3): tools listed as JSON
in ``<tools>`` in the system message, each call a JSON object in its own ``<tool_call>`` block,
results in ``<tool_response>`` blocks of a user message::

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"zone": "CET"}}
    </tool_call>

Text before the first call is content; calls are separated by one newline. The grammar writes
the call object on one line, ``json.dumps``' layout, ``name`` first.
"""

import json
import re
from typing import Any

from cluster.api.tools.format import CallDelta, StreamPiece, ToolCallStream, ToolFormat, register
from replicas.engine.structured_output import lark_json

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_INSTRUCTIONS = """# Tools

You may call one or more functions to answer the user.
The functions you may call are listed as JSON, one per line, within <tools></tools>:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and arguments within <tool_call></tool_call>:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>"""


def _held_back(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (and may become it)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class HermesStream(ToolCallStream):
    """States: ``text`` (content; holds back an end that may begin ``<tool_call>``), ``head``
    (after the tag, until the name and ``"arguments":`` are read), ``arguments`` (each character
    of the arguments' JSON value is released as it comes, a scanner finding where it ends),
    ``tail`` (until ``</tool_call>``). After a call, whitespace before more text is dropped."""

    def __init__(self) -> None:
        self._state = "text"
        self._buffer = ""
        self._num_calls = 0
        self._depth = 0  # of the arguments' brackets
        self._in_string = False
        self._escaped = False

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> StreamPiece:
        self._buffer += text
        piece = StreamPiece()
        while self._buffer:
            before = (self._state, len(self._buffer))
            getattr(self, f"_{self._state}")(piece)
            if (self._state, len(self._buffer)) == before:
                break  # waits for more text
        return piece

    def finish(self, is_cut: bool = False) -> StreamPiece:
        piece = StreamPiece()
        # In the text state only an end that may begin ``<tool_call>`` is left: text at a
        # normal stop before any call, the start of a call's markup after a call or at a cut.
        if self._state == "text" and not (is_cut or self._num_calls):
            piece.content = self._buffer
        self._buffer = ""  # a call cut short before its name is dropped with its markup
        return piece

    def _text(self, piece: StreamPiece) -> None:
        if self._num_calls:
            self._buffer = self._buffer.lstrip()
        start = self._buffer.find(OPEN)
        if start >= 0:
            piece.content += self._buffer[:start]
            self._buffer = self._buffer[start + len(OPEN) :]
            self._state = "head"
            return
        keep = _held_back(self._buffer, OPEN)
        piece.content += self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep :]

    def _head(self, piece: StreamPiece) -> None:
        match = _HEAD.match(self._buffer)
        if match is not None and match.end() < len(self._buffer):  # all whitespace read
            piece.calls.append(CallDelta(self._num_calls, name=json.loads(match.group(1))))
            self._num_calls += 1
            self._buffer = self._buffer[match.end() :]
            self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False
            return
        end = self._buffer.find(CLOSE)
        if end >= 0:  # not the grammar's layout: read the whole object if it is one
            self._whole_call(self._buffer[:end], piece)
            self._buffer = self._buffer[end + len(CLOSE) :]
            self._state = "text"

    def _whole_call(self, text: str, piece: StreamPiece) -> None:
        try:
            call = json.loads(text)
        except ValueError:
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            piece.content += OPEN + text + CLOSE  # not a call: the model's text as it is
            return
        arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
        piece.calls.append(CallDelta(self._num_calls, name=call["name"], arguments=arguments))
        self._num_calls += 1

    def _arguments(self, piece: StreamPiece) -> None:
        taken = 0
        for char in self._buffer:
            if self._escaped:
                self._escaped = False
            elif self._in_string:
                self._escaped = char == "\\"
                self._in_string = char != '"'
            elif self._depth == 0 and char in "},":
                self._state = "tail"  # the value ended: the call object's closing brace
                break
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
            taken += 1
        if taken:
            piece.calls.append(CallDelta(self._num_calls - 1, arguments=self._buffer[:taken]))
        self._buffer = self._buffer[taken:]

    def _tail(self, piece: StreamPiece) -> None:
        end = self._buffer.find(CLOSE)
        if end >= 0:
            self._buffer = self._buffer[end + len(CLOSE) :]
            self._state = "text"


@register
class HermesFormat(ToolFormat):
    name = "hermes"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return _INSTRUCTIONS.format(tools=lines)

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        blocks = []
        for call in calls:
            function = call.get("function", call)
            arguments = function.get("arguments", {})
            if isinstance(arguments, str):  # not a JSON object: as the client sent it
                name = json.dumps(function["name"], ensure_ascii=False)
                body = f'{{"name": {name}, "arguments": {arguments}}}'
            else:
                written = {"name": function["name"], "arguments": arguments}
                body = json.dumps(written, ensure_ascii=False)  # as the grammar lets models write
            blocks.append(f"{OPEN}\n{body}\n{CLOSE}")
        return "\n".join(blocks)

    def render_results(self, results: list[str]) -> str:
        return "\n".join(f"<tool_response>\n{result}\n</tool_response>" for result in results)

    def grammar(
        self, functions: list[tuple[str, dict[str, Any]]], *, is_required: bool, is_parallel: bool
    ) -> str:
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"],
            }
            for name, parameters in functions
        ]
        body = lark_json(calls[0] if len(calls) == 1 else {"anyOf": calls})
        more = ' ("\\n" call)*' if is_parallel else ""
        rules = ["%llguidance {}"]
        if not functions:  # tool_choice none: any text but a call's tag
            rules.append("start: TEXT")
            rules.append(r"TEXT: /(.|\n)+/ & ~/(.|\n)*<tool_call>(.|\n)*/")
            return "\n".join(rules) + "\n"
        if is_required:
            rules.append(f"start: call{more}")
        else:  # free text, or text (maybe none) ending in the first call's tag, then calls
            rules.append(f"start: TEXT | lead call_rest{more}")
            rules.append(r"TEXT: /(.|\n)+/ & ~/(.|\n)*<tool_call>(.|\n)*/")
            rules.append(r"lead[lazy]: /(.|\n)*<tool_call>/")
        rules.append(f"call: {json.dumps(OPEN)} call_rest")
        rules.append(f'call_rest: "\\n" body "\\n{CLOSE}"')
        rules.append(f"body: {body}")
        return "\n".join(rules) + "\n"

    def stream(self) -> HermesStream:
        return HermesStream()
