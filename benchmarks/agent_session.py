"""agent-session: multi-turn tool-using agent sessions against `strata serve` (dp 2, host tier on).

Each session is an agent's conversation behind one tools block of about ``tools_tokens`` tokens
(function tools with JSON-schema parameters, as agent frameworks send them): a user asks, the
model calls a tool (``tool_choice: "required"``, so the call is valid by construction), the
tool's result comes back, the model answers (``tool_choice: "none"``), the user asks again, and so
on for ``requests`` requests. ``sessions`` sessions run at once, interleaved on the two replicas.
Three ways of sending the same sessions, side by side in one run (they take turns, in rotating
order, ``rounds`` times; each uses its own ``cache_salt``, so none reuses another's blocks):

* ``resend``: ``/v1/chat/completions`` with the whole history every turn, prefix caching on;
* ``no-cache``: the same with a fresh ``cache_salt`` on every request, so no cached block ever
  matches: every request computes its whole prompt, as with prefix caching off;
* ``previous_response_id``: ``/v1/responses``, each turn sending only its new items and the id of
  the previous response (the server keeps the conversation).

Per request index: TTFT (request sent to the first streamed output: text, or a tool call's first
delta, which the parser can emit once the call's name is known) and the cached share of the
prompt (``cached_tokens / prompt_tokens`` from the usage).
"""

import asyncio
import json
import os
import random
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.http_load import free_port, stop_server, wait_healthy
from benchmarks.report import Report, new_figure
from benchmarks.workload import median, rotated
from replicas.model.resolve import DEFAULT_MODEL as REAL_MODEL

NAME = "agent-session"
ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("resend", "no-cache", "previous_response_id")
TTFT_TARGET = 0.5  # resend / no-cache mean TTFT past the first request of a session


@dataclass(frozen=True, slots=True)
class Settings:
    sessions: int = 4
    requests: int = 8  # per session: tool call, answer, tool call, answer, ...
    rounds: int = 2
    tools_tokens: int = 3000
    call_tokens: int = 48
    answer_tokens: int = 16


QUICK = Settings(sessions=1, requests=4, rounds=1, tools_tokens=600, call_tokens=160)

_TOPICS = ("orders", "invoices", "shipments", "customers", "tickets", "refunds", "inventory")
_TOPICS += ("calendar", "weather", "flights", "hotels", "documents", "metrics", "alerts")
_VERBS = ("search", "get", "create", "update", "cancel", "list", "summarize", "export")
_QUESTIONS = (
    "Where is order 4411 and when will it arrive?",
    "Refund the duplicate charge on invoice 981.",
    "Which tickets about login failures are still open?",
    "Book a flight from Lisbon to Oslo next Tuesday.",
    "How many units of part X-20 are left in the Leeds warehouse?",
    "Summarize yesterday's alerts for the payments service.",
    "Move my 3pm meeting with Dana to Thursday.",
    "Export last month's metrics for the checkout page.",
)


def tools_block(num_tokens: int, rng: random.Random) -> list[dict]:
    """Function tools whose JSON is about ``num_tokens`` tokens (3.5 characters a token)."""
    tools: list[dict] = []
    while len(json.dumps(tools)) < 3.5 * num_tokens:
        verb, topic = rng.choice(_VERBS), rng.choice(_TOPICS)
        name = f"{verb}_{topic}_{len(tools)}"
        properties = {
            "query": {"type": "string", "description": f"What to {verb} among the {topic}."},
            "limit": {"type": "integer", "description": "Most results to return (1-50)."},
            "status": {
                "type": "string",
                "enum": ["open", "closed", "pending", "any"],
                "description": f"Only {topic} in this state.",
            },
            "filters": {
                "type": "object",
                "description": f"Narrow the {topic} by owner and date range.",
                "properties": {
                    "owner": {"type": "string"},
                    "since": {"type": "string", "description": "ISO date, inclusive."},
                },
            },
        }
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": (
                        f"{verb.capitalize()} {topic} in the company's records. Use it when the "
                        f"user asks about {topic}; it returns JSON with the matching {topic}, "
                        "their identifiers, owners, states and last update times."
                    ),
                    "parameters": {
                        "type": "object",
                        "properties": properties,
                        "required": ["query"],
                    },
                },
            }
        )
    return tools


def _flat_tools(tools: list[dict]) -> list[dict]:
    """The Responses API's tool shape: the function's fields at the top level."""
    return [{"type": "function", **tool["function"]} for tool in tools]


@dataclass(slots=True)
class Turn:
    index: int
    kind: str  # "call" or "answer"
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


