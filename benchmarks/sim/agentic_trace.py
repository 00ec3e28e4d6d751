"""A generated agentic trace in the Mooncake format: tool-using agent sessions.

No agentic trace ships with Strata (Mooncake's FAST'25 ``toolagent_trace.jsonl`` is not in
``benchmarks/traces/``), so this one is generated, seeded and deterministic, shaped after two
descriptions: the Mooncake tool-and-agent workload's published figures (23,608 requests in an
hour, 6.6 a second; mean input 8,596 tokens, mean output 182) and the sessions of the
``agent-session`` benchmark (a tools block shared by every session of an agent, then a
conversation that grows by a tool result and an answer each turn)::

    app a       a system prompt and tools block of 2-12 whole blocks (1k-6k tokens), shared by
                every session of the app; apps drawn by popularity (Zipf, s = 1)
    session     arrives as a Poisson process; 2 + Geometric(mean 7) turns, at most 30
    turn k      prompt = app block + the session's history + this turn's new content (a
                tool result or user message: log-normal, median 300 tokens, sigma 1); output
                Exponential(mean 182) tokens, 8 to 1,024; the next turn arrives 1 s +
                Exponential(mean 4 s) later (the model's answer, the tool's run)

Hash ids (512 tokens each, as Mooncake's): an app's blocks have ids of their own; a session's
full blocks keep theirs from turn to turn (the history is a prefix of the next prompt), and a
last partial block gets a new id each turn (its content grows). The output is part of the next
turn's history. ``python -m benchmarks.sim.agentic_trace --output PATH`` writes the trace.
"""

import argparse
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.sim.trace import TRACE_TOKENS_PER_HASH_ID, TraceRecord

BLOCK = TRACE_TOKENS_PER_HASH_ID


@dataclass(frozen=True, slots=True)
class AgenticShape:
    num_requests: int = 12000
    requests_per_s: float = 6.6
    num_apps: int = 12
    app_blocks: tuple[int, int] = (2, 12)
    mean_extra_turns: float = 7.0
    max_turns: int = 30
    content_median_tokens: float = 300.0
    content_sigma: float = 1.0
    mean_output_tokens: float = 182.0
    output_tokens: tuple[int, int] = (8, 1024)
    think_s: tuple[float, float] = (1.0, 4.0)  # fixed part, exponential mean


@dataclass(slots=True)
class _Session:
    app: int
    turns_left: int
    next_s: float
    history: int = 0  # tokens after the app block
    block_ids: list[int] | None = None  # ids of the history's full blocks


def generate(shape: AgenticShape = AgenticShape(), seed: int = 0) -> list[TraceRecord]:
    """``shape.num_requests`` requests, sorted by arrival (see the module docstring)."""
    rng = random.Random(seed)
    ids = _ids()
    apps = [
        [next(ids) for _ in range(rng.randint(*shape.app_blocks))] for _ in range(shape.num_apps)
    ]
    weights = [1 / (rank + 1) for rank in range(shape.num_apps)]
    mean_turns = 2 + shape.mean_extra_turns
    session_rate = shape.requests_per_s / mean_turns
    pending: list[_Session] = []
    records: list[TraceRecord] = []
    clock = 0.0
    while len(records) < shape.num_requests:
        clock += rng.expovariate(session_rate)
        turns = min(shape.max_turns, 2 + _geometric(rng, shape.mean_extra_turns))
        app = rng.choices(range(shape.num_apps), weights)[0]
        pending.append(_Session(app, turns, clock, block_ids=[]))
        for session in [s for s in pending if s.next_s <= clock]:
            while session.turns_left and session.next_s <= clock:
                records.append(_turn(session, apps[session.app], shape, rng, ids))
        pending = [s for s in pending if s.turns_left]
    records.sort(key=lambda r: r.timestamp_ms)
    return records[: shape.num_requests]


def _turn(
    session: _Session, app: list[int], shape: AgenticShape, rng: random.Random, ids: Iterator[int]
) -> TraceRecord:
    """One request of ``session`` at its ``next_s``; advances the session past it."""
    content = max(
        16, round(shape.content_median_tokens * math.exp(rng.gauss(0, shape.content_sigma)))
    )
    length = session.history + content
    while len(session.block_ids) < length // BLOCK:
        session.block_ids.append(next(ids))
    hash_ids = [*app, *session.block_ids[: length // BLOCK]]
    if length % BLOCK:
        hash_ids.append(next(ids))  # a partial block: its content is this turn's
    low, high = shape.output_tokens
    output = min(high, max(low, round(rng.expovariate(1 / shape.mean_output_tokens))))
    record = TraceRecord(
        round(session.next_s * 1000), len(app) * BLOCK + length, output, tuple(hash_ids)
    )
    session.history = length + output
    session.turns_left -= 1
    fixed, mean = shape.think_s
    session.next_s += fixed + rng.expovariate(1 / mean)
    return record


def _geometric(rng: random.Random, mean: float) -> int:
    """A geometric count (0, 1, 2, ...) with this mean."""
    p = 1 / (1 + mean)
    return int(math.log(1 - rng.random()) / math.log(1 - p))


def _ids() -> Iterator[int]:
    n = 0
    while True:
        yield n
        n += 1


def write(records: list[TraceRecord], path: Path) -> None:
    with open(path, "w") as f:
        for r in records:
            row = {
                "timestamp": int(r.timestamp_ms),
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=AgenticShape.num_requests)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(generate(AgenticShape(num_requests=args.requests), args.seed), args.output)


if __name__ == "__main__":
    main()
