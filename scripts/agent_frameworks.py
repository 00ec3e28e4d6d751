"""Run the agent frameworks users build on against a running `strata serve`, as their users do.

Not part of the test suite: the frameworks are large and pull their own pins, so they live in a
throwaway virtual environment outside the repository::

    python3 -m venv /tmp/agents && /tmp/agents/bin/pip install instructor openai-agents \\
        langchain-openai "pydantic-ai-slim[openai]" llama-index-llms-openai-like
    bash scripts/run.sh --port 8000 &          # or any strata serve
    /tmp/agents/bin/python scripts/agent_frameworks.py --base-url http://127.0.0.1:8000/v1

Each check runs one framework's default structured or tool-calling path and prints PASS or FAIL
with what came back; a framework that is not installed is SKIP. The exit status is the number of
failures. The model may be tiny: what is checked is that every path runs end to end and that
what comes back has the framework's types (tool calls are valid by construction on Strata).
"""

import argparse
import asyncio
import json
import sys
import traceback
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, Field


class City(BaseModel):
    name: str = Field(description="The city's name.")
    country: str
    population_millions: float


class Ticket(BaseModel):
    title: str
    priority: Literal["low", "medium", "high"]
    tags: list[str]


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """Get the current weather in a city."""
    return json.dumps({"city": city, "temperature": 21, "unit": unit, "sky": "clear"})


PROMPT_CITY = "Tell me about Lisbon, the capital of Portugal."
PROMPT_TICKET = "File a ticket: the login page times out for users in Europe. It is urgent."
PROMPT_WEATHER = "What is the weather in Oslo right now? Use the tool."


def check_instructor(base_url: str, model: str) -> str:
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(
        OpenAI(base_url=base_url, api_key="strata", max_retries=0), mode=instructor.Mode.TOOLS
    )
    city = client.chat.completions.create(
        model=model,
        response_model=City,
        messages=[{"role": "user", "content": PROMPT_CITY}],
        max_tokens=96,
        max_retries=0,
    )
    assert isinstance(city, City)
    return repr(city)


def check_pydantic_ai(base_url: str, model: str) -> str:
    from pydantic_ai import Agent, ToolOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    chat = OpenAIChatModel(model, provider=OpenAIProvider(base_url=base_url, api_key="strata"))
    agent = Agent(chat, output_type=ToolOutput(Ticket), model_settings={"max_tokens": 96})
    result = agent.run_sync(PROMPT_TICKET)
    assert isinstance(result.output, Ticket)
    weather = Agent(chat, model_settings={"max_tokens": 64})
    weather.tool_plain(get_weather)
    answer = weather.run_sync(PROMPT_WEATHER)
    return f"{result.output!r}; tool run answered {str(answer.output)[:60]!r}"


def check_langchain(base_url: str, model: str) -> str:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=model, base_url=base_url, api_key="strata", max_tokens=96)
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(PROMPT_WEATHER)
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather", message
    structured = llm.with_structured_output(City, method="function_calling").invoke(PROMPT_CITY)
    assert isinstance(structured, City)
    streamed = None
    for chunk in llm.bind_tools([get_weather], tool_choice="any").stream(PROMPT_WEATHER):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and streamed.tool_calls, streamed
    return f"{message.tool_calls[0]}; {structured!r}; streamed {streamed.tool_calls[0]}"


def check_llama_index(base_url: str, model: str) -> str:
    from llama_index.core.prompts import PromptTemplate
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(
        model=model,
        api_base=base_url,
        api_key="strata",
        is_chat_model=True,
        is_function_calling_model=True,
        max_tokens=96,
    )
    city = llm.structured_predict(City, PromptTemplate("{question}"), question=PROMPT_CITY)
    assert isinstance(city, City)
    return repr(city)


def _agents_run(base_url: str, model: str, responses: bool) -> str:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="strata", max_retries=0)
    kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    agent = Agent(
        name="weather",
        instructions="You answer weather questions with the get_weather tool.",
        tools=[function_tool(get_weather)],
        model=kind(model=model, openai_client=client),
        model_settings=ModelSettings(max_tokens=256, tool_choice="required"),
        reset_tool_choice=True,
    )
    result = asyncio.run(Runner.run(agent, PROMPT_WEATHER, max_turns=4))
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    assert calls, result.new_items
    return f"{len(calls)} tool call(s), final {str(result.final_output)[:60]!r}"


def check_openai_agents_chat(base_url: str, model: str) -> str:
    return _agents_run(base_url, model, responses=False)


def check_openai_agents_responses(base_url: str, model: str) -> str:
    return _agents_run(base_url, model, responses=True)


CHECKS: dict[str, tuple[str, Callable[[str, str], str]]] = {
    "instructor (Mode.TOOLS)": ("instructor", check_instructor),
    "pydantic-ai (ToolOutput, a function tool)": ("pydantic_ai", check_pydantic_ai),
    "langchain (bind_tools, function-calling structured output, streaming)": (
        "langchain_openai",
        check_langchain,
    ),
    "llama-index (structured_predict)": ("llama_index.llms.openai_like", check_llama_index),
    "openai-agents (chat completions model)": ("agents", check_openai_agents_chat),
    "openai-agents (Responses model)": ("agents", check_openai_agents_responses),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="default: the server's only model")
    args = parser.parse_args()
    from openai import OpenAI

    model = args.model or OpenAI(base_url=args.base_url, api_key="strata").models.list().data[0].id
    failures = 0
    for name, (module, check) in CHECKS.items():
        try:
            __import__(module)
        except ImportError:
            print(f"SKIP {name}: {module} is not installed")
            continue
        try:
            print(f"PASS {name}: {check(args.base_url, model)}")
        except Exception as error:
            failures += 1
            print(f"FAIL {name}: {type(error).__name__}: {error}")
            traceback.print_exc(limit=3, file=sys.stdout)
    return failures


if __name__ == "__main__":
    raise SystemExit(main())
