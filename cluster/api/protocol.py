"""Bodies of the OpenAI-compatible API: the requests, validated here (their base ``_Body`` in
``cluster.api.body``, chat messages and function tools in ``cluster.api.messages``), and the
answers' bodies (``cluster.api.answers``); every one of them is importable from here.

Fields a body does not declare are ignored and logged by name (vLLM's behaviour: clients
written for other servers send extensions of their own); fields Strata knows but cannot honour
(``audio``, ``prediction``, ``functions``...) are refused with a 400 naming them; fields that
change nothing here (``user``, ``metadata``, ``store``, ``reasoning_effort``) are accepted;
``service_tier`` sets the request's priority class in the prefix cache (``flex``: batch).
Supported beyond the basics: ``n`` and ``best_of`` (choices share their prompt's prefill),
``logprobs`` / ``top_logprobs`` (at most 20), ``echo`` with prompt logprobs,
``presence_penalty`` / ``frequency_penalty`` (in [-2, 2]), ``logit_bias`` (token id -> bias in
[-100, 100]), a list of prompts in completions, ``stream_options.include_usage``,
``response_format`` (``text``, ``json_object``, ``json_schema``) and function ``tools`` with
``tool_choice`` and ``parallel_tool_calls`` (checked and served by ``cluster.api.tools``),
and the prompt-cache fields ``prompt_cache_key``, ``prompt_cache_options`` (``mode``, ``ttl``),
``prompt_cache_retention`` and a chat text part's ``prompt_cache_breakpoint``, read into one
``CacheHints`` (``GenerationRequest.cache_hints``; lifetimes: ``replicas.cache_hints``).

Extensions beyond OpenAI: ``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``,
``stream_options.continuous_usage_stats`` (vLLM's: the usage so far on every chunk),
``stop_token_ids``, ``ignore_eos``, ``cache_salt`` (a per-tenant salt of the prefix-cache block
hashes: requests reuse cached KV only from requests with the same salt) and, named as vLLM names
them, ``structured_outputs`` (``{"json": schema}``, ``{"regex": ...}``, ``{"choice": [...]}``,
``{"json_object": true}``, ``{"grammar": ...}`` in Lark (llguidance's dialect) or GBNF, as vLLM's
guidance backend reads it) and the older ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``.
"""

import json
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from cluster.api.answers import (  # noqa: F401  (the answer bodies, named here too)
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)
from cluster.api.body import _Body, ignored_fields  # noqa: F401
from cluster.api.messages import (  # noqa: F401  (the chat messages and tools, named here too)
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
)
from replicas.cache_hints import (
    DEFAULT_TTL,
    RETENTION_TTLS_S,
    CacheHints,
    parse_service_tier,
    parse_ttl,
)
from replicas.kv.events import tiers
from replicas.kv.manager import ALL_TIERS

MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions endpoint's bound


class ResetPrefixCacheRequest(_Body):
    # An admin action: a misspelt field must not widen what it forgets to every tier.
    model_config = ConfigDict(extra="forbid")

    tier: str = Field(
        ALL_TIERS,
        description="Which tier's unreferenced cached blocks to forget: all, or a registered "
        "tier's name (npu, host, disk, ...).",
    )
    # vLLM's query flags, for clients of its /reset_prefix_cache.
    reset_running_requests: bool = Field(
        False, description="vLLM's: also preempt running requests; only false is served."
    )
    reset_external: bool = Field(
        False, description="vLLM's: also the offloaded (external) cache; tier all includes it."
    )
    reset_connector: bool = Field(
        False, description="vLLM's older name of reset_external; tier all includes it."
    )

    @field_validator("tier")
    @classmethod
    def _known_tier(cls, tier: str) -> str:
        # The tiers registered when the request comes, not when this module was imported.
        choices = (ALL_TIERS, *tiers())
        if tier not in choices:
            names = ", ".join(repr(str(choice)) for choice in choices)
            raise ValueError(f"tier must be one of {names}; got {tier!r}")
        return tier


