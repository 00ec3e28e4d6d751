"""How long one simulated engine step takes, from a hardware profile (``profiles/*.json``).

A step runs its scheduled requests as one batch. With ``token_scale`` s (trace tokens per
simulated token) one simulated output token stands for s real decode steps, so a step is a
first real step, which finishes the batch's prefill chunks (their first tokens), followed by
s - 1 further decode sub-steps::

    sub_step = fixed + per_seq * decodes + per_context_token * sum of decode contexts
    first    = fixed + sum over prefill chunks (per_token * n + per_token_context * n *
               (ctx + n / 2)) + [per_seq * decodes + per_context_token * contexts]
               + loads * block_bytes / h2d_bandwidth + latency            (if any load)
               + stores * block_bytes / d2h_bandwidth + latency  (unless stores overlap compute;
                 then 2 * stores * block_bytes / device_copy_bandwidth: their gather)
    tail     = (s - 1) * sub_step                                          (if any decode)

``loads`` counts every load of the step's plan, a waiting request's prefetch loads included:
``replicas.kv.transfer.KVTransfer`` makes the forward pass wait for the whole plan, so a
prefetch costs the step what any load costs (it saves its request the load at admission).

``n`` and ``ctx`` are counted in trace tokens (simulated tokens x s): prefill is linear in its
tokens plus an attention term in tokens x context; a decode step is a fixed cost plus a
per-sequence and a per-context-token (KV read) cost. ``block_bytes`` is the KV of one simulated
block (``block_size * s * HardwareProfile.kv_cache_bytes_per_token``), so the profile's KV
dtype sizes the NPU, host and disk tiers in blocks and every copy time. The compute constants
stay those of the profile's engine dtype: 8-bit KV's cheaper KV reads in decode are not
credited. The simulator may cut the tail at a sub-step boundary when a request arrives (see
``engine``), as a real engine admits it at its next step.
"""

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import NamedTuple

