"""Loads models of the registered architectures from GGUF files (llama.cpp's format).

A GGUF file holds the hyper-parameters and the tokenizer as metadata under llama.cpp's key
names, and the weights as (often quantized) tensors. ``read_gguf_info`` turns the metadata into
``ModelArgs`` and an ``HFTokenizer`` that tokenizes as llama.cpp does; the tensors are read
and dequantized by ``replicas.model.gguf_weights`` (whose names this module re-exports).

Two conventions differ from Hugging Face checkpoints:

* ggml lists a tensor's dimensions innermost first; the reader's arrays are already in row-major
  order, so ``[in, out]`` in the file is our ``[out, in]`` Linear weight.
* llama.cpp's converter interleaves the two rotary halves of every head of Llama's q and k
  projections (its rope rotates adjacent pairs); we rotate halves, so the rows are put back for
  architectures registered with ``gguf_interleaved_rotary``. Qwen2 and Qwen3 files are written
  in the halves layout and are not touched.

What an architecture implies beyond the shared keys (Qwen2's biases, Qwen3's q/k norms) is
applied by its registry entry's ``gguf_args``.
"""

import functools
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replicas.model.config import ModelArgs
from replicas.model.gguf_file import GGUFFile
from replicas.model.gguf_weights import GGUF_TENSOR_TYPES as GGUF_TENSOR_TYPES
from replicas.model.gguf_weights import GGUFWeights as GGUFWeights
from replicas.model.gguf_weights import _dequantize
from replicas.model.gguf_weights import gguf_int4_groups as gguf_int4_groups
from replicas.model.gguf_weights import gguf_weight_bits as gguf_weight_bits
from replicas.model.gguf_weights import int4_groups_of_tensor as int4_groups_of_tensor
from replicas.model.gguf_weights import load_gguf_weights as load_gguf_weights
from replicas.model.gguf_weights import permute_rotary as permute_rotary
from replicas.model.gguf_weights import unpermute_rotary as unpermute_rotary
from replicas.model.registry import Architecture, architectures
from replicas.model.tokenizer import HFTokenizer
from replicas.model.transformer import rope_inv_freq

logger = logging.getLogger(__name__)

_MAGIC = b"GGUF"

# llama.cpp's token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4

# Pre-tokenizer split patterns, applied one after the other as llama.cpp applies them
# (llama-vocab.cpp), each isolating its matches from the text between them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        (_LLAMA3,),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2"), (_QWEN2,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        (r"\p{N}", _GPT2),
    ),
    **dict.fromkeys(
        ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "mpt", "olmo", "jais", "exaone4"),
        (_GPT2,),
    ),
    **dict.fromkeys(("gpt-4o", "llama4"), (_GPT4O,)),
}
# Pre-tokenizers whose vocabulary is looked up whole before merging, and that add BOS unless
# the file says otherwise.
_IGNORE_MERGES = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1"))
_IGNORE_MERGES |= {"pixtral", "midm-2.0", "lfm2"}
_ADD_BOS = _IGNORE_MERGES
# Tokens that end generation, recognised by their text as llama.cpp does; they are control
# tokens whatever their type in the file.
_END_OF_GENERATION = frozenset(
    (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "<|end_of_text|>",
    )
)


def is_gguf_file(path: str | Path) -> bool:
    """Whether ``path`` is a file named ``*.gguf`` or starting with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with path.open("rb") as f:
        return f.read(4) == _MAGIC


def open_gguf(path: str | Path) -> GGUFFile:
    """The header of GGUF file ``path`` (``replicas.model.gguf_file``; memory-mapped, tensors
    are read when used). A process reads a model's info more than once (the config's capacity
    plan, the deployment, the engine), so the headers of the last few files are kept, keyed by
    path, size and modification time."""
    path = Path(path).resolve()
    stat = path.stat()
    return _open_gguf(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (ValueError, OSError) as error:
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from error


def read_gguf_info(path: str | Path, name: str = "") -> tuple[ModelArgs, HFTokenizer]:
    """The model's architecture and tokenizer from the metadata of GGUF file ``path``."""
    return gguf_model_info(open_gguf(path), name or str(path))


