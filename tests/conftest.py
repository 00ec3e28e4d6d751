"""Settings of the whole test session."""

import atexit
import os
import shutil
import tempfile

import pytest

# What ``auto`` chose on this machine (replicas.model.autotune) is kept per test session, not in
# the user's cache: a run measures afresh. Set at import, before any process (a Ray worker, a
# server) is started, so that they all inherit it.
if "STRATA_AUTOTUNE_CACHE" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="strata-tests-")
    os.environ["STRATA_AUTOTUNE_CACHE"] = os.path.join(_cache_dir, "autotune.json")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
# And the whole session is one deployment in ``auto``'s sense: a choice measured on a machine too
# busy for it to be cached is reused by every later engine of the session, so two engines a test
# compares (cache on and off, a run and its reference) never take different products, which round
# differently.
os.environ.setdefault("STRATA_AUTOTUNE_SCOPE", "test-session")
# CUDA's paged attention kernels (replicas.model.paged_attention) run on a CPU in Triton's
# interpreter, which Triton sets up only if told before its first import. A GPU runs them
# compiled (``nvidia-smi`` answering is the cue: torch is not imported yet).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _tier_registry():
    """Every test leaves the KV tier registry as it found it: a config naming a tier (``peer``,
    a test's own) registers it process-wide, and most tests count the built-in tiers only."""
    from tests.tier_registry import restored_tier_registry

    with restored_tier_registry():
        yield
