"""Tool-call formats: how one model family writes tool definitions, calls and results as text.

A format is a ``ToolFormat`` subclass in its own file, registered by name (``register``); adding
a family (Llama 3's JSON calls, Mistral's ``[TOOL_CALLS]``) is a new file and one registration.
A format knows four things:

* how to render tools, calls and results as text, for chat templates that do not render them
  themselves (``system_prompt``, ``render_calls``, ``render_results``);
* the Lark grammar of an output that calls tools (``grammar``), so that every call the model
  emits parses and its arguments follow the function's schema;
* how to split an output into content and calls, incrementally (``stream``), which is also how
  a whole output is parsed (``parse``), so a stream and a non-streamed answer always agree.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class CallDelta:
    """What a stream learnt about call ``index`` (0, 1, ... within one output): ``name`` on the
    call's first delta only, then fragments of its arguments (a JSON text once joined)."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class StreamPiece:
    """What one ``feed`` (or ``finish``) of a stream releases."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def extend(self, other: "StreamPiece") -> None:
        self.content += other.content
        self.calls += other.calls

    def calls_by_index(self) -> list[CallDelta]:
        """The call deltas merged into one per call index, in the order the calls began: a
        call's name and the first fragment of its arguments in one delta, as OpenAI streams
        them (clients that read one entry per index per chunk lose nothing)."""
        merged: dict[int, CallDelta] = {}
        for delta in self.calls:
            before = merged.get(delta.index)
            if before is None:
                merged[delta.index] = delta
            else:
                name = before.name if before.name is not None else delta.name
                arguments = before.arguments + delta.arguments
                merged[delta.index] = CallDelta(delta.index, name, arguments)
        return list(merged.values())


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # the JSON text as the model wrote it


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None  # None when the output holds calls only
    calls: tuple[ParsedCall, ...]


class ToolCallStream(ABC):
    """Splits one output, fed in pieces, into content and call deltas. Text that may be the
    start of a call's markup is held back until it is known not to be; markup never reaches
    ``content``."""

    @abstractmethod
    def feed(self, text: str) -> StreamPiece:
        """The content and call deltas that ``text`` (the output's next piece) releases."""

    @abstractmethod
    def finish(self, is_cut: bool = False) -> StreamPiece:
        """What was held back, at the end of the output. ``is_cut``: the output ended at its
        token limit (``finish_reason: "length"``). A call cut short after its name stays a
        call, its arguments as far as they were written (what a stream has already sent); a
        call cut before its name is dropped, and so is the start of a call's markup held back
        at a cut or after a call: markup never reaches ``content``."""

    @property
    @abstractmethod
    def num_calls(self) -> int:
        """Calls begun so far."""


class ToolFormat(ABC):
    name: ClassVar[str]

    @abstractmethod
    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """The text offering ``tools`` (OpenAI's ``{"type": "function", "function": ...}``),
        written at the start of the system message."""

    @abstractmethod
    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """An assistant message's tool calls (chat-template shape: ``{"function": {"name",
        "arguments"}}``) as the model writes them."""

    @abstractmethod
    def render_results(self, results: list[str]) -> str:
        """Consecutive tool results as the text of one user message."""

    @abstractmethod
    def grammar(
        self, functions: list[tuple[str, dict[str, Any]]], *, is_required: bool, is_parallel: bool
    ) -> str:
        """A Lark grammar (llguidance's dialect) of an output calling ``functions`` (name,
        parameters schema): calls only when ``is_required``, else text or calls; several calls
        only when ``is_parallel``. With no functions (``tool_choice: none``): text that holds
        no call's markup."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh incremental parser of one output."""

    def parse(self, text: str, is_cut: bool = False) -> ParsedOutput:
        """A whole output as content and calls, exactly as a stream of it would give them
        (``is_cut``: the output ended at its token limit, see ``ToolCallStream.finish``)."""
        stream = self.stream()
        piece = stream.feed(text)
        piece.extend(stream.finish(is_cut))
        names: dict[int, str] = {}
        arguments: dict[int, str] = {}
        for delta in piece.calls:
            if delta.name is not None:
                names[delta.index] = delta.name
            arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
        calls = tuple(ParsedCall(names[i], arguments[i]) for i in sorted(names))
        return ParsedOutput(piece.content or None, calls)


_FORMATS: dict[str, type[ToolFormat]] = {}


def register(format_class: type[ToolFormat]) -> type[ToolFormat]:
    """Class decorator: makes a format available by its ``name``."""
    _FORMATS[format_class.name] = format_class
    return format_class


def tool_format(name: str) -> ToolFormat:
    """The registered format ``name``; ``ValueError`` naming the known ones otherwise."""
    if name not in _FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(sorted(_FORMATS))}")
    return _FORMATS[name]()
