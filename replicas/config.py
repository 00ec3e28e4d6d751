"""Configuration of one replica: pydantic models validated at start-up, before anything runs.

Each rule names the option it checks, so a bad configuration fails with one sentence that says
what to change. ``cluster.config.ClusterConfig`` composes these models.
"""

import math
import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from replicas import dtypes
from replicas.dtypes import DTYPE_CHOICES, torch_dtype
from replicas.kv.free_block_queue import DECAY, RETAINED_PRIORITIES
from replicas.kv.retention import policy_names
from replicas.kv.tiers import BackingOptions, parse_options
from replicas.model.kv_format import KV_FORMATS
from replicas.model.native_stack import DECODER_STACKS
from replicas.model.quant import INT4_KERNELS, QUANTIZATIONS
from replicas.prefix_cache_config import PrefixCacheConfig

HOST_GB_OPTION = "--experimental-kv-offload-host-memory-gb"
HOST_RATIO_OPTION = "--experimental-kv-offload-host-memory-ratio"
WRITE_THROUGH_OPTION = "--experimental-kv-offload-write-through-threshold"
WRITE_BACK_OPTION = "--experimental-kv-offload-write-back"
RETENTION_OPTION = "--experimental-kv-offload-retention"
RETAINED_SHARE_OPTION = "--experimental-kv-offload-retained-share"
DISK_PATH_OPTION = "--experimental-kv-offload-disk-path"
DISK_GB_OPTION = "--experimental-kv-offload-disk-gb"
SPECULATIVE_NGRAM_OPTION = "--speculative-ngram"
KV_FRACTION_OPTION = "--npu-kv-memory-fraction"

GPU_KV_MEMORY_FRACTION = 0.9
"""``npu_kv_memory_fraction``'s default on CUDA: the rest is headroom for what the activation
reserve does not count (the allocator's fragmentation, CUDA graphs, kernels' workspaces)."""
CPU_KV_MEMORY_FRACTION = 0.5
"""``npu_kv_memory_fraction``'s default on a CPU, whose RAM also holds the process itself, the
tokenizer, the autotuner's candidates while they are timed and every other program."""

IMMEDIATE_PROMOTION = "immediate"
"""The ``write_through_threshold`` that copies every block to host when it is first written."""

# An option whose values name registered things takes them from the registry: a Literal built
# from it lists them in the JSON schema and the CLI's help, and pydantic's error names the option
# and the values in one sentence. A retention policy registered after this import is reached
# through KVCacheManager, not the config.
RetentionPolicyName = Literal[policy_names()]
KVCacheDtypeName = Literal[("auto", *KV_FORMATS)]
QuantizationName = Literal[("auto", *QUANTIZATIONS)]
DecoderStackName = Literal[DECODER_STACKS]
Int4KernelName = Literal[INT4_KERNELS]


