"""Mooncake-format traces as token-level requests, for the simulator and the real engine alike.

A record is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids":
[...]}`` where each hash id stands for a block of 512 trace tokens (the last one may be partial)
and equal ids mean equal content. The mapping to token ids, with ``T = tokens_per_hash_id``::

    tokens(id)  = T pseudo-random byte-tokenizer ids drawn from random.Random(id)
    prompt      = tokens(id_0) + tokens(id_1) + ...   truncated to max(1, round(input_length*T/512))
    max_tokens  = max(1, round(output_length * T / 512))   (outputs are scaled like prompts)
    arrival_s   = timestamp / 1000

so requests sharing their first k ids share their first k*T prompt tokens exactly, and with
``T == block_size`` one hash id is one KV block. Each simulated token then stands for
``512 / T`` trace tokens (``token_scale``); the cost model charges time for the trace tokens.
"""

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

TRACE_TOKENS_PER_HASH_ID = 512
TOKEN_VOCAB = 256  # byte-tokenizer ids, valid for the built-in models


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request ready to replay: token-exact prompt, output budget and arrival time."""

    request_id: str
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int
    hash_ids: tuple[int, ...]
    cache_key: str | None = None  # the API's prompt_cache_key (Mooncake traces carry none)
    cache_salt: str | None = None  # its tenant (replicas.kv.tenants; Mooncake traces: none)
    batch: bool = False  # its priority class: OpenAI's service_tier "flex"


def load_trace(path: Path, max_requests: int | None = None) -> list[TraceRecord]:
    """The first ``max_requests`` records of a JSON-lines trace, sorted by timestamp (stable)."""
    records = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            records.append(
                TraceRecord(
                    float(row["timestamp"]),
                    int(row["input_length"]),
                    int(row["output_length"]),
                    tuple(int(h) for h in row["hash_ids"]),
                )
            )
            if max_requests is not None and len(records) >= max_requests:
                break
    records.sort(key=lambda r: r.timestamp_ms)
    return records


def hash_id_tokens(hash_id: int, tokens_per_hash_id: int) -> list[int]:
    """The deterministic token block of one hash id (same on every machine and run)."""
    return list(random.Random(hash_id).randbytes(tokens_per_hash_id))


def scaled_length(trace_tokens: int, tokens_per_hash_id: int) -> int:
    return max(1, round(trace_tokens * tokens_per_hash_id / TRACE_TOKENS_PER_HASH_ID))


def expand(
    records: Iterable[TraceRecord], tokens_per_hash_id: int, id_prefix: str = "r"
) -> list[TraceRequest]:
    """Token-level requests of ``records`` (see the module docstring for the mapping)."""
    if tokens_per_hash_id <= 0:
        raise ValueError(f"tokens_per_hash_id must be positive, got {tokens_per_hash_id}")
    blocks: dict[int, list[int]] = {}
    requests = []
    for i, record in enumerate(records):
        prompt: list[int] = []
        for hash_id in record.hash_ids:
            block = blocks.get(hash_id)
            if block is None:
                block = blocks[hash_id] = hash_id_tokens(hash_id, tokens_per_hash_id)
            prompt.extend(block)
        num_prompt = min(scaled_length(record.input_length, tokens_per_hash_id), len(prompt))
        if not prompt:  # a record without hash ids: fresh tokens seeded by its position
            prompt = hash_id_tokens(-1 - i, num_prompt)
        requests.append(
            TraceRequest(
                f"{id_prefix}{i}",
                record.timestamp_ms / 1000.0,
                prompt[:num_prompt],
                scaled_length(record.output_length, tokens_per_hash_id),
                record.hash_ids,
            )
        )
    return requests


def unbounded_cached_blocks(records: Sequence[TraceRecord]) -> tuple[list[int], int]:
    """Per record, the leading blocks an unbounded prefix cache would hold at its arrival (a
    block hits when the request's whole prefix up to and including it was seen before: KV is
    prefix-exact); and the number of distinct prefixes (blocks with their whole prefix)."""
    nodes: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node: a prefix trie
    cached = []
    for record in records:
        parent, num_leading, matching = -1, 0, True
        for hash_id in record.hash_ids:
            node = nodes.get((parent, hash_id))
            if node is None:
                node = nodes[(parent, hash_id)] = len(nodes)
                matching = False
            num_leading += matching
            parent = node
        cached.append(num_leading)
    return cached, len(nodes)


def trace_summary(records: list[TraceRecord]) -> dict[str, float]:
    """Size of a trace and the block hit rate of an unbounded prefix cache
    (``unbounded_cached_blocks``)."""
    num_refs = sum(len(r.hash_ids) for r in records)
    distinct = {hash_id for r in records for hash_id in r.hash_ids}
    cached, num_prefix_blocks = unbounded_cached_blocks(records)
    num_prefix_hits = sum(cached)
    span = (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0 if records else 0.0
    return {
        "num_requests": len(records),
        "num_block_refs": num_refs,
        "num_distinct_blocks": len(distinct),
        "num_distinct_prefix_blocks": num_prefix_blocks,
        "unbounded_prefix_hit_rate": num_prefix_hits / num_refs if num_refs else 0.0,
        "duration_s": span,
    }
