"""What the device decides before any weight is loaded (replicas.model.device_defaults): the
CUDA branch checked on a CPU."""

import pytest
import torch

from replicas.model import load_model
from replicas.model.device_defaults import auto_dtype, device_quantization
from replicas.model.quant import QuantizedLinear


def test_auto_dtype_is_bfloat16_on_cuda_and_measured_on_a_cpu():
    assert auto_dtype("auto", "cuda") == "bfloat16"
    assert auto_dtype("auto", "cpu") == "auto"
    assert auto_dtype("auto", "cuda", is_builtin=True) == "float32"  # the test models' reference
    assert auto_dtype("float16", "cuda") == "float16"


def test_quantization_on_cuda_is_none_for_auto_and_refused_when_asked():
    assert device_quantization("auto", "cuda") == "none"
    assert device_quantization("none", "cuda") == "none"
    assert device_quantization("int4", "cpu") == "int4"
    assert device_quantization("auto", "cpu") == "auto"
    for scheme in ("int8", "int4"):
        with pytest.raises(ValueError, match=f"quantization {scheme} has no kernel on cuda"):
            device_quantization(scheme, "cuda")


def test_the_loader_refuses_quantized_weights_on_cuda_before_loading_any():
    with pytest.raises(ValueError, match="quantization int4 has no kernel on cuda"):
        load_model("tiny", torch.device("cuda"), quantization="int4")


def test_a_quantized_layer_off_the_cpu_raises_rather_than_unpack_its_weight():
    layer = QuantizedLinear.int8(torch.randn(64, 64))
    with pytest.raises(RuntimeError, match="runs on CPUs only"):
        layer(torch.randn(2, 64, device="meta"))
