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


def test_q3_k_m_takes_llama_cpps_types_and_q3_k_blocks_hold_the_stated_spread():
    types = tensor_types(SHAPES["smollm2-1.7b"], "Q3_K_M")
    assert types["token_embd.weight"] == "Q6_K"
    for i in range(24):
        assert types[f"blk.{i}.attn_output.weight"] == "Q4_K"
        assert types[f"blk.{i}.attn_v.weight"] == ("Q5_K" if i < 2 else "Q4_K")
        assert types[f"blk.{i}.ffn_down.weight"] == ("Q5_K" if i < 1 else "Q4_K")
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_gate.weight"] == "Q3_K"
    blocks = write_gguf.random_blocks("Q3_K", 64, 1024, np.random.default_rng(0))
    values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q3_K)
    assert values.std() == pytest.approx(write_gguf.WEIGHT_STD, rel=0.1)
    assert abs(values.mean()) < 0.1 * write_gguf.WEIGHT_STD


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    return _small(tmp_path_factory, "Q4_K_M", seed=1)


def _small(tmp_path_factory, mix: str, seed: int):
    """A file of the ``SMALL`` shape in ``mix``, with SmolLM2's tokenizer."""
    from tests.unit.model.test_gguf import smollm2_path

    source = smollm2_path()
    if source is None:
        pytest.skip("SmolLM2 is not installed")
    out = tmp_path_factory.mktemp("w") / f"small-{mix}.gguf"
    return write_gguf.write(SMALL, mix, out, seed=seed, source=source)


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


def test_an_int4_build_takes_q4_k_weights_as_stored_and_never_dequantizes_them(
    small_file, monkeypatch
):
    """A ``Q4_K`` block is eight groups of 32 with a scale and a minimum each, Strata's int4
    grouping: its codes are served as stored (the weight Strata's kernel holds is the file's,
    but for the scales' float16 rounding), and the float values are never made."""
    from replicas.model.gguf import read_gguf_info
    from replicas.model.gguf_weights import unpermute_rotary

    args, _ = read_gguf_info(small_file)
    net, read = _strata_int4_build(small_file, monkeypatch)
    stored = {t.name: t for t in gguf.GGUFReader(str(small_file)).tensors}
    w13 = net.layers[1].feed_forward.w13  # layer 1: every matrix Q4_K
    assert w13.scheme == "int4" and w13.kernel == "strata"
    gate_up = [
        gguf.quants.dequantize(np.asarray(stored[f"blk.1.ffn_{n}.weight"].data), QType.Q4_K)
        for n in ("gate", "up")
    ]
    expected = torch.from_numpy(np.concatenate(gate_up))
    got = w13.dequantized(torch.float32)
    assert torch.allclose(got, expected, rtol=0, atol=2**-8 * expected.abs().max().item())
    q = gguf.quants.dequantize(np.asarray(stored["blk.1.attn_q.weight"].data), QType.Q4_K)
    wq = unpermute_rotary(torch.from_numpy(q), args.head_dim)
    assert torch.allclose(
        net.layers[1].attention.wqkv.dequantized()[: wq.shape[0]].float(),
        wq,
        rtol=0,
        atol=2**-8 * wq.abs().max().item(),
    )
    q4_k = {f"layers.1.{n}.weight" for n in ("attention.wq", "feed_forward.w1", "feed_forward.w3")}
    assert q4_k & set(read) == set()
    # layer 0's ffn_down is Q6_K: served in 6 bits as stored, exactly the file's, never read
    w2 = gguf.quants.dequantize(np.asarray(stored["blk.0.ffn_down.weight"].data), QType.Q6_K)
    assert net.layers[0].feed_forward.w2.scales.dtype == torch.uint8
    assert torch.equal(
        net.layers[0].feed_forward.w2.dequantized(torch.float32), torch.from_numpy(w2)
    )
    assert "layers.0.feed_forward.w2.weight" not in read
    # layer 0's v is Q6_K beside Q4_K q and k: one mixed product, each weight as stored, no
    # float value read
    parts = net.layers[0].attention.wqkv.parts
    v = gguf.quants.dequantize(np.asarray(stored["blk.0.attn_v.weight"].data), QType.Q6_K)
    assert [p.scales.dtype for p in parts] == [torch.uint8] * 3
    assert torch.equal(parts[2].dequantized(torch.float32), torch.from_numpy(v))
    assert not {f"layers.0.attention.{n}.weight" for n in ("wq", "wk", "wv")} & set(read)


