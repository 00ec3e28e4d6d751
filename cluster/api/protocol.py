"""Bodies of the OpenAI-compatible API: requests validated here, responses built here.

Requests reject unknown fields with a 400, as OpenAI does. A few OpenAI parameters that Strata
does not implement are accepted only at their neutral value, because common clients send them
explicitly (the official ``openai`` client sends nothing it is not given):
``presence_penalty`` and ``frequency_penalty`` (0), ``logit_bias`` (empty), ``logprobs`` (off),
and for completions ``echo`` (false) and ``best_of`` (1). Any other value is a 400 naming it.

Extensions beyond OpenAI: ``top_k``, ``stop_token_ids``, ``ignore_eos`` and ``cache_salt``
(a per-tenant salt of the prefix-cache block hashes: requests reuse cached KV only from requests
with the same salt).
"""

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
)

_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "logprobs": (False, 0),
    "echo": (False,),
    "best_of": (1,),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ResetPrefixCacheRequest(_Body):
    tier: Literal["all", "npu", "host"] = Field(
        "all", description="Which tier's unreferenced cached blocks to forget."
    )


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="Send a last chunk with the usage.")
    include_obfuscation: bool | None = Field(
        None, description="Accepted for compatibility; chunks are never padded."
    )


class GenerationRequest(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="The served model's name; omitted means it.")
    max_tokens: int | None = Field(None, description="Most tokens to generate.")
    temperature: float = Field(1.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, description="Nucleus sampling mass in (0, 1].")
    top_k: int = Field(0, description="Extension: sample among the k likeliest (0 or -1: off).")
    seed: int | None = Field(None, description="Makes a sampled request reproducible.")
    stop: str | list[str] | None = Field(None, description="Strings that end the output.")
    stop_token_ids: list[int] | None = Field(None, description="Extension: ending token ids.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past EOS.")
    n: int = Field(1, description="Choices per request; only 1 is supported.")
    user: str | None = Field(None, description="End-user id; accepted and ignored.")
    cache_salt: str | None = Field(
        None, min_length=1, description="Extension: per-tenant salt of prefix-cache hashes."
    )
    stream: bool = Field(False, description="Stream server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Only with stream=true.")
    presence_penalty: float | None = Field(None, description="Accepted only at 0.")
    frequency_penalty: float | None = Field(None, description="Accepted only at 0.")
    logit_bias: dict[str, float] | None = Field(None, description="Accepted only empty.")

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("n")
    @classmethod
    def _check_n(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"n={value} is not supported: only one choice (n=1) per request")
        return value

    @field_validator(
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "echo",
        "best_of",
        check_fields=False,
    )
    @classmethod
    def _check_neutral(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and value not in _NEUTRAL[info.field_name]:
            raise ValueError(
                f"{info.field_name}={value!r} is not supported by this server; omit it"
            )
        return value

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] = Field(
        "", description="A string or a list of token ids; a list holding one of those is fine."
    )
    max_tokens: int | None = Field(16, description="Most tokens to generate.")
    logprobs: int | None = Field(None, description="Accepted only off.")
    echo: bool | None = Field(None, description="Accepted only false.")
    best_of: int | None = Field(None, description="Accepted only at 1.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) > 1:
                raise ValueError(
                    f"prompt holds {len(value)} prompts; batched prompts are not supported, "
                    "send one prompt per request"
                )
            value = value[0]
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            return value
        raise ValueError("prompt must be a string or a list of token ids")


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        "user", description="Who speaks."
    )
    content: str | None = Field(None, description="Text, or a list of text parts.")
    name: str | None = Field(None, description="Speaker name, passed to the chat template.")

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

    def to_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(
        default_factory=list,
        min_length=1,
        validate_default=True,
        description="The conversation so far.",
    )
    max_completion_tokens: int | None = Field(
        None, description="Most tokens to generate; wins over max_tokens."
    )
    logprobs: bool | None = Field(None, description="Accepted only false.")


# ---- responses ----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens served from the prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str = ""
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice] = Field(default_factory=list)
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str = ""


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage = Field(default_factory=AssistantMessage)
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice] = Field(default_factory=list)
    usage: Usage | None = None


class DeltaMessage(BaseModel):
    """What a chunk adds; fields with nothing to add are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage = Field(default_factory=DeltaMessage)
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatStreamChoice] = Field(default_factory=list)
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "strata"
    max_model_len: int = Field(0, description="Most tokens (prompt plus output) of one request.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
