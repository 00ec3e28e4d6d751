"""What the device decides before any weight is loaded: the dtype ``auto`` means and which
quantized layouts can run. Pure functions of the device type, so that the CUDA branch is
tested on a CPU-only machine.

On CUDA ``dtype=auto`` is bfloat16, the dtype of its tensor cores: the weights are loaded
straight into it (no float32 copy first) and nothing is timed. The weight-only quantized
layouts (``quantization`` int8 and int4) have packed kernels on the CPU only: on CUDA a
quantized checkpoint (a GGUF file of 4- to 8-bit tensors) is dequantized to the engine dtype at
load (``auto`` means ``none`` there), and an explicit int8 or int4 is refused at start-up,
rather than unpacked on the host or cast whole on every call.
"""

CUDA_AUTO_DTYPE = "bfloat16"
QUANTIZED_DEVICES = ("cpu",)
"""Devices with kernels for the weight-only quantized layouts (``replicas.model.quant``)."""


def auto_dtype(dtype: str, device_type: str, is_builtin: bool = False) -> str:
    """``dtype`` with ``auto`` resolved where the device alone decides it: bfloat16 on CUDA,
    float32 for a built-in test model (the reference its tests compare against); ``auto``
    stays ``auto`` on a CPU, where the candidates are measured
    (``replicas.model.autotune``)."""
    if dtype != "auto":
        return dtype
    if is_builtin:
        return "float32"
    return CUDA_AUTO_DTYPE if device_type == "cuda" else "auto"


def device_quantization(quantization: str, device_type: str) -> str:
    """``quantization`` as ``device_type`` runs it: ``auto`` is ``none`` where no quantized
    kernel exists; ``ValueError`` naming the option for an explicit int8 or int4 there."""
    if device_type in QUANTIZED_DEVICES or quantization == "none":
        return quantization
    if quantization == "auto":
        return "none"
    raise ValueError(
        f"quantization {quantization} has no kernel on {device_type} in Strata (its packed "
        f"int8 and int4 products run on CPUs only); set quantization to none or auto, which "
        f"load the weights in the engine dtype, a quantized GGUF file dequantized"
    )
