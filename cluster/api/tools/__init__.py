"""Tool calling in chat completions: checks and plan (``plan``), prompt rendering
(``prompt``), formats with their grammars and parsers (``format``, one file per format:
``hermes``) and the chat renderer that splits outputs into content and calls (``renderer``)."""

from cluster.api.tools import hermes  # noqa: F401  (registers the format)
from cluster.api.tools.format import (
    CallDelta,
    ParsedCall,
    ParsedOutput,
    StreamPiece,
    ToolCallStream,
    ToolFormat,
    register,
    tool_format,
)
from cluster.api.tools.plan import DEFAULT_FORMAT, ToolPlan, plan_tools
from cluster.api.tools.prompt import messages_with_tools_as_text, render_chat_prompt
from cluster.api.tools.renderer import ToolCallIds, ToolChatRenderer, finish_reason, tool_calls_of

__all__ = [
    "DEFAULT_FORMAT",
    "CallDelta",
    "ParsedCall",
    "ParsedOutput",
    "StreamPiece",
    "ToolCallIds",
    "ToolCallStream",
    "ToolChatRenderer",
    "ToolFormat",
    "ToolPlan",
    "finish_reason",
    "messages_with_tools_as_text",
    "plan_tools",
    "register",
    "render_chat_prompt",
    "tool_calls_of",
    "tool_format",
]
