"""One shared Ray instance for the whole integration test session, sized for 2 cores."""

import os

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="session")
def ray_session():
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            namespace="strata-tests",
            log_to_driver=False,
        )
    yield ray
    ray.shutdown()