from replicas.dtypes import torch_dtype
from replicas.engine.scheduler import ScheduledRequest
from replicas.kv.records import TransferPlan
from replicas.model.kv_format import KV_FORMATS, kv_format

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
KV_CACHE_DTYPES = ("auto", *KV_FORMATS)


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """Constants of one accelerator + model pair, in seconds, bytes and bytes per second.

    ``kv_bytes_per_token`` counts K and V of one token in the engine dtype ``dtype``.
    ``kv_cache_dtype`` is the KV dtype simulated (``auto``: the engine dtype, as the engine's
    option); another one recounts the same rows of ``kv_head_dim`` values (one token, one KV
    head, K or V) in the engine's KV format (``replicas.model.kv_format``), scales included.
    """

    name: str
    kv_bytes_per_token: int
    npu_kv_memory_bytes: int
    max_model_len: int  # the model's context, in trace tokens: longer requests are skipped
    step_fixed_s: float
    prefill_per_token_s: float
    prefill_per_token_context_s: float
    decode_per_seq_s: float
    decode_per_context_token_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    transfer_latency_s: float
    stores_overlap_compute: bool
    # Device copies, bytes read + written: an overlapped store's gather on the device, which the
    # next forward pass waits for (0: not charged).
    device_copy_bytes_per_s: float = 0.0
    disk_read_bytes_per_s: float = 0.0  # the disk tier (0: the profile models none)
    disk_latency_s: float = 0.0  # per batch of reads
    dtype: str = ""  # the engine dtype kv_bytes_per_token counts in ("": only auto KV)
    kv_head_dim: int = 0  # elements of one KV row (0: only auto KV)
    kv_cache_dtype: str = "auto"
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict)
    fit: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _ = self.kv_cache_bytes_per_token  # a KV dtype the profile cannot count fails at once

    @property
    def kv_cache_bytes_per_token(self) -> int:
        """K and V of one token as the simulated engine stores them, in ``kv_cache_dtype``."""
        if self.kv_cache_dtype in ("auto", self.dtype):
            return self.kv_bytes_per_token
        if not self.dtype or self.kv_head_dim <= 0:
            raise ValueError(
                f"hardware profile {self.name} needs dtype and kv_head_dim to simulate "
                f"kv_cache_dtype {self.kv_cache_dtype}"
            )
        engine = kv_format("auto", torch_dtype(self.dtype))
        num_rows = self.kv_bytes_per_token // engine.row_bytes(self.kv_head_dim)
        stored = kv_format(self.kv_cache_dtype, engine.storage_dtype)
        return num_rows * stored.row_bytes(self.kv_head_dim)

    def with_kv_cache_dtype(self, kv_cache_dtype: str) -> "HardwareProfile":
        """This profile simulating ``kv_cache_dtype`` (``auto``: its engine dtype)."""
        return replace(self, kv_cache_dtype=kv_cache_dtype)

    @classmethod
    def load(cls, name_or_path: str | Path) -> "HardwareProfile":
        """A shipped profile by name (``h200-llama8b``) or a JSON file by path."""
        path = Path(name_or_path)
        if not path.suffix:
            path = PROFILES_DIR / f"{name_or_path}.json"
        if not path.is_file():
            shipped = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
            raise ValueError(f"--hardware {name_or_path}: no such profile (shipped: {shipped})")
        data = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown profile keys {sorted(unknown)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


class CostModel:
    """Step time of a scheduled batch and its transfer plan under one ``HardwareProfile``."""

    def __init__(self, profile: HardwareProfile, block_size: int, token_scale: float) -> None:
        if token_scale <= 0:
            raise ValueError(f"token_scale must be positive, got {token_scale}")
        self.profile = profile
        self.block_size = block_size
        self.token_scale = token_scale
        self.block_bytes = profile.kv_cache_bytes_per_token * block_size * token_scale

    def num_npu_blocks(self) -> int:
        """Simulated NPU blocks that fit in the profile's KV memory."""
        return int(self.profile.npu_kv_memory_bytes // self.block_bytes)

    def prefill_s(self, num_tokens: float, num_context_tokens: float) -> float:
        """One prefill chunk of ``num_tokens`` after ``num_context_tokens`` (trace tokens)."""
        p = self.profile
        attention = num_tokens * (num_context_tokens + num_tokens / 2)
        return p.prefill_per_token_s * num_tokens + p.prefill_per_token_context_s * attention

    def decode_s(self, num_seqs: int, num_context_tokens: float) -> float:
        """One decode step's variable part for ``num_seqs`` sequences (trace tokens)."""
        p = self.profile
        return p.decode_per_seq_s * num_seqs + p.decode_per_context_token_s * num_context_tokens

    def load_s(self, num_blocks: int) -> float:
        if not num_blocks:
            return 0.0
        p = self.profile
        return p.transfer_latency_s + num_blocks * self.block_bytes / p.h2d_bytes_per_s

    def disk_load_s(self, num_blocks: int) -> float:
        """Reading ``num_blocks`` from the disk tier into host blocks (one batch)."""
        if not num_blocks:
            return 0.0
        p = self.profile
        if p.disk_read_bytes_per_s <= 0:
            raise ValueError(f"hardware profile {p.name} has no disk_read_bytes_per_s")
        return p.disk_latency_s + num_blocks * self.block_bytes / p.disk_read_bytes_per_s

    def store_s(self, num_blocks: int) -> float:
        """What the step waits for of ``num_blocks`` stores: the bus copy, or where stores
        overlap compute only their gather into device staging (``replicas.kv.stream_copier``)."""
        p = self.profile
        if not num_blocks:
            return 0.0
        if p.stores_overlap_compute:
            if p.device_copy_bytes_per_s <= 0:
                return 0.0
            return 2 * num_blocks * self.block_bytes / p.device_copy_bytes_per_s
        return p.transfer_latency_s + num_blocks * self.block_bytes / p.d2h_bytes_per_s

    def transfer_s(self, plan: TransferPlan) -> float:
        """The copies a step's forward pass waits for: stores (unless they overlap compute)
        and every load, prefetch loads included (the engine waits for the whole plan)."""
        return self.load_s(len(plan.loads)) + self.store_s(len(plan.stores))

    def step_timing(
        self, scheduled: Sequence[ScheduledRequest], plan: TransferPlan
    ) -> "StepTiming":
        """Timing of one step; read before the step's bookkeeping (``num_computed_tokens`` is
        the context each scheduled request starts from)."""
        s = self.token_scale
        prefill = 0.0
        num_decodes = 0
        decode_context = 0
        for item in scheduled:
            request, num_new = item.request, item.num_new_tokens
            context = request.num_computed_tokens
            is_decode = (
                num_new == 1 and request.num_output_tokens and context == request.num_tokens - 1
            )
            if is_decode:
                num_decodes += 1
                decode_context += context
            else:
                prefill += self.prefill_s(num_new * s, context * s)
        fixed = self.profile.step_fixed_s
        decode = self.decode_s(num_decodes, decode_context * s) if num_decodes else 0.0
        first = fixed + prefill + decode + self.transfer_s(plan)
        sub_step = fixed + decode if num_decodes else 0.0
        tail = (s - 1) * sub_step
        return StepTiming(first, sub_step, tail)


class StepTiming(NamedTuple):
    first_s: float
    """Until the step's prefill chunks are done: when their first tokens exist."""
    sub_step_s: float
    """One real decode step of the batch (0 without decodes): where the tail may be cut."""
    tail_s: float
    """The remaining decode sub-steps of the simulated step."""

    @property
    def total_s(self) -> float:
        return self.first_s + self.tail_s