def gguf_model_info(reader: Any, name: str) -> tuple[ModelArgs, HFTokenizer]:
    """``ModelArgs`` and tokenizer of an open GGUF file; ``name`` becomes ``ModelArgs.name``."""
    metadata = GGUFMetadata(reader)
    args = gguf_model_args(reader, name, metadata)
    return args, gguf_tokenizer(reader, args.eos_token_ids, metadata)


def gguf_architecture(gguf_name: str) -> Architecture:
    """The registered architecture whose GGUF files say ``general.architecture = gguf_name``;
    raises ValueError naming it and the supported ones."""
    by_name = {a.gguf_name: a for a in architectures() if a.gguf_name}
    if gguf_name not in by_name:
        raise ValueError(
            f"unsupported GGUF architecture '{gguf_name}'; Strata supports: "
            + ", ".join(sorted(by_name))
        )
    return by_name[gguf_name]


def gguf_model_args(reader: Any, name: str, metadata: "GGUFMetadata | None" = None) -> ModelArgs:
    """Reads the ``{architecture}.*`` and ``tokenizer.ggml.*`` hyper-parameters."""
    meta = metadata or GGUFMetadata(reader)
    arch = meta.get("general.architecture", "<none>")
    architecture = gguf_architecture(arch)
    names = architecture.gguf_tensor_names
    if meta.get(f"{arch}.expert_count", 0):
        raise ValueError(f"unsupported GGUF model: {arch} with mixture-of-experts layers")

    def key(suffix: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{suffix}", default)
        if value is None:
            raise ValueError(f"GGUF metadata has no {arch}.{suffix}")
        return value

    hidden_size = key("embedding_length")
    num_layers = key("block_count")
    num_heads, num_kv_heads, head_dim = _attention_dims(key, hidden_size)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens else key("vocab_size")
    max_positions = key("context_length", 4096)
    rope_theta = float(key("rope.freq_base", 10000.0))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" and meta.get(f"{arch}.rope.scaling.factor", 1.0) != 1.0:
        raise ValueError(
            f"unsupported GGUF rope scaling '{scaling}'; Strata supports none and llama3 "
            "(rope_freqs)"
        )
    rope_scaling = None
    if _has_tensor(reader, "rope_freqs.weight"):
        rope_scaling = _llama3_scaling(reader, head_dim, rope_theta, max_positions)
    args = ModelArgs(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=_same_per_layer(key("feed_forward_length"), "feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=not _has_tensor(reader, names.tensor_name("output.weight")),
        attention_bias=_has_tensor(reader, names.tensor_name("layers.0.attention.wq.bias")),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_token_ids(meta, tokens or []),
        name=name,
        architecture=architecture.name,
    )
    return architecture.gguf_args(args, meta)


def _attention_dims(key: Callable[..., Any], hidden_size: int) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, head_dim)``; keys, values and rotary dimensions must agree."""
    num_heads = _same_per_layer(key("attention.head_count"), "attention.head_count")
    num_kv_heads = _same_per_layer(
        key("attention.head_count_kv", num_heads), "attention.head_count_kv"
    )
    head_dim = key("attention.key_length", hidden_size // num_heads)
    value_dim = key("attention.value_length", head_dim)
    rope_dim = key("rope.dimension_count", head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise ValueError(
            f"unsupported GGUF attention: key length {head_dim}, value length {value_dim}, "
            f"rotary dimensions {rope_dim}; Strata needs all three equal"
        )
    return num_heads, num_kv_heads, head_dim


def _eos_token_ids(meta: "GGUFMetadata", tokens: list[str]) -> tuple[int, ...]:
    """The end-of-sequence, end-of-turn and end-of-message ids, and every token whose text
    llama.cpp ends generation on whatever type the file gives it."""
    eos_ids = [
        meta.get(f"tokenizer.ggml.{k}_token_id")
        for k in ("eos", "eot", "eom")
        if meta.get(f"tokenizer.ggml.{k}_token_id") is not None
    ]
    eos_ids += [i for i, text in enumerate(tokens) if text in _END_OF_GENERATION]
    return tuple(dict.fromkeys(eos_ids))


def _same_per_layer(value: Any, what: str) -> int:
    """llama.cpp allows some sizes per layer; Strata needs one for all layers."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"unsupported GGUF model: {what} varies across layers ({value})")
        return value[0]
    return value


def _llama3_scaling(
    reader: Any, head_dim: int, rope_theta: float, max_positions: int
) -> dict[str, Any] | None:
    """The llama3 ``rope_scaling`` whose frequency divisors are the file's ``rope_freqs``.

    llama.cpp's converter stores Llama 3.1's long-context scaling as one divisor per rotary
    frequency: 1 for short wavelengths, ``factor`` for long ones and a smooth blend between. The
    blend is linear in 1/wavelength, which pins the band; it is described here with
    ``low_freq_factor=1``. The result is checked against the divisors before it is used.
    """
    tensor = _find_tensor(reader, "rope_freqs.weight")
    divisors = torch.from_numpy(_dequantize(tensor, tensor.data)).double().flatten()
    base = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if divisors.shape != base.shape:
        raise ValueError(f"GGUF rope_freqs has {divisors.numel()} entries, expected {base.numel()}")
    factor = float(divisors.max())
    if factor <= 1.0 + 1e-6:
        return None
    # The blend of 1/divisor between 1/factor (long wavelengths) and 1 (short ones) is
    # a * x + b in x = 1/wavelength, 0 at the band's low edge and 1 at its high edge.
    x = (base / (2 * math.pi)).numpy()
    blend = ((1 / divisors - 1 / factor) / (1 - 1 / factor)).numpy()
    slope, intercept = _blend_line(x, blend)
    if intercept >= 0 or slope <= 0:
        raise ValueError("GGUF rope_freqs does not describe llama3 rope scaling")
    # With low_freq_factor 1: blend = (old_context * x - 1) / (high_freq_factor - 1).
    high_freq_factor = 1 - 1 / intercept
    old_context = -slope / intercept
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": float(high_freq_factor),
        "original_max_position_embeddings": float(old_context),
    }
    probe = ModelArgs(
        vocab_size=1,
        hidden_size=head_dim,
        intermediate_size=1,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=scaling,
        max_position_embeddings=max_positions,
    )
    ours = rope_inv_freq(probe).double()
    if not torch.allclose(ours, base / divisors, rtol=1e-4, atol=0):
        raise ValueError("GGUF rope_freqs does not describe llama3 rope scaling")
    return scaling


