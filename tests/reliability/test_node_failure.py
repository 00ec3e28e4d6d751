"""A whole node dies under load (``ray.cluster_utils.Cluster`` on this machine, in a separate
process so that the session's shared Ray instance is untouched): the requests streaming from
the replica on that node are resumed on the surviving replica, new ones go there too, and the
lost replica comes back when a node joins."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("node_failure_script.py")
ROOT = Path(__file__).resolve().parents[2]


def test_losing_a_node_loses_no_request_and_the_replica_returns():
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=420,
        cwd=ROOT,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith('{"node_failure"'))
    result = json.loads(line)["node_failure"]
    print(f"\nFIGURES node_failure {result}", flush=True)
    survivor = 1 - result["doomed"]
    assert result["errors"] == []  # no hang, no unexpected error
    assert result["lost"] == 0 and result["resumed"] >= 1  # its streams went on elsewhere
    assert result["num_served_after_kill"] == result["num_sent_after_kill"]  # all re-routed
    assert result["served_after_kill_by"] == [survivor]
    assert result["live_after_kill"] == 1  # dropped from routing
    assert result["rejoined"] and result["final_ok"]
    assert (
        result["integrity"]
        == [{"npu_blocks_used": 0, "host_blocks_used": 0, "num_unfinished": 0}] * 2
    )
