"""From a validated body to an answer: tokenize, check limits, generate, render.

    body --> Generation (prompt token ids, SamplingParams, renderer)    every 4xx is raised here
         --> backend.generate --> first output --> JSON answer or SSE stream

Errors the backend raises before its first output (prompt it can never serve, overload, no
replica) still get a proper status code, because an SSE stream starts only once the first output
is there. Later failures end the stream with an error event.
"""

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, fields
from typing import Any

from fastapi import Request
from jinja2.exceptions import TemplateError
from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax
from starlette.responses import Response

from cluster.api.cache_breakpoints import breakpoint_tokens
from cluster.api.errors import APIError, from_backend_error, internal_error
from cluster.api.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from cluster.api.renderers import (
    ChatRenderer,
    CompletionRenderer,
    Renderer,
    running_usage,
    usage_of,
)
from cluster.api.streaming import (
    ClientDisconnected,
    EventStreamResponse,
    until_disconnected,
)
from cluster.api.tools import (
    DEFAULT_FORMAT,
    ToolChatRenderer,
    ToolPlan,
    plan_tools,
    render_chat_prompt,
    tool_format,
)
from cluster.backend import Backend, NoLiveReplicaError, OverloadedError, ReplicaFailedError
from cluster.choices import SequenceOutput, best_of, generate_sequences
from cluster.metrics import RequestMetrics, StrataMetrics
from replicas.cache_hints import CacheHints
from replicas.engine.structured_output import GrammarCompiler, StructuredOutputs
from replicas.outputs import RequestOutput
from replicas.prompt import check_prompt_length
from replicas.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it
_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
MAX_SEQUENCES = 128  # sequences one request may ask for (prompts x n or best_of)


@dataclass(slots=True)
class Generation:
    """A request that passed every check, ready for the backend."""

    prompts: list[list[int]]  # token ids of each prompt
    sampling_params: SamplingParams
    cache_salt: str | None
    stream: bool
    include_usage: bool
    renderer: Renderer
    prompt_param: str  # the body field holding the prompt: "prompt" or "messages"
    cache_hints: CacheHints | None = None  # prompt_cache_key and retention, when given
    continuous_usage: bool = False  # every chunk carries the usage so far


