"""ModelArgs from Hugging Face config dicts, and the KV cache specs a model implies."""

import pytest
import torch

from replicas.model import KVCacheSpec, ModelArgs, Transformer
from replicas.model.hf import hf_model_args


def llama_dict(**overrides):
    d = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
    }
    return {**d, **overrides}


def test_llama_defaults_and_legacy_rope_layout():
    args = hf_model_args(llama_dict(), name="m")
    assert (args.head_dim, args.num_kv_heads) == (16, 4)
    assert args.rope_theta == 500000.0
    assert args.rope_type == "llama3" and args.rope_scaling["factor"] == 8.0
    assert args.eos_token_ids == (2, 3) and args.bos_token_id == 1
    assert args.layer_types == ("full", "full") and args.sliding_window is None
    assert not (args.tie_word_embeddings or args.attention_bias or args.qk_norm)
    assert args.name == "m" and args.architecture == "LlamaForCausalLM"


def test_rope_parameters_layout_of_transformers_5():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=1,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1234.0},
        eos_token_id=7,
    )
    args = hf_model_args(config.to_dict())
    assert args.rope_theta == 1234.0 and args.rope_scaling is None
    assert args.eos_token_ids == (7,) and args.num_kv_heads == 2


def test_qwen_flags():
    qwen2 = hf_model_args(llama_dict(architectures=["Qwen2ForCausalLM"]))
    qwen3 = hf_model_args(
        llama_dict(architectures=["Qwen3ForCausalLM"], head_dim=32, tie_word_embeddings=True)
    )
    assert qwen2.attention_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and qwen3.tie_word_embeddings and qwen3.head_dim == 32
    assert (qwen2.architecture, qwen3.architecture) == ("Qwen2ForCausalLM", "Qwen3ForCausalLM")


def test_qwen_sliding_window_only_when_enabled():
    base = llama_dict(architectures=["Qwen2ForCausalLM"], num_hidden_layers=4, sliding_window=8)
    off = hf_model_args({**base, "use_sliding_window": False, "max_window_layers": 1})
    assert off.layer_types == ("full",) * 4 and off.sliding_window is None
    on = hf_model_args({**base, "use_sliding_window": True, "max_window_layers": 1})
    assert on.layer_types == ("full", "sliding", "sliding", "sliding")
    assert on.sliding_window == 8
    explicit = hf_model_args(
        {
            **base,
            "use_sliding_window": True,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        }
    )
    assert explicit.layer_types == ("sliding", "full") * 2


def test_unsupported_architecture_is_named():
    supported = "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    with pytest.raises(
        ValueError,
        match=f"unsupported architecture 'GPT2LMHeadModel'; Strata supports: {supported}",
    ):
        hf_model_args(llama_dict(architectures=["GPT2LMHeadModel"]))


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        hf_model_args(llama_dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="unsupported rope type 'linear'"):
        hf_model_args(llama_dict(rope_scaling={"type": "linear", "factor": 2.0}))


def test_kv_cache_specs_split_layers_by_group():
    args = ModelArgs(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_layers=5,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        layer_types=("sliding", "full", "sliding", "sliding", "full"),
        sliding_window=16,
    )
    specs = Transformer(args).kv_cache_specs(torch.bfloat16)
    assert list(specs) == ["full", "sliding"]
    assert specs["full"] == KVCacheSpec("full", 2, 2, 8, None, torch.bfloat16)
    assert specs["sliding"] == KVCacheSpec("sliding", 3, 2, 8, 16, torch.bfloat16)
    assert specs["sliding"].shape(10, 4) == (10, 3, 2, 4, 2, 8)
    assert specs["sliding"].block_bytes(4) == 3 * 2 * 4 * 2 * 8 * 2


def test_sliding_layers_need_a_window():
    with pytest.raises(ValueError, match="sliding_window"):
        ModelArgs(16, 32, 64, 1, 4, 2, 8, layer_types=("sliding",))


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [("llama", (False, False)), ("qwen2", (True, False)), ("qwen3", (False, True))],
)
def test_config_without_architectures_falls_back_on_model_type(model_type, expected):
    d = llama_dict(model_type=model_type)
    del d["architectures"]
    args = hf_model_args(d)
    assert (args.attention_bias, args.qk_norm) == expected
    assert args.architecture.lower().startswith(model_type)


def test_config_without_architectures_or_known_model_type_is_named():
    d = llama_dict(model_type="gpt2")
    del d["architectures"]
    with pytest.raises(ValueError, match="no architectures and an unsupported model_type 'gpt2'"):
        hf_model_args(d)
