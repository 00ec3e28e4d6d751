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

from fastapi import Request
from jinja2.exceptions import TemplateError
from starlette.responses import Response

from cluster.api.errors import APIError, from_backend_error, internal_error
from cluster.api.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from cluster.api.renderers import ChatRenderer, CompletionRenderer, Renderer, usage_of
from cluster.api.streaming import (
    DONE,
    ClientDisconnected,
    EventStreamResponse,
    sse,
    until_disconnected,
)
from cluster.backend import Backend, NoLiveReplicaError, OverloadedError, ReplicaFailedError
from cluster.metrics import RequestMetrics, StrataMetrics
from replicas.outputs import RequestOutput
from replicas.prompt import check_prompt_length
from replicas.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it
_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


@dataclass(slots=True)
class Generation:
    """A request that passed every check, ready for the backend."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None
    stream: bool
    include_usage: bool
    renderer: Renderer
    prompt_param: str  # the body field holding the prompt: "prompt" or "messages"


class Serving:
    def __init__(self, backend: Backend, metrics: StrataMetrics, max_tokens_limit: int) -> None:
        self.backend = backend
        self.metrics = metrics
        self.max_tokens_limit = max_tokens_limit

    # ---- checks: body -> Generation ----------------------------------------------------------
    def completion(self, body: CompletionRequest) -> Generation:
        self.check_model(body.model)
        prompt = body.prompt
        token_ids = self.backend.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        is_set = "max_tokens" in body.model_fields_set
        requested = body.max_tokens if is_set else None
        default = None if is_set else body.max_tokens  # OpenAI's 16, shortened to fit
        renderer = CompletionRenderer(self.backend.model_name)
        return self._generation(body, token_ids, requested, default, "max_tokens", renderer)

    def chat(self, body: ChatCompletionRequest) -> Generation:
        self.check_model(body.model)
        messages = [message.to_template() for message in body.messages]
        try:
            text = self.backend.tokenizer.apply_chat_template(messages)
        except (ValueError, TemplateError) as error:
            raise APIError.bad_request(str(error), "messages") from None
        token_ids = self.backend.tokenizer.encode(text)
        requested, param = body.max_completion_tokens, "max_completion_tokens"
        if requested is None:
            requested, param = body.max_tokens, "max_tokens"
        renderer = ChatRenderer(self.backend.model_name)
        return self._generation(body, token_ids, requested, None, param, renderer)

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
        token_ids: list[int],
        requested: int | None,
        default: int | None,
        max_tokens_param: str,
        renderer: Renderer,
    ) -> Generation:
        """``requested`` is the client's max_tokens (None: not given); without it, generate up
        to ``default`` tokens (None: as many as fit), shortened to fit the context."""
        max_model_len = self.backend.max_model_len
        prompt_param = "messages" if isinstance(renderer, ChatRenderer) else "prompt"
        num_prompt = len(token_ids)
        try:
            check_prompt_length(num_prompt, max_model_len)
        except ValueError as error:
            raise APIError.bad_request(str(error), prompt_param) from None
        room = max_model_len - num_prompt
        if requested is None:
            max_tokens = min(room, self.max_tokens_limit, default or room)
        else:
            max_tokens = requested
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop=body.stop,
                stop_token_ids=list(body.stop_token_ids or []),
                ignore_eos=body.ignore_eos,
            )
        except ValueError as error:
            name = str(error).split(" ", 1)[0]
            param = max_tokens_param if name == "max_tokens" else name
            raise APIError.bad_request(
                str(error), param if name in _SAMPLING_FIELDS else None
            ) from None
        if max_tokens > self.max_tokens_limit:
            raise APIError.bad_request(
                f"{max_tokens_param}={max_tokens} is more than this server allows "
                f"({self.max_tokens_limit})",
                max_tokens_param,
            )
        if max_tokens > room:
            raise APIError.bad_request(
                f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{num_prompt} tokens and {max_tokens_param} is {max_tokens} "
                f"({num_prompt + max_tokens} in total). Lower {max_tokens_param} or shorten "
                "the prompt.",
                max_tokens_param,
            )
        return Generation(
            token_ids,
            params,
            body.cache_salt,
            body.stream,
            body.include_usage,
            renderer,
            prompt_param,
        )

    # ---- generation: Generation -> answer ----------------------------------------------------
    async def respond(self, request: Request, generation: Generation) -> Response:
        tracker = self.metrics.track()
        outputs = self.backend.generate(
            generation.renderer.request_id,
            generation.prompt_token_ids,
            generation.sampling_params,
            generation.cache_salt,
        )
        work = self._first(outputs) if generation.stream else self._collect(outputs, tracker)
        is_streaming = False
        try:
            output = await until_disconnected(request.receive, work)
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
            if not is_streaming:  # done with the backend's stream, or failed: release it
                await outputs.aclose()
        if not generation.stream:
            tracker.finish(output.finish_reason)
            body = generation.renderer.response(output).model_dump_json()
            return Response(body, media_type="application/json")
        events = self._events(generation, output, outputs, tracker)
        return EventStreamResponse(events, close_also=outputs)

    @staticmethod
    async def _first(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
        output = await anext(outputs, None)
        if output is None:
            raise ReplicaFailedError("the request ended without any output")
        return output

    @staticmethod
    async def _collect(
        outputs: AsyncIterator[RequestOutput], tracker: RequestMetrics
    ) -> RequestOutput:
        final = None
        async for output in outputs:
            tracker.observe(output)
            final = output
        if final is None or not final.finished:
            raise ReplicaFailedError("the request's outputs ended before it finished")
        return final

    async def _events(
        self,
        generation: Generation,
        first: RequestOutput,
        outputs: AsyncIterator[RequestOutput],
        tracker: RequestMetrics,
    ) -> AsyncGenerator[bytes, None]:
        renderer = generation.renderer
        finish_reason = "abort"  # unless the stream reaches its end
        try:
            async with contextlib.aclosing(outputs):
                for chunk in renderer.first_chunks():
                    yield sse(chunk)
                output: RequestOutput | None = first
                while output is not None:
                    tracker.observe(output)
                    chunk = renderer.chunk(output)
                    if chunk is not None:
                        yield sse(chunk)
                    if output.finished:
                        break
                    output = await anext(outputs, None)
                if output is None:
                    raise ReplicaFailedError("the request's outputs ended before it finished")
                finish_reason = output.finish_reason
                if generation.include_usage:
                    yield sse(renderer.usage_chunk(usage_of(output)))
        except Exception as error:
            finish_reason = "error"
            api_error = from_backend_error(error)
            if api_error is None:
                logger.exception("request %s failed mid-stream", renderer.request_id)
                api_error = internal_error()
            yield sse(api_error.body())
        finally:
            tracker.finish(finish_reason)
        yield DONE