class Serving:
    def __init__(self, backend: Backend, metrics: StrataMetrics, max_tokens_limit: int) -> None:
        self.backend = backend
        self.metrics = metrics
        self.max_tokens_limit = max_tokens_limit
        self._grammar_compiler: GrammarCompiler | None = None

    def _grammar(self) -> GrammarCompiler:
        """Schemas are compiled here first, so that a bad one is a 400 naming its field (the
        replica compiles it again, from its cache of compiled grammars)."""
        if self._grammar_compiler is None:
            tokenizer = self.backend.tokenizer
            self._grammar_compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
        return self._grammar_compiler

    # ---- checks: body -> Generation ----------------------------------------------------------
    def completion(self, body: CompletionRequest) -> Generation:
        self.check_model(body.model)
        encode = self.backend.tokenizer.encode
        prompts = [encode(p) if isinstance(p, str) else p for p in body.prompts]
        is_set = "max_tokens" in body.model_fields_set
        requested = body.max_tokens if is_set else None
        default = None if is_set else body.max_tokens  # OpenAI's 16, shortened to fit
        if body.best_of is not None and body.stream and body.best_of > body.n:
            raise APIError.bad_request("best_of above n cannot be streamed", "best_of")
        renderer = CompletionRenderer(
            self.backend.model_name,
            self.backend.tokenizer,
            num_choices=body.n,
            logprobs=body.logprobs,
            echo=body.echo,
        )
        prompt_logprobs = body.logprobs if body.echo else None
        if body.echo and requested == 0 and prompt_logprobs is None:
            prompt_logprobs = 0  # max_tokens=0 with echo: the prompt is all there is
        extra = {
            "n": body.n,
            "best_of": body.best_of,
            "logprobs": body.logprobs,
            "prompt_logprobs": prompt_logprobs,
        }
        return self._generation(body, prompts, requested, default, "max_tokens", renderer, extra)

    def chat(self, body: ChatCompletionRequest) -> Generation:
        self.check_model(body.model)
        messages = [message.to_template() for message in body.messages]
        tools = plan_tools(body, self._grammar)
        try:
            text = render_chat_prompt(
                self.backend.tokenizer,
                messages,
                list(tools.tools) if tools is not None else None,
                tools.format if tools is not None else tool_format(DEFAULT_FORMAT),
            )
        except (ValueError, TemplateError) as error:
            raise APIError.bad_request(str(error), "messages") from None
        token_ids = self.backend.tokenizer.encode(text)
        requested, param = body.max_completion_tokens, "max_completion_tokens"
        if requested is None:
            requested, param = body.max_tokens, "max_tokens"
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if tools is not None and tools.parses_calls:
            renderer: ChatRenderer = ToolChatRenderer(
                self.backend.model_name,
                self.backend.tokenizer,
                num_choices=body.n,
                logprobs=logprobs,
                tool_format=tools.format,
            )
        else:
            renderer = ChatRenderer(
                self.backend.model_name,
                self.backend.tokenizer,
                num_choices=body.n,
                logprobs=logprobs,
            )
        return self._generation(
            body,
            [token_ids],
            requested,
            None,
            param,
            renderer,
            {"n": body.n, "logprobs": logprobs},
            breakpoints=self._chat_breakpoints(body, messages, tools, token_ids),
            constraint=tools.constraint if tools is not None else None,
        )

    def _chat_breakpoints(
        self,
        body: ChatCompletionRequest,
        messages: list[dict],
        tools: ToolPlan | None,
        token_ids: list[int],
    ) -> list[tuple[int, float | None]]:
        """The prompt's ``prompt_cache_breakpoint`` positions in tokens, with their lifetimes."""
        marked = [
            (i, end, ttl) for i, m in enumerate(body.messages) for end, ttl in m.cache_breakpoints
        ]
        tokenizer = self.backend.tokenizer
        return breakpoint_tokens(
            lambda marked_messages: render_chat_prompt(
                tokenizer,
                marked_messages,
                list(tools.tools) if tools is not None else None,
                tools.format if tools is not None else tool_format(DEFAULT_FORMAT),
            ),
            tokenizer.encode,
            messages,
            marked,
            token_ids,
        )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.backend.model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves "
                f"'{self.backend.model_name}'",
                param="model",
                code="model_not_found",
            )

    def _generation(
        self,
        body: GenerationRequest,
        prompts: list[list[int]],
        requested: int | None,
        default: int | None,
        max_tokens_param: str,
        renderer: Renderer,
        extra: dict,
        *,
        breakpoints: list[tuple[int, float | None]] = (),
        constraint: StructuredOutputs | None = None,
    ) -> Generation:
        """``requested`` is the client's max_tokens (None: not given); without it, generate up
        to ``default`` tokens (None: as many as fit), shortened to fit the context of the
        longest prompt. ``extra``: the endpoint's own sampling fields."""
        max_model_len = self.backend.max_model_len
        prompt_param = "messages" if isinstance(renderer, ChatRenderer) else "prompt"
        num_prompt = max(len(token_ids) for token_ids in prompts)
        try:  # before the room it leaves sizes max_tokens; the 400 names the body's field
            for token_ids in prompts:
                check_prompt_length(len(token_ids), max_model_len)
        except ValueError as error:
            raise APIError.bad_request(str(error), prompt_param) from None
        room = max_model_len - num_prompt
        if requested is None:
            max_tokens = min(room, self.max_tokens_limit, default or room)
        else:
            max_tokens = requested
        constraint = self._constraint(body, constraint)
        self._check_logit_bias(body)
        params = _sampling_params(body, max_tokens, max_tokens_param, renderer, constraint, extra)
        self._check_budget(max_tokens, max_tokens_param, num_prompt)
        num_sequences = len(prompts) * params.num_sequences
        if num_sequences > MAX_SEQUENCES:
            raise APIError.bad_request(
                f"this request asks for {num_sequences} sequences (prompts x "
                f"{'best_of' if params.best_of else 'n'}); at most {MAX_SEQUENCES} are served",
                "best_of" if params.best_of else "n",
            )
        return Generation(
            prompts,
            params,
            body.cache_salt,
            body.stream,
            body.include_usage,
            renderer,
            prompt_param,
            continuous_usage=body.continuous_usage,
            cache_hints=body.cache_hints(num_prompt, breakpoints),
        )

    def _constraint(
        self, body: GenerationRequest, constraint: StructuredOutputs | None
    ) -> StructuredOutputs | None:
        """The endpoint's own ``constraint`` (tool calls: ``ToolPlan.constraint``, set only
        where calls win over a text format), else the request's structured output
        (``response_format`` and the like). Either way the structured output is checked
        against the grammar compiler: a bad one is a 400 naming its field."""
        try:
            structured, structured_param = body.structured()
        except ValueError as error:
            raise APIError.bad_request(str(error), "response_format") from None
        try:
            if structured is not None:
                if structured.get("grammar") is not None:  # GBNF as vLLM's guidance reads it
                    structured = {**structured, "grammar": _lark(structured["grammar"])}
                own = StructuredOutputs(**structured)
                self._grammar().validate(own)
                constraint = constraint or own
        except ValueError as error:
            raise APIError.bad_request(str(error), structured_param) from None
        return constraint

    def _check_logit_bias(self, body: GenerationRequest) -> None:
        vocab_size = self.backend.tokenizer.vocab_size
        for token in body.logit_bias or ():
            if token.isdigit() and int(token) >= vocab_size:
                raise APIError.bad_request(
                    f"logit_bias: token id {token} is not below the vocabulary size {vocab_size}",
                    "logit_bias",
                )

    def _check_budget(self, max_tokens: int, max_tokens_param: str, num_prompt: int) -> None:
        """``max_tokens`` within the server's limit and, with the longest prompt, the context."""
        max_model_len = self.backend.max_model_len
        if max_tokens > self.max_tokens_limit:
            raise APIError.bad_request(
                f"{max_tokens_param}={max_tokens} is more than this server allows "
                f"({self.max_tokens_limit})",
                max_tokens_param,
            )
        if max_tokens > max_model_len - num_prompt:
            raise APIError.bad_request(
                f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{num_prompt} tokens and {max_tokens_param} is {max_tokens} "
                f"({num_prompt + max_tokens} in total). Lower {max_tokens_param} or shorten "
                "the prompt.",
                max_tokens_param,
            )

    # ---- generation: Generation -> answer ----------------------------------------------------
    async def respond(self, request: Request, generation: Generation) -> Response:
        tracker = self.metrics.track()
        outputs = generate_sequences(
            self.backend,
            generation.renderer.request_id,
            generation.prompts,
            generation.sampling_params,
            generation.cache_salt,
            generation.cache_hints,
        )
        if generation.stream:
            work = self._first(outputs)
        else:
            work = self._collect(generation, outputs, tracker)
        is_streaming = False
        try:
            result = await until_disconnected(request.receive, work)
            is_streaming = generation.stream
        except ClientDisconnected:
            tracker.finish("abort")
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except ValueError as error:  # the backend's verdict on the prompt: nothing ran
            raise APIError.bad_request(str(error), generation.prompt_param) from None
        except Exception as error:
            if not isinstance(error, (OverloadedError, NoLiveReplicaError)):  # those never ran
                tracker.finish("error")
            raise
        finally:
            if not is_streaming:  # done with the backend's streams, or failed: release them
                await outputs.aclose()
        if not generation.stream:
            choices = result
            tracker.finish(choices[0][1].finish_reason)
            finals = [output for _, output in choices]
            usage = usage_of(finals, generation.sampling_params.n)
            body = generation.renderer.response(choices, usage).model_dump_json()
            return Response(body, media_type="application/json")
        events = self._events(generation, result, outputs, tracker)
        return EventStreamResponse(events, close_also=outputs)

    @staticmethod
    async def _first(outputs: AsyncIterator[SequenceOutput]) -> SequenceOutput:
        output = await anext(outputs, None)
        if output is None:
            raise ReplicaFailedError("the request ended without any output")
        return output

    @staticmethod
    async def _collect(
        generation: Generation, outputs: AsyncIterator[SequenceOutput], tracker: RequestMetrics
    ) -> list[tuple[int, RequestOutput]]:
        """Every choice's final output, as (index, output) in index order. The latencies are
        those of the first prompt's first sequence."""
        params = generation.sampling_params
        finals: dict[tuple[int, int], RequestOutput] = {}
        async for prompt_index, index, output in outputs:
            if prompt_index == index == 0:
                tracker.observe(output)
            finals[prompt_index, index] = output
        choices = []
        for prompt_index in range(len(generation.prompts)):
            sequences = [finals.get((prompt_index, i)) for i in range(params.num_sequences)]
            if any(o is None or not o.finished for o in sequences):
                raise ReplicaFailedError("the request's outputs ended before it finished")
            for output in best_of(sequences, params):
                index = generation.renderer.choice_index(prompt_index, output.index)
                choices.append((index, output))
        return choices

    async def _events(
        self,
        generation: Generation,
        first: SequenceOutput,
        outputs: AsyncIterator[SequenceOutput],
        tracker: RequestMetrics,
    ) -> AsyncGenerator[bytes, None]:
        renderer = generation.renderer
        num_choices = len(generation.prompts) * generation.sampling_params.n
        finals: dict[int, RequestOutput] = {}
        latest: dict[int, RequestOutput] = {}  # each choice's last output so far
        finish_reason = "abort"  # unless the stream reaches its end
        num_prompt_tokens = sum(len(token_ids) for token_ids in generation.prompts)
        n = generation.sampling_params.n
        try:
            async with contextlib.aclosing(outputs):
                # The role chunks come before any token: the prompts, cached as far as known.
                cached = first[2].num_cached_tokens if first[1] == 0 else 0
                for chunk in renderer.first_chunks(len(generation.prompts)):
                    if generation.continuous_usage:
                        chunk.usage = running_usage(num_prompt_tokens, {}, n, cached)
                    yield renderer.encode(chunk)
                item: SequenceOutput | None = first
                while item is not None:
                    prompt_index, sequence_index, output = item
                    index = renderer.choice_index(prompt_index, sequence_index)
                    if index == 0:
                        tracker.observe(output)
                    latest[index] = output
                    chunk = renderer.chunk(index, output)
                    if chunk is not None:
                        if generation.continuous_usage:
                            chunk.usage = running_usage(num_prompt_tokens, latest, n)
                        yield renderer.encode(chunk)
                    if output.finished:
                        finals[index] = output
                        if len(finals) == num_choices:
                            break
                    item = await anext(outputs, None)
                if len(finals) < num_choices:
                    raise ReplicaFailedError("the request's outputs ended before it finished")
                finish_reason = finals[0].finish_reason
                if generation.include_usage:
                    ordered = [finals[i] for i in range(num_choices)]
                    usage = usage_of(ordered, generation.sampling_params.n)
                    yield renderer.encode(renderer.usage_chunk(usage))
        except Exception as error:
            finish_reason = "error"
            api_error = from_backend_error(error)
            if api_error is None:
                logger.exception("request %s failed mid-stream", renderer.request_id)
                api_error = internal_error()
            yield renderer.encode(renderer.error_payload(api_error))
        finally:
            tracker.finish(finish_reason)
        if renderer.stream_end:
            yield renderer.stream_end


