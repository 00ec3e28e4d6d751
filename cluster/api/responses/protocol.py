"""Bodies of ``/v1/responses`` (OpenAI's Responses API), in the official client's shapes.

``ResponsesRequest`` is what a client sends; ``ResponseObject`` is what it reads back (from the
POST, from ``GET /v1/responses/{id}`` and inside the stream's lifecycle events); the
``*Event`` models are the stream's events. Fields known but not served are refused with a 400
naming them; fields that change nothing here (``user``, ``reasoning``, ``service_tier``...) are
accepted and echoed, as vLLM does.
"""

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from cluster.api.protocol import _Body

# Known request fields this server cannot honour: set to anything but null, they are a 400.
UNSERVED_FIELDS = (
    "conversation",
    "prompt",
    "context_management",
    "background_options",
    "moderation",
    "image",
    "access_programs",
)
# ``include`` values that are vacuously honoured: no reasoning items are ever produced.
SERVED_INCLUDES = frozenset({"reasoning.encrypted_content"})


class TextFormat(_Body):
    """``text.format``: the output constraint, flat (name and schema beside the type)."""

    type: Literal["text", "json_object", "json_schema"] = Field(
        "text", description="text (no constraint), json_object or json_schema."
    )
    name: str | None = Field(None, description="json_schema: the schema's name.")
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="json_schema: the JSON schema to follow."
    )
    description: str | None = Field(None, description="json_schema: not used.")
    strict: bool | None = Field(None, description="json_schema: the schema is always enforced.")


class TextConfig(_Body):
    format: TextFormat = Field(default_factory=TextFormat, description="Output constraint.")
    verbosity: str | None = Field(None, description="Accepted and echoed; not used.")


class FunctionTool(_Body):
    """A function tool in the Responses shape: flat, not nested under ``function``."""

    type: str = Field("function", description="Only function tools are served.")
    name: str = Field("", description="The function's name.")
    description: str | None = Field(None, description="What the function does.")
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of its arguments.")
    strict: bool | None = Field(None, description="Arguments follow the schema exactly.")

    @field_validator("type")
    @classmethod
    def _only_functions(cls, value: str) -> str:
        if value != "function":
            raise ValueError(
                f"tools of type '{value}' are not served by this server; only function tools are"
            )
        return value


class ResponsesStreamOptions(_Body):
    include_obfuscation: bool | None = Field(
        None, description="Accepted for compatibility; events are never padded."
    )