def _blend_line(x: np.ndarray, blend: np.ndarray) -> tuple[float, float]:
    """``(slope, intercept)`` of the blend as a line in ``x``: fitted through the band's
    frequencies, or, with fewer than two inside it, a line that ends in the gaps around it."""
    medium = (blend > 1e-4) & (blend < 1 - 1e-4)
    long, short = x[blend <= 1e-4], x[blend >= 1 - 1e-4]
    below = float(long.max()) if len(long) else 0.0  # the band starts above this x
    above = float(short.min()) if len(short) else math.inf  # and ends below this one
    if medium.sum() >= 2:
        slope, intercept = (float(v) for v in np.polyfit(x[medium], blend[medium], 1))
    elif medium.sum() == 1:  # any line through the point, steep enough to end in the gaps
        x_m, s_m = float(x[medium][0]), float(blend[medium][0])
        slope = 2 * max(s_m / (x_m - below), (1 - s_m) / (above - x_m))
        intercept = s_m - slope * x_m
    else:  # the band falls between two frequencies
        top = above if math.isfinite(above) else 2 * below + 1
        low_edge, high_edge = below + (top - below) / 3, below + 2 * (top - below) / 3
        slope = 1 / (high_edge - low_edge)
        intercept = -slope * low_edge
    return slope, intercept