def _lark(grammar: Any) -> Any:
    """``grammar`` in Lark (llguidance's dialect): as given, or converted from GBNF (llama.cpp's
    ``::=`` rules). ``ValueError`` when it is neither."""
    if not isinstance(grammar, str) or is_lark_syntax(grammar):
        return grammar  # StructuredOutputs says what is wrong with a non-string
    try:
        return gbnf_to_lark(grammar)
    except Exception as error:  # the converter raises its own kinds
        raise ValueError(f"structured_outputs.grammar is neither Lark nor GBNF: {error}") from None


def _sampling_params(
    body: GenerationRequest,
    max_tokens: int,
    max_tokens_param: str,
    renderer: Renderer,
    constraint: StructuredOutputs | None,
    extra: dict,
) -> SamplingParams:
    """The request's sampling parameters; a 400 naming the field the client sent otherwise."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=body.logit_bias,
            min_tokens=body.min_tokens,
            structured_outputs=constraint,
            **extra,
        )
    except ValueError as error:
        name = str(error).split(" ", 1)[0].split("[", 1)[0]
        param = max_tokens_param if name == "max_tokens" else name
        if name == "logprobs" and isinstance(renderer, ChatRenderer):
            param = "top_logprobs"
        raise APIError.bad_request(
            str(error), param if name in _SAMPLING_FIELDS else None
        ) from None
