"""The event-loop watchdog: a blocked serving loop is logged once with every thread's stack,
and /health reports the stall after the loop answers again."""

import time

import pytest
from fastapi.testclient import TestClient

from cluster.api import create_app
from cluster.api.watchdog import LoopWatchdog
from tests.unit.api.conftest import ScriptedBackend


def block_the_loop_for(seconds: float) -> None:
    time.sleep(seconds)  # a synchronous call on the event loop: what the watchdog is for


def test_a_blocked_loop_is_logged_with_its_stack_and_reported_by_health(caplog):
    app = create_app(ScriptedBackend(), watchdog_stall_s=0.2)

    @app.get("/block")
    async def block() -> dict:
        block_the_loop_for(0.8)
        return {}

    with caplog.at_level("WARNING", logger="cluster.api.watchdog"):
        with TestClient(app) as client:
            assert client.get("/health").json()["event_loop"]["stalls"] == 0
            assert client.get("/block").status_code == 200
            health = client.get("/health").json()
            time.sleep(0.3)  # a heartbeat after the stall
            again = client.get("/health").json()
    assert health["event_loop"]["stalls"] == 1
    assert again["event_loop"]["stalls"] == 1  # one stall, logged once
    assert 0.6 <= again["event_loop"]["longest_stall_s"] < 5
    assert again["event_loop"]["blocked_s"] == 0.0
    stalls = [r for r in caplog.records if "has not answered" in r.getMessage()]
    assert len(stalls) == 1
    # The loop's own stack names the blocking call.
    assert "block_the_loop_for" in stalls[0].getMessage()
    assert "time.sleep(seconds)" in stalls[0].getMessage()
    assert any("answered again after" in r.getMessage() for r in caplog.records)


def test_a_live_loop_is_never_reported():
    app = create_app(ScriptedBackend(), watchdog_stall_s=0.2)
    with TestClient(app) as client:
        for _ in range(5):
            time.sleep(0.1)
            assert client.get("/health").json()["event_loop"]["stalls"] == 0


def test_the_watchdog_can_be_off_and_refuses_a_bad_threshold():
    app = create_app(ScriptedBackend(), watchdog_stall_s=None)
    with TestClient(app) as client:
        assert "event_loop" not in client.get("/health").json()
    with pytest.raises(ValueError, match="stall_s"):
        LoopWatchdog(0)
