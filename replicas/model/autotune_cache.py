"""The per-machine file that keeps ``auto``'s choices (``replicas.model.autotune``): where it
is, the lock that makes replicas starting together measure in turn, reading and replacing it
whole, and the key of a choice (the CPU facts, the model's files, the rules' version)."""

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from replicas.model.native_stack import ISA_ENV

logger = logging.getLogger(__name__)

CACHE_ENV = "STRATA_AUTOTUNE_CACHE"


@contextlib.contextmanager
def locked(cache_file: Path):
    """An exclusive lock beside ``cache_file`` (none where the folder cannot be written)."""
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        handle = open(cache_file.with_name(cache_file.name + ".lock"), "a")  # noqa: SIM115
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cache_path() -> Path | None:
    """The per-machine choice cache: ``STRATA_AUTOTUNE_CACHE`` (``off``: none), else
    ``$XDG_CACHE_HOME/strata/autotune.json`` (``~/.cache`` by default)."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return None if configured.lower() in ("off", "0", "none") else Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "strata" / "autotune.json"


CHOICE_RULES = 8
"""Raised whenever ``autotune.choose`` or the timing changes, so that no cached choice outlives
the rules it followed (7: candidates timed on a probe, priced at the model's depth; 8: a
candidate out of the running timed no further)."""


def cache_key(
    model_files: Sequence[Path | str],
    device: torch.device,
    options: Sequence[Sequence[str]],
    kv_cache_dtype: str = "auto",
) -> str:
    """The key of a choice: this CPU, torch, the threads, the device, the model's files (path,
    size and modification time), the candidates and the KV cache dtype they were timed with,
    the rules that chose (``CHOICE_RULES``) and the native library's sources (a changed kernel
    is measured again)."""
    from replicas.model.native_stack import SOURCES

    files = []
    for name in model_files:
        path = Path(name)
        stat = path.stat() if path.exists() else None
        files.append([str(path), stat.st_size if stat else 0, stat.st_mtime_ns if stat else 0])
    facts = {
        "cpu": cpu_facts(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "model": files,
        "candidates": [list(c) for c in options],
        "kv_cache_dtype": kv_cache_dtype,
        "rules": CHOICE_RULES,
        "native": hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", ISA_ENV)
"""Environment variables that keep torch's, oneDNN's or Strata's kernels below what the CPU has."""


def cpu_facts() -> dict[str, str]:
    """The CPU as the choice depends on it: model name, flags (Linux), torch's capability, and
    the instruction-set limits set in the environment (``ISA_LIMITS``), if any."""
    facts = {"model": "", "flags": ""}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            key = {"model name": "model", "flags": "flags", "Features": "flags"}.get(name.strip())
            if key and not facts[key]:
                facts[key] = value.strip()
    facts["model"] = facts["model"] or platform.processor() or platform.machine()
    facts["torch_capability"] = torch.backends.cpu.get_cpu_capability()
    facts["isa_limits"] = " ".join(f"{n}={os.environ[n]}" for n in ISA_LIMITS if n in os.environ)
    return facts


def read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, key: str, choice: "Choice") -> None:  # noqa: F821
    """Add ``choice`` under ``key``, atomically (the file is replaced whole; writers hold the
    lock)."""
    data = read_cache(path)
    data[key] = {
        "choice": list(choice.candidate),
        "timings": [[*t.candidate, t.prefill_s_per_token, t.decode_s] for t in choice.timings],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as f:
            json.dump(data, f, indent=1)
        os.replace(f.name, path)
    except OSError as error:
        logger.warning("auto: could not write the choice cache %s: %s", path, error)
