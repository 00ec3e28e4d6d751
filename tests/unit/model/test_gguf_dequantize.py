"""The loader's torch dequantization of each GGUF type against gguf-py's numpy (bit for bit),
and a ``Q3_K`` weight kept exactly as the ``Q6_K`` rows of its values."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize
from gguf.constants import GGML_QUANT_SIZES

from replicas.model.gguf_dequantize import BLOCK_BYTES, TORCH_DEQUANTIZE, q3_k_six_bit
from replicas.model.six_bit import six_bit_weight, strata_six_bit
from tests.unit.model.quant_reference import _strata_built  # noqa: F401

SCALE_BYTES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q6_K": (208,), "IQ4_XS": (0,)}
SCALE_BYTES |= {kind: (0, 2) for kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K")}


def random_blocks(kind: str, count: int, seed: int) -> np.ndarray:
    """``count`` blocks of ``kind`` [count, bytes]: random bits, small positive float16 scales
    (``F16`` and ``BF16``: normal values)."""
    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
    if kind in ("F16", "BF16"):
        values = rng.standard_normal(count * size // 2).astype(np.float32)
        half = values.astype(np.float16) if kind == "F16" else (values.view(np.uint32) >> 16)
        return (
            half.astype(np.uint16 if kind == "BF16" else np.float16)
            .view(np.uint8)
            .reshape(count, size)
        )
    blocks = rng.integers(0, 256, (count, size), dtype=np.uint8)
    for at in SCALE_BYTES.get(kind, (0,)):
        d = (rng.random(count) * 0.01 + 1e-3).astype(np.float16)
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(count, 2)
    return blocks


@pytest.mark.parametrize("kind", sorted(TORCH_DEQUANTIZE))
def test_torch_dequantizes_each_type_bit_for_bit_as_gguf_py(kind, monkeypatch):
    """torch's ops (Strata's library, where loaded, takes some types: test_weight_packing.py)."""
    monkeypatch.setattr("replicas.model.gguf_dequantize._native", lambda: False)
    monkeypatch.setattr("replicas.model.native_stack.is_loaded", lambda: False)
    function = TORCH_DEQUANTIZE[kind]
    assert BLOCK_BYTES[function] == GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1]
    blocks = random_blocks(kind, 64, seed=len(kind))
    expected = dequantize(blocks.reshape(4, -1), GGMLQuantizationType[kind]).astype(np.float32)
    got = function(torch.from_numpy(blocks.copy())).reshape(4, -1).numpy()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), kind


@pytest.mark.skipif("not _strata_built()", reason="no native library here")
def test_q3_k_is_kept_exactly_in_the_six_bit_layout():
    """A ``Q3_K`` weight's 6-bit fields (Strata's 6-bit product) hold its values exactly, as
    gguf-py dequantizes them."""
    q3 = random_blocks("Q3_K", 32, seed=7).reshape(8, 4 * 110)
    six = q3_k_six_bit(torch.from_numpy(q3))
    assert six.codes.shape == (8, 1024) and int(six.codes.max()) <= 35
    expected = dequantize(q3, GGMLQuantizationType.Q3_K).astype(np.float32)
    packed, scales = strata_six_bit([six])
    got = six_bit_weight(packed, scales, 8).numpy()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
