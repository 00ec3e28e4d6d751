"""``/v1/responses``: create (through chat completions), retrieve and delete.

ResponsesRequest --translate--> ChatCompletionRequest --Serving.chat--> Generation
    (previous turn: prompt = its exact tokens + the new messages; the store)
Generation with a ResponsesRenderer --Serving.respond--> JSON or event stream
    --on finish, with store=true--> ResponseStore (under the request's API key)
"""

import dataclasses
import json
import time

from fastapi import Request
from pydantic import ValidationError
from starlette.responses import Response

from cluster.api.errors import APIError, describe_validation_error
from cluster.api.middleware import api_key_id
from cluster.api.protocol import ChatCompletionRequest
from cluster.api.responses.protocol import ResponseDeleted, ResponseObject, ResponsesRequest
from cluster.api.responses.renderer import ResponsesRenderer
from cluster.api.responses.store import ResponseStore, StoredResponse
from cluster.api.responses.translate import (
    chat_body,
    chat_message_of,
    chat_tools,
    continuation_ids,
    input_messages,
    new_id,
    responses_message,
    responses_param,
    system_messages,
)
from cluster.api.serving import Generation, Serving
from cluster.api.tools import DEFAULT_FORMAT, render_chat_prompt, tool_format
from replicas.outputs import RequestOutput


def not_found(response_id: str, param: str | None = None) -> APIError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return APIError(
        404,
        f"{what} with id '{response_id}' not found.",
        param=param,
        code="previous_response_not_found" if param else "response_not_found",
    )


class ResponsesAPI:
    def __init__(self, serving: Serving, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store

    def owner(self, request: Request) -> str:
        """Whose store a request reads and writes: its API key's (one for all without keys)."""
        return api_key_id(request.scope) or ""

    async def create(self, request: Request, body: ResponsesRequest) -> Response:
        owner = self.owner(request)
        self.serving.check_model(body.model)
        previous = None
        if body.previous_response_id is not None:
            previous = self.store.get(owner, body.previous_response_id)
            if previous is None:
                raise not_found(body.previous_response_id, "previous_response_id")
        new_messages = input_messages(body.input)
        history = (previous.messages if previous is not None else []) + new_messages
        generation = self._generation(body, system_messages(body.instructions) + history)
        if previous is not None:
            generation = self._continue(generation, previous, body, new_messages)
        draft = ResponseObject(
            id=new_id("resp"),
            created_at=int(time.time()),
            model=self.serving.backend.model_name,
            **self._echoed(body),
        )

        def store(response: ResponseObject, final: RequestOutput) -> None:
            entry = StoredResponse.build(
                response.id,
                response.model_dump_json().encode(),
                body.instructions,
                history,
                chat_message_of(response.output),
                final.prompt_token_ids,
                final.token_ids,
            )
            self.store.put(owner, entry)

        renderer = ResponsesRenderer(generation.renderer, draft, store if body.store else None)
        generation = dataclasses.replace(
            generation, renderer=renderer, include_usage=True, prompt_param="input"
        )
        return await self.serving.respond(request, generation)

    def _generation(self, body: ResponsesRequest, messages: list[dict]) -> Generation:
        """The chat completions generation of ``body``; its 400s name the Responses field."""
        try:
            chat = ChatCompletionRequest.model_validate(chat_body(body, messages))
            return self.serving.chat(chat)
        except ValidationError as error:
            api_error = describe_validation_error(error)
        except APIError as error:
            api_error = error
        api_error.param = responses_param(api_error.param)
        api_error.message = responses_message(api_error.message)
        raise api_error

    def _continue(
        self,
        generation: Generation,
        previous: StoredResponse,
        body: ResponsesRequest,
        new_messages: list[dict],
    ) -> Generation:
        """``generation`` prompted with the previous turn's exact tokens followed by the new
        messages, when the template allows it and it fits; as it is otherwise."""
        tokenizer = self.serving.backend.tokenizer
        fmt = tool_format(DEFAULT_FORMAT)

        def render(messages: list[dict], tools: list[dict]) -> str:
            return render_chat_prompt(tokenizer, messages, tools or None, fmt)

        previous_tools = json.loads(previous.body)["tools"]
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
        token_ids = continuation_ids(
            tokenizer,
            render,
            previous,
            chat_tools(previous_tools),
            body.instructions,
            new_messages,
            chat_tools(tools),
        )
        room = self.serving.backend.max_model_len - generation.sampling_params.max_tokens
        if token_ids is None or len(token_ids) > room:
            return generation
        hints = generation.cache_hints
        if hints is not None and hints.retain_tokens == len(generation.prompts[0]):
            hints = dataclasses.replace(hints, retain_tokens=len(token_ids))  # the whole prompt
        return dataclasses.replace(generation, prompts=[token_ids], cache_hints=hints)

    @staticmethod
    def _echoed(body: ResponsesRequest) -> dict:
        """The request fields a response repeats."""
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
        text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else None
        echoed = {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning,
            "store": body.store,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "tool_choice": body.tool_choice or "auto",
            "tools": tools,
            "user": body.user,
            "safety_identifier": body.safety_identifier,
            "service_tier": body.service_tier,
            "metadata": body.metadata or {},
            "prompt_cache_key": body.prompt_cache_key,
        }
        if text is not None:
            echoed["text"] = text
        return echoed

    def retrieve(self, request: Request, response_id: str) -> Response:
        if request.query_params.get("stream") in ("true", "True", "1"):
            raise APIError.bad_request(
                "streaming a stored response again is not supported by this server", "stream"
            )
        entry = self.store.get(self.owner(request), response_id)
        if entry is None:
            raise not_found(response_id)
        return Response(entry.body, media_type="application/json")

    def delete(self, request: Request, response_id: str) -> Response:
        if not self.store.delete(self.owner(request), response_id):
            raise not_found(response_id)
        return Response(
            ResponseDeleted(id=response_id).model_dump_json(), media_type="application/json"
        )
