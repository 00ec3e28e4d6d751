"""``ray job submit`` of a batch job onto a Ray head started with token authentication."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
AGENT_PORTS = (
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
    "node-manager-port",
    "object-manager-port",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head():
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    gcs, dashboard = free_port(), free_port()
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            "--num-cpus=2",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            "--disable-usage-stats",
            # Ports of its own: another Ray on this machine (the test session's) holds the
            # defaults, and a job agent that cannot bind its port never comes up.
            *(f"--{name}={free_port()}" for name in AGENT_PORTS),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        probe = subprocess.run(
            [str(BIN / "ray"), "job", "list", "--address", address],
            env=env,
            capture_output=True,
            timeout=60,
        )
        if probe.returncode == 0:
            break
        time.sleep(2)
    else:
        os.killpg(head.pid, signal.SIGTERM)
        pytest.fail("the Ray head's jobs API did not come up within 120 s")
    yield address, env
    os.killpg(head.pid, signal.SIGTERM)
    try:  # a head that has not stopped in 5 s is killed: its graceful stop is no test's subject
        head.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)


def test_batch_job_through_ray_job_submit(ray_head, tmp_path):
    address, env = ray_head
    prompts = tmp_path / "prompts.jsonl"
    shared = "You are a helpful assistant for Strata users. " * 4
    lines = [
        {"id": f"p{i}", "prompt": shared + f"Question {i}?", "max_tokens": 6, "ignore_eos": True}
        for i in range(6)
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    results = tmp_path / "results.jsonl"
    # The shipped config with its start-up measurement fixed (what ``auto`` chooses is no
    # subject here, and measuring it at one thread a replica is most of a minute).
    config = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    config["model"].update(
        dtype="float32", quantization="int4", decoder_stack="native", int4_kernel="torch"
    )
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    command = [
        str(BIN / "ray"),
        "job",
        "submit",
        "--address",
        address,
        "--working-dir",
        str(ROOT),
        "--",
        "python",
        "-m",
        "cluster.job",
        "--config",
        str(config_path),
        "--input",
        str(prompts),
        "--output",
        str(results),
    ]
    for _ in range(36):  # the head's job agent may still be starting: it says so, then serves
        submit = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if "No available agent to submit job" not in submit.stderr:
            break
        time.sleep(5)
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    assert "succeeded" in submit.stdout
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(6)]
    assert all(len(r["token_ids"]) == 6 and r["finish_reason"] == "length" for r in rows)
    assert {r["replica_index"] for r in rows} <= {0, 1}
    assert sum(r["num_cached_tokens"] for r in rows) > 0  # the shared prefix was reused


def test_jobs_api_refuses_requests_without_the_token(ray_head):
    import urllib.error
    import urllib.request

    address, _ = ray_head
    for headers in ({}, {"Authorization": "Bearer not-the-token"}):
        request = urllib.request.Request(f"{address}/api/jobs/", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code in (401, 403)
