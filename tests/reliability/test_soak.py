"""The soak's short round on the real model (``tests/reliability/soak.py``): SmolLM2 on two
replicas with the host tier, a mixed load, one replica kill. ``STRATA_SOAK_S`` sets its length
(default 30 s); the documented 30-minute run is ``python -m tests.reliability.soak``."""

import os

from tests.reliability.conftest import serve_on_ray
from tests.reliability.soak import run_soak, soak_config

ROUND_S = float(os.environ.get("STRATA_SOAK_S", "30"))


def test_a_short_soak_loses_nothing_and_holds_its_memory(ray_session):
    with serve_on_ray(soak_config(), "rel-soak") as (server, backend):
        report = run_soak(server.url, backend, ROUND_S, kill_every_s=ROUND_S / 3)
    assert report.kills >= 1, report
    assert report.greedy_checked > 0 and report.requests.get("completed", 0) > 0, report
    assert not report.failures, report.failures