class ResponsesRequest(_Body):
    """``POST /v1/responses``."""

    model: str | None = Field(None, description="The served model's name; omitted means it.")
    input: str | list[dict[str, Any]] = Field(
        ..., description="A string (one user message) or a list of input items."
    )
    instructions: str | None = Field(None, description="A system message before the input.")
    tools: list[FunctionTool] | None = Field(None, description="Function tools the model may call.")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"auto", "none", "required" or {"type": "function", "name": ...}.'
    )
    parallel_tool_calls: bool | None = Field(None, description="Allow several calls per turn.")
    max_tool_calls: int | None = Field(
        None, ge=1, description="Most function calls kept in one response."
    )
    max_output_tokens: int | None = Field(None, description="Most tokens to generate.")
    temperature: float | None = Field(None, description="Sampling temperature; 0 is greedy.")
    top_p: float | None = Field(None, description="Nucleus sampling mass in (0, 1].")
    top_logprobs: int | None = Field(None, description="Only 0 (or null) is served.")
    text: TextConfig | None = Field(None, description="Output format (text.format).")
    stream: bool = Field(False, description="Stream the response's events (SSE).")
    stream_options: ResponsesStreamOptions | None = Field(None, description="With stream=true.")
    store: bool = Field(True, description="Keep the response for GET and previous_response_id.")
    previous_response_id: str | None = Field(
        None, description="Continue the conversation of this stored response."
    )
    background: bool | None = Field(None, description="Only false is served.")
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description='Only "disabled" is served: a prompt too long is a 400.'
    )
    include: list[str] | None = Field(
        None, description='Only "reasoning.encrypted_content" (no reasoning is produced).'
    )
    reasoning: dict[str, Any] | None = Field(None, description="Accepted and echoed; not used.")
    metadata: dict[str, str] | None = Field(None, description="Stored and echoed.")
    user: str | None = Field(None, description="Accepted and echoed.")
    safety_identifier: str | None = Field(None, description="Accepted and echoed.")
    service_tier: str | None = Field(
        None, description="flex: batch (its cached blocks evicted first); others interactive."
    )
    prompt_cache_key: str | None = Field(
        None, description="Passed on to chat completions when it serves it."
    )
    prompt_cache_options: dict[str, Any] | None = Field(
        None, description="Passed on to chat completions when it serves it."
    )
    prompt_cache_retention: str | None = Field(
        None, description="Passed on to chat completions when it serves it."
    )
    # Extensions beyond OpenAI, passed on to chat completions as they are.
    top_k: int | None = Field(None, description="Extension: sample among the k likeliest.")
    min_p: float | None = Field(None, description="Extension: min-p sampling, as chat takes it.")
    seed: int | None = Field(None, description="Extension: makes sampling reproducible.")
    stop: str | list[str] | None = Field(None, description="Extension: strings that end it.")
    cache_salt: str | None = Field(None, description="Extension: per-tenant prefix-cache salt.")
    repetition_penalty: float | None = Field(None, description="Extension.")
    presence_penalty: float | None = Field(None, description="Extension.")
    frequency_penalty: float | None = Field(None, description="Extension.")
    min_tokens: int | None = Field(None, description="Extension.")
    ignore_eos: bool | None = Field(None, description="Extension.")
    # Known, and not served: a request that sets one is refused rather than answered wrongly.
    conversation: Any = Field(None, description="Not served; use previous_response_id.")
    prompt: Any = Field(None, description="Not served (stored prompt templates).")
    context_management: Any = Field(None, description="Not served.")
    background_options: Any = Field(None, description="Not served.")
    moderation: Any = Field(None, description="Not served.")
    image: Any = Field(None, description="Not served.")
    access_programs: Any = Field(None, description="Not served.")

    @field_validator(*UNSERVED_FIELDS)
    @classmethod
    def _refuse(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    @field_validator("background")
    @classmethod
    def _check_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not supported by this server")
        return value

    @field_validator("truncation")
    @classmethod
    def _check_truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise ValueError('truncation "auto" is not supported by this server; use "disabled"')
        return value

    @field_validator("include")
    @classmethod
    def _check_include(cls, value: list[str] | None) -> list[str] | None:
        unserved = [item for item in value or () if item not in SERVED_INCLUDES]
        if unserved:
            raise ValueError(f"include {unserved} is not supported by this server")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("top_logprobs is not supported on /v1/responses by this server")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("input must not be an empty list")
        if not isinstance(value, str) and not (
            isinstance(value, list) and all(isinstance(item, dict) for item in value)
        ):
            raise ValueError("input must be a string or a list of input items (JSON objects)")
        return value


# ---- what the client reads back ---------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


OutputItem = OutputMessage | FunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Input tokens served from the prefix cache.")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseObject(BaseModel):
    """OpenAI's ``Response``: the whole answer, or its snapshot in a lifecycle event."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    background: bool = False
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    prompt_cache_key: str | None = None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


# ---- stream events: each carries its ``sequence_number``, set when it is sent -------------


class StreamEvent(BaseModel):
    type: str
    sequence_number: int = 0


class LifecycleEvent(StreamEvent):
    """response.created / in_progress / completed / incomplete."""

    response: ResponseObject


class OutputItemEvent(StreamEvent):
    """response.output_item.added / done."""

    output_index: int
    item: OutputItem


class ContentPartEvent(StreamEvent):
    """response.content_part.added / done."""

    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText


class TextDeltaEvent(StreamEvent):
    type: str = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(StreamEvent):
    type: str = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ArgumentsDeltaEvent(StreamEvent):
    type: str = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(StreamEvent):
    type: str = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(StreamEvent):
    type: str = "error"
    code: str | None = None
    message: str
    param: str | None = None


class EventBatch(BaseModel):
    """The events one engine output (or the end of the stream) adds, sent in order."""

    events: list[StreamEvent] = Field(default_factory=list)