def __getattr__(name: str) -> object:
    """``TORCH_DTYPES`` and ``dtype_name_of``, which are ``replicas.dtypes``' now: still read
    here, with a ``DeprecationWarning``, until the next release."""
    if name in ("TORCH_DTYPES", "dtype_name_of"):
        warnings.warn(
            f"replicas.config.{name} is deprecated; import it from replicas.dtypes",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(dtypes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def planning_dtype(name: str) -> str:
    """The dtype that sizes KV memory before a replica has resolved ``auto``: the widest
    candidate (float32), so that a byte budget's checks hold whatever the replica chooses."""
    return "float32" if name == "auto" else name


def check_one_host_capacity(
    has_bytes: bool, has_ratio: bool, bytes_option: str, ratio_option: str
) -> None:
    """The host tier is sized by a byte budget or by a ratio, never by both."""
    if has_bytes and has_ratio:
        raise ValueError(
            f"{bytes_option} and {ratio_option} are mutually exclusive; set only one of them"
        )


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class KVOffloadConfig(_Config):
    """The host-memory (L2) tier of the prefix cache. Off unless ``enabled=True`` and one capacity
    is given: a positive byte budget, or a positive ratio (a ratio of 0 means no ratio); see
    DESIGN section 5 for the exact capacity rules.

    Capacity or write options that cannot take effect warn (``UserWarning``) and leave the tier
    off: a capacity without ``enabled=True``, write-back or a write-through threshold without a
    capacity."""

    enabled: bool = Field(False, description="Turn the host tier on (must be explicit).")
    host_memory_bytes: int | None = Field(
        None,
        description="Host KV budget in bytes for the whole deployment, divided equally among "
        "the replicas; positive when set, exclusive with host_memory_ratio.",
    )
    host_memory_ratio: float = Field(
        0.0,
        description="Host blocks per NPU block, per replica and cache type (floor); 0: no ratio. "
        "Exclusive with host_memory_bytes.",
    )
    write_through_threshold: int | Literal["immediate"] = Field(
        2,
        description="Copy an NPU block to host when its hits (later requests matching it) reach "
        "this many; 0 disables write-through; 'immediate' copies every block when it is first "
        "written.",
    )
    write_back: bool = Field(
        False, description="Copy NPU-only cached blocks to host when NPU pressure evicts them."
    )
    tuning_hint_interval_s: float | None = Field(
        300.0,
        gt=0,
        description="Seconds between two tuning-hint lines in each replica's log (the host hit "
        "rate at other capacities and with write-back, and the tuning step the traffic "
        "supports); None: no hints.",
    )
    retention: RetentionPolicyName = Field(
        "fixed",
        description="fixed: write-through promotion and write-back as set; adaptive: every "
        "store made when the NPU tier evicts a block: one that reached the write-through "
        "threshold is stored then, any other when the reuse observed for its kind pays for the "
        "copy (exclusive with write_back).",
    )
    miss_ratio_curve_sample_rate: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Share of block hashes (0 < rate <= 1) the miss-ratio curve's ghost records "
        "and shadow host tiers track, per cache type (spatial sampling; the tuning hint and the "
        "host hit rate estimates read the curve); 1.0: exact shadows, every hash (up to 17.5x "
        "the host capacity in hashes); None: about 1% of the host capacity in hashes, with at "
        "least 1024 sampled blocks in the 1x shadow (every hash below 1024 host blocks).",
    )
    disk_path: str | None = Field(
        None,
        description="Directory of the disk KV tier behind the host tier: blocks leave host for "
        "it by the host tier's rules, survive restarts and are read by every replica of the "
        "node; needs disk_bytes. None: no disk tier.",
    )
    disk_bytes: int | None = Field(
        None,
        description="Disk KV budget in bytes for the whole deployment, divided equally among "
        "the replicas; positive, and set exactly when disk_path is.",
    )
    tiers: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Tiers behind the host tier besides disk, by registered name "
        "(replicas.kv.tiers), each with its options: bytes (its budget for the whole "
        "deployment, divided equally among the replicas) and the tier's own; they need the "
        "host tier. The disk tier takes disk_path and disk_bytes.",
    )
    retained_share: float = Field(
        0.25,
        description="Share (0 to 1) of each host and disk tier that prefixes retained by the "
        "API's prompt-cache lifetimes (prompt_cache_options.ttl, prompt_cache_retention, "
        "prompt_cache_breakpoint) may hold ahead of ordinary blocks; 0 retains nothing.",
    )
    retained_priority: str = Field(
        DECAY,
        description="How retained host and disk blocks are ordered in eviction: decay, a "
        "priority that decays over the block's lifetime (just released, behind every ordinary "
        "block; at its deadline, an ordinary block at its release time), or pin, behind every "
        "ordinary block until its deadline.",
    )

    @field_validator("write_through_threshold", mode="before")
    @classmethod
    def _none_is_off(cls, value: object) -> object:
        """``None``, the Python API's former spelling of "off", reads as 0."""
        return 0 if value is None else value

    @model_validator(mode="after")
    def _check(self) -> "KVOffloadConfig":
        self._check_values()
        self._check_disk()
        self.backing_options()  # each tier's options, checked by the tier
        self._check_capacity()
        self._warn_without_capacity()
        return self

    @property
    def _has_capacity(self) -> bool:
        return self.host_memory_bytes is not None or self.host_memory_ratio > 0

    def _check_values(self) -> None:
        """Each host-tier value on its own, and the one pair of policies that excludes itself."""
        if not (math.isfinite(self.retained_share) and 0.0 <= self.retained_share <= 1.0):
            raise ValueError(
                f"kv_offload_config.retained_share ({RETAINED_SHARE_OPTION}) must be a number "
                f"from 0 to 1, got {self.retained_share}"
            )
        if self.retained_priority not in RETAINED_PRIORITIES:
            raise ValueError(
                f"kv_offload_config.retained_priority must be {' or '.join(RETAINED_PRIORITIES)}, "
                f"got {self.retained_priority!r}"
            )
        num_bytes = self.host_memory_bytes
        if num_bytes is not None and num_bytes <= 0:
            raise ValueError(
                f"kv_offload_config.host_memory_bytes ({HOST_GB_OPTION}) must be positive, got "
                f"{num_bytes} bytes ({num_bytes / 2**30:g} GiB); leave it unset for no byte budget"
            )
        if self.host_memory_ratio < 0:
            raise ValueError(
                f"kv_offload_config.host_memory_ratio ({HOST_RATIO_OPTION}) must be non-negative "
                f"(0: no ratio), got {self.host_memory_ratio}"
            )
        threshold = self.write_through_threshold
        if threshold != IMMEDIATE_PROMOTION and threshold < 0:
            raise ValueError(
                f"kv_offload_config.write_through_threshold ({WRITE_THROUGH_OPTION}) must be "
                f">= 0 (0 disables) or '{IMMEDIATE_PROMOTION}', got {threshold}"
            )
        if self.retention == "adaptive" and self.write_back:
            raise ValueError(
                f"kv_offload_config.retention='adaptive' ({RETENTION_OPTION} adaptive) decides "
                f"write-back per block; it cannot be combined with write_back ({WRITE_BACK_OPTION})"
            )

    def _check_disk(self) -> None:
        """The disk tier: a positive budget and a non-empty path, given together."""
        if self.disk_bytes is not None and self.disk_bytes <= 0:
            raise ValueError(
                f"kv_offload_config.disk_bytes ({DISK_GB_OPTION}) must be positive, got "
                f"{self.disk_bytes} bytes"
            )
        if (self.disk_path is None) != (self.disk_bytes is None):
            given, missing = (
                (f"disk_path ({DISK_PATH_OPTION})", f"disk_bytes ({DISK_GB_OPTION})")
                if self.disk_bytes is None
                else (f"disk_bytes ({DISK_GB_OPTION})", f"disk_path ({DISK_PATH_OPTION})")
            )
            raise ValueError(f"kv_offload_config.{given} needs {missing} too")
        if self.disk_path is not None and not self.disk_path.strip():
            raise ValueError(f"kv_offload_config.disk_path ({DISK_PATH_OPTION}) is empty")

    def _check_capacity(self) -> None:
        """One host capacity, given exactly when the tier is on; the disk tier needs it."""
        check_one_host_capacity(
            self.host_memory_bytes is not None,
            self.host_memory_ratio > 0,
            f"kv_offload_config.host_memory_bytes ({HOST_GB_OPTION})",
            f"kv_offload_config.host_memory_ratio ({HOST_RATIO_OPTION})",
        )
        behind = [f"disk_path ({DISK_PATH_OPTION})"] if self.disk_path is not None else []
        behind += [f"tiers[{name!r}]" for name in self.tiers]
        if behind and not (self.enabled and self._has_capacity):
            raise ValueError(
                f"kv_offload_config.{behind[0]} needs the host tier: its blocks load through "
                f"it; set enabled=True and {HOST_GB_OPTION} or {HOST_RATIO_OPTION}"
            )
        if self.enabled and not self._has_capacity:
            raise ValueError(
                "kv_offload_config.enabled=True needs a positive host_memory_bytes or "
                "host_memory_ratio"
            )
        if not self.enabled and self._has_capacity:
            warnings.warn(
                "kv_offload_config sets a host capacity but enabled=False: the host KV tier "
                "stays off; pass enabled=True to turn it on",
                UserWarning,
                stacklevel=3,
            )

    def _warn_without_capacity(self) -> None:
        """Write options given without a host capacity cannot take effect: say so."""
        ignored = []
        if self.retention == "adaptive":
            ignored.append(f"retention='adaptive' ({RETENTION_OPTION})")
        if self.write_back:
            ignored.append(f"write_back ({WRITE_BACK_OPTION})")
        if self.write_through_threshold != 0 and (
            "write_through_threshold" in self.model_fields_set
        ):
            ignored.append(f"write_through_threshold ({WRITE_THROUGH_OPTION})")
        if ignored and not self._has_capacity:
            warnings.warn(
                f"kv_offload_config sets {' and '.join(ignored)} but no host capacity "
                f"({HOST_GB_OPTION} or {HOST_RATIO_OPTION}): the host KV tier stays off and "
                f"{'they have' if len(ignored) > 1 else 'it has'} no effect",
                UserWarning,
                stacklevel=3,
            )

    @property
    def promotion_threshold(self) -> int | None:
        """Deprecated: ``write_through_threshold`` in the cache manager's former spelling (None
        off, 0 at first write); the manager now takes ``write_through_threshold`` as it is."""
        warnings.warn(
            "KVOffloadConfig.promotion_threshold is deprecated: the cache manager and the "
            "simulator take write_through_threshold as written (0 off, 'immediate')",
            DeprecationWarning,
            stacklevel=2,
        )
        threshold = self.write_through_threshold
        return 0 if threshold == IMMEDIATE_PROMOTION else threshold or None

    @property
    def is_active(self) -> bool:
        return self.enabled and self._has_capacity

    @property
    def has_disk(self) -> bool:
        return self.is_active and self.disk_path is not None

    def backing_options(self) -> "dict[str, BackingOptions]":
        """The options of every tier behind host that is on, by name, disk first (checked by
        each tier: ``replicas.kv.tiers.parse_options``)."""
        if "disk" in self.tiers:
            raise ValueError(
                f"kv_offload_config.tiers names 'disk'; set disk_path ({DISK_PATH_OPTION}) and "
                f"disk_bytes ({DISK_GB_OPTION}) instead"
            )
        options = {name: parse_options(name, given) for name, given in self.tiers.items()}
        if self.disk_path is not None:
            disk = {"path": self.disk_path, "bytes": self.disk_bytes}
            options = {"disk": parse_options("disk", disk), **options}
        return options if self.is_active else {}


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
    speculative_ngram: int = Field(
        0,
        ge=0,
        description="Draft tokens per decode step proposed by n-gram prompt lookup (the tokens "
        "that followed the last earlier occurrence of the sequence's last tokens) and verified "
        "in the same forward pass, for greedy requests without logprobs or logits processing; "
        "outputs are unchanged. 0 turns speculative decoding off.",
    )

    @model_validator(mode="after")
    def _check(self) -> "SchedulerConfig":
        if self.speculative_ngram >= self.max_num_batched_tokens:
            raise ValueError(
                f"speculative_ngram ({SPECULATIVE_NGRAM_OPTION}) must be below "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}): a step verifies a "
                "decode token and its drafts together"
            )
        if self.kv_offload_config.is_active and not self.prefix_cache_config.enabled:
            raise ValueError(
                "kv_offload_config (the host KV tier) needs prefix caching; it cannot be used "
                "with prefix_cache_config.enabled=False (--no-enable-prefix-caching)"
            )
        return self