CPU = torch.device("cpu")
QType = gguf.GGMLQuantizationType


def _strata_int4_build(path, monkeypatch) -> tuple[torch.nn.Module, list[str]]:
    """The whole model of ``path`` built as float32/int4-strata/native, and the parameters whose
    float values the build read."""
    from replicas.model.autotune import Candidate
    from replicas.model.gguf import GGUFWeights, open_gguf, read_gguf_info
    from replicas.model.streamed import build_streamed

    args, _ = read_gguf_info(path)
    weights = GGUFWeights(open_gguf(path), args, path)
    read = []
    copy_into = GGUFWeights.copy_into
    monkeypatch.setattr(
        GGUFWeights, "copy_into", lambda self, n, t: (read.append(n), copy_into(self, n, t))
    )
    net = build_streamed(args, weights, Candidate("float32", "int4", "native", "strata"), CPU)
    return net, read


@pytest.fixture(scope="module")
def small_q5_file(tmp_path_factory):
    return _small(tmp_path_factory, "Q5_K_M", seed=2)


def test_an_int4_build_serves_q5_k_weights_in_5_bits_as_stored(small_q5_file, monkeypatch):
    """A ``Q5_K_M`` file's ``Q5_K`` blocks have the stated spread, and under Strata's kernels an
    int4 build serves them as stored, a fifth bit plane beside int4's nibbles: exactly the
    file's weights, never dequantized."""

    stored = {t.name: t for t in gguf.GGUFReader(str(small_q5_file)).tensors}
    assert stored["blk.1.ffn_up.weight"].tensor_type == QType.Q5_K
    assert stored["blk.0.ffn_down.weight"].tensor_type == QType.Q6_K
    gate_up = [
        gguf.quants.dequantize(np.asarray(stored[f"blk.1.ffn_{n}.weight"].data), QType.Q5_K)
        for n in ("gate", "up")
    ]
    for values in gate_up:
        assert 0.7 < values.std() / write_gguf.WEIGHT_STD < 1.4
        assert abs(values.mean()) < 0.05 * write_gguf.WEIGHT_STD
    net, read = _strata_int4_build(small_q5_file, monkeypatch)
    w13 = net.layers[1].feed_forward.w13
    assert w13.scheme == "int4" and w13.weight.shape[1] == SMALL.hidden // 32 * 5
    assert torch.equal(w13.dequantized(torch.float32), torch.from_numpy(np.concatenate(gate_up)))
    assert {"layers.1.feed_forward.w1.weight", "layers.1.feed_forward.w3.weight"} & set(
        read
    ) == set()


def test_probes_share_a_head_packed_from_stored_codes_and_only_that(small_file):
    """``auto``'s probes over ``KeptFloat`` take the tied ``Q6_K`` head packed once for
    Strata's kernels whatever their dtype (no float value enters it); a head quantized from
    float values (torch's kernels) is made again for each."""
    from replicas.model.autotune import Candidate
    from replicas.model.gguf import GGUFWeights, open_gguf, read_gguf_info
    from replicas.model.streamed import KeptFloat, build_streamed

    args, _ = read_gguf_info(small_file)
    kept = KeptFloat(
        GGUFWeights(open_gguf(small_file), args, small_file), ["tok_embeddings.weight"]
    )
    heads = {}
    for dtype in ("float32", "bfloat16"):
        for kernel in ("strata", "torch"):
            candidate = Candidate(dtype, "int4", "native", kernel)
            heads[dtype, kernel] = build_streamed(args, kept, candidate, CPU, [0]).output
    assert heads["float32", "strata"] is heads["bfloat16", "strata"]
    assert heads["float32", "torch"] is not heads["bfloat16", "torch"]
    stored = {t.name: t for t in gguf.GGUFReader(str(small_file)).tensors}["token_embd.weight"]
    head = gguf.quants.dequantize(np.asarray(stored.data), QType.Q6_K)
    assert torch.equal(
        heads["bfloat16", "strata"].dequantized(torch.float32), torch.from_numpy(head)
    )


