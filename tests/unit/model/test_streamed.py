"""A checkpoint's model built a tensor at a time (``replicas.model.streamed``) against the
model the loader built before: the whole file dequantized by gguf-py into a float32 model, cast
to the candidate's dtype, then quantized whole."""

import numpy as np
import pytest
import torch

from replicas.model.autotune import Candidate
from replicas.model.gguf import GGUFWeights, int4_groups_of_tensor, open_gguf, read_gguf_info
from replicas.model.gguf_weights import _dequantize
from replicas.model.quantize import quantize_model
from replicas.model.registry import build_model, get_architecture
from replicas.model.streamed import build_streamed, probe_layers, probe_size

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
from gguf import GGMLQuantizationType as QType  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from tests.unit.model.test_gguf import (  # noqa: E402
    gguf_tensors,
    hf_model_of,
    llama_config,
    write_gguf,
)

CPU = torch.device("cpu")
CANDIDATES = [
    Candidate("float32", "none"),
    Candidate("bfloat16", "none"),
    Candidate("float32", "int8"),
    Candidate("bfloat16", "int8"),
    Candidate("float32", "int4"),
    Candidate("bfloat16", "int4", "native", "strata"),
]


def old_build(path, candidate: Candidate):
    """The model as the loader built it before: every tensor dequantized by gguf-py into a
    float32 model, the model cast, then quantized whole with the file's int4 codes."""
    args, _ = read_gguf_info(path)
    names = get_architecture(args.architecture).gguf_tensor_names
    tensors = {t.name: t for t in open_gguf(path).tensors}
    net = build_model(args)
    groups, bits = {}, {}

    def rows(name: str, values: torch.Tensor) -> torch.Tensor:
        """Llama's q and k rows back from llama.cpp's interleaved rotary layout."""
        if ".attention.wq." not in name and ".attention.wk." not in name:
            return values
        heads = values.reshape(-1, args.head_dim // 2, 2, *values.shape[1:])
        return heads.transpose(1, 2).reshape(values.shape)

    with torch.no_grad():
        for name, param in net.named_parameters():
            t = tensors[names.tensor_name(name)]
            values = torch.from_numpy(dequantize(np.asarray(t.data), t.tensor_type).copy())
            param.copy_(rows(name, values).reshape(param.shape))
            bits[name] = {"F32": 32, "Q8_0": 8, "Q4_0": 4}[t.tensor_type.name]
            if t.tensor_type.name == "Q4_0":
                stored = int4_groups_of_tensor(t)
                groups[name] = stored._replace(
                    **{f: rows(name, x) for f, x in stored._asdict().items() if torch.is_tensor(x)}
                )
    net = net.to(getattr(torch, candidate.dtype))
    if candidate.quantization != "none":
        quantize_model(net, candidate.quantization, groups, bits, candidate.kernel)
    return net.eval()


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def small_gguf(request, tmp_path_factory):
    """Three llama layers: Q4_0 matrices (q and k in llama.cpp's rotary layout), Q8_0 ones,
    float32 norms."""
    config = llama_config(num_hidden_layers=3, tie_word_embeddings=request.param)
    tensors = gguf_tensors(hf_model_of(config, seed=3), "llama")
    types = {
        name: QType.Q8_0 if name.endswith(("ffn_down.weight", "output.weight")) else QType.Q4_0
        for name, value in tensors.items()
        if value.ndim == 2
    }
    return str(write_gguf(tmp_path_factory.mktemp("g") / "s.gguf", "llama", config, tensors, types))


def logits(net, make_batch, chunk) -> torch.Tensor:
    tokens = list(range(5, 45))
    specs = net.kv_cache_specs(torch.float32)
    caches = {g: torch.zeros(s.shape(3, 16)) for g, s in specs.items()}
    batch = make_batch([chunk(tokens, 0, len(tokens), {g: [0, 1, 2] for g in specs})], 16)
    with torch.no_grad():
        return net.compute_logits(net(batch, caches))


@pytest.mark.parametrize("candidate", CANDIDATES, ids=str)
def test_a_streamed_build_is_bitwise_the_old_whole_model_build(
    candidate, small_gguf, make_batch, chunk
):
    args, _ = read_gguf_info(small_gguf)
    weights = GGUFWeights(open_gguf(small_gguf), args, small_gguf)
    ours = build_streamed(args, weights, candidate, CPU)
    expected = old_build(small_gguf, candidate)
    assert ours.tok_embeddings.weight.dtype == getattr(torch, candidate.dtype)
    if candidate.quantization != "none":
        assert type(ours.layers[0].feed_forward.w13).__name__ == "QuantizedLinear"
    got, want = logits(ours, make_batch, chunk), logits(expected, make_batch, chunk)
    assert torch.isfinite(want).all() and want.std() > 0.1
    assert torch.equal(got, want)


def test_a_probe_is_the_whole_models_layers_it_names(small_gguf, make_batch, chunk):
    """A probe of layers [0, 2] computes what the whole model's layers 0 and 2 compute."""
    args, _ = read_gguf_info(small_gguf)
    weights = GGUFWeights(open_gguf(small_gguf), args, small_gguf)
    whole = build_streamed(args, weights, Candidate("float32", "int4"), CPU)
    probe = build_streamed(args, weights, Candidate("float32", "int4"), CPU, [0, 2])
    assert len(probe.layers) == probe.args.num_layers == 2
    del whole.layers[1]
    assert torch.equal(logits(probe, make_batch, chunk), logits(whole, make_batch, chunk))


def test_a_probe_has_one_layer_of_each_kind_of_a_k_quant_mix():
    """SmolLM2-1.7B in Q4_K_M: llama.cpp keeps attn_v and ffn_down at 6 bits in layers 0-2,
    5, 8, ..., 20 and 21-23 (half of them); a probe has both kinds, in their proportion."""
    from replicas.model.builtin import BUILTIN_MODEL_ARGS

    args = BUILTIN_MODEL_ARGS["tiny"]()
    args.num_layers, args.layer_types = 24, ("full",) * 24
    six = {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23}
    bits = {f"layers.{i}.attention.wv.weight": 6 if i in six else 4 for i in range(24)}
    bits |= {f"layers.{i}.attention.wq.weight": 4 for i in range(24)}
    for count in (2, 4, 6):
        layers = probe_layers(args, bits, count)
        assert len(layers) == count and len(set(layers) & six) == count // 2
    assert probe_layers(args, {}, 3) == [0, 1, 2]  # one kind: the first layers
    assert probe_layers(args, bits, 30) == list(range(24))


def test_a_probes_layers_hold_at_least_32_mi_weights():
    """SmolLM2-135M: 3,540,096 weights a layer (576 x 1,536 of attention, 3 x 576 x 1,536 of
    feed-forward, two norms): 10 layers of its 30; at least 2 however large a layer."""
    from replicas.model.builtin import BUILTIN_MODEL_ARGS
    from tests.unit.model.test_gguf import smollm2_path

    assert probe_size(BUILTIN_MODEL_ARGS["tiny"]()) >= 2
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 is not installed")
    args, _ = read_gguf_info(path)
    assert probe_size(args) == -(-(1 << 25) // 3540096) == 10


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_torchs_dequantization_is_gguf_pys_bit_for_bit(kind):
    block_bytes = {"Q4_0": 18, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}[kind]
    halves = {"Q4_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}[kind]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (32, 4 * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(-1, block_bytes)
    for at in halves:  # finite float16 scales
        scales = rng.uniform(-0.01, 0.01, len(blocks)).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    qtype = getattr(QType, kind)
    expected = dequantize(raw, qtype)

    class Tensor:
        tensor_type = qtype

    ours = _dequantize(Tensor(), raw)
    assert ours.shape == expected.shape and np.array_equal(
        ours.view(np.uint32), expected.view(np.uint32)
    )


def test_a_probes_timings_are_priced_at_the_models_depth():
    """What is not the layers once, the layers' share of the probe times depth / probe depth:
    a probe of 4 layers at 10 ms a token over 2 ms of rest stands for 24 layers at 50 ms."""
    from replicas.model.autotune import at_depth

    assert at_depth((0.010, 0.030), (0.002, 0.006), 4, 24) == pytest.approx((0.050, 0.150))
    assert at_depth((0.001, 0.030), (0.002, 0.006), 4, 24) == pytest.approx((0.002, 0.150))
    head = (0.0005, 0.004)  # a probe timed without its head: the head's times added once
    assert at_depth((0.010, 0.030), (0.002, 0.006), 4, 24, head) == pytest.approx((0.0505, 0.154))


def test_time_rest_times_the_model_without_its_layers_and_gives_them_back():
    from replicas.model import autotune, load_model

    net = load_model("tiny", CPU).model
    layers, calls = net.layers, []
    for layer in layers:
        layer.register_forward_hook(lambda *args: calls.append(1))
    autotune.time_rest(net, torch.float32)
    assert calls == [] and net.layers is layers
    net.use_native_stack(False)  # hooks see eager layers only
    autotune.time_model(net, torch.float32)
    assert len(calls) > 0


def test_tune_times_the_rest_once_per_form_of_the_head(monkeypatch, small_gguf):
    """float32 int8 and torch's int4 keep the (Q8_0 or Q4_0 tied) head alike or not: the rest
    is timed once per distinct head, and never for a whole model."""
    from replicas.model import autotune

    args, _ = read_gguf_info(small_gguf)
    weights = GGUFWeights(open_gguf(small_gguf), args, small_gguf)
    heads, with_logits = [], []

    def time_model(*args, **kwargs):
        with_logits.append(args[4] if len(args) > 4 else kwargs.get("logits", True))
        return (1e-3, 1e-2)

    def time_rest(net, *args, logits=True):
        heads.append((net.output.extra_repr(), logits))
        return (0, 0.004 if logits else 0.001)  # the head: 3 ms a step

    monkeypatch.setattr(autotune, "time_model", time_model)
    monkeypatch.setattr(autotune, "time_rest", time_rest)
    options = [Candidate("float32", q) for q in ("none", "int8", "int4")]
    choice = autotune.tune(
        options, lambda c: build_streamed(args, weights, c, CPU, [0]), "k", None, layers=3
    )
    assert len(heads) == len(set(heads)) >= 4  # each head with and without its logits
    assert {logits for _, logits in heads} == {True, False}
    assert with_logits and not any(with_logits)  # the probes skip the head
    # 1 layer of 3 at 9 ms, 1 ms of the rest and the head's 3 ms
    assert all(t.decode_s == pytest.approx(0.031) for t in choice.timings)
    heads.clear()
    with_logits.clear()
    autotune.tune(options, lambda c: build_streamed(args, weights, c, CPU), "k", None, layers=3)
    assert heads == [] and all(with_logits)


def test_probes_built_over_a_kept_embedding_are_those_built_without(small_gguf, make_batch, chunk):
    """``KeptFloat``: the embedding is read once; a float32 probe's embedding is the kept
    tensor itself, and every probe computes what it computes when read from the file."""
    from replicas.model.streamed import KeptFloat

    args, _ = read_gguf_info(small_gguf)
    weights = GGUFWeights(open_gguf(small_gguf), args, small_gguf)
    reads = []
    original = weights.copy_into
    weights.copy_into = lambda name, target: reads.append(name) or original(name, target)
    kept = KeptFloat(weights, ["tok_embeddings.weight"])
    nets = []
    for candidate in (CANDIDATES[1], CANDIDATES[0], CANDIDATES[4], CANDIDATES[0]):
        net = build_streamed(args, kept, candidate, CPU, [1])
        expected = build_streamed(args, weights, candidate, CPU, [1])
        assert torch.equal(logits(net, make_batch, chunk), logits(expected, make_batch, chunk))
        nets.append(net)
    float32 = [n.tok_embeddings.weight for n in (nets[1], nets[3])]
    assert float32[0].data_ptr() == float32[1].data_ptr()
    assert reads.count("tok_embeddings.weight") == 1 + 4  # once kept, once per plain build


def test_a_safetensors_directory_is_measured_on_probes_and_built_as_chosen(
    hf_checkpoint, monkeypatch, tmp_path, make_batch, chunk
):
    """A float checkpoint (two shards) with dtype auto: probes of some layers are timed, and the
    model built as chosen is the one an explicit dtype loads."""
    from replicas.model import autotune, load_model, streamed
    from tests.unit.model.test_gguf import llama_config as tiny_llama

    monkeypatch.setattr(streamed, "PROBE_MIN_WEIGHTS", 1)  # a tiny model's probe: 2 layers
    directory, _ = hf_checkpoint(tiny_llama(num_hidden_layers=6), max_shard_size="20KB")
    assert len(list(directory.glob("*.safetensors"))) > 1
    depths = []
    bfloat16_faster = {torch.float32: (2e-3, 2e-2), torch.bfloat16: (1e-3, 1e-2)}
    monkeypatch.setattr(
        autotune,
        "time_model",
        lambda net, dtype, *a: depths.append(net.args.num_layers) or bfloat16_faster[dtype],
    )
    monkeypatch.setattr(autotune, "time_rest", lambda *a, **k: (0.0, 0.0))
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path / "choices.json"))
    loaded = load_model(str(directory), CPU, "auto", decoder_stack="eager")
    assert loaded.dtype == torch.bfloat16 and loaded.auto.source.startswith("measured")
    assert depths and max(depths) < 6 and len(loaded.model.layers) == 6
    explicit = load_model(str(directory), CPU, "bfloat16", decoder_stack="eager")
    got = logits(loaded.model, make_batch, chunk)
    assert torch.equal(got, logits(explicit.model, make_batch, chunk))
