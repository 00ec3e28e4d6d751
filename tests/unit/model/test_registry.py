"""The architecture registry: lookups name what is supported, and an architecture registered
from outside Strata's files (here, this test) loads like a shipped one."""

import json
from dataclasses import dataclass, fields
from types import MappingProxyType

import pytest
import torch

from replicas.model import Architecture, ModelArgs, Transformer, load_model, register_architecture
from replicas.model.hf import hf_model_args
from replicas.model.registry import get_architecture, unregister_architecture
from replicas.model.tensor_names import HF_TENSOR_NAMES, TensorNames
from tests.unit.model.test_model_loader import small_llama

CPU = torch.device("cpu")
BLOCK_SIZE = 4
SHIPPED = "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"


@dataclass(slots=True)
class ToyArgs(ModelArgs):
    logit_scale: float = 1.0  # a hyper-parameter ModelArgs does not have


class ToyTransformer(Transformer):
    """Llama's layers with scaled logits."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.args.logit_scale


def toy_args(args: ModelArgs, config) -> ToyArgs:
    shared = {f.name: getattr(args, f.name) for f in fields(ModelArgs)}
    return ToyArgs(**shared, logit_scale=config["logit_scale"])


# Checkpoints of the toy architecture name tensors after our parameters, under "toy.".
TOY_NAMES = TensorNames(
    layer_prefix="toy.blocks.",
    layers=MappingProxyType({part: part for part in HF_TENSOR_NAMES.layers}),
    top=MappingProxyType({part: f"toy.{part}" for part in HF_TENSOR_NAMES.top}),
)


@pytest.fixture
def toy():
    architecture = register_architecture(
        Architecture(
            name="ToyForCausalLM",
            hf_model_type="toy",
            model_class=ToyTransformer,
            hf_args=toy_args,
            hf_tensor_names=TOY_NAMES,
        )
    )
    yield architecture
    unregister_architecture(architecture.name)


def as_toy_checkpoint(directory, logit_scale: float) -> None:
    """Rewrites a Llama checkpoint directory into one of the toy architecture."""
    from safetensors.torch import load_file, save_file

    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    ours = [name for name, _ in Transformer(hf_model_args(config)).named_parameters()]
    renamed = {HF_TENSOR_NAMES.tensor_name(n): TOY_NAMES.tensor_name(n) for n in ours}
    [path] = directory.glob("*.safetensors")
    save_file({renamed[k]: t for k, t in load_file(path).items()}, path)
    config.update(architectures=["ToyForCausalLM"], logit_scale=logit_scale)
    config_path.write_text(json.dumps(config))


def test_registered_architecture_loads_with_its_class_args_and_names(
    toy, hf_checkpoint, make_batch, chunk
):
    directory, hf_model = hf_checkpoint(small_llama())
    as_toy_checkpoint(directory, logit_scale=2.0)
    loaded = load_model(str(directory), CPU)
    assert type(loaded.model) is ToyTransformer
    assert loaded.args.architecture == "ToyForCausalLM" and loaded.args.logit_scale == 2.0

    tokens = [1, 5, 9, 4, 7, 3]
    specs = loaded.model.kv_cache_specs(torch.float32)
    caches = {g: torch.zeros(s.shape(4, BLOCK_SIZE)) for g, s in specs.items()}
    batch = make_batch([chunk(tokens, 0, len(tokens), {"full": [2, 0]})], BLOCK_SIZE)
    with torch.no_grad():
        logits = loaded.model.compute_logits(loaded.model(batch, caches))
        reference = hf_model(torch.tensor([tokens])).logits[0].float() * 2.0  # [T, vocab]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)


def test_model_type_finds_a_registered_architecture(toy):
    config = {**small_llama().to_dict(), "model_type": "toy", "logit_scale": 3.0}
    del config["architectures"]
    args = hf_model_args(config)
    assert isinstance(args, ToyArgs) and args.architecture == "ToyForCausalLM"


def test_lookups_name_the_registered_architectures(toy):
    with pytest.raises(ValueError, match=f"'GPT2LMHeadModel'; Strata supports: {SHIPPED}, Toy"):
        get_architecture("GPT2LMHeadModel")
    supported_types = "llama, qwen2, qwen3, toy"
    with pytest.raises(ValueError, match=f"model_type 'gpt2'; Strata supports: {supported_types}"):
        hf_model_args({"model_type": "gpt2"})


def test_shipped_architectures_are_the_supported_list():
    with pytest.raises(ValueError, match=f"Strata supports: {SHIPPED}$"):
        get_architecture("ToyForCausalLM")


def test_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="gguf_name 'qwen2' is already registered by Qwen2"):
        register_architecture(Architecture(name="Qwen2Clone", gguf_name="qwen2"))
    with pytest.raises(ValueError, match="name 'LlamaForCausalLM' is already registered"):
        register_architecture(Architecture(name="LlamaForCausalLM"))