class ScaleRequest(_Body):
    """``POST /v1/admin/scale``: resize the deployment while it serves."""

    model_config = ConfigDict(extra="forbid")

    data_parallel_size: int = Field(
        ..., ge=1, strict=True, description="The number of replicas to run from now on."
    )


class TokenizeRequest(_Body):
    """``POST /tokenize`` (as vLLM serves it): a prompt's token ids."""

    model: str | None = Field(None, description="The served model's name; omitted means it.")
    prompt: str = Field(..., description="The text to tokenize.")
    add_special_tokens: bool = Field(True, description="Start with BOS where the model does.")


class DetokenizeRequest(_Body):
    """``POST /detokenize``: the text of token ids."""

    model: str | None = Field(None, description="The served model's name; omitted means it.")
    tokens: list[int] = Field(..., description="Token ids to decode.")


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="Send a last chunk with the usage.")
    include_obfuscation: bool | None = Field(
        None, description="Accepted for compatibility; chunks are never padded."
    )
    continuous_usage_stats: bool = Field(
        False, description="Extension (vLLM's): every chunk carries the usage so far."
    )


class JSONSchemaFormat(_Body):
    name: str = Field("schema", description="The schema's name; not used.")
    description: str | None = Field(None, description="Not used.")
    schema_: dict[str, Any] = Field(
        default_factory=dict, alias="schema", description="The JSON schema to follow."
    )
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = Field(
        "text", description="text (no constraint), json_object or json_schema."
    )
    json_schema: JSONSchemaFormat | None = Field(None, description="With type json_schema.")

    @model_validator(mode="after")
    def _check_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self


