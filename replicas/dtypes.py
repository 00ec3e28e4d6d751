"""The dtypes a replica computes in, by config name: the one table the config, the model loader
and the KV formats (``replicas.model.kv_format``) read."""

from collections.abc import Iterable

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""The dtypes a replica computes in (and its float KV formats), by config name; bytes per
element are ``TORCH_DTYPES[name].itemsize``."""


def _one_of(names: Iterable[str]) -> str:
    """``"a, b or c"``."""
    *head, last = names
    return f"{', '.join(head)} or {last}" if head else last


DTYPE_CHOICES = _one_of(TORCH_DTYPES)
"""The names of ``TORCH_DTYPES`` as one phrase, for messages."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name; ``ValueError`` naming the choices otherwise."""
    dtype = TORCH_DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"dtype must be {DTYPE_CHOICES}, got {name!r}")
    return dtype


def dtype_name_of(dtype: torch.dtype) -> str:
    """The config name of a torch dtype; ``ValueError`` for one Strata does not run."""
    for name, candidate in TORCH_DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"dtype must be {DTYPE_CHOICES}, got {dtype}")
