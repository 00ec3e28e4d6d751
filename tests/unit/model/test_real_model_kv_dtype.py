"""SmolLM2-135M-Instruct with K and V stored as int8 and fp8_e4m3: perplexity on the shipped
text against the engine dtype's KV (float32), through the same cached attention as serving."""

from pathlib import Path

import pytest
import torch

from replicas.model import load_model
from replicas.model.perplexity import perplexity
from replicas.model.resolve import DEFAULT_MODEL, packaged_model_path

try:
    SMOLLM2 = packaged_model_path(DEFAULT_MODEL)
except ValueError as missing:
    pytest.skip(str(missing), allow_module_level=True)

TEXT = (Path(__file__).parents[2] / "data" / "perplexity.txt").read_text()
WINDOW = 512
# Targets of the issue; measured: -0.002% (int8) and -0.33% (fp8_e4m3), see docs/design.md.
MAX_INCREASE = {"int8": 0.01, "fp8_e4m3": 0.02}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dense():
    return load_model(str(SMOLLM2), torch.device("cpu"), "float32", quantization="none")


@pytest.fixture(scope="module")
def reference_perplexity(dense):
    return perplexity(dense.model, dense.tokenizer.encode(TEXT), WINDOW)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_perplexity_stays_within_its_target(dense, reference_perplexity, kv_cache_dtype):
    got = perplexity(dense.model, dense.tokenizer.encode(TEXT), WINDOW, kv_cache_dtype)
    assert got != reference_perplexity  # the KV really was quantized
    assert abs(got / reference_perplexity - 1) <= MAX_INCREASE[kv_cache_dtype]
