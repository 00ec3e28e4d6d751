"""Loading models: built-in names, Hugging Face directories, and the errors users see."""

import json

import pytest
import torch

from replicas.model import ByteTokenizer, HFTokenizer, load_model

CPU = torch.device("cpu")


def small_llama():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=2,
    )


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'nope': not a built-in model"):
        load_model("nope", CPU)


def test_builtin_loads_in_eval_mode_without_grad():
    loaded = load_model("tiny", CPU, dtype=torch.bfloat16)
    assert loaded.name == "tiny" and isinstance(loaded.tokenizer, ByteTokenizer)
    assert not loaded.model.training
    assert all(not p.requires_grad and p.dtype == torch.bfloat16 for p in loaded.model.parameters())


def test_hf_directory_loads_with_tokenizer_and_eos(hf_checkpoint):
    directory, _ = hf_checkpoint(small_llama())
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    loaded = load_model(str(directory), CPU, dtype=torch.bfloat16)
    assert loaded.name == str(directory)
    assert loaded.args.eos_token_ids == (2, 5)
    assert isinstance(loaded.tokenizer, HFTokenizer)
    assert loaded.model.output.weight.dtype == torch.bfloat16
    assert not loaded.model.training


def test_tied_model_shares_embedding_and_head(hf_checkpoint):
    config = small_llama()
    config.tie_word_embeddings = True
    directory, hf_model = hf_checkpoint(config)
    model = load_model(str(directory), CPU).model
    assert model.output.weight is model.tok_embeddings.weight
    torch.testing.assert_close(model.output.weight, hf_model.lm_head.weight)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'MambaForCausalLM'"):
        load_model(str(tmp_path), CPU)


def rewrite_checkpoint(directory, edit) -> None:
    from safetensors.torch import load_file, save_file

    [path] = directory.glob("*.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_tensor_is_named(hf_checkpoint):
    directory, _ = hf_checkpoint(small_llama())
    rewrite_checkpoint(directory, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\."):
        load_model(str(directory), CPU)


def test_unexpected_tensor_is_named(hf_checkpoint):
    directory, _ = hf_checkpoint(small_llama())
    rewrite_checkpoint(directory, lambda t: t.update({"vision.proj.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors: vision\.proj\.weight"):
        load_model(str(directory), CPU)


def test_mis_shaped_tensor_is_named(hf_checkpoint):
    directory, _ = hf_checkpoint(small_llama())
    rewrite_checkpoint(directory, lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight .* shape \(7,\), expected \(32,\)"):
        load_model(str(directory), CPU)
