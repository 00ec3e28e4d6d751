"""Assembly of Strata: configuration, the offline ``LLM`` API and the command line."""

from cluster.llm import LLM
from replicas.config import KVOffloadConfig, PrefixCacheConfig, SchedulerConfig
from replicas.engine.structured_output import StructuredOutputs
from replicas.outputs import RequestOutput, TokenLogprob
from replicas.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "KVOffloadConfig",
    "PrefixCacheConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "StructuredOutputs",
    "TokenLogprob",
]
