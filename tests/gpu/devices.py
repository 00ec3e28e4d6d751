"""Device parameters of the CUDA tests: each runs on ``cuda`` (marked ``cuda``, skipped without
a GPU) and, where its logic means something there, on ``cpu`` too, so that a machine without a
GPU still runs the same code paths' bookkeeping."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU and a CUDA build of torch"),
]
CUDA_ONLY = [pytest.param("cuda", id="cuda", marks=CUDA)]
DEVICES = [pytest.param("cpu", id="cpu"), *CUDA_ONLY]
# For tests that take minutes on a CPU and whose CPU run other tests already cover.
SLOW_ON_CPU = [
    pytest.param(
        "cpu",
        id="cpu",
        marks=pytest.mark.skipif(
            os.environ.get("STRATA_SLOW_CPU_VARIANTS") != "1",
            reason="minutes on a CPU; set STRATA_SLOW_CPU_VARIANTS=1 to run it",
        ),
    ),
    *CUDA_ONLY,
]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
