"""The model architectures Strata can load, by Hugging Face architecture name.

An ``Architecture`` says how checkpoints of one architecture become a model: the names that
identify it (``architectures`` / ``model_type`` in ``config.json``, ``general.architecture`` in a
GGUF file), the model class built from ``ModelArgs``, the quirks its configs leave implicit and
its tensor names. The loaders read the generic hyper-parameters and ask the registry for the rest.

Each architecture Strata ships is one module of ``replicas.model.architectures`` that calls
``register_architecture`` when imported; the registry imports that package on first use. Adding
an architecture is a new module there, or a ``register_architecture`` call before loading.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from replicas.model.config import ModelArgs
from replicas.model.tensor_names import GGUF_TENSOR_NAMES, HF_TENSOR_NAMES, TensorNames
from replicas.model.transformer import Transformer

if TYPE_CHECKING:
    from replicas.model.gguf import GGUFMetadata


def _as_read(args: ModelArgs, _: Any) -> ModelArgs:
    return args


@dataclass(frozen=True, slots=True)
class Architecture:
    """One architecture: the names that identify its checkpoints and how to build its model.

    ``hf_args`` and ``gguf_args`` receive the ``ModelArgs`` read from the keys every architecture
    shares (``architecture`` already set to ``name``) together with the file's config or
    metadata, and return them with what the architecture implies (Qwen2: biased q/k/v).
    """

    name: str  # Hugging Face architecture, the first of config.json's "architectures"
    hf_model_type: str | None = None  # config.json "model_type" read as this architecture
    gguf_name: str | None = None  # GGUF "general.architecture"; None: no GGUF files
    model_class: type[Transformer] = Transformer  # built from ModelArgs
    hf_args: Callable[[ModelArgs, Mapping[str, Any]], ModelArgs] = _as_read
    gguf_args: Callable[[ModelArgs, "GGUFMetadata"], ModelArgs] = _as_read
    hf_tensor_names: TensorNames = HF_TENSOR_NAMES
    gguf_tensor_names: TensorNames = GGUF_TENSOR_NAMES
    # llama.cpp's converter interleaved the two rotary halves of each q and k head.
    gguf_interleaved_rotary: bool = False


_ARCHITECTURES: dict[str, Architecture] = {}


def _registered() -> dict[str, Architecture]:
    """The registry, with the architectures Strata ships in it."""
    # Imported here, not at the top: those modules import this one to register themselves.
    # While they run, this import finds the package half-imported and returns at once.
    import replicas.model.architectures  # noqa: F401

    return _ARCHITECTURES


def register_architecture(architecture: Architecture) -> Architecture:
    """Adds ``architecture``; raises ValueError if one of its names is already taken."""
    registered = _registered()
    for other in registered.values():
        for kind in ("name", "hf_model_type", "gguf_name"):
            value = getattr(architecture, kind)
            if value is not None and value == getattr(other, kind):
                raise ValueError(f"{kind} '{value}' is already registered by {other.name}")
    registered[architecture.name] = architecture
    return architecture


def unregister_architecture(name: str) -> None:
    """Removes the architecture registered as ``name``."""
    del _registered()[name]


def architectures() -> tuple[Architecture, ...]:
    """Every registered architecture, the ones Strata ships included."""
    return tuple(_registered().values())


def get_architecture(name: str) -> Architecture:
    """The architecture registered as ``name``; ValueError naming the supported ones else."""
    registered = _registered()
    if name not in registered:
        raise ValueError(
            f"unsupported architecture '{name}'; Strata supports: " + ", ".join(sorted(registered))
        )
    return registered[name]


def build_model(args: ModelArgs) -> Transformer:
    """The model of ``args.architecture``, with freshly initialised weights."""
    return get_architecture(args.architecture).model_class(args)
