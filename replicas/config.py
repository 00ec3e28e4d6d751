"""Configuration of one replica: pydantic models validated at start-up, before anything runs.

Each rule names the option it checks, so a bad configuration fails with one sentence that says
what to change. ``cluster.config.ClusterConfig`` composes these models.
"""

import warnings

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class PrefixCacheConfig(_Config):
    """Reuse of token-exact, full-block prompt prefixes across requests."""

    enabled: bool = Field(True, description="Reuse cached KV of matching prompt prefixes.")


class KVOffloadConfig(_Config):
    """The host-memory (L2) tier of the prefix cache. Off unless ``enabled=True`` and one capacity
    option is positive; see DESIGN section 5 for the exact capacity rules."""

    enabled: bool = Field(False, description="Turn the host tier on (must be explicit).")
    host_memory_bytes: int | None = Field(
        None,
        description="Process-wide host KV budget in bytes, divided equally among DP replicas.",
    )
    host_memory_ratio: float = Field(
        0.0, description="Host blocks per NPU block, per replica and cache type (floor)."
    )
    write_through_threshold: int | None = Field(
        2,
        description="Copy an NPU block to host when its hit count reaches this; None disables, "
        "0 copies at first write.",
    )
    write_back: bool = Field(
        False, description="Copy NPU-only cached blocks to host when NPU pressure evicts them."
    )

    @model_validator(mode="after")
    def _check(self) -> "KVOffloadConfig":
        if self.host_memory_bytes is not None and self.host_memory_bytes < 0:
            raise ValueError(
                f"kv_offload_config.host_memory_bytes must be non-negative, "
                f"got {self.host_memory_bytes}"
            )
        if self.host_memory_ratio < 0:
            raise ValueError(
                f"kv_offload_config.host_memory_ratio must be non-negative, "
                f"got {self.host_memory_ratio}"
            )
        if self.write_through_threshold is not None and self.write_through_threshold < 0:
            raise ValueError(
                "kv_offload_config.write_through_threshold must be >= 0 or None, "
                f"got {self.write_through_threshold}"
            )
        has_bytes = bool(self.host_memory_bytes)
        has_ratio = self.host_memory_ratio > 0
        if has_bytes and has_ratio:
            raise ValueError(
                "kv_offload_config.host_memory_bytes and kv_offload_config.host_memory_ratio are "
                "mutually exclusive; set only one of them"
            )
        if self.enabled and not (has_bytes or has_ratio):
            raise ValueError(
                "kv_offload_config.enabled=True needs a positive host_memory_bytes or "
                "host_memory_ratio"
            )
        if not self.enabled and (has_bytes or has_ratio):
            warnings.warn(
                "kv_offload_config sets a host capacity but enabled=False: the host KV tier "
                "stays off; pass enabled=True to turn it on",
                UserWarning,
                stacklevel=2,
            )
        return self

    @property
    def is_active(self) -> bool:
        return self.enabled and (bool(self.host_memory_bytes) or self.host_memory_ratio > 0)


class SchedulerConfig(_Config):
    """Batching limits and cache policy of one replica."""

    max_num_seqs: int = Field(64, ge=1, description="Most requests running at once.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Most tokens (prefill chunks plus decodes) in one engine step."
    )
    enable_chunked_prefill: bool = Field(
        True, description="Split prompts longer than the step's token budget over several steps."
    )
    prefix_cache_config: PrefixCacheConfig = Field(default_factory=PrefixCacheConfig)
    kv_offload_config: KVOffloadConfig = Field(default_factory=KVOffloadConfig)

    @model_validator(mode="after")
    def _check(self) -> "SchedulerConfig":
        if self.kv_offload_config.is_active and not self.prefix_cache_config.enabled:
            raise ValueError(
                "kv_offload_config (the host KV tier) needs prefix caching; it cannot be used "
                "with prefix_cache_config.enabled=False (--no-enable-prefix-caching)"
            )
        return self


class EngineConfig(_Config):
    """Everything one replica's engine needs: model, KV memory and scheduling."""

    model: str = Field(
        "tiny",
        description="Built-in name, local Hugging Face directory, .gguf file or hub id.",
    )
    revision: str | None = Field(None, description="Hub branch, tag or commit of a hub id.")
    seed: int = Field(0, description="Seed of built-in weights and of unseeded sampling.")
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    num_npu_blocks: int | None = Field(
        None, ge=1, description="KV blocks in the NPU tier; derived from npu_kv_memory_bytes."
    )
    npu_kv_memory_bytes: int = Field(
        256 * 2**20, ge=1, description="NPU KV memory used when num_npu_blocks is not given."
    )
    max_model_len: int | None = Field(
        None, ge=2, description="Most tokens (prompt plus output) of one request."
    )
    device: str = Field("auto", description="'auto' (cuda if available, else cpu), 'cpu', 'cuda'.")
    dtype: str = Field("float32", description="Weights and KV dtype: float32, bfloat16, float16.")
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads of this engine's process; None keeps torch's."
    )
    scheduler_config: SchedulerConfig = Field(default_factory=SchedulerConfig)

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        return self