class Session:
    """One agent conversation, sent as ``variant`` says."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        variant: str,
        tools: list[dict],
        seed: int,
        settings: Settings,
    ) -> None:
        self.http = http
        self.variant = variant
        self.tools = tools
        self.rng = random.Random(seed)
        self.settings = settings
        self.salt = f"{variant}-{uuid.uuid4().hex}"
        self.messages: list[dict] = [
            {"role": "system", "content": "You are an operations agent. Use the tools."}
        ]
        self.previous_id: str | None = None
        self.pending_items: list[dict] = []

    async def run(self) -> list[Turn]:
        turns = []
        self._ask()
        for index in range(self.settings.requests):
            kind = "call" if index % 2 == 0 else "answer"
            if self.variant == "previous_response_id":
                turn = await self._responses_turn(index, kind)
            else:
                turn = await self._chat_turn(index, kind)
            turns.append(turn)
        return turns

    def _ask(self) -> None:
        message = {"role": "user", "content": self.rng.choice(_QUESTIONS)}
        self.messages.append(message)
        self.pending_items.append({"type": "message", **message})

    def _tool_result(self, call_id: str, name: str) -> str:
        rows = [{"id": self.rng.randrange(10**6), "state": "open"} for _ in range(3)]
        return json.dumps({"tool": name, "call_id": call_id, "results": rows})

    async def _chat_turn(self, index: int, kind: str) -> Turn:
        body = {
            "messages": self.messages,
            "tools": self.tools,
            "tool_choice": "required" if kind == "call" else "none",
            "max_tokens": self.settings.call_tokens
            if kind == "call"
            else self.settings.answer_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "cache_salt": self.salt if self.variant == "resend" else uuid.uuid4().hex,
        }
        sent = time.monotonic()
        first: float | None = None
        content, calls, usage = "", {}, None
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"chat: {response.status_code} {await response.aread()!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    delta = choice["delta"]
                    if delta.get("content") or delta.get("tool_calls"):
                        first = first or time.monotonic()
                    content += delta.get("content") or ""
                    for call in delta.get("tool_calls") or []:
                        entry = calls.setdefault(call["index"], {"arguments": ""})
                        entry.update({k: v for k, v in call.items() if k in ("id", "type")})
                        function = call.get("function") or {}
                        if function.get("name"):
                            entry["name"] = function["name"]
                        entry["arguments"] += function.get("arguments") or ""
        if kind == "call":
            if not calls:
                raise RuntimeError(f"tool_choice required gave no call: {content!r}")
            tool_calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for _, c in sorted(calls.items())
            ]
            self.messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
            for call in tool_calls:
                result = self._tool_result(call["id"], call["function"]["name"])
                self.messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": result}
                )
        else:
            self.messages.append({"role": "assistant", "content": content})
            self._ask()
        return self._turn(index, kind, sent, first, usage)

    async def _responses_turn(self, index: int, kind: str) -> Turn:
        body = {
            "input": self.pending_items if self.previous_id else self._first_input(),
            "tools": _flat_tools(self.tools),
            "tool_choice": "required" if kind == "call" else "none",
            "max_output_tokens": (
                self.settings.call_tokens if kind == "call" else self.settings.answer_tokens
            ),
            "temperature": 0,
            "stream": True,
            "store": True,
            "cache_salt": self.salt,
        }
        if self.previous_id:
            body["previous_response_id"] = self.previous_id
        self.pending_items = []
        sent = time.monotonic()
        first: float | None = None
        completed = None
        async with self.http.stream("POST", "/v1/responses", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"responses: {response.status_code} {await response.aread()!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                event_type = event.get("type", "")
                if event_type in (
                    "response.output_text.delta",
                    "response.function_call_arguments.delta",
                ):
                    first = first or time.monotonic()
                if (
                    event_type == "response.output_item.added"
                    and event["item"]["type"] == "function_call"
                ):
                    first = first or time.monotonic()
                if event_type in ("response.completed", "response.incomplete"):
                    completed = event["response"]  # incomplete: max_output_tokens reached
        if completed is None:
            raise RuntimeError("the response stream ended without its last event")
        self.previous_id = completed["id"]
        calls = [item for item in completed["output"] if item["type"] == "function_call"]
        if kind == "call":
            if not calls:
                raise RuntimeError("tool_choice required gave no function_call")
            for call in calls:
                output = self._tool_result(call["call_id"], call["name"])
                self.pending_items.append(
                    {"type": "function_call_output", "call_id": call["call_id"], "output": output}
                )
        else:
            self._ask()
        usage = completed.get("usage") or {}
        chat_usage = {
            "prompt_tokens": usage.get("input_tokens", 0),
            "prompt_tokens_details": {
                "cached_tokens": (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
            },
        }
        return self._turn(index, kind, sent, first, chat_usage)

    def _first_input(self) -> list[dict]:
        system = self.messages[0]
        return [{"type": "message", **system}, *self.pending_items]

    @staticmethod
    def _turn(index: int, kind: str, sent: float, first: float | None, usage: dict | None) -> Turn:
        if first is None or usage is None:
            raise RuntimeError("a streamed turn gave no output or no usage")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return Turn(index, kind, first - sent, usage["prompt_tokens"], cached)


async def _round(base: str, settings: Settings, tools: list[dict], order: list[str]) -> dict:
    turns: dict[str, list[Turn]] = {}
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        for variant in order:
            sessions = [
                Session(http, variant, tools, seed, settings) for seed in range(settings.sessions)
            ]
            results = await asyncio.gather(*(s.run() for s in sessions))
            turns[variant] = [turn for session in results for turn in session]
    return turns


def _serve(model: str, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "cluster.cli", "serve", model]
    command += ["--config", "configs/default.yaml", "--port", str(port)]
    if model == "tiny":
        command += ["--dtype", "float32"]
    with log.open("w") as out:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        )


def run(
    output_dir: Path, *, quick: bool, command: str, model: str = REAL_MODEL
) -> dict[str, object]:
    settings = QUICK if quick else Settings()
    if quick and model == REAL_MODEL:
        model = "tiny"  # a smoke test of the code path, not figures
    tools = tools_block(settings.tools_tokens, random.Random(0))
    output_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = output_dir / "serve.log"
    server = _serve(model, port, log)
    base = f"http://127.0.0.1:{port}"
    turns: dict[str, list[Turn]] = {variant: [] for variant in VARIANTS}
    try:
        wait_healthy(base, server, log)
        warm = Settings(**{**asdict(settings), "sessions": 1, "requests": 2})
        asyncio.run(_round(base, warm, tools, list(VARIANTS)))  # warm-up, not recorded
        for round_index in range(settings.rounds):
            result = asyncio.run(_round(base, settings, tools, rotated(VARIANTS, round_index)))
            for variant, recorded in result.items():
                turns[variant] += recorded
    finally:
        stop_server(server)
    per_index = {
        variant: {
            index: {
                "ttft_s": median([t.ttft_s for t in recorded if t.index == index]),
                "cached_share": median(
                    [t.cached_tokens / t.prompt_tokens for t in recorded if t.index == index]
                ),
                "prompt_tokens": median([t.prompt_tokens for t in recorded if t.index == index]),
            }
            for index in range(settings.requests)
        }
        for variant, recorded in turns.items()
    }

    def later_mean(variant: str) -> float:
        later = [t.ttft_s for t in turns[variant] if t.index > 0]
        return sum(later) / len(later)

    ratios = {
        "resend_over_no_cache_ttft": later_mean("resend") / later_mean("no-cache"),
        "previous_id_over_resend_ttft": later_mean("previous_response_id") / later_mean("resend"),
    }
    report = Report(
        NAME,
        f"Agent sessions with a {settings.tools_tokens}-token tools block, model {model}, dp 2",
        command,
        quick,
        __doc__.split("\n\n", 1)[1].strip(),
    )
    report.add_table(
        f"Per request of a session (medians over {settings.sessions} sessions x "
        f"{settings.rounds} rounds): TTFT in ms / cached share of the prompt",
        ["request", "kind", "prompt tokens", *VARIANTS],
        [
            [
                index,
                "call" if index % 2 == 0 else "answer",
                per_index["resend"][index]["prompt_tokens"],
                *(
                    f"{1e3 * per_index[v][index]['ttft_s']:.0f} / "
                    f"{per_index[v][index]['cached_share']:.2f}"
                    for v in VARIANTS
                ),
            ]
            for index in range(settings.requests)
        ],
    )
    met = ratios["resend_over_no_cache_ttft"] <= TTFT_TARGET
    report.add_table(
        "Ratios (mean TTFT of every request after a session's first)",
        ["ratio", "value", "target", "met"],
        [
            ["resend / no-cache", ratios["resend_over_no_cache_ttft"], f"<= {TTFT_TARGET}", met],
            ["previous_response_id / resend", ratios["previous_id_over_resend_ttft"], "", ""],
        ],
    )
    figure, (axis,) = new_figure()
    for variant in VARIANTS:
        indices = list(range(settings.requests))
        axis.plot(
            indices, [1e3 * per_index[variant][i]["ttft_s"] for i in indices], "o-", label=variant
        )
    axis.set_xlabel("request of the session")
    axis.set_ylabel("median TTFT (ms)")
    axis.legend()
    report.figures["agent_session.png"] = figure
    report.results = {
        "model": model,
        "settings": asdict(settings),
        "per_index": {v: {str(i): x for i, x in p.items()} for v, p in per_index.items()},
        "ratios": ratios,
        "turns": {v: [asdict(t) for t in recorded] for v, recorded in turns.items()},
    }
    return report.write(output_dir)
