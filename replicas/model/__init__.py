"""The model of one replica: config, architecture registry, transformer over the block KV cache,
tokenizers, loading."""

from replicas.model.batch import ForwardBatch
from replicas.model.builtin import BUILTIN_MODELS
from replicas.model.config import KVCacheSpec, ModelArgs
from replicas.model.loader import LoadedModel, load_model, load_model_info
from replicas.model.registry import Architecture, register_architecture
from replicas.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from replicas.model.transformer import Transformer

__all__ = [
    "BUILTIN_MODELS",
    "Architecture",
    "ByteTokenizer",
    "ForwardBatch",
    "HFTokenizer",
    "KVCacheSpec",
    "LoadedModel",
    "ModelArgs",
    "Tokenizer",
    "Transformer",
    "load_model",
    "load_model_info",
    "register_architecture",
]