class StructuredOutputsParams(_Body):
    """vLLM's ``structured_outputs`` extension: exactly one field."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema.")
    regex: str | None = Field(None, description="A regular expression to match.")
    choice: list[str] | None = Field(None, description="One of these strings.")
    json_object: bool | None = Field(None, description="Any JSON object.")
    grammar: str | None = Field(
        None, description="A grammar the whole output matches: Lark (llguidance's) or GBNF."
    )


class PromptCacheOptions(_Body):
    """OpenAI's ``prompt_cache_options``: with ``ttl``, the prompt (implicit mode) or the prefix
    up to each breakpoint is kept at least that long (``replicas.cache_hints``)."""

    mode: Literal["implicit", "explicit"] = Field(
        "implicit",
        description="implicit: the whole prompt is a breakpoint too; explicit: only the "
        "content parts marked with prompt_cache_breakpoint are.",
    )
    ttl: str | None = Field(
        None, description="Least lifetime of the request's breakpoints: 5m, 30m, 1h, 12h or 24h."
    )

    @field_validator("ttl")
    @classmethod
    def _check_ttl(cls, value: str | None) -> str | None:
        if value is not None:
            parse_ttl(value, "prompt_cache_options.ttl")
        return value


class GenerationRequest(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="The served model's name; omitted means it.")
    max_tokens: int | None = Field(None, description="Most tokens to generate.")
    temperature: float = Field(1.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, description="Nucleus sampling mass in (0, 1].")
    top_k: int = Field(0, description="Extension: sample among the k likeliest (0 or -1: off).")
    min_p: float = Field(
        0.0,
        description="Extension: keep the tokens with at least this share of the likeliest "
        "token's probability (0: off).",
    )
    seed: int | None = Field(None, description="Makes a sampled request reproducible.")
    stop: str | list[str] | None = Field(None, description="Strings that end the output.")
    stop_token_ids: list[int] | None = Field(None, description="Extension: ending token ids.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past EOS.")
    n: int = Field(1, description="Choices per prompt; they share the prompt's prefill.")
    user: str | None = Field(None, description="End-user id; accepted and ignored.")
    safety_identifier: str | None = Field(None, description="Accepted and ignored.")
    metadata: dict[str, str] | None = Field(None, description="Accepted and ignored.")
    store: bool | None = Field(None, description="Accepted; chat completions are not stored.")
    service_tier: str | None = Field(
        None,
        description="The request's priority class in the prefix cache: flex is batch (its "
        "blocks are evicted first), auto, default, scale and priority are interactive; unset: "
        "the tenant's default (prefix_cache_config.batch_tenants).",
    )
    cache_salt: str | None = Field(
        None, min_length=1, description="Extension: per-tenant salt of prefix-cache hashes."
    )
    prompt_cache_key: str | None = Field(
        None, description="Requests with one key go to one replica while it is not overloaded."
    )
    prompt_cache_options: PromptCacheOptions | None = Field(
        None, description="mode (implicit or explicit) and ttl of the request's breakpoints."
    )
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description="24h keeps the prompt (or its breakpoints' prefix) for 24 hours."
    )
    stream: bool = Field(False, description="Stream server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Only with stream=true.")
    presence_penalty: float = Field(0.0, description="Subtracted once per token in the output.")
    frequency_penalty: float = Field(0.0, description="Subtracted per occurrence in the output.")
    repetition_penalty: float = Field(
        1.0, description="Extension: divides the logits of tokens seen in prompt or output."
    )
    logit_bias: dict[str, float] | None = Field(None, description="Token id -> added logit.")
    min_tokens: int = Field(0, description="Extension: no EOS or stop token before this many.")
    response_format: ResponseFormat | None = Field(None, description="JSON output constraints.")
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="Extension: json / regex / choice / json_object constraint."
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="Extension (legacy).")
    guided_regex: str | None = Field(None, description="Extension (legacy).")
    guided_choice: list[str] | None = Field(None, description="Extension (legacy).")
    guided_grammar: str | None = Field(None, description="Extension (legacy).")

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("service_tier")
    @classmethod
    def _check_service_tier(cls, value: str | None) -> str | None:
        parse_service_tier(value)
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

    def cache_hints(
        self, num_prompt_tokens: int, breakpoints: list[tuple[int, float | None]] = ()
    ) -> CacheHints | None:
        """The request's prompt-cache hints for a prompt of ``num_prompt_tokens`` tokens whose
        breakpoints end after ``(tokens, ttl_s or None)``; None when it gives none.

        Retained: the prefix up to the last breakpoint, and the whole prompt in implicit mode
        when ``prompt_cache_options.ttl`` or ``prompt_cache_retention="24h"`` is given; for the
        longest lifetime any of them asks, so every breakpoint's least lifetime is met. A
        breakpoint without a ttl takes the request's (``DEFAULT_TTL`` without one); explicit
        mode without a breakpoint retains nothing."""
        options = self.prompt_cache_options or PromptCacheOptions()
        request_ttl = parse_ttl(options.ttl, "ttl") if options.ttl is not None else None
        if self.prompt_cache_retention == "24h":
            request_ttl = max(request_ttl or 0.0, RETENTION_TTLS_S["24h"])
        spans = [
            (tokens, ttl or request_ttl or RETENTION_TTLS_S[DEFAULT_TTL])
            for tokens, ttl in breakpoints
        ]
        if options.mode == "implicit" and request_ttl is not None:
            spans.append((num_prompt_tokens, request_ttl))
        retain_tokens = max((tokens for tokens, _ in spans), default=0)
        ttl_s = max((ttl for _, ttl in spans), default=0.0)
        batch = parse_service_tier(self.service_tier)
        if self.prompt_cache_key is None and not retain_tokens and batch is None:
            return None
        return CacheHints(
            self.prompt_cache_key, retain_tokens, ttl_s if retain_tokens else 0.0, batch=batch
        )

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def structured(self) -> tuple[dict[str, Any] | None, str | None]:
        """The output constraint as ``StructuredOutputs`` keyword arguments, and the body
        field that set it; ``(None, None)`` without one. Raises ``ValueError`` when several
        fields set one."""
        found: list[tuple[dict[str, Any], str]] = []
        format_ = self.response_format
        if format_ is not None and format_.type == "json_object":
            found.append(({"json_object": True}, "response_format"))
        if format_ is not None and format_.type == "json_schema":
            schema = json.dumps(format_.json_schema.schema_)
            found.append(({"json": schema}, "response_format"))
        if self.structured_outputs is not None:
            given = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            if given.get("json") is not None and not isinstance(given["json"], str):
                given["json"] = json.dumps(given["json"])
            if given.get("json_object") is False:
                given.pop("json_object")
            found.append((given, "structured_outputs"))
        if self.guided_json is not None:
            schema = self.guided_json
            found.append(
                ({"json": schema if isinstance(schema, str) else json.dumps(schema)}, "guided_json")
            )
        if self.guided_regex is not None:
            found.append(({"regex": self.guided_regex}, "guided_regex"))
        if self.guided_choice is not None:
            found.append(({"choice": self.guided_choice}, "guided_choice"))
        if self.guided_grammar is not None:
            found.append(({"grammar": self.guided_grammar}, "guided_grammar"))
        if not found:
            return None, None
        if len(found) > 1:
            names = ", ".join(name for _, name in found)
            raise ValueError(f"set one output constraint, not several ({names})")
        return found[0]


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        "", description="A string, a list of token ids, or a list of either (one per prompt)."
    )
    max_tokens: int | None = Field(16, description="Most tokens to generate.")
    logprobs: int | None = Field(
        None, description="Logprobs of each token and this many alternatives (at most 5)."
    )
    echo: bool = Field(False, description="Return the prompt before the completion.")
    best_of: int | None = Field(None, description="Sequences per prompt; the n likeliest win.")
    suffix: str | None = Field(None, description="Accepted only empty.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, str) or _is_token_ids(value):
            return value
        if isinstance(value, list) and value:
            if all(isinstance(p, str) for p in value) or all(_is_token_ids(p) for p in value):
                return value
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        raise ValueError(
            "prompt must be a string, a list of token ids, or a list of strings or of "
            "token-id lists"
        )

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_COMPLETION_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {value}")
        return value

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported by this server; omit it")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per entry of a batched ``prompt``."""
        prompt = self.prompt
        if isinstance(prompt, str) or _is_token_ids(prompt):
            return [prompt]
        return list(prompt)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


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
    logprobs: bool = Field(False, description="Return each output token's logprob.")
    top_logprobs: int | None = Field(
        None, description="Alternatives per token (at most 20); needs logprobs=true."
    )
    tools: list[ChatTool] | None = Field(None, description="Functions the model may call.")
    tool_choice: str | NamedToolChoice | None = Field(
        None,
        description="none, auto (the default with tools), required, or one named function.",
    )
    parallel_tool_calls: bool = Field(
        True, description="Whether one answer may hold several calls."
    )
    reasoning_effort: str | None = Field(
        None, description="Accepted and ignored: the served models do not reason apart."
    )
    verbosity: str | None = Field(None, description="Accepted and ignored.")
    modalities: list[str] | None = Field(None, description='Only ["text"] is served.')
    # Known, and not served: a request that sets one is refused rather than answered wrongly.
    audio: dict[str, Any] | None = Field(None, description="Not served (no audio output).")
    prediction: dict[str, Any] | None = Field(None, description="Not served.")
    web_search_options: dict[str, Any] | None = Field(None, description="Not served.")
    functions: list[Any] | None = Field(None, description="Not served; use tools.")
    function_call: str | dict[str, Any] | None = Field(
        None, description="Not served; use tool_choice."
    )

    @field_validator("audio", "prediction", "web_search_options", "functions", "function_call")
    @classmethod
    def _refuse(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            hint = {"functions": "; use tools", "function_call": "; use tool_choice"}
            raise ValueError(
                f"{info.field_name} is not supported by this server{hint.get(info.field_name, '')}"
            )
        return value

    @field_validator("modalities")
    @classmethod
    def _check_modalities(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(m != "text" for m in value):
            raise ValueError(f'modalities {value} are not served; only ["text"] is')
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None:
            return value
        if not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        if not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value


# ---- responses ----------------------------------------------------------------------------
