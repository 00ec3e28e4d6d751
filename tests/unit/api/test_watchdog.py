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
    app = create_app(ScriptedBackend(), watchdog_stall_s=0.4)

    @app.get("/block")
    async def block() -> dict:
        block_the_loop_for(2.0)
        return {}

    with caplog.at_level("WARNING", logger="cluster.api.watchdog"), TestClient(app) as client:
        before = client.get("/health").json()["event_loop"]["stalls"]
        assert client.get("/block").status_code == 200
        time.sleep(0.5)  # a heartbeat after the stall
        health = client.get("/health").json()["event_loop"]
    # One stall for the blocking call (a loaded machine may add short ones of its own).
    assert health["stalls"] >= before + 1
    assert 1.5 <= health["longest_stall_s"] < 10
    assert health["blocked_s"] == 0.0
    stalls = [r.getMessage() for r in caplog.records if "has not answered" in r.getMessage()]
    assert len(stalls) == health["stalls"]  # each stall logged once
    # The loop's own stack names the blocking call.
    assert any("block_the_loop_for" in m and "time.sleep(seconds)" in m for m in stalls)
    assert any("answered again after" in r.getMessage() for r in caplog.records)


def test_a_live_loop_is_never_reported():
    app = create_app(ScriptedBackend(), watchdog_stall_s=2.0)
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
