"""``benchmarks.write_gguf``: llama.cpp's tensor types for the mixes, blocks whose weights have
the stated spread, and a file Strata loads and generates with."""

import numpy as np
import pytest
import torch

from benchmarks import write_gguf
from benchmarks.write_gguf import SHAPES, Shape, tensor_types

gguf = pytest.importorskip("gguf")

# llama.cpp's use_more_bits for 24 layers: the first and last 3, and every third from layer 5
SIX_BIT_LAYERS_OF_24 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23}
SMALL = Shape(hidden=256, intermediate=512, layers=8, heads=4, kv_heads=2, rope_theta=1e4)


def test_q4_k_m_keeps_attn_v_and_ffn_down_of_llama_cpps_layers_at_6_bits():
    types = tensor_types(SHAPES["smollm2-1.7b"], "Q4_K_M")
    assert types["token_embd.weight"] == "Q6_K"  # the tied output matrix
    six = {int(n.split(".")[1]) for n, t in types.items() if t == "Q6_K" and n.startswith("blk")}
    assert six == SIX_BIT_LAYERS_OF_24
    for i in range(24):
        v, down = types[f"blk.{i}.attn_v.weight"], types[f"blk.{i}.ffn_down.weight"]
        assert v == down == ("Q6_K" if i in SIX_BIT_LAYERS_OF_24 else "Q4_K")
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_up.weight"] == "Q4_K"


def test_q4_0_keeps_an_output_matrix_of_960_columns_at_8_bits():
    types = tensor_types(SHAPES["smollm2-360m"], "Q4_0")
    assert types.pop("token_embd.weight") == "Q8_0"  # 960 is no multiple of Q6_K's 256
    assert set(types.values()) == {"Q4_0"} and len(types) == 7 * 32


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    from tests.unit.model.test_gguf import smollm2_path

    source = smollm2_path()
    if source is None:
        pytest.skip("SmolLM2 is not installed")
    out = tmp_path_factory.mktemp("w") / "small.gguf"
    return write_gguf.write(SMALL, "Q4_K_M", out, seed=1, source=source)


def test_every_block_type_holds_weights_of_the_stated_spread(small_file):
    seen = set()
    for t in gguf.GGUFReader(str(small_file)).tensors:
        if not t.name.startswith(("blk.0.", "blk.1.", "output_norm")):
            continue  # layer 0's attn_v and ffn_down are Q6_K, layer 1's Q4_K
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        if t.tensor_type.name == "F32":
            assert np.all(values == 1.0)
            continue
        seen.add(t.tensor_type.name)
        assert 0.7 < values.std() / write_gguf.WEIGHT_STD < 1.4, t.name
        assert abs(values.mean()) < 0.05 * write_gguf.WEIGHT_STD, t.name
    assert seen == {"Q4_K", "Q6_K"}


def test_strata_loads_the_file_and_generates(small_file):
    from replicas.model import load_model
    from tests.unit.model.conftest import engine_greedy

    loaded = load_model(str(small_file), torch.device("cpu"), "float32", quantization="int4")
    assert loaded.args.num_layers == 8 and loaded.args.vocab_size == 49152
    assert loaded.args.tie_word_embeddings
    prompt = loaded.tokenizer.encode("The history of the printing press")
    assert loaded.tokenizer.decode(prompt) == "The history of the printing press"
    [tokens] = engine_greedy(loaded, [prompt], max_tokens=4, ignore_eos=True)
    assert len(tokens) == 4