def test_q2_k_and_iq4_xs_take_llama_cpps_types_and_fallbacks():
    q2 = tensor_types(SHAPES["smollm2-1.7b"], "Q2_K")  # 32 query heads, 32 KV heads
    for i in range(24):
        assert q2[f"blk.{i}.attn_v.weight"] == q2[f"blk.{i}.ffn_down.weight"] == "Q3_K"
        assert q2[f"blk.{i}.attn_output.weight"] == "Q3_K"
        assert q2[f"blk.{i}.attn_q.weight"] == q2[f"blk.{i}.ffn_up.weight"] == "Q2_K"
    assert tensor_types(SMALL, "Q2_K")["blk.0.attn_v.weight"] == "Q3_K"  # 2 heads a KV head
    iq4 = tensor_types(SHAPES["smollm2-360m"], "IQ4_XS")  # 960 columns: IQ4_NL
    assert iq4.pop("token_embd.weight") == "Q8_0"
    assert iq4.pop("blk.0.ffn_down.weight") == "IQ4_XS"  # 2,560 columns
    assert set(iq4.values()) == {"IQ4_NL", "IQ4_XS"}
    assert iq4["blk.0.attn_q.weight"] == "IQ4_NL"


@pytest.mark.parametrize("kind", ["IQ4_NL", "IQ4_XS", "Q2_K", "Q8_0"])
def test_new_block_types_hold_the_stated_spread(kind):
    blocks = write_gguf.random_blocks(kind, 64, 1024, np.random.default_rng(0))
    values = gguf.quants.dequantize(blocks, QType[kind])
    assert values.std() == pytest.approx(write_gguf.WEIGHT_STD, rel=0.15)
    assert abs(values.mean()) < 0.1 * write_gguf.WEIGHT_STD


def test_an_int4_build_keeps_q2_k_q3_k_and_iq4_as_stored(tmp_path_factory, monkeypatch):
    """Under Strata's kernels an int4 build serves a ``Q2_K`` weight in the 2-bit layout, a
    ``Q3_K`` one in the 6-bit layout and an ``IQ4_XS`` one as its level indices: the file's
    values, never dequantized (a ``Q2_K`` file's q/k/v, ``Q2_K`` beside a ``Q3_K`` v, is
    int8)."""
    for mix, seed in (("Q2_K", 3), ("IQ4_XS", 4)):
        path = _small(tmp_path_factory, mix, seed=seed)
        stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
        net, read = _strata_int4_build(path, monkeypatch)
        ffn = net.layers[0].feed_forward
        weights = {
            name: torch.from_numpy(
                np.array(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type))
            )
            for name, t in stored.items()
            if name.startswith("blk.0.ffn_")
        }
        gate_up = torch.cat([weights[f"blk.0.ffn_{n}.weight"] for n in ("gate", "up")])
        down = weights["blk.0.ffn_down.weight"]
        never_read = {f"layers.0.feed_forward.{w}.weight" for w in ("w1", "w3", "w2")}
        assert never_read & set(read) == set()
        if mix == "IQ4_XS":  # every product's indices as stored, d (ls - 32) in float16
            for product, weight in ((ffn.w13, gate_up), (ffn.w2, down)):
                assert product.scheme == "int4" and product.weight.dtype == torch.int8
                got = product.dequantized(torch.float32)
                assert torch.allclose(got, weight, rtol=2**-11, atol=0)
            continue
        for values in gate_up, down:  # Q2_K and Q3_K blocks of the stated spread
            assert 0.7 < values.std() / write_gguf.WEIGHT_STD < 1.4
            assert abs(values.mean()) < 0.05 * write_gguf.WEIGHT_STD
        assert ffn.w13.scheme == "int4" and ffn.w13.weight.shape[1] == SMALL.hidden // 32 * 2
        assert torch.equal(ffn.w13.dequantized(torch.float32), gate_up)
        assert ffn.w2.scales.dtype == torch.uint8  # ffn_down Q3_K, in 6 bits
        assert torch.equal(ffn.w2.dequantized(torch.float32), down)
        # Q2_K q and k beside a Q3_K v: one mixed product, each as stored, no float value read
        parts = net.layers[0].attention.wqkv.parts
        assert [p.weight.shape[1] for p in parts] == [SMALL.hidden // 32 * n for n in (2, 2, 6)]
        assert not {f"layers.0.attention.{n}.weight" for n in ("wq", "wk", "wv")} & set(read)