class GGUFMetadata:
    """The key-value metadata of an open GGUF file (``GGUFFile.values``)."""

    def __init__(self, reader: GGUFFile) -> None:
        self._values = reader.values

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)


# ---- tokenizer ---------------------------------------------------------------------------------


def gguf_tokenizer(
    reader: Any, eos_token_ids: tuple[int, ...] = (), metadata: "GGUFMetadata | None" = None
) -> HFTokenizer:
    """The tokenizer of the ``tokenizer.ggml.*`` metadata, tokenizing as llama.cpp does.

    Byte-level BPE (``tokenizer.ggml.model == "gpt2"``) only: the vocabulary and merges of the
    file, the split patterns llama.cpp uses for ``tokenizer.ggml.pre``, control and
    user-defined tokens matched whole (control ones left out when decoding), and the chat
    template of ``tokenizer.chat_template``.
    """
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    meta = metadata or GGUFMetadata(reader)
    model = meta.get("tokenizer.ggml.model", "<none>")
    if model != "gpt2":
        kind = " (SentencePiece)" if model == "llama" else ""
        raise ValueError(
            f"unsupported GGUF tokenizer model '{model}'{kind}; Strata reads byte-level BPE "
            "tokenizers (tokenizer.ggml.model 'gpt2')"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    merges = [_split_merge(m) for m in meta.get("tokenizer.ggml.merges") or []]
    pre = meta.get("tokenizer.ggml.pre") or "default"
    patterns = _split_patterns(pre)
    vocab = {text: i for i, text in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES)
    tokenizer = RustTokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    special, user_defined = _added_tokens(tokens, types)
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user_defined)

    def token_text(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    return HFTokenizer.from_tokenizer(
        tokenizer,
        bos_token=token_text("bos"),
        eos_token=token_text("eos"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", pre in _ADD_BOS)),
        eos_token_ids=eos_token_ids,
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _split_patterns(pre: str) -> tuple[str, ...]:
    """The split patterns llama.cpp uses for the ``tokenizer.ggml.pre`` name; GPT-2's, with a
    warning, for a name Strata does not know."""
    patterns = _PRE_TOKENIZERS.get(pre)
    if patterns is None:
        logger.warning(
            "GGUF pre-tokenizer '%s' is not one Strata knows; splitting text with GPT-2's "
            "pattern, which may tokenize differently from llama.cpp",
            pre,
        )
        patterns = (_GPT2,)
    return patterns


def _added_tokens(tokens: list[str], types: list[int]) -> tuple[list[Any], list[Any]]:
    """``(special, user_defined)`` tokens matched whole: control and unknown tokens and the
    end-of-generation texts are special (left out when decoding)."""
    from tokenizers import AddedToken

    special, user_defined = [], []
    for text, kind in zip(tokens, types):
        if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN) or text in _END_OF_GENERATION:
            special.append(AddedToken(text, special=True, normalized=False))
        elif kind == TOKEN_USER_DEFINED:
            user_defined.append(AddedToken(text, special=False, normalized=False))
    return special, user_defined


def _split_merge(merge: str) -> tuple[str, str]:
    """A merge is two tokens joined by a space; the first may itself start with one."""
    at = merge.find(" ", 1)
    if at < 0:
        raise ValueError(f"malformed GGUF merge {merge!r}")
    return merge[:at], merge[at + 1 :]


def _find_tensor(reader: Any, name: str) -> Any:
    return next((t for t in reader.tensors if t.name == name), None)


def _has_tensor(reader: Any, name: str) -> bool:
    return _find_tensor(reader, name) is not None
