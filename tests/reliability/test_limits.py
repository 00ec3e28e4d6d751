"""Configured limits: a host budget this machine cannot hold fails ``strata serve`` at start-up,
in the driver, before Ray starts; the server section of the config (body size, max_tokens cap,
API key, public metrics) reaches the HTTP app that ``strata serve`` builds."""

import os
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

import cluster.deploy
from cluster.backend import LocalBackend
from cluster.config import ClusterConfig
from cluster.server import build_app
from replicas.config import EngineConfig
from replicas.engine.engine import Engine
from tests.reliability.conftest import ROOT, assert_openai_error


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--experimental-kv-offload-host-memory-gb", "100000"),
        ("--experimental-kv-offload-host-memory-ratio", "100000"),
    ],
)
def test_a_host_budget_beyond_this_machine_fails_before_ray_starts(flag, value):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    run = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "serve", "--config", "configs/default.yaml"]
        + [flag, value, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=env,
    )
    output = run.stdout + run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("strata: error:")]
    assert run.returncode == 2, output[-3000:]
    assert len(errors) == 1, output[-3000:]
    assert "needs" in errors[0] and "GiB of host memory" in errors[0], errors[0]
    assert "--experimental-kv-offload-host-memory" in errors[0]  # names the option
    assert "Traceback" not in output
    assert "Started a local Ray instance" not in output and "ReplicaActor" not in output


def test_the_server_section_reaches_the_app(monkeypatch):
    """ServerConfig's caps, key and metrics visibility are what the served app enforces (the
    Ray deployment is swapped for one local engine; ``build_app`` is otherwise unchanged)."""
    engine = Engine(EngineConfig(model="tiny", num_npu_blocks=64))
    monkeypatch.setattr(cluster.deploy, "RayBackend", lambda config, name: LocalBackend(engine))
    config = ClusterConfig.model_validate(
        {
            "server": {
                "api_key": "sk-limits",
                "max_request_body_bytes": 2048,
                "max_tokens_limit": 5,
                "metrics_public": False,
                "max_waiting_requests": 3,
            }
        }
    )
    app, _ = build_app(config)
    key = {"Authorization": "Bearer sk-limits"}
    with TestClient(app) as client:
        big = client.post("/v1/completions", json={"prompt": "x" * 4096}, headers=key)
        assert assert_openai_error(big.json())["code"] == "request_too_large"
        assert big.status_code == 413
        over = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 6}, headers=key)
        assert over.status_code == 400 and assert_openai_error(over.json())["param"] == "max_tokens"
        ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5}, headers=key)
        assert ok.status_code == 200, ok.text
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=key).status_code == 200
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models").status_code == 401
