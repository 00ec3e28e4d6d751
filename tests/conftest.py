"""Settings of the whole test session."""

import atexit
import os
import shutil
import tempfile

# What ``auto`` chose on this machine (replicas.model.autotune) is kept per test session, not in
# the user's cache: a run measures afresh. Set at import, before any process (a Ray worker, a
# server) is started, so that they all inherit it.
if "STRATA_AUTOTUNE_CACHE" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="strata-tests-")
    os.environ["STRATA_AUTOTUNE_CACHE"] = os.path.join(_cache_dir, "autotune.json")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