class ReplicaModelConfig(_Config):
    """The model a replica runs, where, and its NPU KV memory; the deployment's ``model``
    section (``cluster.config.ModelConfig``) and ``EngineConfig`` share these fields."""

    model: str = Field(
        "tiny",
        description="Built-in name (tiny, tiny-hybrid, smollm2-135m), local Hugging Face "
        "directory, .gguf file or Hugging Face hub id (org/name).",
    )
    revision: str | None = Field(
        None, description="Hub branch, tag or commit of a hub id; None: the default branch."
    )
    seed: int = Field(0, description="Seed of built-in weights and of unseeded sampling.")
    dtype: str = Field(
        "auto",
        description=f"Weights and KV dtype: {DTYPE_CHOICES} or auto (the faster of "
        "float32 and bfloat16, measured on this machine at start-up; bfloat16 only where it "
        "is faster in prefill and decode both; float32 for the built-in test models).",
    )
    kv_cache_dtype: KVCacheDtypeName = Field(
        "auto",
        description="How K and V are stored in every tier (NPU, host, disk): auto (the engine "
        "dtype), float32, bfloat16, float16, or 8-bit with one float16 scale per token and KV "
        "head: int8 (symmetric) or fp8_e4m3; dequantized inside attention.",
    )
    quantization: QuantizationName = Field(
        "auto",
        description="How linear weights are kept: none (in dtype), int8 (per output channel), "
        "int4 (groups of 32; a GGUF file's Q4_0/Q4_1/Q4_K codes and scales as stored, its 5- "
        "to 8-bit tensors at int8) or auto (for a quantized GGUF file on a CPU, the fastest of "
        "none, int8 and int4 measured on this machine at start-up; else none).",
    )
    decoder_stack: DecoderStackName = Field(
        "auto",
        description="How the decoder layers run on a CPU: native (one C++ loop over the ops "
        "eager calls, without the Python interpreter in the step: the same outputs bitwise; "
        "compiled once per machine with the C++ compiler), eager (module by module in Python) "
        "or auto (each way timed with the dtype and quantization candidates at start-up, the "
        "faster kept; eager where native cannot run). Eager under torch_compile.",
    )
    int4_kernel: Int4KernelName = Field(
        "auto",
        description="The product of int4 weights (and of the int8 weights an int4 model "
        "keeps, such as a GGUF file's Q8_0 LM head) under the native decoder stack: strata "
        "(Strata's, in the native library: integer multiply-adds against activations "
        "quantized in two int8 passes, bitwise the same on every CPU path), torch (its packed "
        "kernel, bfloat16 activations) or auto (each timed with the candidates at start-up, "
        "the faster kept). The eager stack and torch_compile use torch's.",
    )
    torch_compile: bool = Field(
        False,
        description="Run the decoder stack through torch.compile (inductor; attention stays "
        "eager): fewer, fused ops per decode step for tens of seconds of compiling at start-up; "
        "the model runs eager where compiling fails. Off unless asked: measured by "
        "benchmarks engine-vs-llamacpp (--torch-compile), not by auto.",
    )
    device: str = Field(
        "auto", description="auto (cuda if available, else cpu), cpu, cuda or cuda:N."
    )
    cuda_graphs: bool = Field(
        True,
        description="On a GPU, replay decode steps as CUDA graphs captured at start-up, one "
        "per batch-size bucket (one launch a step); off: every kernel launched from Python.",
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    num_npu_blocks: int | None = Field(
        None,
        ge=1,
        description="KV blocks in the NPU tier per replica (of the global cache type); "
        "None: what npu_kv_memory_bytes holds.",
    )
    npu_kv_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="NPU KV memory per replica in bytes, used when num_npu_blocks is None; "
        "None: sized from the memory the device has left after the weights and one step's "
        "activations, times npu_kv_memory_fraction (replicas.kv.sizing).",
    )
    npu_kv_memory_fraction: float | None = Field(
        None,
        description="Share (above 0, at most 1) of the memory its device has left after the "
        f"weights and one step's activations that a replica's NPU KV pool takes, when neither "
        f"num_npu_blocks nor npu_kv_memory_bytes is set: of the GPU's free memory on CUDA, of "
        f"the RAM available to each of a node's replicas after the host tier on a CPU. None: "
        f"{GPU_KV_MEMORY_FRACTION} on CUDA, {CPU_KV_MEMORY_FRACTION} on a CPU.",
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="Most tokens (prompt plus output) of one request; None: the model's "
        "maximum positions, capped by what the NPU tier holds.",
    )

    @model_validator(mode="after")
    def _check_model(self) -> "ReplicaModelConfig":
        if self.dtype != "auto":
            torch_dtype(self.dtype)
        fraction = self.npu_kv_memory_fraction
        if fraction is not None and not (math.isfinite(fraction) and 0.0 < fraction <= 1.0):
            raise ValueError(
                f"npu_kv_memory_fraction ({KV_FRACTION_OPTION}) must be a number above 0 and at "
                f"most 1, got {fraction}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        return self


class EngineConfig(ReplicaModelConfig):
    """Everything one replica's engine needs: model, KV memory and scheduling."""

    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads of this engine's process; None keeps torch's."
    )
    scheduler_config: SchedulerConfig = Field(default_factory=SchedulerConfig)
