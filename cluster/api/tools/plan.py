"""A chat request's tools, checked, and what they mean for its generation.

``plan_tools`` turns ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` into a ``ToolPlan``
or a 400 naming the bad field (OpenAI's ``tools[0].function.parameters`` style). The plan's
``constraint`` makes every call valid by construction:

    tool_choice   grammar of the output                           calls parsed
    none          text without call markup (tools still shown)    no
    auto          free text, or text then calls                   yes
    required      one call or more                                yes
    named         one call of that function                       yes

``parallel_tool_calls: false`` allows one call at most; a named function is called exactly
once. When the output is also constrained (``response_format``, ``structured_outputs``...,
the Responses API's ``text.format``), a required or named call wins, as OpenAI serves the
pair: the output is the call, and the constraint applies to text, of which there is none. With
``auto`` the constraint wins and no calls are parsed.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.api.errors import APIError
from cluster.api.protocol import ChatCompletionRequest, ChatTool
from cluster.api.tools.format import ToolFormat, tool_format
from replicas.engine.structured_output import GrammarCompiler, StructuredOutputs

DEFAULT_FORMAT = "hermes"
CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """``tools`` in OpenAI's shape (what chat templates and the fallback rendering read);
    ``choice`` is ``none``, ``auto``, ``required`` or ``function`` (``function_name``)."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    function_name: str | None
    is_parallel: bool
    format: ToolFormat
    constraint: StructuredOutputs | None  # None: the output is not constrained for calls

    @property
    def parses_calls(self) -> bool:
        """Whether outputs are split into content and tool calls."""
        return self.constraint is not None and self.choice != "none"


def plan_tools(
    body: ChatCompletionRequest,
    compiler: Callable[[], GrammarCompiler],
    format_name: str = DEFAULT_FORMAT,
) -> ToolPlan | None:
    """The request's tool plan; None when it offers no tools. ``compiler`` gives the grammar
    compiler that checks each function's parameters schema. Raises ``APIError`` (400)."""
    if body.tools == []:  # as OpenAI: an empty list is a mistake, not "no tools"
        raise APIError.bad_request("tools must hold at least one tool; omit it for none", "tools")
    tools = body.tools or []
    functions = _functions(tools, compiler)
    choice, function_name = _choice(body.tool_choice, functions, bool(tools))
    if not tools:
        return None
    try:
        constrained_by = body.structured()[1]
    except ValueError as error:  # several output constraints at once
        raise APIError.bad_request(str(error), "response_format") from None
    fmt = tool_format(format_name)
    constraint = None
    # A call that must be made wins over an output constraint, as in OpenAI's API: the output
    # is the call, and the constraint describes text, of which there is none.
    if constrained_by is None or choice in ("required", "function"):
        called = [
            (n, p)
            for n, p in functions
            if choice != "none" and (choice != "function" or n == function_name)
        ]
        # A named function is called once, as OpenAI and vLLM do: a small model left free to
        # go on would repeat the call until max_tokens.
        is_parallel = body.parallel_tool_calls and choice != "function"
        grammar = fmt.grammar(called, is_required=choice != "auto", is_parallel=is_parallel)
        constraint = StructuredOutputs(grammar=grammar)
        try:
            compiler().validate(constraint)
        except ValueError as error:
            raise APIError.bad_request(f"tools cannot be called: {error}", "tools") from None
    shown = tuple(tool.model_dump(exclude_none=True) for tool in tools)
    return ToolPlan(shown, choice, function_name, body.parallel_tool_calls, fmt, constraint)


def _functions(
    tools: list[ChatTool], compiler: Callable[[], GrammarCompiler]
) -> list[tuple[str, dict[str, Any]]]:
    """Each tool's (name, parameters schema), checked."""
    functions: list[tuple[str, dict[str, Any]]] = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise APIError.bad_request(
                f"tools[{i}].type {tool.type!r} is not supported; only function tools are",
                f"tools[{i}].type",
            )
        if tool.function is None:
            raise APIError.bad_request(f"tools[{i}] needs a function", f"tools[{i}].function")
        name = tool.function.name
        param = f"tools[{i}].function.name"
        if not _NAME.fullmatch(name):
            raise APIError.bad_request(
                f"{param} {name!r} must be 1 to 64 letters, digits, underscores or dashes", param
            )
        if any(name == known for known, _ in functions):
            raise APIError.bad_request(f"{param} {name!r} names two tools", param)
        parameters = tool.function.parameters
        functions.append(
            (name, _checked_schema(parameters, f"tools[{i}].function.parameters", compiler))
        )
    return functions


def _checked_schema(
    schema: dict[str, Any] | None, param: str, compiler: Callable[[], GrammarCompiler]
) -> dict[str, Any]:
    if schema is None or schema == {}:
        return _NO_PARAMETERS
    if schema.get("type", "object") != "object":
        raise APIError.bad_request(
            f"{param} must be a JSON schema of an object (type object), not of {schema['type']!r}",
            param,
        )
    try:
        compiler().validate(StructuredOutputs(json=json.dumps(schema)))
    except ValueError as error:
        reason = str(error).split(": ", 1)[-1]
        raise APIError.bad_request(f"{param} is not a valid JSON schema: {reason}", param) from None
    return schema


def _choice(
    tool_choice: Any, functions: list[tuple[str, dict[str, Any]]], has_tools: bool
) -> tuple[str, str | None]:
    """``(choice, function name)``; the default is auto with tools, none without."""
    if tool_choice is None:
        return ("auto" if has_tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise APIError.bad_request(
                f"tool_choice must be one of {', '.join(CHOICES)} or a named function, "
                f"got {tool_choice!r}",
                "tool_choice",
            )
        if tool_choice == "required" and not has_tools:
            raise APIError.bad_request("tool_choice required needs tools", "tool_choice")
        return tool_choice, None
    if tool_choice.type != "function":
        raise APIError.bad_request(
            f"tool_choice.type {tool_choice.type!r} is not supported; name a function "
            '({"type": "function", "function": {"name": ...}})',
            "tool_choice",
        )
    name = tool_choice.function.name
    if not has_tools:
        raise APIError.bad_request(
            f"tool_choice names {name!r} but no tools are given", "tool_choice"
        )
    if all(name != known for known, _ in functions):
        names = ", ".join(known for known, _ in functions)
        raise APIError.bad_request(
            f"tool_choice names {name!r}, which is not among the tools ({names})", "tool_choice"
        )
    return "function", name
